"""Layer-wise KV offload (--enable-layerwise-offload): prompts 4x longer than the GPU KV pool, served one layer at a
time with their KV in the host pool, give the greedy tokens a server whose pool holds them whole gives.

Through the real Engine (scheduler and worker processes): several chunk sizes, ring sizes 2 and 3, step bounds and
both step loops; two long requests at once beside two short ones; a follow-up turn over the first long prompt that
computes only its new tokens; the KV invariant of the device pool and of the host pool after each; short requests
served between the long one's steps; the admission limits; launch.py's HTTP server (/generate, a 400). In process
(the invariant checked after every step): real weights (the demo model, fp32) on a prompt longer than the pool;
documents in the host tier under cache_salt, LRU eviction and pins. The start-up check of host memory, and
bench/long_context.py --smoke."""

import numpy as np
import pytest

from radixserve.engine import Engine
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import tiny_model_dir

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

POOL = 64  # device KV slots of the offloading engines
LONG = 4 * POOL  # each long prompt
OUT = 10
HOST_GB = 0.001  # ~1950 tokens of the tiny Llama's KV (512 bytes a token)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=OUT, ignore_eos=True)


def workload():
    rng = np.random.default_rng(7)
    longs = [rng.integers(100, 40000, LONG).tolist() for _ in range(2)]
    shorts = [rng.integers(100, 40000, 24).tolist() for _ in range(2)]
    question = rng.integers(100, 40000, 16).tolist()
    return longs, shorts, question


@pytest.fixture(scope="module")
def model_dir():
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def reference(model_dir):
    """The same prompts on a server whose pool holds everything (no offload): its tokens are the truth."""
    longs, shorts, question = workload()
    with Engine(model_dir, device="cpu", max_total_tokens=2048) as engine:
        outs = engine.generate(longs + shorts, GREEDY)
        follow_up = longs[0] + outs[0].token_ids + question
        return [o.token_ids for o in outs], follow_up, engine.generate(follow_up, GREEDY).token_ids


def assert_invariants(info: dict) -> None:
    assert info["kv_invariant_ok"], "free + cached + owned == total on the device, and on the host pool"
    assert info["long_running"] == 0 and info["long_waiting"] == 0 and info["host_kv_owned"] == 0


