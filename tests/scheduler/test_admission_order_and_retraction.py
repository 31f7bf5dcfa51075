"""Scheduler decisions that identical outputs cannot reveal, made visible with a real tiny model (InProcessEngine).

Greedy tokens do not depend on admission order or on how much room is reserved for decoding, so tests that compare
outputs pass whatever the order. Here the order shows in `cached_tokens`: with one request running at a time and a
KV pool too small for two prompts, a cache miss that runs before a cache hit evicts the hit's prefix. Retraction
shows in the scheduler's retraction counter (`retractions` of /server_info) and must change no sampled token, seeded
sampling and penalties included.
"""

import numpy as np
import pytest

from scheduler_service.in_process_engine import InProcessEngine
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import tiny_model_dir
from scheduler_service.request import Req

rng = np.random.default_rng(0)
HOT = rng.integers(100, 40000, 100).tolist()  # the prefix a warm-up request leaves in the tree
MISS = rng.integers(100, 40000, 70).tolist()  # shares nothing with HOT; needs most of the pool
PROMPTS = [rng.integers(100, 40000, int(rng.integers(12, 24))).tolist() for _ in range(8)]


@pytest.fixture(scope="module")
def model_dir():
    return str(tiny_model_dir("llama"))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def assert_idle_and_clean(engine):
    s = engine.scheduler
    s.check_invariant()
    usage = s.kv_usage()
    assert usage["free"] + usage["evictable"] == usage["total"], usage
    assert not s.running and not s.waiting


def one_at_a_time(model_dir, **kw) -> InProcessEngine:
    """One running request, the whole prompt in one step, 140 KV slots: HOT (100) and MISS (70) do not fit together."""
    engine = InProcessEngine(
        model_dir, device="cpu", max_total_tokens=140, max_running_requests=1, chunked_prefill_size=-1, **kw
    )
    engine.generate(HOT, greedy(1))  # leaves exactly HOT in the tree
    return engine


@pytest.mark.parametrize(
    "policy, max_wait_steps, expected",
    [
        # Longest prefix first: the hits run before the miss that arrived ahead of them, each hits all of HOT.
        ("lpm", 1000, [100, 100, 100, 100, 100]),
        # Arrival order: the miss runs first and evicts HOT; the first hit recomputes it, the others reuse it.
        ("fcfs", 1000, [0, 100, 100, 100, 100]),
        # LPM with aging: one hit (4 steps) later the miss has waited > 3 steps and goes next, evicting HOT again.
        ("lpm", 3, [100, 0, 100, 100, 100]),
    ],
)
def test_admission_order_shows_in_cached_tokens(model_dir, policy, max_wait_steps, expected):
    engine = one_at_a_time(model_dir, schedule_policy=policy, max_wait_steps=max_wait_steps)
    results = engine.generate([MISS] + [HOT + [i] for i in range(1, 6)], greedy(4))
    assert all(r.finish_reason == "length" for r in results)
    assert results[0].cached_tokens == 0
    assert [r.cached_tokens for r in results[1:]] == expected
    assert_idle_and_clean(engine)


def run_with_ratio(model_dir, ratio: float, params, prompts=PROMPTS, max_total_tokens=200):
    engine = InProcessEngine(
        model_dir,
        device="cpu",
        max_total_tokens=max_total_tokens,
        chunked_prefill_size=64,
        init_new_token_ratio=ratio,
        min_new_token_ratio=ratio,
    )
    results = engine.generate(prompts, params)
    assert all(r.finish_reason == "length" for r in results), [r.error for r in results]
    assert_idle_and_clean(engine)
    return [r.token_ids for r in results], engine.scheduler.stats.retractions


@pytest.fixture(scope="module")
def unpressured_greedy(model_dir):
    return run_with_ratio(model_dir, 0.7, greedy(30), max_total_tokens=8192)


def test_full_decode_reservation_never_retracts(model_dir, unpressured_greedy):
    # Reserving every request's whole max_new_tokens at admission means what is admitted always fits: 8 requests
    # of up to 53 tokens in 200 slots run a few at a time and none is ever pushed out.
    tokens, retractions = run_with_ratio(model_dir, 1.0, greedy(30))
    assert retractions == 0
    assert tokens == unpressured_greedy[0]


def test_no_decode_reservation_overcommits_and_retracts(model_dir, unpressured_greedy):
    # Reserving nothing admits more than the pool can grow into: retractions happen, the tokens stay the same.
    tokens, retractions = run_with_ratio(model_dir, 0.0, greedy(30))
    assert retractions > 0
    assert tokens == unpressured_greedy[0]


def test_seeded_sampling_and_penalties_survive_retraction(model_dir):
    # The same seed gives the same tokens whether or not the request was retracted and recomputed in between, and
    # penalties keep counting the tokens generated before the retraction. The penalties here are negative (a
    # repetition penalty below 1): they make already generated tokens likely again, so sampling depends on them.
    prompts = PROMPTS[:6]
    params = [
        SamplingParams(
            temperature=1.0,
            top_p=0.9,
            seed=100 + i,
            max_new_tokens=16,
            ignore_eos=True,
            frequency_penalty=-1.5 if i % 3 == 1 else 0.0,
            presence_penalty=-1.0 if i % 3 == 1 else 0.0,
            repetition_penalty=0.5 if i % 3 == 2 else 1.0,
        )
        for i in range(len(prompts))
    ]
    calm, calm_retractions = run_with_ratio(model_dir, 0.7, params, prompts, max_total_tokens=8192)
    squeezed, retractions = run_with_ratio(model_dir, 0.0, params, prompts, max_total_tokens=120)
    assert calm_retractions == 0 and retractions > 0
    assert squeezed == calm


def test_abort_of_a_retracted_request_frees_everything(model_dir):
    engine = InProcessEngine(
        model_dir,
        device="cpu",
        max_total_tokens=200,
        chunked_prefill_size=64,
        init_new_token_ratio=0.0,
        min_new_token_ratio=0.0,
    )
    s = engine.scheduler
    reqs = [Req(f"r{i}", prompt, greedy(30)) for i, prompt in enumerate(PROMPTS)]
    for req in reqs:
        s.add_request(req)
    victim = None
    for _ in range(500):
        engine.loop.step()
        s.check_invariant()
        victim = next((r for r in reqs if r.retractions and r.status.value == "waiting"), None)
        if victim is not None:
            break
    assert victim is not None, "no request was retracted"
    assert victim.output_ids, "retracted after it had generated tokens"
    assert s.abort(victim.rid)
    outputs = engine.loop.run_until_idle()
    aborted = [o for o in outputs if o.req is victim]
    assert aborted and aborted[-1].finished and victim.finish_reason == "abort"
    assert all(not o.new_token_ids for o in aborted), "nothing is generated for an aborted request"
    assert all(r.finish_reason == "length" for r in reqs if r is not victim)
    assert_idle_and_clean(engine)
    assert not s.abort(victim.rid)
