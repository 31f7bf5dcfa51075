"""Lone decodes as groups of one (forward_context.lone_decode_groups, --lone-decode-min-tokens): in a step with
shared-prefix groups, a decode in no group whose context is long enough is read by the prefix kernel as a group of
its own instead of by the suffix kernel's few programs. Checked here: the tables it makes; the attention they give,
against the plain decode kernel, through the torch twin and the split kernels (under TRITON_INTERPRET=1 in a child
process, and on the GPU), with the table padded as a decode CUDA graph pads it; and the greedy tokens through the
scheduler (in process) and through a launched server, equal to the plain path's."""

import numpy as np
import pytest
import torch

import kernels
import radixserve.forward_context as forward_context
from bench.shared_prefix_batches import make_grouped_batch, prefix_groups_message, rel_err
from radixserve.forward_context import DecodeGroups, lone_decode_groups, pack_decode_groups
from radixserve.protocol import PrefixGroups, pack_i32
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import tiny_model_dir
from radixserve.worker.cuda_graph import max_groups
from scheduler_service.in_process_engine import InProcessEngine


def i32(values):
    return np.array(values, dtype=np.int32)


def test_lone_decodes_become_groups_of_one_longest_first():
    # Decodes 0 and 2 are in group 0 (a 20-token prefix); 1, 3 and 4 in none, with contexts of 49, 9 and 39 tokens.
    tables = (i32([20]), i32([5]), i32([0, -1, 0, -1, -1]), i32([20, 0, 20, 0, 0]))
    rows, seq_lens = i32([1, 2, 3, 4, 6]), i32([30, 50, 25, 10, 40])
    lens, prefix_rows, req_group, suffix_start = lone_decode_groups(*tables, rows, seq_lens, 16, room=10)
    assert lens.tolist() == [20, 49, 39] and prefix_rows.tolist() == [5, 2, 6]  # a lone decode's prefix: its own row
    assert req_group.tolist() == [0, 1, 0, -1, 2]  # the 9-token context stays out (min 16)
    assert suffix_start.tolist() == [20, 49, 20, 0, 39]  # each keeps its new token for the suffix kernel
    # Room for one group: the longest context gets it.
    lens, _, req_group, _ = lone_decode_groups(*tables, rows, seq_lens, 16, room=1)
    assert lens.tolist() == [20, 49] and req_group.tolist() == [0, 1, 0, -1, -1]
    # No room, or none long enough: the tables as they were.
    for min_tokens, room in [(16, 0), (50, 10)]:
        out = lone_decode_groups(*tables, rows, seq_lens, min_tokens, room)
        assert all(a is b for a, b in zip(out, tables))


def test_packed_table_counts_the_lone_groups_as_live():
    groups = PrefixGroups(pack_i32([20]), pack_i32([5]), pack_i32([-1, 0, -1, 0, -1]), pack_i32([0, 20, 0, 20, 0]))
    rows, seq_lens = i32([1, 2, 3, 4]), i32([30, 50, 25, 40])  # batch index 0 is a prefill
    plain, _, _ = pack_decode_groups(groups, 1, 4, 4, decodes=(rows, seq_lens))  # lone_min_tokens 0: off
    assert np.array_equal(plain, pack_decode_groups(groups, 1, 4, 4)[0])
    flat, max_prefix, max_size = pack_decode_groups(groups, 1, 4, 4, decodes=(rows, seq_lens), lone_min_tokens=16)
    g = DecodeGroups.view(torch.from_numpy(flat), 4, 4, 64, 4, 1)
    assert g.live_groups.tolist() == [3] and g.prefix_lens.tolist() == [20, 49, 39, 0]
    assert g.member_start.tolist() == [0, 2, 3, 4, 4] and g.members.tolist() == [0, 2, 1, 3]
    assert g.req_group.tolist() == [0, 1, 0, 2] and (max_prefix, max_size) == (49, 2)
    # A captured graph's table never overflows: lone groups fill the room its padding leaves, no more.
    flat, _, _ = pack_decode_groups(groups, 1, 2, 4, decodes=(rows, seq_lens), lone_min_tokens=16)
    assert flat[-2] == 2


