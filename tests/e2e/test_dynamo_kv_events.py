"""The radix tree's KV events as Dynamo's own KV router sees them: one radixserve Dynamo worker with two data-parallel
replicas (--dp-size 2) and a KvRouter in this process, over file discovery and the zmq event plane. Requests go
through Dynamo's request plane to a chosen replica (dp_rank); after each, the router's count of cached blocks per
replica is checked: stored blocks on the replica that ran the request only, cache_salt namespaces apart, a pinned
prefix on every replica and kept through a flush, and under memory pressure, for every prompt, exactly the blocks the
replica's tree still holds (the cached tokens its next request finds, in whole blocks). Last, an engine process
killed mid-request: the request fails with the reason and the worker exits."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest
from dynamo.llm import KvRouter, KvRouterConfig
from transformers import AutoTokenizer
from dynamo.runtime import DistributedRuntime

from radixserve.runtime.process_util import process_tree_argv

from dynamo_fixture import BLOCK, MODEL, MODEL_DIR, Worker, dynamo_env, wait_for

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

SETTLE_S = 10.0  # events reach the router over the event plane within milliseconds; room for a busy CPU


@pytest.fixture
def worker(tmp_path, monkeypatch):
    # Room for about six 100-token prompts per replica, so that a dozen of them evict.
    w = Worker(tmp_path, tmp_path, "worker-dp2", "--dp-size", "2", "--max-total-tokens", "700")
    for key, value in dynamo_env(tmp_path).items():  # this process's runtime: the same store, loopback too
        if key.startswith("DYN_"):
            monkeypatch.setenv(key, value)
    try:
        wait_for(w.ready, "the dp-size 2 worker", 240)
        yield w
    except BaseException:
        print(w.tail())
        raise
    finally:
        w.stop()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 10000) for _ in range(n)]


def test_router_sees_each_replicas_blocks_exactly(worker):
    asyncio.run(_check_events(worker))


async def _check_events(worker: Worker) -> None:
    rt = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
    router = KvRouter(rt.endpoint("dynamo.radixserve.generate"), BLOCK, KvRouterConfig())
    rng = random.Random(0)

    async def blocks(ids: list[int], salt: str | None = None) -> dict[int, int]:
        scores = await router.get_overlap_scores(ids, cache_namespace=salt)
        found = {w["dp_rank"]: w["device_blocks"] for w in scores["workers"]}
        return {rank: found.get(rank, 0) for rank in (0, 1)}

    async def reaches(ids: list[int], expected: dict[int, int], salt: str | None, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while await blocks(ids, salt) != expected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)
        return await blocks(ids, salt) == expected

    async def eventually(ids: list[int], expected: dict[int, int], salt: str | None = None) -> None:
        """The router's view reaches `expected` (events travel apart from the replies) and stays there."""
        assert await reaches(ids, expected, salt, SETTLE_S), (await blocks(ids, salt), expected)

    async def send(ids: list[int], dp_rank: int, salt: str | None = None, max_tokens: int = 2) -> int:
        """Runs the request on that replica; returns the prompt tokens it found cached."""
        stream = await router.generate(
            ids,
            MODEL,
            stop_conditions={"max_tokens": max_tokens, "ignore_eos": True},
            sampling_options={"temperature": 0.0},
            worker_id=worker.id,
            dp_rank=dp_rank,
            extra_args={"nvext": {"cache_salt": salt}} if salt else None,
        )
        outputs = [out async for out in stream]
        return outputs[-1]["completion_usage"]["prompt_tokens_details"]["cached_tokens"]

    deadline = time.monotonic() + 60
    while len((await router.get_overlap_scores([1] * BLOCK))["workers"]) < 2:  # both replicas registered
        assert time.monotonic() < deadline, "the router never saw both replicas"
        await asyncio.sleep(0.3)

    # Until the router's subscription to a replica's events is up, what that replica publishes is lost (zmq); the
    # router recovers the replica's whole state when a later event shows it a gap. So: one request per replica until
    # the router has seen its blocks, then a flush.
    for rank in (0, 1):
        for _ in range(10):
            warm = tokens(rng, 40)
            await send(warm, dp_rank=rank, max_tokens=1)
            if await reaches(warm, {rank: 2, 1 - rank: 0}, None, 2.0):
                break
        else:
            raise AssertionError(f"the router never heard replica {rank}'s events")
    assert worker.control("flush_cache")["success"]
    await eventually(warm, {0: 0, 1: 0})

    # Stored: on the replica that ran the request, in full blocks (70 prompt + 1 computed output = 4 blocks).
    prompt = tokens(rng, 70)
    await send(prompt, dp_rank=1)
    await eventually(prompt, {0: 0, 1: 4})
    # A salted request's blocks are the salt's: found with it, invisible without it or with another one.
    assert await send(prompt, dp_rank=0, salt="tenant-a") == 0
    await eventually(prompt, {0: 4, 1: 0}, "tenant-a")
    await eventually(prompt, {0: 0, 1: 4})
    await eventually(prompt, {0: 0, 1: 0}, "tenant-b")

    # A pin is made on every replica; a flush removes every block but the pinned ones.
    system = tokens(rng, 40)
    assert worker.control("pin_prefix", {"input_ids": system})["status"] == 200
    await eventually(system, {0: 2, 1: 2})
    assert worker.control("flush_cache")["success"]
    await eventually(prompt, {0: 0, 1: 0})
    await eventually(prompt, {0: 0, 1: 0}, "tenant-a")
    await eventually(system, {0: 2, 1: 2})

    # Memory pressure on replica 0: a dozen 100-token prompts (6 full blocks each, not 7) in a 700-token pool, all
    # starting with the same 40 tokens: an evicted prompt leaves that head (2 full blocks) behind.
    head = tokens(rng, 40)
    prompts = [head + tokens(rng, 60) for _ in range(12)]
    for ids in prompts:
        await send(ids, dp_rank=0, max_tokens=1)
    assert worker.info()["evicted_tokens"] > 0
    await eventually(prompts[-1], {0: 6, 1: 0})
    seen = []
    for ids in reversed(prompts):  # what the router believes, then what the replica's tree finds
        believed = (await blocks(ids))[0]
        found = await send(ids, dp_rank=0, max_tokens=1)
        seen.append(believed)
        assert believed == found // BLOCK, (believed, found)
        # Its own insert reaching the router means the evictions it caused, sent before, have too.
        await eventually(ids, {0: 6, 1: 0})
    assert {2, 6} <= set(seen), seen  # whole prompts, and evicted ones down to their shared head
    await eventually(system, {0: 2, 1: 2})  # the pin held through all of it
    info = worker.info()
    assert info["kv_invariant_ok"] and info["num_running"] == 0

    # Stop strings are the scheduler's to match (here no frontend stands between to cut the text): a greedy reply,
    # then the same request stopping at one of its words, on fewer tokens.
    async def reply(stop: list[str] | None) -> dict:
        stream = await router.generate(
            prompts[1],
            MODEL,
            stop_conditions={"max_tokens": 12, "stop": stop},
            sampling_options={"temperature": 0.0},
            worker_id=worker.id,
            dp_rank=1,
        )
        outs = [out async for out in stream]
        return {"tokens": [t for out in outs for t in out["token_ids"]], "finish": outs[-1]["finish_reason"]}

    free = await reply(None)
    text = AutoTokenizer.from_pretrained(MODEL_DIR).decode(free["tokens"])
    stopped = await reply([text.split()[1]])
    assert stopped["finish"] == "stop" and len(stopped["tokens"]) < len(free["tokens"]), (free, stopped, text)
    assert free["tokens"][: len(stopped["tokens"])] == stopped["tokens"]

    # A process of the engine dies mid-request: the request fails with the reason, and the worker leaves (exit 1)
    # rather than stay registered without an engine.
    stream = await router.generate(
        prompts[0], MODEL, stop_conditions={"max_tokens": 500, "ignore_eos": True}, worker_id=worker.id, dp_rank=1
    )
    first = await stream.__anext__()
    assert first["token_ids"]
    # Every replica's worker process: the request runs on replica 1, and killing replica 0's alone let it finish its
    # 500 tokens before the death was noticed on a quiet machine.
    victims = [pid for pid, argv in process_tree_argv(worker.process.pid).items() if "radixserve.worker" in argv]
    assert len(victims) == 2, victims
    for victim in victims:
        os.kill(victim, signal.SIGKILL)
    with pytest.raises(Exception, match="radixserve engine failed"):
        async for _ in stream:
            pass
    assert await asyncio.to_thread(worker.process.wait, 60) == 1
    rt.shutdown()
