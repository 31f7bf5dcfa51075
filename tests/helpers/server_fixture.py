"""Start `python launch.py` as a real subprocess (real sockets, real child processes) for end-to-end tests.

Test modules define a module-scoped fixture around `launched_server(...)`. The server runs the tiny random Llama on
the CPU; its output goes to a log file that is printed when startup fails or a test needs it.

Every server started here is listed in `LaunchedServer.live` while it runs, and after each test (tests/conftest.py)
`assert_idle_kv_invariant` checks through /server_info that the server went idle with every KV slot accounted for:
whatever a test did (streams, aborts, disconnects, errors), nothing may leak.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from radixserve.runtime.launcher import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 180
STOP_TIMEOUT_S = 15
IDLE_TIMEOUT_S = 60  # a test's last requests (a disconnected stream, an abort in flight) finish within this
STARTUP_POLL_S = 0.05  # a refused connection costs next to nothing; a long interval is time lost at every start
# Every httpx.get() builds a client and, by default, its own SSL context, loading the CA bundle (~17 ms of CPU, and
# more while a server starts beside it) though the servers speak plain http: the startup polls and the idle checks
# after every test did ~900 of those a run. One context, made once, serves all of them.
SSL_CONTEXT = httpx.create_ssl_context()


def _die_with_pytest() -> None:
    # If pytest is killed, launch.py must not outlive it (its own children die with it in turn).
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class LaunchedServer:
    live: list["LaunchedServer"] = []  # started and not stopped, in this pytest process

    def __init__(self, model_dir: str | Path | None, *flags: str):
        self.model_dir = None if model_dir is None else str(model_dir)  # None: launch.py's default, the demo
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.flags = flags
        self._log = tempfile.NamedTemporaryFile(prefix="radixserve-test-", suffix=".log", delete=False)
        self.process: subprocess.Popen | None = None
        self.api_key: str | None = None  # found at start() the way launch.py finds it, for /server_info

    @property
    def openai_base_url(self) -> str:
        return f"{self.url}/v1"

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def start(self) -> "LaunchedServer":
        model = ["--model", self.model_dir] if self.model_dir else []
        cmd = [sys.executable, "launch.py", *model, "--device", "cpu", "--port", str(self.port), *self.flags]
        self.api_key = self._api_key()
        self.process = subprocess.Popen(
            cmd, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=_die_with_pytest
        )
        LaunchedServer.live.append(self)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"launch.py exited with {self.process.returncode} during startup:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5, verify=SSL_CONTEXT).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(STARTUP_POLL_S)
        self.stop()
        raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def _api_key(self) -> str | None:
        flags = list(self.flags)
        if "--api-key" in flags:
            return flags[flags.index("--api-key") + 1]
        if "--api-key-file" in flags:
            return Path(flags[flags.index("--api-key-file") + 1]).read_text().splitlines()[0].strip()
        return os.environ.get("RADIXSERVE_API_KEY")

    def server_info(self) -> dict:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        response = httpx.get(f"{self.url}/server_info", headers=headers, timeout=10, verify=SSL_CONTEXT)
        response.raise_for_status()
        return response.json()

    def assert_idle_kv_invariant(self, timeout_s: float = IDLE_TIMEOUT_S) -> None:
        """Wait until nothing runs or waits, then every KV slot must be free or cached (none locked, none owned by
        a request) and the scheduler's own invariant check must pass."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.server_info()
            if info["num_running"] == 0 and info["num_waiting"] == 0:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"server still busy {timeout_s} s after the test: {info}")
            time.sleep(0.1)
        assert info["kv_invariant_ok"], f"KV invariant broken at idle: {info}"
        # Pinned prefixes (POST /v1/cache/pin) are protected in the tree but held by no request.
        pinned = info.get("kv_pinned", 0)
        in_use = info["kv_protected"] - pinned + info["kv_owned"]
        assert in_use == 0, f"{in_use} KV slots still held with no request running: {info}"
        assert info["kv_free"] + info["kv_evictable"] + pinned == info["kv_total"], f"KV slots unaccounted for: {info}"

    def stop(self) -> int | None:
        if self in LaunchedServer.live:
            LaunchedServer.live.remove(self)
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise RuntimeError(f"launch.py did not stop within {STOP_TIMEOUT_S} s of SIGTERM:\n{self.log()}")
        finally:
            self._log.close()


@contextlib.contextmanager
def launched_server(model_dir: str | Path | None, *flags: str):
    server = LaunchedServer(model_dir, *flags).start()
    try:
        yield server
    except Exception:
        # A fixture's own checks after the start, or a test that starts its server inline, failed: the server's
        # log is deleted below, so it goes to the report now (pytest shows a failure's captured output).
        print(f"--- launch.py's log (port {server.port}) ---\n{server.log()[-6000:]}")
        raise
    finally:
        server.stop()
        with contextlib.suppress(OSError):
            os.unlink(server._log.name)
