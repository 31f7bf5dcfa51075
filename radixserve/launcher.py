"""Starts and supervises the engine's processes: one worker per tensor-parallel rank, the scheduler, and (for the
HTTP server) the tokenizer process. Used by launch.py and by the offline Engine. Children report ready or failed
over a socket; any child's death is noticed and reported with its reason."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

from radixserve.config import ServerArgs
from radixserve.ipc import Channel, Endpoints, make_ipc_dir
from radixserve.process_util import child_argv
from radixserve.protocol import ChildToLauncher, ProcessFailed, ProcessReady

READY_TIMEOUT_S = 900
DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
STOP_GRACE_S = 5.0


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    ready: bool = False
    failure: str | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class Launcher:
    def __init__(self, args: ServerArgs, serve_http: bool = True):
        self.args = args
        self.serve_http = serve_http
        self.model_dir = str(resolve_model_dir(args.model))
        if args.model is None and args.served_model_name is None:
            args.served_model_name = DEMO_MODEL_NAME
        self.endpoints = Endpoints(make_ipc_dir())
        self.ctx = zmq.Context()
        self.inbox = Channel(self.ctx, zmq.PULL, self.endpoints.launcher, bind=True, recv_type=ChildToLauncher)
        self.children: list[Child] = []
        self.stop_requested = False

    def spawn(self, name: str, module: str, **extra) -> None:
        cmd = [sys.executable, "-m", module, *child_argv(self.args, self.model_dir, self.endpoints, **extra)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.children.append(Child(name, subprocess.Popen(cmd, env=env)))

    def start(self) -> None:
        dist_init = self.args.dist_init_addr or f"127.0.0.1:{free_port()}"
        for rank in range(self.args.tp_size):
            self.spawn(f"worker-{rank}", "radixserve.worker", rank=rank, dist_init_method=f"tcp://{dist_init}")
        self.spawn("scheduler", "scheduler_service")
        if self.serve_http:
            self.spawn("tokenizer", "tokenizer_service")

    def _read_inbox(self, timeout_ms: int) -> None:
        message = self.inbox.recv(timeout_ms)
        while message is not None:
            child = next((c for c in self.children if c.name == message.name), None)
            if child is not None:
                if isinstance(message, ProcessReady):
                    child.ready = True
                elif isinstance(message, ProcessFailed):
                    child.failure = message.message
            message = self.inbox.recv_nowait()

    def _dead_child(self) -> Child | None:
        for child in self.children:
            if child.failure is not None or child.process.poll() is not None:
                return child
        return None

    def wait_until_ready(self) -> Child | None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not all(c.ready for c in self.children):
            if self.stop_requested:
                return None
            self._read_inbox(200)
            dead = self._dead_child()
            if dead is not None:
                return dead
            if time.monotonic() > deadline:
                slow = ", ".join(c.name for c in self.children if not c.ready)
                print(f"radixserve: timed out after {READY_TIMEOUT_S}s waiting for: {slow}", file=sys.stderr)
                return next(c for c in self.children if not c.ready)
        return None

    def supervise(self) -> Child | None:
        while not self.stop_requested:
            self._read_inbox(200)
            dead = self._dead_child()
            if dead is not None:
                return dead
        return None

    def describe_death(self, child: Child) -> str:
        """What happened to a dead child: how it exited and the error it reported, if any."""
        time.sleep(0.3)  # a failing child sends its traceback just before it exits
        self._read_inbox(0)
        code = child.process.poll()
        state = describe_exit(code) if code is not None else "reported a fatal error"
        return f"{child.name} (pid {child.process.pid}) {state}" + (f":\n{child.failure}" if child.failure else "")

    def dead_child_message(self) -> str | None:
        """None while every child lives; otherwise what happened to the first dead one."""
        self._read_inbox(0)
        dead = self._dead_child()
        return None if dead is None else self.describe_death(dead)

    def stop(self) -> None:
        # The tokenizer first, so clients get an error instead of waiting on an engine that is going away.
        for child in sorted(self.children, key=lambda c: c.name != "tokenizer"):
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for child in self.children:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
        self.inbox.close()
        self.ctx.term()
        shutil.rmtree(self.endpoints.ipc_dir, ignore_errors=True)




def resolve_model_dir(model: str | None) -> Path:
    """The model directory to serve; with none given, the SmolLM2 demo model (built on first use)."""
    if model is None:
        from radixserve.testing.smollm2 import smollm2_dir
        return smollm2_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist (pass an HF directory with config.json)")
    return path
