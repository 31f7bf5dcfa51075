"""Scheduler behaviour with a real tiny model on the CPU: the KV invariant after every step, identical greedy
outputs whatever the batching, prefix reuse, aborts in every state, no starvation."""

import numpy as np
import pytest

from scheduler_service.in_process_engine import InProcessEngine
from radixserve.request_validation import InvalidRequest
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import tiny_model_dir
from scheduler_service.request import Req

VOCAB = 49152


@pytest.fixture(scope="module")
def model_dir():
    return tiny_model_dir("llama")


def make_engine(model_dir, **kw) -> InProcessEngine:
    kw.setdefault("max_total_tokens", 8192)
    kw.setdefault("max_running_requests", 64)
    engine = InProcessEngine(str(model_dir), device="cpu", **kw)
    engine.scheduler.check_invariant_every_step = True
    return engine


def prompts_with_shared_prefixes(n, seed=0):
    """Prompts that share prefixes of various lengths, so the radix tree splits and reuses nodes."""
    rng = np.random.default_rng(seed)
    roots = [rng.integers(0, VOCAB, int(rng.integers(5, 60))).tolist() for _ in range(4)]
    out = []
    for i in range(n):
        root = roots[i % 4][: int(rng.integers(1, len(roots[i % 4]) + 1))]
        out.append(root + rng.integers(0, VOCAB, int(rng.integers(1, 30))).tolist())
    return out


def greedy(max_new_tokens, **kw):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True, **kw)


def run_all(engine, prompts, max_new=(8, 24)):
    rng = np.random.default_rng(1)
    params = [greedy(int(rng.integers(*max_new))) for _ in prompts]
    results = engine.generate(prompts, params)
    assert all(r.finish_reason == "length" for r in results), [r.error for r in results]
    assert_idle_and_clean(engine)
    return [r.token_ids for r in results]


def assert_idle_and_clean(engine):
    s = engine.scheduler
    s.check_invariant()
    assert not s.running and not s.waiting
    u = s.kv_usage()
    assert u["protected"] == 0 and u["owned"] == 0
    assert u["free"] + u["evictable"] == u["total"]


@pytest.fixture(scope="module")
def reference_outputs(model_dir):
    """Greedy outputs with no cache reuse, no chunking, no mixing: requests run one at a time."""
    engine = make_engine(model_dir, disable_radix_cache=True, chunked_prefill_size=-1, disable_mixed_batch=True)
    prompts = prompts_with_shared_prefixes(24)
    rng = np.random.default_rng(1)
    params = [greedy(int(rng.integers(8, 24))) for _ in prompts]
    outs = [engine.generate(p, sp).token_ids for p, sp in zip(prompts, params)]
    assert_idle_and_clean(engine)
    return prompts, outs


# One configuration on the real model (radix cache on, mixed batches, the default chunk); the others run on the fake
# executor (test_scheduler_with_fake_executor.py), which catches the same slot bookkeeping errors in a fraction of
# the time.
@pytest.mark.parametrize("config", [dict()])
def test_same_greedy_outputs_whatever_the_batching(model_dir, reference_outputs, config):
    prompts, expected = reference_outputs
    engine = make_engine(model_dir, **config)
    # Run twice: the second pass hits the prefixes the first one left in the tree.
    assert run_all(engine, prompts) == expected
    assert run_all(engine, prompts) == expected
    if not config.get("disable_radix_cache"):
        assert engine.scheduler.stats.cached_prompt_tokens > 0


def test_tiny_kv_pool_forces_eviction_and_retraction(model_dir, reference_outputs):
    prompts, expected = reference_outputs
    engine = make_engine(
        model_dir, max_total_tokens=160, chunked_prefill_size=16, init_new_token_ratio=0.05, min_new_token_ratio=0.01
    )
    assert run_all(engine, prompts) == expected
    stats = engine.scheduler.stats
    assert stats.retractions > 0, "pool this small must retract"
    assert stats.evicted_tokens > 0, "pool this small must evict"


