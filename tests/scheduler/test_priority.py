"""Priority scheduling (--enable-priority-scheduling), driven through the scheduler's real step loop with a fake
executor: higher `priority` is admitted first, ties keep the policy's order, and the aging bound (--max-wait-steps)
admits a low-priority request even while higher-priority work keeps arriving. Without the flag the field changes
nothing (and the HTTP routes refuse a non-zero one: tests/http/test_echo_logprobs.py)."""

import numpy as np

from radixserve.config import ServerArgs
from radixserve.sampling import SamplingParams
from scheduler_service.fake_executor import FakeExecutor
from scheduler_service.policy import order_waiting_queue
from scheduler_service.request import Req
from scheduler_service.scheduler import Scheduler
from scheduler_service.step_loop import SerialStepLoop

CONTEXT_LEN = 256
NEW_TOKENS = 3


def make_loop(**kw) -> SerialStepLoop:
    kw.setdefault("max_running_requests", 1)  # one at a time: the admission order is the order of service
    args = ServerArgs(device="cpu", **kw)
    scheduler = Scheduler(args, 2048, CONTEXT_LEN, [2])
    scheduler.check_invariant_every_step = True
    return SerialStepLoop(scheduler, FakeExecutor(2048, args.max_running_requests, CONTEXT_LEN))


def request(rid: str, priority: int, seed: int) -> Req:
    prompt = np.random.default_rng(seed).integers(10, 1000, 12).tolist()  # no shared prefixes: LPM ties everywhere
    req = Req(rid, prompt, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True))
    req.priority = priority
    return req


def admission_order(loop: SerialStepLoop, reqs: list[Req]) -> list[str]:
    for req in reqs:
        loop.scheduler.add_request(req)
    order = []
    while loop.has_work():
        for out in loop.step():
            if out.new_token_ids and out.req.rid not in order:
                order.append(out.req.rid)
    return order


def test_higher_priority_is_admitted_first_only_with_the_flag():
    reqs = lambda: [  # noqa: E731
        request("low-a", 0, 1),
        request("low-b", 0, 2),
        request("mid", 3, 3),
        request("high-a", 7, 4),
        request("negative", -2, 5),
        request("high-b", 7, 6),
    ]
    with_flag = admission_order(make_loop(enable_priority_scheduling=True), reqs())
    assert with_flag == ["high-a", "high-b", "mid", "low-a", "low-b", "negative"]
    for policy in ("lpm", "fcfs"):
        without = admission_order(make_loop(schedule_policy=policy), reqs())
        assert without == ["low-a", "low-b", "mid", "high-a", "negative", "high-b"], policy


def admission_step_under_a_stream_of_high_priority(max_wait_steps: int, steps: int) -> int | None:
    """A low-priority request queued first, then a high-priority one arriving every step: the step at which the
    low one gets its first token (None: not within `steps`)."""
    loop = make_loop(enable_priority_scheduling=True, max_wait_steps=max_wait_steps)
    loop.scheduler.add_request(request("low", 0, 0))
    for step in range(steps):
        loop.scheduler.add_request(request(f"high-{step}", 10, step + 1))
        for out in loop.step():
            if out.req.rid == "low" and out.new_token_ids:
                return loop.scheduler.step_count
    return None


def test_the_aging_bound_admits_a_starved_request():
    # Without a reachable bound, high-priority arrivals keep the low one waiting for as long as they come...
    assert admission_step_under_a_stream_of_high_priority(max_wait_steps=10**9, steps=80) is None
    # ...with one, it waits the bound plus what runs ahead of it (one request of NEW_TOKENS steps), never more.
    admitted = admission_step_under_a_stream_of_high_priority(max_wait_steps=20, steps=80)
    assert admitted is not None and 20 < admitted <= 20 + NEW_TOKENS + 2


def test_request_groups_take_turns_only_within_one_priority():
    args = ServerArgs(device="cpu", enable_priority_scheduling=True, schedule_policy="fcfs")
    scheduler = Scheduler(args, 2048, CONTEXT_LEN, [2])
    # Two sequences each of two requests at priority 1 (rids "<request>-<index>"), and one request at priority 5.
    for seed, (rid, priority) in enumerate([("a-0", 1), ("a-1", 1), ("b-0", 1), ("b-1", 1), ("c-0", 5), ("c-1", 5)]):
        scheduler.add_request(request(rid, priority, seed))
    ordered = order_waiting_queue(scheduler.waiting, scheduler.tree, args, scheduler.step_count)
    assert [r.rid for r in ordered] == ["c-0", "c-1", "a-0", "b-0", "a-1", "b-1"]
