"""ZeroMQ endpoints between the processes (ipc:// sockets in a private 0700 directory) and typed send/receive of
protocol Structs. Only msgspec msgpack goes over these sockets: decoding never runs code."""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

T = TypeVar("T")


def make_ipc_dir() -> str:
    # mkdtemp creates the directory with mode 0700: other users cannot connect to our sockets.
    path = tempfile.mkdtemp(prefix="radixserve-")
    os.chmod(path, 0o700)
    return path


@dataclass(frozen=True)
class Endpoints:
    ipc_dir: str

    def _at(self, name: str) -> str:
        return f"ipc://{Path(self.ipc_dir) / name}"

    @property
    def tokenizer_to_scheduler(self) -> str:
        return self._at("tokenizer_to_scheduler")

    def scheduler_to_front_end(self, index: int = 0) -> str:
        # One per front end (--api-server-count): each HTTP process gets only its own requests' outputs and replies.
        # The other way, one PULL takes every front end's PUSH (tokenizer_to_scheduler).
        return self._at(f"scheduler_to_front_end_{index}")

    def scheduler_to_worker(self, rank: int) -> str:
        # One PUSH per rank rather than PUB/SUB: a PUSH queues until its peer connects, a PUB drops.
        return self._at(f"scheduler_to_worker_{rank}")

    @property
    def workers_to_scheduler(self) -> str:
        return self._at("workers_to_scheduler")

    @property
    def launcher(self) -> str:
        return self._at("launcher")


class Channel(Generic[T]):
    """One ZeroMQ PUSH or PULL socket that sends or receives msgspec Structs of a given (union) type. Every link is
    PUSH/PULL: a PUSH queues until its peer connects, where a PUB would drop."""

    def __init__(self, ctx: zmq.Context, kind: int, address: str, bind: bool, recv_type: Any = None):
        self.socket = ctx.socket(kind)
        self.socket.setsockopt(zmq.LINGER, 0)
        if kind == zmq.PUSH:
            self.socket.setsockopt(zmq.SNDHWM, 0)  # never drop a message
        elif kind == zmq.PULL:
            self.socket.setsockopt(zmq.RCVHWM, 0)
        (self.socket.bind if bind else self.socket.connect)(address)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(recv_type) if recv_type is not None else None

    def send(self, message) -> None:
        self.socket.send(self._encoder.encode(message), copy=False)

    def recv(self, timeout_ms: int | None = None, spin_s: float = 0.0):
        """Next message, or None after timeout_ms without one. With spin_s > 0 it first polls without sleeping for
        up to spin_s (--spin-wait-ms): measured on the H100 host, a process blocked in the kernel woke 0.1-0.25 ms
        after its message arrived, and a lone request's first token crosses four such hops. Spun time counts
        towards timeout_ms."""
        if spin_s > 0:
            deadline = time.perf_counter() + spin_s
            while True:
                message = self.recv_nowait()
                if message is not None:
                    return message
                if time.perf_counter() >= deadline:
                    break
            if timeout_ms is not None:
                timeout_ms = max(0, timeout_ms - int(spin_s * 1e3))
        if timeout_ms is not None and not self.socket.poll(timeout_ms):
            return None
        return self._decoder.decode(self.socket.recv(copy=False).buffer)

    def recv_nowait(self):
        try:
            return self._decoder.decode(self.socket.recv(flags=zmq.NOBLOCK, copy=False).buffer)
        except zmq.Again:
            return None

    def close(self) -> None:
        self.socket.close(linger=0)


class AsyncChannel(Channel[T]):
    """The same over zmq.asyncio, for the HTTP process's event loop."""

    def __init__(self, ctx: zmq.asyncio.Context, kind: int, address: str, bind: bool, recv_type: Any = None):
        super().__init__(ctx, kind, address, bind, recv_type)

    async def recv_async(self):
        frame = await self.socket.recv(copy=False)
        return self._decoder.decode(frame.buffer)
