"""radixserve Dynamo workers (python -m radixserve.dynamo) and Dynamo's own frontend (python -m dynamo.frontend) as
real processes on one host: file discovery in a temporary directory ($DYN_FILE_KV), the tcp request plane and the zmq
event plane, so neither etcd nor NATS is needed. Every address they bind on purpose is loopback."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from radixserve.testing.tiny_models import tiny_model_dir

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = tiny_model_dir("llama")
MODEL = MODEL_DIR.name  # the served model name: the directory's, as with launch.py
BLOCK = 16  # --kv-events-block-size's default under python -m radixserve.dynamo
# One SSL context for the polls and control calls below (server_fixture.SSL_CONTEXT says why).
SSL_CONTEXT = httpx.create_ssl_context()


def free_port() -> int:
    """A free loopback port below 32768: Dynamo 1.6.1 reads DYN_SYSTEM_PORT as a signed 16-bit number."""
    while True:
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue


def dynamo_env(store: Path) -> dict[str, str]:
    return {
        **os.environ,
        "DYN_FILE_KV": str(store),
        "DYN_LOG": "warn",
        "DYN_TCP_RPC_HOST": "127.0.0.1",
        "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1",
        "DYN_SYSTEM_HOST": "127.0.0.1",
        "PYTHONUNBUFFERED": "1",
        "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0",
    }  # a stopped worker leaves at once (default: seconds)


class Proc:
    def __init__(self, argv: list[str], store: Path, log: Path):
        self.log = log
        self.process = subprocess.Popen(
            argv,
            cwd=REPO,
            env=dynamo_env(store),
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # its radixserve children too (they die with it anyway)
            self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


class Worker(Proc):
    def __init__(self, store: Path, log_dir: Path, name: str, *flags: str):
        self.port = free_port()  # its Dynamo system server: /health and /engine/control/...
        super().__init__(
            [
                sys.executable,
                "-m",
                "radixserve.dynamo",
                "--model",
                str(MODEL_DIR),
                "--device",
                "cpu",
                "--discovery-backend",
                "file",
                "--port",
                str(self.port),
                *flags,
            ],
            store,
            log_dir / f"{name}.log",
        )
        self.id: int | None = None

    def control(self, name: str, body: dict | None = None) -> dict:
        r = httpx.post(
            f"http://127.0.0.1:{self.port}/engine/control/{name}", json=body or {}, timeout=60, verify=SSL_CONTEXT
        )
        r.raise_for_status()
        return r.json()

    def info(self) -> dict:
        return self.control("server_info")

    def ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"worker exited early:\n{self.tail()}")
        try:
            health = httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2, verify=SSL_CONTEXT)
            if health.json().get("status") != "ready":
                return False
        except (httpx.HTTPError, ValueError):
            return False
        self.id = self.info()["dynamo_worker_id"]
        return True


class Frontend(Proc):
    def __init__(self, store: Path, log_dir: Path, mode: str):
        self.port = free_port()
        super().__init__(
            [
                sys.executable,
                "-m",
                "dynamo.frontend",
                "--discovery-backend",
                "file",
                "--router-mode",
                mode,
                "--http-host",
                "127.0.0.1",
                "--http-port",
                str(self.port),
            ],
            store,
            log_dir / f"frontend-{mode}.log",
        )
        self.url = f"http://127.0.0.1:{self.port}"


def wait_for(predicate, what: str, timeout: float, interval: float = 0.3) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def serves(frontend: Frontend, worker: Worker) -> bool:
    """The frontend routes to this worker: a request pinned to it (nvext.backend_instance_id) succeeds."""
    body = {"model": MODEL, "prompt": "ping", "max_tokens": 1, "nvext": {"backend_instance_id": worker.id}}
    try:
        response = httpx.post(f"{frontend.url}/v1/completions", json=body, timeout=30, verify=SSL_CONTEXT)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def idle(worker: Worker) -> bool:
    info = worker.info()
    return info["num_running"] == 0 and info["num_waiting"] == 0


def wait_until_unlisted(store: Path, worker_id: int, timeout: float = 60) -> None:
    """Until discovery no longer lists the worker (a killed one stays listed until its lease lapses, seconds), as
    Dynamo's own client sees it."""
    import asyncio

    from dynamo.runtime import DistributedRuntime

    async def watch() -> None:
        runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
        try:
            client = await runtime.endpoint("dynamo.radixserve.generate").client()
            deadline = time.monotonic() + timeout
            while worker_id in client.instance_ids():
                assert time.monotonic() < deadline, f"worker {worker_id} still listed after {timeout:.0f} s"
                await asyncio.sleep(0.3)
        finally:
            runtime.shutdown()

    saved = {key: os.environ.get(key) for key in dynamo_env(store)}
    os.environ.update({k: v for k, v in dynamo_env(store).items() if k.startswith("DYN_")})
    try:
        asyncio.run(watch())
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