CONFIGS = {
    "chunk64-ring2": dict(layerwise_offload_chunk_size=64, layerwise_offload_ring_size=2),
    "chunk100-ring3-1unit": dict(
        layerwise_offload_chunk_size=100, layerwise_offload_ring_size=3, layerwise_offload_units_per_step=1
    ),
    "chunk256-ring2-whole-layers": dict(layerwise_offload_chunk_size=256, layerwise_offload_units_per_step=0),
    "chunk48-ring3-serial": dict(
        layerwise_offload_chunk_size=48,
        layerwise_offload_ring_size=3,
        layerwise_offload_units_per_step=3,
        disable_overlap_schedule=True,
    ),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_offload_gives_the_tokens_of_a_pool_that_holds_it(model_dir, reference, config):
    longs, shorts, _ = workload()
    expected, follow_up, follow_up_expected = reference
    with Engine(
        model_dir,
        device="cpu",
        max_total_tokens=POOL,
        chunked_prefill_size=32,
        enable_layerwise_offload=True,
        hicache_size=HOST_GB,
        **config,
    ) as engine:
        outs = engine.generate(longs + shorts, GREEDY)
        assert [o.error for o in outs] == [None] * 4
        assert [o.token_ids for o in outs] == expected
        info = engine.server_info()
        assert_invariants(info)
        assert info["long_max_decode_batch"] == 2, "the two long requests decoded in one step"
        assert info["kv_pool_tokens"] == info["hicache_capacity_tokens"] > 4 * POOL
        # Both long documents (prompt + output) are in the host tier; a follow-up over the first computes only its
        # own tokens: the document and the reply (but its last token, which had no KV) come from host memory.
        again = engine.generate(follow_up, GREEDY)
        after = engine.server_info()
        assert again.token_ids == follow_up_expected
        assert again.cached_tokens == LONG + OUT - 1
        computed = after["prefill_tokens_computed"] - info["prefill_tokens_computed"]
        assert computed == len(follow_up) - again.cached_tokens
        assert_invariants(after)


def test_short_requests_keep_running_while_a_long_one_is_served(model_dir):
    """One long step per ordinary step: a short request gets all its tokens while a long prefill is still going
    (one unit a step: 2 layers x 16 chunks of the long prompt)."""
    longs, shorts, _ = workload()
    with Engine(
        model_dir,
        device="cpu",
        max_total_tokens=POOL,
        enable_layerwise_offload=True,
        hicache_size=HOST_GB,
        layerwise_offload_chunk_size=16,
        layerwise_offload_units_per_step=1,
    ) as engine:
        long_out, short_out = engine.generate([longs[0], shorts[0]], SamplingParams(temperature=0.0, max_new_tokens=4))
        assert short_out.first_token_s < long_out.first_token_s
        info = engine.server_info()
        assert info["long_steps"] >= 2 * 16 and info["steps"] > info["long_steps"]
        assert_invariants(info)


def test_admission_names_the_limits(model_dir):
    with Engine(
        model_dir,
        device="cpu",
        max_total_tokens=POOL,
        context_length=3000,
        enable_layerwise_offload=True,
        hicache_size=HOST_GB,
    ) as engine:
        capacity = engine.server_info()["hicache_capacity_tokens"]
        assert capacity < 3000
        with pytest.raises(ValueError, match="maximum context length is 3000 tokens"):
            engine.generate([5] * 2990, SamplingParams(max_new_tokens=20))
        with pytest.raises(ValueError, match=f"holds at most {capacity} tokens per sequence.*--hicache-size"):
            engine.generate([5] * capacity, SamplingParams(max_new_tokens=1))
        echo = engine.generate([5] * 300, SamplingParams(max_new_tokens=1, prompt_logprobs=0))
        assert echo.finish_reason == "error" and "prompt logprobs" in echo.error
        ok = engine.generate([5] * (capacity - 4), SamplingParams(max_new_tokens=4, ignore_eos=True))
        assert ok.error is None and len(ok.token_ids) == 4
        assert_invariants(engine.server_info())


def test_host_memory_is_checked_at_start_up():
    from radixserve.runtime.preflight import LaunchError, check_host_memory

    check_host_memory(2.0, 1, available=int(3e9))
    with pytest.raises(
        LaunchError,
        match=r"--hicache-size 2 GB of host KV per rank \(4 ranks on this node\) needs "
        r"8.0 GB of host memory, but this machine has 3.0 GB available",
    ):
        check_host_memory(2.0, 4, available=int(3e9))


def test_offload_needs_a_host_pool():
    from radixserve.config import ServerArgs

    with pytest.raises(ValueError, match="give its size with --hicache-size"):
        ServerArgs(device="cpu", enable_layerwise_offload=True)
    with pytest.raises(ValueError, match="--layerwise-offload-ring-size must be >= 2"):
        ServerArgs(device="cpu", enable_layerwise_offload=True, hicache_size=1, layerwise_offload_ring_size=1)


def test_real_weights_give_the_same_tokens_with_offload():
    """The demo model (SmolLM2-135M, fp32): its 30 layers one at a time on a prompt over 2.5x the pool give the
    tokens of a pool that holds it (in process: the processes are shown above, and this model is slow to load)."""
    from radixserve.testing import smollm2_dir
    from scheduler_service.in_process_engine import InProcessEngine

    model = str(smollm2_dir())
    text = " ".join(
        f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} stones." for i in range(20)
    )
    messages = [{"role": "user", "content": text + "\nWhich box holds the most stones?"}]
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    whole = InProcessEngine(model, device="cpu", dtype="float32", max_total_tokens=1024)
    prompt = whole.apply_chat_template(messages)
    expected = whole.generate(prompt, params).token_ids
    pool = 112
    assert len(prompt) > 2.5 * pool
    offload = InProcessEngine(
        model,
        device="cpu",
        dtype="float32",
        max_total_tokens=pool,
        enable_layerwise_offload=True,
        hicache_size=0.05,
        layerwise_offload_chunk_size=100,
    )
    offload.scheduler.check_invariant_every_step = True
    out = offload.generate(prompt, params)
    assert out.token_ids == expected and out.error is None
    assert offload.scheduler.long.jobs >= 1 + 5  # a prefill job and a decode job per further token
    offload.scheduler.check_invariant(walk_tree=True)


