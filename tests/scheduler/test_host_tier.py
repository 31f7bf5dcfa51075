"""The host-memory KV tier (--hicache-size, radixserve/cache/host_tier.py).

On its own: the tier's trees and copies against a model of the KV contents (the worker's real KVCache and
HostKVCache, on the CPU), step by step as the scheduler drives them, so that every slot of both trees is checked to
hold the KV of its own prefix after each step's saves, loads and forward. Through the real Engine (scheduler and
worker processes): a prefix evicted from a small device pool comes back by a copy instead of a prefill, with the
same greedy tokens.
"""

import numpy as np
import pytest
import torch

from radixserve.cache.host_tier import HostTier, _last_writes
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.slot_allocator import TokenSlotAllocator
from radixserve.cache.tree_node import path_tokens, subtree
from radixserve.worker.kv_cache import HostKVCache, KVCache, _runs

NUM_LAYERS = 2


def kv_of(tokens) -> np.ndarray:
    """What a model would store for each token of `tokens`: a function of the token and everything before it (a
    rolling hash, exact in float32), so a slot holding another prefix's KV is caught."""
    h, out = 0, []
    for t in tokens:
        h = (h * 1000003 + int(t) + 1) % (1 << 20)
        out.append(h)
    return np.asarray(out, dtype=np.float32)


class Harness:
    """A device tree, its tier, and the worker's KV buffers; `step` runs requests as the scheduler and worker do."""

    def __init__(self, device_slots: int, host_slots: int, min_load_tokens: int = 4, device: str = "cpu"):
        self.allocator = TokenSlotAllocator(device_slots)
        self.tree = RadixCache(self.allocator)
        self.tier = HostTier(self.tree, self.allocator, host_slots, min_load_tokens=min_load_tokens)
        self.kv = KVCache(NUM_LAYERS, device_slots, 1, 2, torch.float32, device)
        self.host_kv = HostKVCache(self.kv, host_slots)

    def _write_device(self, slots, values) -> None:
        device = self.kv.k_buffers[0].device
        index = torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(device)
        for layer in range(NUM_LAYERS):
            v = torch.from_numpy(values + 10 * layer).to(device)[:, None, None].expand(-1, 1, 2)
            self.kv.k_buffers[layer][index] = v
            self.kv.v_buffers[layer][index] = -v

    def step(self, prompts, namespace=None) -> list[int]:
        """One step: admit each prompt (device match, then the tier's load), compute the rest, then build the batch
        (saves, loads), run the 'forward' (write the computed KV), and cache every prompt. Returns the prefix
        length each prompt started from."""
        admitted, committed = [], 0
        for tokens in prompts:
            tokens = np.asarray(tokens, dtype=np.int32)
            match = self.tier.load(tokens, self.tree.match_prefix(tokens, namespace), namespace, reserve=committed)
            self.tree.inc_lock_ref(match.last_node)
            n = len(tokens) - len(match.slots)
            short = committed + n - self.allocator.num_free
            if short > 0:
                self.tree.evict(short)
            if self.allocator.num_free < committed + n:
                self.tree.dec_lock_ref(match.last_node)
                continue
            admitted.append((tokens, match, n))
            committed += n
        new_slots = [self.allocator.alloc(n) for _, _, n in admitted]
        save_src, save_dst, load_src, load_dst = self.tier.take_copies()
        self.host_kv.save(save_src, save_dst)  # the worker's order: saves, loads, forward
        self.host_kv.load(load_src, load_dst)
        for (tokens, match, n), slots in zip(admitted, new_slots):
            self._write_device(slots, kv_of(tokens)[len(match.slots) :])
        for (tokens, match, n), slots in zip(admitted, new_slots):
            self.tree.insert(tokens, np.concatenate([match.slots, slots]), namespace)
            self.tree.dec_lock_ref(match.last_node)
        return [len(match.slots) for _, match, _ in admitted]

    def check(self) -> None:
        """Every cached token, on the device and on the host, holds the KV of its own prefix; both pools add up."""
        for tree, read in ((self.tree, self._device_kv), (self.tier.tree, self._host_kv)):
            tree.check_invariants()
            for node in subtree(*tree._roots.values()):
                want = kv_of(path_tokens(node))[-len(node) :]
                np.testing.assert_array_equal(read(node.value), want, err_msg=f"{tree is self.tree} {node!r}")
        assert self.allocator.num_free + self.tree.total_size() == self.allocator.num_total
        self.tier.check_invariant(walk_tree=True)

    def _device_kv(self, slots) -> np.ndarray:
        index = torch.from_numpy(slots.astype(np.int64)).to(self.kv.k_buffers[0].device)
        k1, v0 = self.kv.k_buffers[1][index][:, 0, 1].cpu().numpy(), self.kv.v_buffers[0][index][:, 0, 0].cpu().numpy()
        np.testing.assert_array_equal(k1 - 10, -v0)
        return -v0

    def _host_kv(self, slots) -> np.ndarray:
        if self.kv.k_buffers[0].is_cuda:
            torch.cuda.synchronize()  # the device -> host copies are asynchronous there
        rows = self.host_kv.buffer[:, :, torch.from_numpy(slots.astype(np.int64))]  # [layers, 2, n, heads, dim]
        np.testing.assert_array_equal(rows[1, 0, :, 0, 0].numpy() - 10, -rows[0, 1, :, 0, 1].numpy())
        return rows[0, 0, :, 0, 0].numpy()


