"""Channel.recv with spin_s (--spin-wait-ms): it polls without sleeping for up to spin_s, then blocks as before; a
message is returned whether it arrives before, during or after the spin, and timeout_ms still bounds the whole wait."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from radixserve.runtime.ipc import Channel


class Note(msgspec.Struct):
    text: str


@pytest.fixture
def link(tmp_path):
    ctx = zmq.Context()
    address = f"ipc://{tmp_path / 'link'}"
    receiver = Channel(ctx, zmq.PULL, address, bind=True, recv_type=Note)
    senders = []

    def send_after(delay_s: float, text: str) -> threading.Thread:
        sender = Channel(ctx, zmq.PUSH, address, bind=False)  # one socket per thread: zmq sockets are not shared
        senders.append(sender)

        def run():
            time.sleep(delay_s)
            sender.send(Note(text))

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    yield receiver, send_after
    for channel in [receiver, *senders]:
        channel.close()
    ctx.term()


def test_a_message_already_queued_is_returned_at_once(link):
    receiver, send_after = link
    send_after(0, "queued").join()
    time.sleep(0.05)
    start = time.perf_counter()
    assert receiver.recv(spin_s=5.0) == Note("queued")
    assert time.perf_counter() - start < 1.0  # not the 5 s spin


def test_a_message_that_arrives_during_the_spin_is_taken_by_it(link):
    receiver, send_after = link
    thread = send_after(0.05, "during")
    start = time.perf_counter()
    assert receiver.recv(spin_s=5.0) == Note("during")
    assert time.perf_counter() - start < 2.0
    thread.join()


def test_a_message_after_the_spin_is_taken_by_the_blocking_wait(link):
    receiver, send_after = link
    thread = send_after(0.3, "after")
    start = time.perf_counter()
    assert receiver.recv(spin_s=0.02) == Note("after")
    assert time.perf_counter() - start >= 0.29
    thread.join()


@pytest.mark.parametrize("spin_s", [0.0, 0.3])
def test_timeout_bounds_the_whole_wait_spin_included(link, spin_s):
    receiver, _ = link
    start = time.perf_counter()
    assert receiver.recv(timeout_ms=400, spin_s=spin_s) is None
    elapsed = time.perf_counter() - start
    assert 0.39 <= elapsed < 0.6  # the spin counts towards timeout_ms, not on top of it (that would be 0.7 s)


def test_a_spin_longer_than_the_timeout_still_ends_at_the_spin(link):
    receiver, _ = link
    start = time.perf_counter()
    assert receiver.recv(timeout_ms=250, spin_s=0.3) is None
    assert 0.29 <= time.perf_counter() - start < 0.45  # (0.55 s if the timeout were waited out after the spin)


def test_spinning_is_on_by_default_on_a_gpu_and_off_on_the_cpu():
    from radixserve.config import ServerArgs

    assert ServerArgs(device="cuda").spin_wait_ms == 50.0
    assert ServerArgs(device="cpu").spin_wait_ms == 0.0  # the CPU's cores run the model
    assert ServerArgs(device="cpu", spin_wait_ms=3).spin_wait_ms == 3