def test_documents_in_the_host_tier_keep_to_their_salt_and_are_evicted_lru(model_dir):
    """In process (the invariant of both pools checked after every step): a finished document is found again under
    its own cache_salt only, and a host pool that holds two documents' KV evicts the least recently used one for a
    third, which is then computed again in full."""
    from scheduler_service.in_process_engine import InProcessEngine
    from scheduler_service.request import Req

    engine = InProcessEngine(
        model_dir,
        device="cpu",
        max_total_tokens=POOL,
        enable_layerwise_offload=True,
        hicache_size=0.0007,
        layerwise_offload_chunk_size=128,
    )  # ~1360 tokens of host KV
    s = engine.scheduler
    s.check_invariant_every_step = True
    rng = np.random.default_rng(3)
    docs = [rng.integers(100, 40000, 400).tolist() for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)

    def run(prompt, salt=None) -> Req:
        req = Req(f"r{rng.integers(1 << 30)}", prompt, params)
        req.cache_salt = salt
        s.add_request(req)
        engine.loop.run_until_idle()
        assert req.finish_reason == "length" and req.offloaded
        return req

    first = run(docs[0], "tenant-a")
    question = docs[0] + first.output_ids + [7, 8, 9]
    assert run(question, "tenant-b").cached_tokens == 0  # another tenant's document is not found
    assert run(question, "tenant-a").cached_tokens == 403  # the tenant's own is: only the question is computed
    run(docs[1])
    assert s.host_tier.tree.evicted_tokens == 0
    run(docs[2])  # no room for a third document: the least recently used ones go
    assert s.host_tier.tree.evicted_tokens > 0
    assert run(question, "tenant-b").cached_tokens == 0 and run(docs[2] + [5]).cached_tokens == 400
    s.check_invariant(walk_tree=True)
    assert s.long.owned_host_slots() == 0 and s.host_tier.tree.locked_size == 0