def test_shared_prompt_is_saved_once_and_a_hit_comes_back_by_copy():
    h = Harness(device_slots=64, host_slots=256)
    system = list(range(100, 140))  # 40 shared tokens
    a, b = system + [1, 2, 3, 4, 5, 6], system + [7, 8, 9, 10, 11, 12]
    assert h.step([a]) == [0]
    assert h.step([b]) == [40]
    h.check()
    h.step([list(range(500, 563))])  # 63 other tokens: everything else must go
    h.check()
    assert h.tree.match_prefix(a).slots.size == 0
    assert h.tier.saved_tokens == 40 + 6 + 6  # the system prompt once, then each question
    assert h.tier.size_tokens == 52
    assert h.step([a + [99]]) == [46]  # all of a, copied back
    assert (h.tier.hits, h.tier.loaded_tokens) == (1, 46)
    h.check()
    assert h.tier.tree.protected_size == 0, "the load's host lock ends when its batch is built"


def test_below_min_load_tokens_or_without_room_nothing_is_loaded():
    h = Harness(device_slots=64, host_slots=256, min_load_tokens=8)
    h.step([list(range(100, 106))])  # 6 tokens
    h.step([list(range(500, 563))])
    assert h.tier.size_tokens == 6
    assert h.step([list(range(100, 107))]) == [0]  # 6 < 8: computed again, not copied
    assert h.tier.hits == 0
    h.check()
    h2 = Harness(device_slots=64, host_slots=256)
    h2.step([list(range(100, 140))])
    h2.step([list(range(500, 563))])
    tokens = np.arange(100, 141, dtype=np.int32)
    before = h2.tree.match_prefix(tokens)
    # Every device slot promised to this step already: the load must not take them.
    assert h2.tier.load(tokens, before, reserve=h2.allocator.num_total) is before
    assert h2.tier.hits == 0


def test_namespaces_never_share_host_copies():
    h = Harness(device_slots=64, host_slots=256)
    tokens = list(range(100, 140))
    h.step([tokens], namespace="tenant-a")
    h.step([list(range(500, 563))])
    assert h.tier.size_tokens == 40
    assert h.step([tokens + [1]], namespace="tenant-b") == [0]
    assert h.tier.hits == 0
    h.step([list(range(600, 663))])
    assert h.step([tokens + [1]], namespace="tenant-a") == [40]
    assert h.tier.hits == 1
    h.check()


def test_a_full_host_keeps_the_most_recent_prefixes():
    h = Harness(device_slots=64, host_slots=100)
    prompts = [list(range(1000 * i, 1000 * i + 60)) for i in range(1, 6)]
    for p in prompts:
        h.step([p])  # each evicts the one before (60 + 60 > 64)
        h.check()
    assert h.tier.size_tokens <= 100
    assert h.tier.saved_tokens >= 4 * 60 - 20  # the last save may only fit in part
    assert h.step([prompts[3] + [1]]) == [60]  # the newest on the host comes back whole
    assert h.step([prompts[0] + [1]]) == [0]  # the oldest went to make room
    h.check()


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_every_cached_slot_holds_its_prefix(seed, device="cpu"):
    """Shared prefixes, pressure on both pools, several requests a step: the copies a step queues run as the worker
    runs them (saves, loads, forward) and every slot of both trees still holds the KV of its own prefix. A wrong
    order (loads first), a slot reused before its copy ran, or two copies into one slot would show here."""
    rng = np.random.default_rng(seed)
    h = Harness(
        device_slots=int(rng.integers(80, 160)),
        host_slots=int(rng.integers(60, 300)),
        min_load_tokens=int(rng.integers(1, 8)),
        device=device,
    )
    roots = [rng.integers(0, 50, int(rng.integers(5, 30))).tolist() for _ in range(4)]
    for _ in range(30):
        prompts = []
        for _ in range(int(rng.integers(1, 4))):
            prefix = roots[int(rng.integers(len(roots)))]
            prompts.append(
                prefix[: int(rng.integers(1, len(prefix) + 1))] + rng.integers(0, 50, int(rng.integers(1, 25))).tolist()
            )
        h.step(prompts, namespace=[None, "t"][int(rng.integers(2))])
        h.check()
    assert h.tier.saved_tokens > 0


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_random_workload_on_cuda_with_pinned_host_memory(seed):
    """The same on a GPU: pinned host buffer, asynchronous copies ordered with the 'forward' on one stream."""
    test_random_workload_every_cached_slot_holds_its_prefix(seed, device="cuda")
    assert HostKVCache(KVCache(1, 4, 1, 2, torch.float16, "cuda"), 4).buffer.is_pinned()


