"""Whom the launcher's watchdog blames, from the heartbeats alone (radixserve/runtime/launcher.py find_hung). The
children are real processes (`sleep`) so that the liveness check is the real one; the heartbeats are what a worker, the
scheduler and the tokenizer send. The end-to-end path (SIGSTOP of a worker) is in tests/e2e/test_launch_hardening.py."""

import subprocess

import pytest

from radixserve.runtime.launcher import Child, find_hung
from radixserve.runtime.supervision_messages import Heartbeat

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

TIMEOUT = 10.0


@pytest.fixture
def children():
    kids = [
        Child(name, subprocess.Popen(["sleep", "60"])) for name in ("worker-0", "worker-1", "scheduler", "tokenizer")
    ]
    yield {c.name: c for c in kids}
    for c in kids:
        c.process.kill()
        c.process.wait()


def beat(child: Child, at: float, progress: int, busy: bool, warm: bool = True) -> None:
    child.on_heartbeat(Heartbeat(child.name, progress, busy, warm), at)


def beat_all(children, at: float, busy: bool = False, progress: int = 5) -> None:
    for c in children.values():
        beat(c, at, progress if c.name != "tokenizer" else 0, busy and c.name != "tokenizer")


def test_idle_or_moving_children_are_never_hung(children):
    for t in range(0, 60):
        beat_all(children, t, busy=True, progress=t)  # busy, but every beat shows progress
    assert find_hung(list(children.values()), TIMEOUT, 60.5) is None
    for t in range(61, 100):
        beat_all(children, t)  # idle (no work), beating: however long, not a hang
    assert find_hung(list(children.values()), TIMEOUT, 99.5) is None


def test_a_busy_child_without_progress_is_hung_and_the_worker_blamed_before_the_scheduler(children):
    beat_all(children, 0)
    for t in range(1, 12):  # the worker stuck in one batch, the scheduler stuck waiting for it; both beat
        beat_all(children, t, busy=True)
    child = find_hung(list(children.values()), TIMEOUT, 11.5)
    # Counted from the last beat that saw it idle: its batch began somewhere after that.
    assert child is children["worker-0"] and child.hang.startswith("made no progress while it had work for 11.5 s")
    assert "--watchdog-timeout is 10 s" in child.hang


def test_a_silent_child_is_blamed_over_a_busy_one_that_waits_on_it(children):
    for t in range(0, 9):
        beat_all(children, t, busy=True, progress=t)  # decoding: progress at every beat
    # worker-1 is stopped (SIGSTOP) just before its beat at 9.9: its last one came at 8.9, after the others' last
    # progress at 8. worker-0 keeps beating, stuck in a collective that waits on worker-1; so does the scheduler.
    beat(children["worker-1"], 8.9, 9, True)
    for t in range(9, 19):
        for name in ("worker-0", "scheduler", "tokenizer"):
            beat(children[name], t, 8 if name != "tokenizer" else 0, name != "tokenizer")
    child = find_hung(list(children.values()), TIMEOUT, 18.5)  # only worker-0 and the scheduler crossed it yet
    assert child is children["worker-1"] and child.hang.startswith("sent no heartbeat for 9.6 s")


def test_the_first_unit_of_work_is_not_timed(children):
    beat_all(children, 0)
    for t in range(1, 300):  # compiling kernels for minutes: busy, not warm
        for c in children.values():
            beat(c, t, 0, c.name != "tokenizer", warm=c.name == "tokenizer")
    assert find_hung(list(children.values()), TIMEOUT, 299.5) is None


def test_a_dead_child_is_not_a_hang(children):
    beat_all(children, 0)
    children["worker-0"].process.kill()
    children["worker-0"].process.wait()
    for t in range(1, 20):
        for name in ("worker-1", "scheduler", "tokenizer"):
            beat(children[name], t, 5, False)
    assert find_hung(list(children.values()), TIMEOUT, 19.5) is None  # a death is reported as a death
