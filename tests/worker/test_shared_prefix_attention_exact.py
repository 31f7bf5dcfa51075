"""Shared-prefix decode attention end to end, fp32 on the CPU with a tiny model: decodes that share a system prompt
are grouped by the scheduler, the worker reads each group's prefix once (kernels.decode_attention_grouped, the
torch twin here), and the greedy tokens are exactly those of the plain path in every scheduling scenario."""

import numpy as np
import pytest
import torch

import kernels
from scheduler_service.in_process_engine import InProcessEngine
from radixserve.forward_context import DecodeGroups, pack_decode_groups
from radixserve.protocol import unpack_i32
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import tiny_model_dir
from radixserve.worker.cuda_graph import max_groups
from scheduler_service.prefix_groups import node_path
from scheduler_service.request import Req

VOCAB = 49152
MIN_TOKENS = 8  # the tiny prompts below share 40-token system prompts


@pytest.fixture(scope="module")
def model_dir():
    return tiny_model_dir("llama")


def make_engine(model_dir, **kw) -> InProcessEngine:
    kw.setdefault("max_total_tokens", 8192)
    kw.setdefault("max_running_requests", 64)
    kw.setdefault("shared_prefix_min_tokens", MIN_TOKENS)
    engine = InProcessEngine(str(model_dir), device="cpu", **kw)
    engine.scheduler.check_invariant_every_step = True
    return engine


def chat_prompts(n=12, seed=0):
    """Three system prompts, each followed by short questions; arrivals interleave the systems."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, VOCAB, 40).tolist() for _ in range(3)]
    return [systems[i % 3] + rng.integers(0, VOCAB, int(rng.integers(1, 10))).tolist() for i in range(n)]


def params_for(prompts, seed=1):
    rng = np.random.default_rng(seed)
    return [SamplingParams(temperature=0.0, max_new_tokens=int(rng.integers(5, 11)), ignore_eos=True) for _ in prompts]


def assert_idle_and_clean(engine):
    s = engine.scheduler
    s.check_invariant(walk_tree=True)
    assert not s.running and not s.waiting
    u = s.kv_usage()
    assert u["protected"] == 0 and u["owned"] == 0


@pytest.fixture(scope="module")
def plain_outputs(model_dir):
    """The feature off: every decode reads its whole KV itself."""
    engine = make_engine(model_dir, disable_shared_prefix_attention=True)
    prompts = chat_prompts()
    results = engine.generate(prompts, params_for(prompts))
    assert engine.scheduler.stats.grouped_decodes == 0
    return prompts, [r.token_ids for r in results]


@pytest.mark.parametrize(
    "config",
    [
        dict(),  # radix cache on, mixed batches, default chunk, overlapped step loop
        dict(disable_overlap_schedule=True),
        dict(chunked_prefill_size=7),
        dict(chunked_prefill_size=-1),
        dict(disable_mixed_batch=True, chunked_prefill_size=7),
        # A pool small enough to retract (whether a given size does depends on how admission batches: 140-120 and
        # 100-90 do since 7a7221e, 160 did before it).
        dict(max_total_tokens=130, chunked_prefill_size=16, init_new_token_ratio=0.05, min_new_token_ratio=0.01),
    ],
)
def test_grouped_decodes_give_the_plain_tokens(model_dir, plain_outputs, config):
    prompts, expected = plain_outputs
    engine = make_engine(model_dir, **config)
    for _ in range(1 if config else 2):  # a second pass starts with the system prompts already cached
        results = engine.generate(prompts, params_for(prompts))
        assert [r.token_ids for r in results] == expected
        assert_idle_and_clean(engine)
    stats = engine.scheduler.stats
    assert stats.grouped_decodes > 0 and stats.shared_prefix_tokens_saved > 0, "no group formed"
    if config.get("max_total_tokens") == 130:
        assert stats.retractions > 0, "a pool this small must retract"


def test_no_groups_without_the_cache_or_below_the_threshold(model_dir, plain_outputs):
    prompts, expected = plain_outputs
    for config in (dict(disable_radix_cache=True), dict(shared_prefix_min_tokens=41)):
        engine = make_engine(model_dir, **config)
        assert [r.token_ids for r in engine.generate(prompts, params_for(prompts))] == expected
        assert engine.scheduler.stats.grouped_decodes == 0, config


def test_group_prefixes_are_the_members_own_and_stay_locked(model_dir, plain_outputs):
    """Step by step, with everything evictable evicted before every step: each group's prefix row holds exactly the
    slots of every member's row, its node is locked once per member, and its slots are never free."""
    prompts, expected = plain_outputs
    engine = make_engine(model_dir, chunked_prefill_size=16)
    s, runner = engine.scheduler, engine.runner
    reqs = [Req(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params_for(prompts)))]
    for req in reqs:
        s.add_request(req)
    checked_groups = 0
    while s.has_work():
        s.tree.evict(1 << 40)
        scheduled = s.schedule()
        if scheduled is None:
            s.take_outputs()
            continue
        sampled = runner.forward(scheduled.batch)
        groups = scheduled.batch.prefix_groups
        if groups is not None:
            table = runner.req_to_token_pool.table
            req_group = unpack_i32(groups.req_group)
            for g, (prefix_len, row) in enumerate(zip(unpack_i32(groups.prefix_lens), unpack_i32(groups.prefix_rows))):
                members = np.flatnonzero(req_group == g)
                assert len(members) >= 2 and prefix_len >= MIN_TOKENS
                prefix = table[int(row), :prefix_len]
                # Still in the tree after the eviction: no other request can be given these slots.
                cached = s.tree.match_prefix(scheduled.reqs[members[0]].fill_ids()[:prefix_len])
                assert np.array_equal(cached.slots[:prefix_len], prefix.numpy())
                for m in members:
                    req = scheduled.reqs[m]
                    assert not scheduled.prefills[m], "only decodes are grouped"
                    assert torch.equal(table[req.req_pool_idx, :prefix_len], prefix)
                    assert unpack_i32(groups.req_suffix_start)[m] == prefix_len < req.kv_len + 1
                node = next(
                    n
                    for n in node_path(scheduled.reqs[members[0]].last_node)
                    if sum(len(a) for a in node_path(n)) == prefix_len
                )
                assert node.lock_ref >= len(members)
                checked_groups += 1
        s.process_results(scheduled, sampled)
        s.take_outputs()
    assert checked_groups > 0
    assert [r.output_ids for r in reqs] == expected
    assert_idle_and_clean(engine)


