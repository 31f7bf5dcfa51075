"""Hang detection, the child's side: the main loop counts the units of work it finishes (`progress`), and a thread
tells launch.py that count about once a second (Heartbeat). The launcher decides what is a hang (launcher.py):
a child whose heartbeats stop is frozen, a busy child whose count stands still for --watchdog-timeout is stuck.

The count lives in the process rather than being sent by the loop itself so that a loop blocked in a collective, a
kernel or a socket still has someone to say "I am alive but not moving"."""

from __future__ import annotations

import threading
import time

import zmq

from radixserve.runtime.ipc import Channel
from radixserve.runtime.supervision_messages import Heartbeat


class Progress:
    """Written by the main loop, read by the heartbeat thread (plain attribute stores are atomic under the GIL)."""

    def __init__(self):
        self.finished = 0
        self.busy = False
        self.started_any = False

    def begin(self) -> None:
        """A unit of work starts (a forward batch, a scheduler step)."""
        self.started_any = True
        self.busy = True

    def end(self) -> None:
        self.finished += 1
        self.busy = False

    @property
    def warm(self) -> bool:
        # The first unit after startup may take minutes (Triton compilation, CUDA graph capture): it is not timed.
        # A child that never reports work (the tokenizer process) is watched for silence from the start.
        return self.finished > 0 or not self.started_any


progress = Progress()


def heartbeat_interval(watchdog_timeout: float) -> float:
    """Several beats per timeout, so that one late beat on a busy machine is not taken for a freeze."""
    return min(1.0, watchdog_timeout / 4)


def start_heartbeat(ctx: zmq.Context, name: str, launcher_address: str, interval_s: float) -> None:
    """Send Heartbeat(name, ...) every interval_s for the rest of the process's life."""

    def beat() -> None:
        # A socket of its own: zmq sockets are not thread-safe.
        channel = Channel(ctx, zmq.PUSH, launcher_address, bind=False)
        while True:
            channel.send(Heartbeat(name, progress.finished, progress.busy, progress.warm))
            time.sleep(interval_s)

    threading.Thread(target=beat, daemon=True, name="heartbeat").start()
