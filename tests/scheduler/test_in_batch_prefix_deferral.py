"""Admission's in-batch prefix rule (scheduler_service/admission.py _shares_prefix_with): a waiting request waits one
step when a prompt being computed shares at least IN_BATCH_PREFIX_MIN_TOKENS tokens with it beyond what the tree
holds for it, so that the shared part is computed once. Only that uncached part counts: requests whose system prompt
is cached and whose questions begin alike (a few tokens) are all admitted at once, as issue 27's burst needs."""

import numpy as np

from radixserve.config import ServerArgs
from radixserve.sampling import SamplingParams
from scheduler_service.admission import IN_BATCH_PREFIX_MIN_TOKENS
from scheduler_service.fake_executor import FakeExecutor
from scheduler_service.request import Req
from scheduler_service.scheduler import Scheduler
from scheduler_service.step_loop import SerialStepLoop

CONTEXT_LEN = 1024
rng = np.random.default_rng(7)
SYSTEM = rng.integers(100, 40000, 300).tolist()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def warm_loop() -> SerialStepLoop:
    """A loop whose tree holds SYSTEM (and a warm-up question after it)."""
    args = ServerArgs(device="cpu", max_running_requests=64)
    scheduler = Scheduler(args, 8192, CONTEXT_LEN, [2])
    scheduler.check_invariant_every_step = True
    loop = SerialStepLoop(scheduler, FakeExecutor(8192, args.max_running_requests, CONTEXT_LEN))
    scheduler.add_request(Req("warm", SYSTEM + rng.integers(100, 40000, 20).tolist(), greedy(2)))
    loop.run_until_idle()
    return loop


def questions(n: int, head: list[int]) -> list[list[int]]:
    return [head + rng.integers(100, 40000, 20).tolist() for _ in range(n)]


def admitted_in_first_step(loop: SerialStepLoop, prompts: list[list[int]]) -> int:
    s = loop.scheduler
    for i, p in enumerate(prompts):
        s.add_request(Req(f"q{i}", p, greedy(3)))
    loop.step()
    admitted = len(prompts) - len(s.waiting)
    loop.run_until_idle()
    s.check_invariant()
    assert not s.running and not s.waiting
    return admitted


def test_cached_system_prompt_and_alike_question_heads_are_admitted_together():
    loop = warm_loop()
    head = rng.integers(100, 40000, 4).tolist()  # "[burst #": the same few tokens after the cached system prompt
    assert admitted_in_first_step(loop, questions(16, SYSTEM + head)) == 16


def test_a_long_uncached_shared_part_is_computed_once():
    loop = warm_loop()
    shared = rng.integers(100, 40000, IN_BATCH_PREFIX_MIN_TOKENS + 8).tolist()  # e.g. a new long instruction
    before = loop.scheduler.stats.prefill_tokens_computed
    assert admitted_in_first_step(loop, questions(16, SYSTEM + shared)) == 1
    # The shared part once, then each request's own 20 tokens (and the first one's prompt beyond SYSTEM).
    computed = loop.scheduler.stats.prefill_tokens_computed - before
    assert computed == len(shared) + 16 * 20, computed


def test_equal_tails_after_different_cached_prefixes_do_not_wait():
    # Two cached system prompts of one length, then the same long uncached text after each: the prompts share
    # nothing from their first token, so neither waits for the other.
    loop = warm_loop()
    other_system = rng.integers(100, 40000, len(SYSTEM)).tolist()
    loop.scheduler.add_request(Req("warm2", other_system + [5], greedy(2)))
    loop.run_until_idle()
    tail = rng.integers(100, 40000, IN_BATCH_PREFIX_MIN_TOKENS + 8).tolist()
    assert admitted_in_first_step(loop, [SYSTEM + tail, other_system + tail]) == 2
