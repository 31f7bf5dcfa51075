"""Bad requests against a real server (`launch.py` subprocess): each gets its HTTP status and an OpenAI error body
with a useful message, and the server keeps serving (a good request right after succeeds). The server runs with an
API key, a small body limit and a small in-flight limit so those paths are exercised too."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from radixserve.testing.tiny_models import tiny_model_dir
from server_fixture import launched_server

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

API_KEY = "test-secret-key"
MODEL = "tiny-test"
MAX_BODY = 64 * 1024
MAX_IN_FLIGHT = 4
CONTEXT = 4096
VOCAB = 49152
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server():
    with launched_server(
        tiny_model_dir("llama"),
        "--api-key",
        API_KEY,
        "--served-model-name",
        MODEL,
        "--max-request-bytes",
        str(MAX_BODY),
        "--max-queued-requests",
        str(MAX_IN_FLIGHT),
    ) as server:
        yield server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


def assert_error(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    for word in words:
        assert word in error["message"], (word, error["message"])
    return error


def assert_server_fine(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "still alive?", "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


def long_prompt_ids(n: int) -> list[int]:
    return [100 + i % 1000 for i in range(n)]


CHAT = [{"role": "user", "content": "Hi"}]

BAD_REQUESTS = [
    # (route, raw body or JSON, status, words in the message, param)
    ("/v1/completions", '{"model": "tiny-test", "prompt": "x",', 400, ["not valid JSON"], None),
    ("/v1/completions", "", 400, ["not valid JSON"], None),
    ("/v1/completions", "[1, 2]", 400, ["must be a JSON object"], None),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, ["stream", "boolean"], "stream"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "10"}, 400, ["max_tokens", "integer"], "max_tokens"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, ["messages"], "messages"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, ["The model `gpt-4` does not exist."], "model"),
    ("/v1/chat/completions", {"model": "nope", "messages": CHAT}, 404, ["The model `nope` does not exist."], "model"),
    ("/v1/completions", {"prompt": ""}, 400, ["prompt must not be empty"], "prompt"),
    ("/v1/completions", {"prompt": []}, 400, ["prompt must not be empty"], "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, ["messages must not be empty"], "messages"),
    ("/v1/completions", {"prompt": [1, 2, VOCAB]}, 400, ["prompt", f"token id {VOCAB}", "vocabulary"], "prompt"),
    ("/v1/completions", {"prompt": [[5], [1, 10**9]]}, 400, ["token id 1000000000", "vocabulary"], "prompt"),
    ("/v1/completions", {"prompt": [1, 10**30]}, 400, [f"token id {10**30}", "vocabulary"], "prompt"),
    ("/v1/completions", {"prompt": [1, -3]}, 400, ["non-negative", "-3"], "prompt"),
    ("/generate", {"input_ids": [7, VOCAB + 5]}, 400, ["input_ids", "vocabulary"], "input_ids"),
    (
        "/v1/completions",
        {"prompt": long_prompt_ids(100), "max_tokens": CONTEXT - 50},
        400,
        [
            f"This model's maximum context length is {CONTEXT} tokens. However, you requested {CONTEXT + 50} tokens "
            f"(100 in the messages, {CONTEXT - 50} in the completion). Please reduce the length of the messages or "
            f"completion."
        ],
        None,
    ),
    (
        "/v1/completions",
        {"prompt": long_prompt_ids(CONTEXT)},
        400,
        [f"maximum context length is {CONTEXT} tokens", f"you requested {CONTEXT + 16} tokens"],
        None,
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": CONTEXT},
        400,
        [f"maximum context length is {CONTEXT} tokens", f"{CONTEXT} in the completion"],
        None,
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "word " * CONTEXT}]},
        400,
        [f"maximum context length is {CONTEXT} tokens", "input tokens"],
        None,
    ),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, ["n must be between 1 and 16"], "n"),
    ("/v1/completions", {"prompt": "x", "n": 17}, 400, ["n must be between 1 and 16"], "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, ["logprobs", "between 0 and 20"], "logprobs"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "logprobs": True, "top_logprobs": 25},
        400,
        ["top_logprobs", "between 0 and 20"],
        "top_logprobs",
    ),
    ("/v1/completions", '{"prompt": "x", "temperature": NaN}', 400, ["temperature", "nan"], "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, ["temperature", ">= 0"], "temperature"),
    (
        "/v1/completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        ["stream_options can only be set when stream is true"],
        "stream_options",
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "stream": False, "stream_options": {"include_usage": True}},
        400,
        ["stream_options"],
        "stream_options",
    ),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [VOCAB]}, 400, ["stop_token_ids", "vocabulary"], None),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, ["messages[0].role"], "messages"),
    ("/generate", {"sampling_params": {"max_new_tokens": 3}}, 400, ["exactly one of text and input_ids"], None),
]


@pytest.mark.parametrize(
    "route,body,status,words,param",
    BAD_REQUESTS,
    ids=[f"{i}-{r.rsplit('/', 1)[-1]}" for i, (r, *_) in enumerate(BAD_REQUESTS)],
)
def test_bad_request_then_good_request(http, route, body, status, words, param):
    content = body if isinstance(body, str) else json.dumps(body)
    response = http.post(route, content=content, headers={"content-type": "application/json"})
    error = assert_error(response, status, *words)
    assert error["param"] == param
    assert_server_fine(http)


def test_openai_client_raises_with_server_message(server):
    client = openai.OpenAI(base_url=server.openai_base_url, api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", n=20)
    assert "n must be between 1 and 16" in str(info.value)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="missing-model", messages=CHAT)
    assert "The model `missing-model` does not exist." in str(info.value)
    ok = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_api_key_required_except_health(server, http):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in (
            ("GET", "/v1/models"),
            ("POST", "/v1/completions"),
            ("GET", "/metrics"),
            ("GET", "/server_info"),
            ("POST", "/generate"),
            ("POST", "/flush_cache"),
        ):
            response = httpx.request(method, server.url + path, headers=headers, json={"prompt": "x"})
            assert_error(response, 401, "API key")
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert http.get("/v1/models").json()["data"][0]["id"] == MODEL
    assert_server_fine(http)


def test_body_over_limit_is_413(server, http):
    big = json.dumps({"prompt": "x" * (MAX_BODY + 10), "max_tokens": 1})
    assert_error(
        http.post("/v1/completions", content=big, headers={"content-type": "application/json"}),
        413,
        "too large",
        str(MAX_BODY),
    )

    # Without a Content-Length (chunked upload) the limit holds while the body is read.
    def chunks():
        for _ in range(5):
            yield b" " * (MAX_BODY // 4)

    response = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    assert_error(response, 413, "too large")
    assert_server_fine(http)


def test_too_many_in_flight_is_503_with_retry_after(server, http):
    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as client:
            body = {"model": MODEL, "prompt": "keep going", "max_tokens": 2000, "stream": True, "ignore_eos": True}
            streams = []
            try:
                for _ in range(MAX_IN_FLIGHT):
                    response = await client.send(
                        client.build_request("POST", "/v1/completions", json=body), stream=True
                    )
                    assert response.status_code == 200
                    lines = response.aiter_lines()  # kept referenced: a collected iterator closes the stream
                    streams.append((response, lines))
                    await anext(lines)  # its first chunk: the sequence is in flight
                over = await client.post("/v1/completions", json={**body, "stream": False})
                assert_error(over, 503, "overloaded", f"limit of {MAX_IN_FLIGHT}")
                assert over.headers["retry-after"] == "1"
                # n counts: with two slots free, n=3 is refused too.
                for _ in range(2):
                    await streams.pop()[0].aclose()
                await asyncio.sleep(0.3)
                many = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 3})
                assert_error(many, 503, "overloaded")
            finally:
                for response, _ in streams:
                    await response.aclose()

    asyncio.run(scenario())
    assert_server_fine(http)


def test_unknown_route_and_wrong_method_in_openai_shape(http):
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get("/v1/completions"), 405)
    assert_server_fine(http)


# ------------------------------------------------------------------------------------- engine gone


def test_no_engine_health_503_and_shutdown_ends_streams(tmp_path):
    """The tokenizer process alone, no scheduler behind it: /health turns 503 once a ping goes unanswered, a request
    waits, and SIGTERM ends that request with an error and the process with exit code 0."""
    import signal
    import subprocess
    import sys
    import time

    from radixserve.config import ServerArgs
    from server_fixture import REPO_ROOT, free_port

    args = ServerArgs(model=str(tiny_model_dir("llama")), device="cpu", port=free_port())
    url = f"http://127.0.0.1:{args.port}"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenizer_service",
            "--server-args-json",
            json.dumps(args.to_dict()),
            "--model-dir",
            args.model,
            "--ipc-dir",
            str(tmp_path),
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                health = httpx.get(f"{url}/health", timeout=30)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "tokenizer process never listened"
                time.sleep(0.2)
        assert_error(health, 503, "not responding")

        with httpx.Client(base_url=url, timeout=30) as client:
            with client.stream("POST", "/v1/completions", json={"prompt": "anyone there?", "stream": True}) as stream:
                assert stream.status_code == 200
                time.sleep(0.3)
                process.send_signal(signal.SIGTERM)
                events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert "The server is shutting down" in events[0] and events[-1] == "data: [DONE]"
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
