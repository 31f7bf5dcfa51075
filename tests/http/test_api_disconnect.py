"""Clients that go away free everything they held: a real server (`launch.py` subprocess), real sockets, clients
that close their connection mid-generation. Within 2 s the scheduler must report nothing running or waiting and
its KV accounting intact (free + cached + owned == total), and the server must go on serving."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from radixserve.testing.tiny_models import tiny_model_dir

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

NUM_STREAMS = 32
LONG = 1000  # tokens: ~10+ s of decoding for 32 sequences on a CPU, far longer than the 2 s allowed to clean up
CLEANUP_DEADLINE_S = 2.0


@pytest.fixture(scope="module")
def server(tiny_llama_server):
    return tiny_llama_server  # shared with other modules (tests/conftest.py)


def server_info(server) -> dict:
    return httpx.get(f"{server.url}/server_info", timeout=10).json()


def generated_tokens(server) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("radixserve:generation_tokens_total"):
            return float(line.split()[-1])
    raise AssertionError("radixserve:generation_tokens_total missing from /metrics")


def wait_until_idle(server, since: float) -> dict:
    """Poll /server_info until nothing runs or waits; fail if that takes longer than the deadline after `since`."""
    while True:
        info = server_info(server)
        if info["num_running"] == 0 and info["num_waiting"] == 0:
            assert time.monotonic() - since < CLEANUP_DEADLINE_S, f"took {time.monotonic() - since:.2f} s"
            return info
        if time.monotonic() - since > CLEANUP_DEADLINE_S:
            pytest.fail(f"still busy {CLEANUP_DEADLINE_S} s after the clients left: {info}")
        time.sleep(0.05)


def assert_kv_intact(info: dict) -> None:
    assert info["kv_invariant_ok"] is True, info
    assert info["kv_owned"] == 0 and info["kv_protected"] == 0, info
    assert info["kv_free"] + info["kv_evictable"] == info["kv_total"], info


def assert_new_request_completes(server) -> None:
    response = httpx.post(
        f"{server.url}/v1/completions",
        timeout=60,
        json={"prompt": "after the storm", "max_tokens": 8, "ignore_eos": True, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8


def test_32_streams_cancelled_after_first_chunk(server):
    tokens_before = generated_tokens(server)

    async def scenario() -> tuple[float, dict]:
        async with (
            openai.AsyncOpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0, timeout=120) as client,
            httpx.AsyncClient(base_url=server.url) as http,
        ):
            release = asyncio.Event()
            first_chunks = 0

            async def one(i: int) -> None:
                nonlocal first_chunks
                stream = await client.completions.create(
                    model=tiny_model_dir("llama").name,
                    prompt=f"Stream {i} tells a very long story:",
                    max_tokens=LONG,
                    stream=True,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                async for chunk in stream:
                    assert chunk.choices[0].finish_reason is None
                    first_chunks += 1
                    await release.wait()  # the first ones hold on until many generate at once
                    break
                await stream.close()  # closes the connection mid-stream

            tasks = [asyncio.create_task(one(i)) for i in range(NUM_STREAMS)]
            while first_chunks < NUM_STREAMS // 2:
                await asyncio.sleep(0.01)
            busy = (await http.get("/server_info", timeout=10)).json()
            release.set()
            await asyncio.gather(*tasks)
            assert first_chunks == NUM_STREAMS
            return time.monotonic(), busy

    closed_at, busy = asyncio.run(scenario())
    info = wait_until_idle(server, closed_at)
    assert_kv_intact(info)
    assert busy["num_running"] >= NUM_STREAMS // 2, busy  # they really were generating together
    # Generation stopped when the clients left: nowhere near 32 x 1000 tokens.
    assert generated_tokens(server) - tokens_before < NUM_STREAMS * LONG / 4
    assert_new_request_completes(server)


def test_non_streaming_client_timeout_aborts(server):
    body = {"prompt": "A long answer, please:", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.0)
    gave_up_at = time.monotonic()
    info = wait_until_idle(server, gave_up_at)
    assert_kv_intact(info)
    assert_new_request_completes(server)


def test_chat_stream_and_generate_stream_disconnects(server):
    tokens_before = generated_tokens(server)
    chat = {
        "messages": [{"role": "user", "content": "Talk forever."}],
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    native = {"text": "Native stream", "stream": True, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for path, body in (("/v1/chat/completions", chat), ("/generate", native)):
            with http.stream("POST", path, json=body) as response:
                lines = response.iter_lines()
                content_chunks = 0
                for line in lines:  # past the role chunk, into generated text
                    if line.startswith("data: ") and (
                        '"content":"' in line and '"content":""' not in line or '"output_ids":[' in line
                    ):
                        content_chunks += 1
                        if content_chunks == 3:
                            break
            left_at = time.monotonic()
            assert_kv_intact(wait_until_idle(server, left_at))
    assert generated_tokens(server) - tokens_before < 1000
    assert_new_request_completes(server)
