"""SIGKILL of each child of launch.py while streams are in flight, one server per case: every client ends within
1 s (an error event or a closed connection, never a hang or a normal end), launch.py exits 1, no process of the
server is left, and the private IPC directory is gone.

What a client sees differs by the victim: a dead worker or scheduler is reported by the launcher to the HTTP
process, which ends each stream with an error event naming it; a dead HTTP process closes the connections itself.
(The hang path, a worker stopped with SIGSTOP, is in tests/e2e/test_launch_hardening.py.)"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from radixserve.runtime.process_util import process_tree_argv
from radixserve.testing.tiny_models import tiny_model_dir
from server_fixture import LaunchedServer

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

NUM_STREAMS = 4
CHUNKS_BEFORE_KILL = 3  # every stream is really generating when the child dies
CLIENT_END_WITHIN_S = 1.0
EXIT_WITHIN_S = 20  # launch.py stops the others (SIGTERM, 5 s grace) and exits


def process_tree(root: int) -> dict[int, str]:
    """root's descendants (not root) with their command lines, from /proc."""
    return {pid: " ".join(argv) for pid, argv in process_tree_argv(root).items() if pid != root}


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its exit status is left


def ipc_dir_of(children: dict[int, str]) -> Path:
    """The private directory, from the children's `--config-file <ipc dir>/child_config.json`."""
    for cmdline in children.values():
        args = cmdline.split()
        if "--config-file" in args:
            return Path(args[args.index("--config-file") + 1]).parent
    raise AssertionError(f"no --config-file on any child's command line: {children}")


@dataclass
class Stream:
    """One streaming client on its own thread: when it ended and how."""

    index: int
    chunks: int = 0
    body: list[str] = field(default_factory=list)
    error: str | None = None
    ended_at: float | None = None
    started: threading.Event = field(default_factory=threading.Event)

    def run(self, url: str) -> None:
        body = {
            "prompt": f"Stream {self.index} counts to infinity:",
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0,
        }
        try:
            # The read timeout is far above the 1 s allowed: a client that hangs shows as one that ended late.
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
                for line in response.iter_lines():
                    self.body.append(line)
                    if line.startswith("data: {"):
                        self.chunks += 1
                        if self.chunks >= CHUNKS_BEFORE_KILL:
                            self.started.set()
        except httpx.HTTPError as e:
            self.error = repr(e)
        finally:
            self.ended_at = time.monotonic()
            self.started.set()  # never leave the test waiting on a stream that failed early

    def ended_in_error(self) -> bool:
        return self.error is not None or any('"error"' in line for line in self.body)


@pytest.mark.parametrize("victim", ["worker-0", "scheduler", "tokenizer"])
def test_sigkill_of_a_child_ends_every_stream_and_the_server(victim):
    modules = {"worker-0": "radixserve.worker", "scheduler": "scheduler_service", "tokenizer": "tokenizer_service"}
    server = LaunchedServer(tiny_model_dir("llama")).start()
    children: dict[int, str] = {}
    try:
        children = process_tree(server.process.pid)
        ipc_dir = ipc_dir_of(children)
        assert ipc_dir.is_dir()
        target = next(pid for pid, cmd in children.items() if f"-m {modules[victim]} " in cmd + " ")

        streams = [Stream(i) for i in range(NUM_STREAMS)]
        threads = [threading.Thread(target=s.run, args=(server.url,), daemon=True) for s in streams]
        for t in threads:
            t.start()
        for s in streams:
            assert s.started.wait(60), f"stream {s.index} got no chunks"
        assert all(s.ended_at is None for s in streams), [s.error or s.body[-3:] for s in streams]

        os.kill(target, signal.SIGKILL)
        killed_at = time.monotonic()
        for t in threads:
            t.join(timeout=CLIENT_END_WITHIN_S + 30)
        late = {
            s.index: (None if s.ended_at is None else round(s.ended_at - killed_at, 3))
            for s in streams
            if s.ended_at is None or s.ended_at - killed_at > CLIENT_END_WITHIN_S
        }
        assert not late, (
            f"streams that ended more than {CLIENT_END_WITHIN_S} s after {victim} died "
            f"(seconds, None: still open): {late}"
        )
        normal = [s.index for s in streams if not s.ended_in_error()]
        assert not normal, (
            f"streams {normal} ended without an error after {victim} died: {[streams[i].body[-3:] for i in normal]}"
        )
        if victim != "tokenizer":  # the HTTP process is alive to say what happened
            for s in streams:
                assert any(f"{victim} died" in line for line in s.body), s.body[-3:]

        code = server.process.wait(timeout=EXIT_WITHIN_S)
        assert code == 1, f"launch.py exited with {code}:\n{server.log()[-3000:]}"
        assert victim in server.log() and "SIGKILL" in server.log(), server.log()[-3000:]
        orphans = {pid: cmd for pid, cmd in children.items() if alive(pid)}
        assert not orphans, f"left running after launch.py exited: {orphans}"
        assert not ipc_dir.exists(), f"IPC directory left behind: {sorted(p.name for p in ipc_dir.iterdir())}"
    finally:
        server.stop()
        for pid in children:  # a failed case must not leave the next one (or CI) with stray servers
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
