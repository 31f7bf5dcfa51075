"""Admission reuses the match that the LPM order took of each waiting prompt (scheduler_service/admission.py
`Admission._match`) instead of matching it again: the same cached prefix, slot for slot, as a fresh match; one tree
match per request in a burst of cache hits; and a new match once the tree has evicted anything since the order was
taken (its slots may have gone back to the allocator)."""

import numpy as np

from radixserve.config import ServerArgs
from radixserve.sampling import SamplingParams
from scheduler_service.fake_executor import FakeExecutor
from scheduler_service.request import Req
from scheduler_service.scheduler import Scheduler
from scheduler_service.step_loop import SerialStepLoop

CONTEXT_LEN = 512
ONE_TOKEN = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)


def make_loop(slots: int) -> SerialStepLoop:
    args = ServerArgs(device="cpu", max_running_requests=64)
    scheduler = Scheduler(args, slots, CONTEXT_LEN, [2])
    scheduler.check_invariant_every_step = True
    return SerialStepLoop(scheduler, FakeExecutor(slots, args.max_running_requests, CONTEXT_LEN))


def count_matches(tree) -> list:
    """A list that gets one entry per match_prefix call from here on."""
    calls = []
    match = tree.match_prefix

    def recorded(tokens, *args, **kwargs):
        calls.append(len(tokens))
        return match(tokens, *args, **kwargs)

    tree.match_prefix = recorded
    return calls


def test_a_burst_of_cache_hits_is_matched_once_each_and_gets_the_fresh_match_slots():
    rng = np.random.default_rng(0)
    loop = make_loop(8192)
    systems = [rng.integers(10, 1000, 200).tolist() for _ in range(4)]
    for i, system in enumerate(systems):  # the system prompts cached
        loop.scheduler.add_request(Req(f"warm{i}", system + [7], ONE_TOKEN))
    loop.run_until_idle()
    calls = count_matches(loop.scheduler.tree)
    burst = [Req(f"r{i}", systems[i % 4] + rng.integers(10, 1000, 9).tolist(), ONE_TOKEN) for i in range(16)]
    for req in burst:
        loop.scheduler.add_request(req)
    scheduled = loop.scheduler.schedule()
    assert scheduled is not None and {r.rid for r in scheduled.reqs} == {r.rid for r in burst}
    assert len(calls) == len(burst)  # the LPM order's matches only; admission matched none again
    for req in burst:
        fresh = loop.scheduler.tree.match_prefix(req.fill_ids()[:-1], namespace=req.cache_salt, record_hit=False)
        assert req.cached_tokens == 200 == len(fresh.slots)
        assert np.array_equal(req.slots[:200], fresh.slots) and req.last_node is fresh.last_node


def test_after_an_eviction_admission_matches_again():
    rng = np.random.default_rng(1)
    loop = make_loop(8192)
    system = rng.integers(10, 1000, 200).tolist()
    loop.scheduler.add_request(Req("warm", system + [7], ONE_TOKEN))
    loop.run_until_idle()
    calls = count_matches(loop.scheduler.tree)
    tree, admission = loop.scheduler.tree, loop.scheduler.admission
    reqs = [Req(f"r{i}", system + rng.integers(10, 1000, 9).tolist(), ONE_TOKEN) for i in range(2)]
    for req in reqs:
        loop.scheduler.add_request(req)
    # Each admission sees the tree's eviction count moved since the order's matches: as if room had been made.
    ensure = admission.memory_pressure.ensure_free_slots

    def evicting(n):
        tree.evicted_tokens += 1
        return ensure(n)

    admission.memory_pressure.ensure_free_slots = evicting
    scheduled = loop.scheduler.schedule()
    assert {r.rid for r in scheduled.reqs} == {"r0", "r1"}
    assert len(calls) == 2 + 1  # both ordered; the second admitted after the first one's "eviction" matched again
    assert all(r.cached_tokens == 200 for r in reqs)