def lone_groups_against_plain(device: str, dtype: torch.dtype, hq: int, hkv: int, d: int) -> float:
    """One batch of two groups and three decodes in no group (contexts 90, 9 and 60 tokens), its group table packed
    with lone groups as a decode graph of 16 requests pads it; the grouped attention by the split kernels against the
    plain decode kernel. Returns the relative error."""
    g = torch.Generator().manual_seed(7)
    b = make_grouped_batch([(37, [2, 3, 5]), (16, [1, 4])], [90, 9, 60], hq, hkv, d, dtype, device, g)
    bs = b["q"].shape[0]
    groups = prefix_groups_message(b)
    rows, seq_lens = b["req_pool_indices"].cpu().numpy(), b["seq_lens"].cpu().numpy()
    table, context = max_groups(16), 4 * b["max_seq_len"]
    flat, _, _ = pack_decode_groups(
        groups, 0, table, bs, slices=lambda *real: 2, decodes=(rows, seq_lens), lone_min_tokens=16
    )
    assert flat[-2] == 4  # the 90- and 60-token decodes became groups; the 9-token one did not
    t = DecodeGroups.view(torch.from_numpy(flat).to(device), table, bs, context, bs, 4)
    plain = torch.empty_like(b["q"])
    scale = d**-0.5
    kernels.decode_attention(
        b["q"],
        b["k_cache"],
        b["v_cache"],
        plain,
        b["req_to_token"],
        b["req_pool_indices"],
        b["seq_lens"],
        scale,
        context,
    )
    o = torch.full_like(b["q"], float("nan"))
    kernels.decode_attention_grouped(
        b["q"], b["k_cache"], b["v_cache"], o, b["req_to_token"], b["req_pool_indices"], b["seq_lens"],
        t.prefix_lens, t.prefix_rows, t.member_start, t.members, t.req_group, t.req_suffix_start, scale,
        context, t.max_prefix_len, t.max_group_size, prefix_splits=t.prefix_splits,
        max_prefix_splits=t.max_prefix_splits, live_groups=t.live_groups,
    )  # fmt: skip
    return rel_err(o, plain)


def test_lone_groups_give_the_plain_attention_on_the_cpu():
    assert lone_groups_against_plain("cpu", torch.float32, 8, 2, 32) < 1e-5  # the torch twins


def interpreter_check() -> None:
    for hq, hkv, d in [(8, 2, 32), (4, 4, 16)]:
        err = lone_groups_against_plain("cpu", torch.float32, hq, hkv, d)
        print(f"Hq{hq}/Hkv{hkv} D{d}: lone groups give the plain attention, {err:.2e}", flush=True)
        assert err < 1e-5


@pytest.mark.server
def test_lone_groups_give_the_plain_attention_in_interpreter():
    from interpreter_child import run_interpreted  # tests/helpers (conftest.py); not in the child itself

    stdout = run_interpreted(__file__)
    assert stdout.count("lone groups give the plain attention") == 2


def test_the_benchs_lone_batches_give_the_plain_attention():
    """bench/shared_prefix_kernel_bench.py --lone times batches made by shared_prefix_batches.with_lone_groups: the
    worker's rule on a bench batch, its tables whole (the torch twin reads every one of them)."""
    from bench.shared_prefix_batches import run_grouped, run_plain, with_lone_groups
    from kernels import reference

    b = make_grouped_batch([(37, [2, 3, 5]), (16, [1, 4])], [90, 9, 60], 8, 2, 32, torch.float32, "cpu", None)
    lone = with_lone_groups(b, 16)
    assert sorted(lone["group_prefix_lens"].tolist()) == [16, 37, 59, 89] and lone["max_group_size"] == 3
    plain, grouped = torch.empty_like(b["q"]), torch.full_like(b["q"], float("nan"))
    run_plain(reference, b, plain)
    run_grouped(reference, lone, grouped)
    assert rel_err(grouped, plain) < 1e-5


