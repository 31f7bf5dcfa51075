"""bench/serving_bench.py's client reports its own share of what it measures (the scorecard's serve keys): its CPU
time over the run's and how late its event loop ran. A closed loop that streams more tokens a second keeps its one
client process busier, and while its loop runs late every first token waits to be read: these figures tell a slower
server from a busier client."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from bench.serving_bench import loop_lag, run_load
from radixserve.testing.tiny_models import tiny_model_dir


def test_loop_lag_sees_a_blocked_loop():
    async def blocked_once() -> list[float]:
        lags: list[float] = []
        monitor = asyncio.create_task(loop_lag(lags))
        await asyncio.sleep(0.02)
        time.sleep(0.05)  # the loop blocked: the sleeper in flight wakes ~50 ms late
        await asyncio.sleep(0.02)
        monitor.cancel()
        return lags

    lags = asyncio.run(blocked_once())
    assert max(lags) >= 0.045, lags
    assert float(np.median(lags)) < 0.01, lags  # the other wake-ups were on time


@pytest.mark.server
def test_run_load_reports_the_clients_own_share():
    from server_fixture import launched_server  # tests/helpers (conftest.py)

    rng = np.random.default_rng(0)
    system = rng.integers(100, 40000, 40).tolist()
    prompts = [system + rng.integers(100, 40000, 5).tolist() for _ in range(8)]
    with launched_server(tiny_model_dir("llama")) as server:
        result = asyncio.run(run_load(server.url, prompts, 6, 4))
    assert 0.0 < result["client_cpu_share"] < 2.0, result
    assert 0.0 <= result["client_loop_lag_p50_ms"] <= result["client_loop_lag_p99_ms"], result
    assert result["ttft_p50_ms"] > 0 and result["cached_prompt_share"] > 0, result
