"""Start `launch.py` for a benchmark and wait until it answers /health. The server's output goes to a log file: an
unread pipe fills up and stalls the server in the middle of a run."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from radixserve.runtime.launcher import free_port

REPO = Path(__file__).resolve().parents[1]


def start_server(
    model_dir: str, flags: list[str], log_prefix: str = "radixserve-bench-", timeout_s: float = 600
) -> tuple[subprocess.Popen, str, Path]:
    """(process, base URL, log file) of a healthy server started with `--model model_dir --port <free> *flags`."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix=log_prefix, suffix=".log")[1])
    cmd = [sys.executable, str(REPO / "launch.py"), "--model", model_dir, "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"launch.py exited during start-up:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"the server was not healthy after {timeout_s:g} s (log: {log})")
