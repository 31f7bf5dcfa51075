"""The scheduler's side of pinned prefixes (scheduler_service/cache_control.py), driven through the real step loops
by the fake executor (no model, no server: fast). A prefix that is not cached is computed by an internal request and
pinned when it finishes; its outputs never reach the front end; a prefix evicted before it could be pinned is
computed again; --max-pinned-tokens is exact (shared tokens counted once); TTLs expire. The HTTP side, through a real
server, is tests/http/test_cache_pins.py."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.config import ServerArgs
from radixserve.protocol import ListPinsRequest, PinPrefixRequest, UnpinPrefixRequest, pack_i32
from radixserve.sampling import SamplingParams
from scheduler_service.cache_control import CacheControl
from scheduler_service.fake_executor import FakeExecutor
from scheduler_service.request import Req
from scheduler_service.scheduler import Scheduler
from scheduler_service.step_loop import make_step_loop

CONTEXT_LEN = 512
POOL = 600


def make(overlap: bool = True, max_pinned: int | None = None):
    args = ServerArgs(device="cpu", max_running_requests=16, disable_overlap_schedule=not overlap)
    scheduler = Scheduler(args, POOL, CONTEXT_LEN, [2])
    scheduler.check_invariant_every_step = True
    loop = make_step_loop(scheduler, FakeExecutor(POOL, args.max_running_requests, CONTEXT_LEN))
    return loop, CacheControl(scheduler, max_pinned)


def tokens(first: int, n: int) -> list[int]:
    return [first] + [20 + (first * 11 + i * 7) % 900 for i in range(n - 1)]


def pin_message(ids: list[int], request_id: str = "r", **kw) -> PinPrefixRequest:
    return PinPrefixRequest(request_id, pack_i32(ids), **kw)


def run(loop, control, evict_before_pin: bool = False) -> list:
    """Step until idle, as SchedulerProcess.run does; every pin reply. The outputs left must be none of the pins'."""
    replies = []
    while loop.has_work():
        outputs = loop.step()
        if evict_before_pin:
            loop.scheduler.tree.evict(POOL)  # memory pressure between a prefix's finish and its pin
        outputs, new = control.take_outputs(outputs)
        assert not [o for o in outputs if o.req.rid.startswith("compute-pin-")]
        replies += new
    return replies


def cached(loop, ids: list[int], salt: str | None = None) -> int:
    return len(loop.scheduler.tree.match_prefix(np.asarray(ids), namespace=salt, record_hit=False).slots)


@pytest.mark.parametrize("overlap", [True, False])
def test_uncached_prefix_is_computed_then_pinned_and_survives_a_flood(overlap):
    loop, control = make(overlap)
    ids = tokens(1, 100)
    assert control.handle(pin_message(ids, ttl_seconds=60.0)) is None  # being computed
    [reply] = run(loop, control)
    assert reply.status == 200 and reply.pins[0].num_tokens == 100 and reply.pinned_tokens == 100
    assert reply.pins[0].expires_at == pytest.approx(reply.pins[0].created_at + 60)
    # Already cached: pinned at once, no computing.
    again = control.handle(pin_message(ids[:50], "r2"))
    assert again.status == 200 and again.pinned_tokens == 100
    s = loop.scheduler
    for i in range(12):  # 12 x 120 tokens through a 600-token pool
        s.add_request(
            Req(f"flood-{i}", tokens(100 + i, 120), SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
        )
    run(loop, control)
    assert cached(loop, ids) == 100 and cached(loop, tokens(100, 120)) == 0
    s.check_invariant(walk_tree=True)
    assert s.tree.locked_size == 0 and s.tree.pinned_size == 100
    s.flush_cache()
    assert cached(loop, ids) == 100
    s.flush_cache(keep_pins=False)
    assert cached(loop, ids) == 0 and s.tree.list_pins() == []


def test_prefix_evicted_before_its_pin_is_computed_again():
    loop, control = make()
    control.handle(pin_message(tokens(2, 80), cache_salt="t"))
    # Every attempt loses its prefix to pressure: after the third, a 503 instead of an endless loop.
    [reply] = run(loop, control, evict_before_pin=True)
    assert reply.status == 503 and "evicted" in reply.message
    control.handle(pin_message(tokens(2, 80), cache_salt="t"))
    [reply] = run(loop, control)
    assert reply.status == 200 and reply.pins[0].cache_salt == "t"
    assert cached(loop, tokens(2, 80), "t") == 80 and cached(loop, tokens(2, 80)) == 0


def test_bound_unpin_list_and_expiry():
    loop, control = make(max_pinned=150)
    assert control.handle(pin_message(tokens(3, 151))).status == 409  # can never fit: refused before computing
    control.handle(pin_message(tokens(3, 100)))
    [first] = run(loop, control)
    control.handle(pin_message(tokens(4, 100)))
    [over] = run(loop, control)  # computed, found over the bound, undone
    assert over.status == 409 and "150" in over.message and over.pinned_tokens == 100
    assert [p.id for p in control.handle(ListPinsRequest("l")).pins] == [first.pins[0].id]
    assert control.handle(UnpinPrefixRequest("u", first.pins[0].id)).status == 200
    assert control.handle(UnpinPrefixRequest("u", first.pins[0].id)).status == 404
    short = control.handle(pin_message(tokens(4, 60), ttl_seconds=5.0))  # cached by the refused pin's computing
    assert short.status == 200 and short.pinned_tokens == 60
    assert control.expire(now=short.pins[0].created_at + 1) == []
    assert control.expire(now=short.pins[0].created_at + 6) == [short.pins[0].id]
    assert loop.scheduler.tree.pinned_size == 0
    off = make(max_pinned=0)[1]
    assert "turned off" in off.handle(pin_message(tokens(5, 3))).message
