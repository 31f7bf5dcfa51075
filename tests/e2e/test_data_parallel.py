"""Data parallelism (--dp-size): the DP controller's mirror of each replica's radix tree stays exact under its
insert/evict events; cache-aware routing keeps groups of requests that share a system prompt on one replica, so two
replicas hit the cache (nearly) as often as one; flush and server_info reach every replica."""

import random

import numpy as np
import pytest

from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.slot_allocator import TokenSlotAllocator
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import tiny_model_dir
from scheduler_service.cache_events import CacheEventLog
from scheduler_service.dp_router import BALANCE_ABS, DataParallelRouter, Replica

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

GROUPS, PER_GROUP, SYSTEM_LEN, QUESTION_LEN = 8, 4, 96, 8


def test_mirror_stays_exact_under_inserts_evictions_and_flush():
    rng = random.Random(0)
    allocator = TokenSlotAllocator(400)
    tree = RadixCache(allocator)
    log = CacheEventLog()
    tree.listener = log
    mirror = Replica()
    stems = [[rng.randrange(50) for _ in range(rng.randrange(1, 30))] for _ in range(12)]

    def random_seq():
        return rng.choice(stems)[: rng.randrange(1, 31)] + [rng.randrange(50) for _ in range(rng.randrange(0, 20))]

    for step in range(400):
        if step == 250:
            tree.reset()
        seq = random_seq()
        if allocator.num_free < len(seq):
            tree.evict(len(seq) - allocator.num_free + rng.randrange(0, 40))
        if allocator.num_free >= len(seq):
            tree.insert(seq, allocator.alloc(len(seq)))
        if rng.random() < 0.3:
            tree.evict(rng.randrange(1, 30))
        message = log.take()
        if message is not None:
            mirror.apply(message)
        for _ in range(5):
            query = random_seq()
            assert mirror.cached.match_len(query) == len(tree.match_prefix(query).slots), (step, query)


def test_router_policies():
    prompt_a, prompt_b = np.arange(100, 140, dtype=np.int32), np.arange(200, 240, dtype=np.int32)
    router = DataParallelRouter(2, "cache_aware")
    first = router.route("a1", prompt_a)
    assert router.route("a2", prompt_a) == first  # in flight on that replica: follows it
    assert router.route("b1", prompt_b) != first  # nothing cached anywhere: the idler replica
    router.finished("a1")
    router.finished("a2")
    assert router.replicas[first].load == 0 and router.replicas[first].in_flight.match_len(prompt_a.tolist()) == 0
    # Too uneven: the least loaded replica wins over the cache.
    for i in range(BALANCE_ABS + 2):
        router.replicas[first].running[f"x{i}"] = prompt_b
    assert router.route("a3", prompt_a) != first

    rr = DataParallelRouter(3, "round_robin")
    assert [rr.route(f"r{i}", prompt_a) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    sq = DataParallelRouter(2, "shortest_queue")
    assert [sq.route(f"s{i}", prompt_a) for i in range(4)] == [0, 1, 0, 1]


def shared_prompt_waves(seed: int = 0) -> list[list[list[int]]]:
    """PER_GROUP waves; each has one request of every group (distinct system prompt, own question), shuffled."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000, 40000) for _ in range(SYSTEM_LEN)] for _ in range(GROUPS)]
    waves = []
    for _ in range(PER_GROUP):
        wave = [system + [rng.randrange(1000, 40000) for _ in range(QUESTION_LEN)] for system in systems]
        rng.shuffle(wave)
        waves.append(wave)
    return waves


def hit_rate(engine) -> float:
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    prompt = cached = 0
    for wave in shared_prompt_waves():
        for result in engine.generate(wave, params):
            prompt, cached = prompt + result.prompt_tokens, cached + result.cached_tokens
    return cached / prompt


@pytest.mark.parametrize("method", ["cache_aware", "round_robin"])
def test_two_replicas_hit_the_cache_like_one(method):
    from radixserve import Engine
    from scheduler_service.in_process_engine import InProcessEngine

    model = str(tiny_model_dir("llama"))
    one = hit_rate(InProcessEngine(model, device="cpu", max_total_tokens=4096))
    with Engine(model, device="cpu", max_total_tokens=4096, dp_size=2, load_balance_method=method) as engine:
        two = hit_rate(engine)
        info = engine.server_info()
        assert info["dp_size"] == 2 and info["dp0_num_running"] == 0 == info["dp1_num_running"]
        # Both replicas served: each computed prompts of its own.
        assert info["dp0_prefill_tokens_computed"] > 0 and info["dp1_prefill_tokens_computed"] > 0
        assert engine.flush_cache()
        assert engine.server_info()["kv_evictable"] == 0  # every replica's tree is empty
    print(
        f"\nprompt-token hit rate, {GROUPS} groups x {PER_GROUP}: one replica {one:.3f}, "
        f"two replicas ({method}) {two:.3f}"
    )
    if method == "cache_aware":
        assert two >= 0.95 * one, (one, two)


def test_get_load_has_one_entry_per_replica():
    from scheduler_service.dp_controller import merge_server_info
    from tokenizer_service.routes_router import replica_loads
    from radixserve.config import ServerArgs

    replica = {
        "num_running": 2,
        "num_waiting": 1,
        "kv_owned": 40,
        "kv_protected": 8,
        "kv_total": 100,
        "prefill_tokens_computed": 5,
        "cached_prompt_tokens": 7,
        "kv_invariant_ok": True,
    }
    merged = merge_server_info(
        [replica, {**replica, "num_running": 0, "kv_owned": 0}], ServerArgs(device="cpu", dp_size=2)
    )
    assert merged["num_running"] == 2 and merged["kv_total"] == 200 and merged["dp_size"] == 2
    assert replica_loads(merged, 2) == [
        {"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 48},
        {"dp_rank": 1, "num_reqs": 1, "num_waiting_reqs": 1, "num_tokens": 8},
    ]
    assert replica_loads(replica, 1) == [{"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 48}]