@pytest.mark.gpu
def test_gpu_lone_groups_give_the_plain_attention():
    assert lone_groups_against_plain("cuda", torch.float32, 32, 8, 128) < 1e-5
    assert lone_groups_against_plain("cuda", torch.bfloat16, 32, 8, 128) < 2e-2


# --------------------------------------------------------------------------------------------------------------------
# Through the scheduler and a server: tokens equal to the plain path's
# --------------------------------------------------------------------------------------------------------------------

VOCAB = 49152


def chat_prompts(seed=0):
    """Two system prompts of 40 tokens with short questions after them, and two long prompts of their own that
    decode alone beside the groups."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, VOCAB, 40).tolist() for _ in range(2)]
    shared = [systems[i % 2] + rng.integers(0, VOCAB, int(rng.integers(1, 8))).tolist() for i in range(6)]
    return shared + [rng.integers(0, VOCAB, 60).tolist() for _ in range(2)]


def max_new(i):
    return 6 + i % 5


SIZES = dict(device="cpu", max_total_tokens=8192, max_running_requests=64)


@pytest.fixture(scope="module")
def plain_tokens():
    prompts = chat_prompts()
    engine = InProcessEngine(str(tiny_model_dir("llama")), disable_shared_prefix_attention=True, **SIZES)
    params = [SamplingParams(temperature=0.0, max_new_tokens=max_new(i), ignore_eos=True) for i in range(len(prompts))]
    return [r.token_ids for r in engine.generate(prompts, params)]


def test_scheduler_steps_with_lone_groups_give_the_plain_tokens(monkeypatch, plain_tokens):
    made = []
    real = forward_context.lone_decode_groups

    def counting(prefix_lens, *args):
        out = real(prefix_lens, *args)
        made.append(len(out[0]) - len(prefix_lens))
        return out

    monkeypatch.setattr(forward_context, "lone_decode_groups", counting)
    prompts = chat_prompts()
    params = [SamplingParams(temperature=0.0, max_new_tokens=max_new(i), ignore_eos=True) for i in range(len(prompts))]
    engine = InProcessEngine(
        str(tiny_model_dir("llama")), shared_prefix_min_tokens=8, lone_decode_min_tokens=16, **SIZES
    )
    engine.scheduler.check_invariant_every_step = True
    assert [r.token_ids for r in engine.generate(prompts, params)] == plain_tokens
    assert engine.scheduler.stats.grouped_decodes > 0, "no group formed"
    assert sum(made) > 0, "no lone decode became a group"


@pytest.mark.server
def test_a_server_with_lone_groups_gives_the_plain_tokens(plain_tokens):
    """The flag through launch.py: concurrent native requests, their output ids those of the plain path."""
    import asyncio

    import httpx
    from server_fixture import launched_server  # tests/helpers (conftest.py)

    prompts = chat_prompts()
    bodies = [
        {"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": max_new(i), "ignore_eos": True}}
        for i, p in enumerate(prompts)
    ]

    async def generate_all(url):
        async with httpx.AsyncClient(timeout=120) as client:
            for body in bodies[:2]:  # the system prompts cached first, so that the batch's decodes share them
                first = dict(body, sampling_params=dict(body["sampling_params"], max_new_tokens=1))
                (await client.post(f"{url}/generate", json=first)).raise_for_status()
            replies = await asyncio.gather(*(client.post(f"{url}/generate", json=body) for body in bodies))
        return [r.json()["output_ids"] for r in replies]

    flags = ("--shared-prefix-min-tokens", "8", "--lone-decode-min-tokens", "16")
    with launched_server(tiny_model_dir("llama"), *flags) as server:
        assert asyncio.run(generate_all(server.url)) == plain_tokens
        info = server.server_info()
        assert info["grouped_decodes"] > 0, "the concurrent requests formed no group"


if __name__ == "__main__":
    interpreter_check()