def test_request_larger_than_the_pool_fails_cleanly(model_dir):
    engine = make_engine(model_dir, max_total_tokens=40, chunked_prefill_size=16)
    # The front end refuses it before anything is queued (request_validation.check_kv_pool) ...
    with pytest.raises(InvalidRequest, match="KV cache holds at most 40 tokens"):
        engine.generate(list(range(100, 160)), greedy(4))
    # ... and a request that skipped that check still fails cleanly in the scheduler, without harming others.
    engine.kv_pool_tokens = None
    ok, too_big = engine.generate([[5] * 10, list(range(100, 160))], [greedy(4), greedy(4)])
    assert ok.finish_reason == "length" and len(ok.token_ids) == 4
    assert too_big.finish_reason == "error" and "cannot hold" in too_big.error
    assert_idle_and_clean(engine)


def test_sixty_four_at_once_equals_one_by_one(model_dir):
    prompts = prompts_with_shared_prefixes(64, seed=7)
    engine = make_engine(model_dir, chunked_prefill_size=64)
    together = [r.token_ids for r in engine.generate(prompts, greedy(6))]
    assert_idle_and_clean(engine)
    alone_engine = make_engine(model_dir, disable_radix_cache=True)
    alone = [alone_engine.generate(p, greedy(6)).token_ids for p in prompts]
    assert together == alone


def step_until(engine, predicate, limit=500):
    for _ in range(limit):
        if predicate():
            return
        engine.loop.step()
    raise AssertionError("condition not reached")


@pytest.mark.parametrize("state", ["waiting", "mid_chunk", "decoding"])
def test_abort_in_every_state_frees_everything(model_dir, state):
    engine = make_engine(model_dir, chunked_prefill_size=8, max_running_requests=1)
    s = engine.scheduler
    blocker = Req("blocker", list(range(1000, 1020)), greedy(30))
    victim = Req("victim", list(range(2000, 2040)), greedy(30))
    if state == "waiting":
        s.add_request(blocker)
        s.add_request(victim)
        step_until(engine, lambda: blocker.output_ids)
        assert victim.status.value == "waiting"
    else:
        s.add_request(victim)
        if state == "mid_chunk":
            step_until(engine, lambda: victim.kv_len > 0)
            assert victim.kv_len < len(victim.prompt_ids)
            # Finished chunks are already shared through the tree, locked by the victim.
            assert s.tree.protected_size == victim.kv_len
        else:
            step_until(engine, lambda: len(victim.output_ids) >= 3)
    assert s.abort("victim")
    assert victim.finish_reason == "abort"
    s.check_invariant()
    engine.loop.run_until_idle()
    assert_idle_and_clean(engine)
    assert not s.abort("victim"), "a finished request cannot be aborted twice"


def test_cache_miss_is_not_starved_by_cache_hits(model_dir):
    engine = make_engine(model_dir, max_running_requests=2, max_wait_steps=16, chunked_prefill_size=64)
    s = engine.scheduler
    rng = np.random.default_rng(5)
    hot = rng.integers(0, VOCAB, 40).tolist()
    s.add_request(Req("warm", hot + [1], greedy(2)))
    engine.loop.run_until_idle()
    miss = Req("miss", rng.integers(0, VOCAB, 30).tolist(), greedy(2))
    s.add_request(miss)
    steps = 0
    # Keep the queue full of cache hits: LPM alone would always prefer them.
    for i in range(400):
        while len(s.waiting) < 6:
            s.add_request(Req(f"hit-{i}-{len(s.waiting)}", hot + rng.integers(0, VOCAB, 3).tolist(), greedy(4)))
        engine.loop.step()
        steps += 1
        if miss.finish_reason:
            break
    assert miss.finish_reason == "length", "the cache miss starved"
    assert steps < 60, f"the cache miss waited {steps} steps"
