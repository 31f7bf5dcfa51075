"""The HTTP front ends of launch.py: --api-server-count N tokenizer processes (python -m tokenizer_service), each
given its index, all listening on --port, one scheduler (or DP controller) behind them, as vLLM's API servers.

What a front end needs from the others is shared through the private run directory: prometheus-client's
multiprocess files (PROMETHEUS_MULTIPROC_DIR, so that any front end's /metrics reports all of them) and the stored
responses of /v1/responses (one sqlite file, tokenizer_service/responses_store.py). With N = 1 neither is used and
the one front end is named "tokenizer", as before."""

from __future__ import annotations

import os

import zmq

from radixserve.protocol import EngineFailed
from radixserve.runtime.ipc import Channel, Endpoints

METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # read by prometheus-client when it is imported: set at spawn


def default_count(device: str) -> int:
    """--api-server-count when not given. One event loop takes a burst's requests in, detokenizes and streams every
    token: on an H100 128 streamed chats arriving at once got their first token at p50 191 / p99 305 ms through one
    front end, 119 / 194 through 4 and 107-111 / 162-165 through 8, on a 16-CPU host
    (bench/results/ttft-under-load-h100.md). So on a GPU: one per 2 CPUs, at most 8. On the CPU device the model,
    not the front end, bounds every step: one."""
    if device == "cpu":
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cpus // 2))


def front_end_name(index: int, count: int) -> str:
    """The child's name in the launcher's messages (ready, heartbeats, deaths)."""
    return "tokenizer" if count == 1 else f"tokenizer-{index}"


def is_front_end(name: str) -> bool:
    return name == "tokenizer" or name.startswith("tokenizer-")


def front_end_env(endpoints: Endpoints, count: int) -> dict[str, str]:
    """The environment of every front end: with several, where prometheus-client keeps each process's values (in the
    0700 run directory, removed with it)."""
    if count == 1:
        return {}
    path = os.path.join(endpoints.ipc_dir, "metrics")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return {METRICS_ENV: path}


class FrontEndLinks:
    """The launcher's PUSH to each front end's output socket: EngineFailed reaches every one of them (a PUSH queues
    until its front end binds, so even early on)."""

    def __init__(self, ctx: zmq.Context, endpoints: Endpoints, count: int):
        self.names = [front_end_name(i, count) for i in range(count)]
        self.channels = [Channel(ctx, zmq.PUSH, endpoints.scheduler_to_front_end(i), bind=False) for i in range(count)]
        self.told = False

    def tell(self, reason: str, dead: str) -> None:
        """Fail every request in flight with the reason and turn /health to 503, in each front end but the dead one."""
        if self.told:
            return
        self.told = True
        for name, channel in zip(self.names, self.channels):
            if name != dead:
                channel.send(EngineFailed(reason))

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
