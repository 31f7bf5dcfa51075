"""Storms against one real server (launch.py subprocess) with a KV pool far too small for its load: 100 streaming
clients that leave mid-stream at random points, then more long requests at once than the pool can hold, so the
scheduler must retract and re-admit. After each, once nothing runs or waits, the KV accounting read from
/server_info must be whole (every slot free or evictable cache, none owned or locked) and the server must go on
serving."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from radixserve.testing.tiny_models import tiny_model_dir
from server_fixture import launched_server

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

POOL_TOKENS = 2048
# Admission reserves this share of max_tokens for decoding: low, so many requests start together and the pool
# runs out while they grow (the scheduler must retract), rather than requests queueing politely.
RESERVE_RATIO = "0.05"
# After the last client leaves. Cleanup takes well under a second; the margin is for a CPU shared with other work,
# where one step of 100 requests can take seconds.
IDLE_WITHIN_S = 30.0

DISCONNECT_CLIENTS = 100
DISCONNECT_MAX_TOKENS = 200  # no stream can end on its own before its client leaves (after <= 12 chunks)
LEAVE_AFTER_CHUNKS = (1, 12)
LEAVE_AFTER_S = (0.05, 2.0)
# Long prompts and short answers: the pool fills in a few prefill steps, not hundreds of decode steps, so the
# storm is cheap on a CPU; 12 x (~280 + 64) tokens is about twice the pool.
EXHAUSTION_CLIENTS = 12
EXHAUSTION_MAX_TOKENS = 64


@pytest.fixture(scope="module")
def server():
    with launched_server(
        tiny_model_dir("llama"),
        "--max-total-tokens",
        str(POOL_TOKENS),
        "--init-new-token-ratio",
        RESERVE_RATIO,
        "--min-new-token-ratio",
        RESERVE_RATIO,
    ) as server:
        yield server


def server_info(server) -> dict | None:
    """The scheduler's state; None while it is too busy to answer in time (503), which a storm on a loaded CPU may
    cause. Anything else is a failure."""
    response = httpx.get(f"{server.url}/server_info", timeout=30)
    if response.status_code == 503 and "did not answer" in response.text:
        return None
    assert response.status_code == 200, f"{response.text}\n{server.log()[-3000:]}"
    return response.json()


def wait_until_idle(server, since: float) -> dict:
    while True:
        info = server_info(server)
        if info and info["num_running"] == 0 and info["num_waiting"] == 0 and info["num_requests_in_flight"] == 0:
            return info
        if time.monotonic() - since > IDLE_WITHIN_S:
            pytest.fail(f"still busy {IDLE_WITHIN_S} s after the storm: {info}")
        time.sleep(0.05)


def assert_idle_kv_invariant(info: dict) -> None:
    assert info["kv_invariant_ok"] is True, info
    in_use = info["kv_owned"] + info["kv_protected"]
    assert info["kv_free"] + info["kv_evictable"] + in_use == info["kv_total"] == POOL_TOKENS, info
    assert in_use == 0, info  # nothing runs, so no slot may be held by a request or locked in the tree


def assert_new_request_completes(server) -> None:
    response = httpx.post(
        f"{server.url}/v1/completions",
        timeout=60,
        json={"prompt": "after the storm", "max_tokens": 8, "ignore_eos": True, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8


def test_disconnect_storm(server):
    rng = random.Random(15)
    outcomes: dict[str, int] = {}
    # A client that leaves after some chunks waits, before it leaves, until half of all clients hold a stream that
    # has started (or 5 s pass): on a loaded machine the clients' arrivals spread out, and streams that leave after
    # a few chunks would otherwise come and go one by one, a queue rather than a storm.
    started = {"now": 0, "peak": 0}
    half_started = asyncio.Event()

    async def client(http: httpx.AsyncClient, i: int, leave_after_chunks: int) -> None:
        body = {
            "prompt": f"Client {i} of the storm writes a story:",
            "max_tokens": DISCONNECT_MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0.8,
            "seed": i,
        }
        finished = False
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            chunks = 0
            try:
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    assert "error" not in event, line
                    if leave_after_chunks > DISCONNECT_MAX_TOKENS and event["choices"][0]["finish_reason"] is not None:
                        # An impatient client (leaves after a time) whose stream was fast enough: it got all of it.
                        assert event["choices"][0]["finish_reason"] == "length", line
                        finished = True
                        break
                    assert event["choices"][0]["finish_reason"] is None, (
                        f"a stream ended before its client left: {line}"
                    )
                    chunks += 1
                    if chunks == 1:  # a stream open and started, until this client leaves
                        started["now"] += 1
                        started["peak"] = max(started["peak"], started["now"])
                        if started["now"] >= DISCONNECT_CLIENTS // 2:
                            half_started.set()
                    if chunks >= leave_after_chunks:
                        try:
                            await asyncio.wait_for(half_started.wait(), 5.0)
                        except asyncio.TimeoutError:
                            pass
                        break  # leaving the block closes the connection mid-stream
            finally:  # left after its chunks, after its time (cancelled) or finished
                if chunks:
                    started["now"] -= 1
        # Counted once the stream is closed: an impatient client's time may run out while it closes, and it is then
        # counted as having left after its time only (counted here too, it was counted twice: 101 outcomes of 100).
        outcome = "finished before leaving" if finished else "left after chunks"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    async def impatient(http: httpx.AsyncClient, i: int, leave_after_s: float) -> None:
        # Gone at a random time: waiting in the queue, in prefill, or decoding.
        try:
            await asyncio.wait_for(client(http, i, DISCONNECT_MAX_TOKENS + 1), leave_after_s)
        except asyncio.TimeoutError:
            outcomes["left after time"] = outcomes.get("left after time", 0) + 1

    async def storm() -> tuple[float, int]:
        limits = httpx.Limits(max_connections=DISCONNECT_CLIENTS + 10)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as http:
            tasks = [
                asyncio.create_task(
                    impatient(http, i, rng.uniform(*LEAVE_AFTER_S))
                    if i % 4 == 0
                    else client(http, i, rng.randint(*LEAVE_AFTER_CHUNKS))
                )
                for i in range(DISCONNECT_CLIENTS)
            ]
            peak = 0  # most requests the scheduler held at once
            while not all(t.done() for t in tasks):
                info = await asyncio.to_thread(server_info, server)
                if info is not None:
                    peak = max(peak, info["num_running"] + info["num_waiting"])
                await asyncio.sleep(0.05)
            await asyncio.gather(*tasks)
            return time.monotonic(), peak

    left_at, peak = asyncio.run(storm())
    assert sum(outcomes.values()) == DISCONNECT_CLIENTS, outcomes
    assert started["peak"] >= DISCONNECT_CLIENTS // 2, started  # a storm, not a queue: half the streams open at once
    assert peak >= DISCONNECT_CLIENTS // 4, peak  # and the scheduler held them at once (polled every 50 ms)
    assert_idle_kv_invariant(wait_until_idle(server, left_at))
    assert_new_request_completes(server)


def test_kv_exhaustion_storm(server):
    retractions_before = wait_until_idle(server, time.monotonic())["retractions"]

    async def one(http: httpx.AsyncClient, i: int) -> dict:
        # Distinct from the first token on, so the radix cache cannot share them.
        words = " ".join(f"{100000 + i * 7919 + j}" for j in range(40))
        body = {
            "prompt": f"{i} {words}; an essay on these numbers:",
            "max_tokens": EXHAUSTION_MAX_TOKENS,
            "ignore_eos": True,
            "temperature": 0,
        }
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    async def storm() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            return await asyncio.gather(*(one(http, i) for i in range(EXHAUSTION_CLIENTS)))

    replies = asyncio.run(storm())
    done_at = time.monotonic()
    assert all(r["usage"]["completion_tokens"] == EXHAUSTION_MAX_TOKENS for r in replies), [r["usage"] for r in replies]
    assert all(r["choices"][0]["finish_reason"] == "length" for r in replies)
    total = sum(r["usage"]["total_tokens"] for r in replies)
    assert total > 1.5 * POOL_TOKENS, total  # the storm is real: the pool cannot hold them all
    info = wait_until_idle(server, done_at)
    assert info["retractions"] > retractions_before, info  # the pool really ran out while they grew
    assert_idle_kv_invariant(info)
    assert_new_request_completes(server)