def test_copies_into_one_slot_keep_the_last_and_runs_cover_the_slots():
    src, dst = _last_writes([(np.array([1, 2, 3]), np.array([10, 11, 12])), (np.array([7]), np.array([11]))])
    assert dict(zip(dst.tolist(), src.tolist())) == {10: 1, 11: 7, 12: 3} and len(dst) == 3
    slots = np.array([5, 6, 7, 2, 9, 10], dtype=np.int32)
    assert _runs(slots) == [(5, 8, 0), (2, 3, 3), (9, 11, 4)]


def test_host_slot_leak_is_reported():
    h = Harness(device_slots=64, host_slots=128)
    h.step([list(range(100, 140))])
    h.step([list(range(500, 563))])
    h.tier.allocator.alloc(3)  # taken outside the tree
    with pytest.raises(AssertionError, match="host KV slot leak"):
        h.tier.check_invariant()


# ---------------------------------------------------------------- through the engines


def shared_prefix_workload(seed: int = 0):
    """Two questions (40 tokens each) on one 96-token system prompt, and a flood of unrelated prompts that fills a
    256-token pool."""
    rng = np.random.default_rng(seed)
    system = rng.integers(100, 1000, 96).tolist()
    questions = [system + rng.integers(100, 1000, 40).tolist() for _ in range(2)]
    flood = [rng.integers(100, 1000, 150).tolist() for _ in range(3)]
    return questions, flood


def run_evict_and_hit(engine, server_info) -> None:
    from radixserve.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    questions, flood = shared_prefix_workload()
    first = [engine.generate(q, params) for q in questions]
    for prompt in flood:  # evicts both questions from the device pool: they go to the host
        engine.generate(prompt, params)
    before = server_info()
    again = engine.generate(questions[0], params)
    after = server_info()
    assert again.token_ids == first[0].token_ids, "a prefix copied back from the host gives the same greedy tokens"
    # The whole prompt but its last token came from the host: the device held none of it after the flood.
    assert again.cached_tokens == len(questions[0]) - 1
    assert after["hicache_hits"] - before["hicache_hits"] == 1
    assert after["hicache_loaded_tokens"] - before["hicache_loaded_tokens"] == again.cached_tokens
    assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] == 1
    assert after["hicache_saved_tokens"] > 0 and 0 < after["hicache_tokens"] <= after["hicache_capacity_tokens"]
    # The other question shares the system prompt (back on the device now); its own tail comes from the host.
    other = engine.generate(questions[1], params)
    assert other.token_ids == first[1].token_ids
    assert other.cached_tokens == len(questions[1]) - 1
    assert server_info()["hicache_hits"] - before["hicache_hits"] == 2
    assert server_info()["kv_invariant_ok"]


@pytest.mark.server
def test_engine_serves_an_evicted_prefix_from_host_memory():
    """The multi-process Engine (scheduler and worker processes, overlapped loop): 0.001 GB holds ~1950 tokens of
    the tiny model's KV, far more than its 256-token device pool."""
    from radixserve.engine import Engine
    from radixserve.testing.tiny_models import tiny_model_dir

    with Engine(str(tiny_model_dir("llama")), device="cpu", max_total_tokens=256, hicache_size=0.001) as engine:
        run_evict_and_hit(engine, engine.server_info)


def test_in_process_serial_loop_serves_an_evicted_prefix_from_host_memory():
    from radixserve.testing.tiny_models import tiny_model_dir
    from scheduler_service.cache_stats import cache_numbers
    from scheduler_service.in_process_engine import InProcessEngine

    engine = InProcessEngine(
        str(tiny_model_dir("llama")),
        device="cpu",
        max_total_tokens=256,
        hicache_size=0.001,
        disable_overlap_schedule=True,
    )
    engine.scheduler.check_invariant_every_step = True
    s = engine.scheduler

    def server_info():
        s.check_invariant(walk_tree=not s.running)
        return {"prefill_tokens_computed": s.stats.prefill_tokens_computed, "kv_invariant_ok": True, **cache_numbers(s)}

    run_evict_and_hit(engine, server_info)


def test_host_tier_is_off_by_default():
    from radixserve.testing.tiny_models import tiny_model_dir
    from scheduler_service.in_process_engine import InProcessEngine

    engine = InProcessEngine(str(tiny_model_dir("llama")), device="cpu", max_total_tokens=256)
    assert engine.scheduler.host_tier is None and engine.runner.host_kv_cache is None
    assert engine.scheduler.tree.evict_hook is None


@pytest.mark.server
def test_benchmark_smoke_shows_host_hits_instead_of_prefill(tmp_path):
    """bench/host_tier_bench.py --smoke (tiny model, CPU, in process): with the tier, later rounds copy their system
    prompts back instead of computing them."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.host_tier_bench", "--smoke", "--json-out", str(out)],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    on, off = results["with host tier"], results["without host tier"]
    assert on["host_hits"]["median"] > 0 and off["host_hits"]["median"] == 0
    assert on["prefill_tokens_computed"]["median"] == (
        off["prefill_tokens_computed"]["median"] - on["host_loaded_tokens"]["median"]
    )