def test_benchmark_smoke(tmp_path):
    """bench/long_context.py --smoke (tiny Qwen3 with YaRN, CPU, the Engine's processes): every phase ran and the
    follow-up question found the whole document in the host tier."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run(
        [sys.executable, "-m", "bench.long_context", "--smoke", "--out-dir", str(tmp_path)],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "long-context.json").read_text())
    assert res["kv_invariant_ok"] and res["rope_scaling"]["rope_type"] == "yarn"
    assert res["follow_up_cached_tokens"] == res["doc_tokens"] + res["out_tokens"] - 1
    assert sorted(map(int, res["decode_points"])) == [400, 800, 1400] and len(res["gpu_prefill_s"]) == 4
    assert "offload_prefill_s" in res and "prefill_vs_gpu_fit" in res and (tmp_path / "long-context.md").is_file()


def test_a_pinned_document_stays_in_host_memory(model_dir):
    """A pin of a prefix longer than the device pool: computed by the long path, pinned in the host tier's tree, kept
    there while other documents push everything else out, listed, and evictable again once unpinned."""
    from radixserve.protocol import ListPinsRequest, PinPrefixRequest, UnpinPrefixRequest, pack_i32
    from scheduler_service.cache_control import CacheControl
    from scheduler_service.in_process_engine import InProcessEngine

    engine = InProcessEngine(
        model_dir,
        device="cpu",
        max_total_tokens=POOL,
        enable_layerwise_offload=True,
        hicache_size=0.0007,
        layerwise_offload_chunk_size=128,
    )  # ~1360 tokens of host KV
    s = engine.scheduler
    s.check_invariant_every_step = True
    control = CacheControl(s, None)
    rng = np.random.default_rng(4)
    doc, others = rng.integers(100, 40000, 400).tolist(), [rng.integers(100, 40000, 400).tolist() for _ in range(3)]
    assert control.handle(PinPrefixRequest("p1", pack_i32(doc), ttl_seconds=None)) is None  # being computed
    replies = []
    while engine.loop.has_work():
        replies += control.take_outputs(engine.loop.step())[1]
    assert [r.status for r in replies] == [200] and replies[0].pins[0].num_tokens == 400
    pin_id = replies[0].pins[0].id
    assert s.host_tier.tree.pinned_size == 400 and s.tree.pinned_size == 0
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    for other in others:  # three more documents through a pool that holds about three
        engine.generate(other, params)
    assert s.host_tier.tree.evicted_tokens > 0
    assert engine.generate(doc + [1, 2], params).cached_tokens == 400  # the pinned document was kept
    assert [p.id for p in control.handle(ListPinsRequest("l")).pins] == [pin_id]
    assert control.handle(UnpinPrefixRequest("u", pin_id)).status == 200
    for other in others:
        engine.generate(other + [3], params)
    assert engine.generate(doc + [1, 2], params).cached_tokens == 0  # unpinned, it was evicted like any prefix
    s.check_invariant(walk_tree=True)


def test_through_the_http_server(model_dir, reference):
    """launch.py with --enable-layerwise-offload: /generate serves a prompt 4x the pool with the tokens a whole pool
    gives, a prompt beyond the host pool is a 400 naming it, and the server goes idle with both pools accounted."""
    import httpx

    from server_fixture import launched_server

    longs, _, _ = workload()
    expected = reference[0][0]
    with launched_server(
        model_dir, "--max-total-tokens", str(POOL), "--enable-layerwise-offload", "--hicache-size", str(HOST_GB)
    ) as server:
        body = {
            "input_ids": longs[0],
            "sampling_params": {"max_new_tokens": OUT, "temperature": 0.0, "ignore_eos": True},
        }
        reply = httpx.post(f"{server.url}/generate", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["output_ids"] == expected
        capacity = server.server_info()["hicache_capacity_tokens"]
        too_long = {"input_ids": [5] * capacity, "sampling_params": {"max_new_tokens": 1}}
        refused = httpx.post(f"{server.url}/generate", json=too_long, timeout=60)
        assert refused.status_code == 400 and f"at most {capacity} tokens" in refused.text
        assert "--hicache-size" in refused.text
        server.assert_idle_kv_invariant()
        assert_invariants(server.server_info())


def test_aborts_in_the_middle_of_jobs(model_dir):
    """Aborting a long request mid-prefill and another mid-decode-job (a job of two that spans steps): the one left
    gets the tokens it gets alone, and every slot, row and host slot comes back (checked after every step)."""
    from scheduler_service.in_process_engine import InProcessEngine
    from scheduler_service.request import Req

    longs, _, _ = workload()
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    config = dict(
        device="cpu",
        max_total_tokens=POOL,
        enable_layerwise_offload=True,
        hicache_size=HOST_GB,
        layerwise_offload_chunk_size=64,
        layerwise_offload_units_per_step=1,
    )
    alone = InProcessEngine(model_dir, **config).generate(longs[0], params).token_ids
    engine = InProcessEngine(model_dir, **config)
    s = engine.scheduler
    s.check_invariant_every_step = True
    reqs = [Req(f"r{i}", prompt, params) for i, prompt in enumerate([longs[0], longs[1], longs[1][:200]])]
    for req in reqs:
        s.add_request(req)
    for _ in range(3):
        engine.loop.step()
    assert s.long.prefill is not None and s.long.prefill.reqs[0] is reqs[0]
    while s.long.prefill is None or s.long.prefill.reqs[0] is not reqs[2]:
        engine.loop.step()  # request 0 decodes while request 1, then 2 prefill
    assert s.abort("r2") and s.long.prefill is None  # mid-prefill: the rest of its job is never sent
    while s.long.decode is None or len(s.long.decode.reqs) < 2 or s.long.decode.next_unit == 0:
        engine.loop.step()
    row, free_before = reqs[1].req_pool_idx, s.row_allocator.num_free
    assert s.abort("r1")  # inside a decode job of both: its row waits for the job's last step (a request given
    assert s.row_allocator.num_free == free_before  # the row before would get this job's token for it)
    while s.long.decode is not None:
        engine.loop.step()
    assert not s.row_allocator._is_free[row] or s.row_allocator.num_free == free_before + 1
    engine.loop.run_until_idle()
    assert reqs[0].output_ids == alone and reqs[0].finish_reason == "length"
    assert [r.finish_reason for r in reqs[1:]] == ["abort", "abort"]
    s.check_invariant(walk_tree=True)
    assert s.row_allocator.num_free == s.row_allocator.num_total and s.long.owned_host_slots() == 0