def test_aborts_among_grouped_decodes(model_dir, plain_outputs):
    prompts, expected = plain_outputs
    engine = make_engine(model_dir)
    s = engine.scheduler
    reqs = [Req(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params_for(prompts)))]
    for req in reqs:
        s.add_request(req)
    while s.stats.grouped_decodes == 0 or any(len(r.output_ids) < 3 for r in reqs):
        engine.loop.step()
    aborted = {r.rid for r in reqs[::4]}
    for rid in aborted:
        assert s.abort(rid)
    engine.loop.run_until_idle()
    assert_idle_and_clean(engine)
    for req, tokens in zip(reqs, expected):
        if req.rid in aborted:
            assert req.finish_reason == "abort" and req.output_ids == tokens[: len(req.output_ids)]
        else:
            assert req.output_ids == tokens


@pytest.mark.server
def test_tensor_parallel_ranks_share_the_group_tables(model_dir, plain_outputs):
    """The multi-process Engine, two ranks (gloo): the tables cross the socket with each batch, every rank splits
    its heads over the same groups, and /server_info counts the grouped decodes."""
    from radixserve.engine import Engine

    prompts, expected = plain_outputs
    with Engine(
        str(model_dir), device="cpu", max_total_tokens=4096, tp_size=2, shared_prefix_min_tokens=MIN_TOKENS
    ) as engine:
        assert [r.token_ids for r in engine.generate(prompts, params_for(prompts))] == expected
        info = engine.server_info()
        assert info["grouped_decodes"] > 0 and info["shared_prefix_tokens_saved"] > 0 and info["kv_invariant_ok"]


def test_padded_group_table_of_a_cuda_graph_gives_the_same_attention():
    """The grouped CUDA graph replays with its bucket's shape: empty groups and ungrouped requests pad the table.
    Through the torch twin, the padded table, the unpadded one and plain decode attention agree (fp32)."""
    from radixserve.protocol import PrefixGroups, pack_i32

    torch.manual_seed(0)
    hq, hkv, d, slots, ctx = 4, 2, 16, 512, 64
    k_cache, v_cache = torch.randn(slots, hkv, d), torch.randn(slots, hkv, d)
    seq_lens = torch.tensor([30, 50, 45, 21, 60, 33], dtype=torch.int32)
    req_to_token = torch.randperm(slots)[: 8 * ctx].reshape(8, ctx).to(torch.int32)
    rows = torch.tensor([1, 2, 3, 4, 5, 6], dtype=torch.int32)
    req_to_token[3, :20] = req_to_token[1, :20]  # requests 0 and 2 share 20 tokens
    req_to_token[[4, 6], :17] = req_to_token[2, :17]  # requests 1, 3 and 5 share 17
    groups = PrefixGroups(
        pack_i32([20, 17]), pack_i32([1, 2]), pack_i32([-1, 0, 1, 0, 1, -1, 1]), pack_i32([0, 20, 17, 20, 17, 0, 17])
    )  # batch index 0 is a prefill
    q = torch.randn(6, hq, d)
    plain = torch.empty_like(q)
    kernels.decode_attention(q, k_cache, v_cache, plain, req_to_token, rows, seq_lens, 0.25, ctx)
    for num_groups, bs in [(None, None), (max_groups(8), 8)]:
        flat, max_prefix, max_size = pack_decode_groups(groups, 1, num_groups, bs, slices=lambda *real: 2)
        bs = bs or 6
        g = DecodeGroups.view(
            torch.from_numpy(flat),
            num_groups or 2,
            bs,
            ctx if num_groups else max_prefix,
            bs if num_groups else max_size,
            4,
        )
        assert g.prefix_splits.tolist() == [2]  # the step's slicing travels in the table
        assert g.live_groups.tolist() == [2]  # and its count of real groups, ahead of the padding
        pad = bs - 6  # padding requests read row 0 with one token, as DecodeCudaGraphs pads them
        o = torch.empty(bs, hq, d)
        kernels.decode_attention_grouped(
            torch.cat([q, torch.randn(pad, hq, d)]),
            k_cache,
            v_cache,
            o,
            req_to_token,
            torch.cat([rows, torch.zeros(pad, dtype=torch.int32)]),
            torch.cat([seq_lens, torch.ones(pad, dtype=torch.int32)]),
            g.prefix_lens,
            g.prefix_rows,
            g.member_start,
            g.members,
            g.req_group,
            g.req_suffix_start,
            0.25,
            ctx,
            g.max_prefix_len,
            g.max_group_size,
            prefix_splits=g.prefix_splits,
            max_prefix_splits=g.max_prefix_splits,
            live_groups=g.live_groups,
        )
        torch.testing.assert_close(o[:6], plain, atol=1e-5, rtol=1e-5)
