"""Every request limit at exactly its value and one past it, against one real server (`launch.py` subprocess, tiny
model): the context length (prompt + max_tokens, and the default max_tokens), sequences per request and in flight,
n, logprobs, body and header sizes, and the bounds of every sampling and request field. At the limit the request
runs; one past it gets a 4xx in OpenAI's error format that names the limit, and the server keeps serving.

Each pair fails if its check moves by one either way (`<` for `<=`, a limit off by one). The queue (20 sequences in
flight) is set below the per-request cap (24) so that both are reachable, each known by its own message."""

from __future__ import annotations

import json
import math
import socket
import time

import httpx
import pytest

from http_checks import assert_error_response, raw_request
from radixserve.testing.tiny_models import tiny_model_dir
from server_fixture import launched_server

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

CONTEXT = 1024  # --context-length, below the tiny model's 4096: long prompts stay cheap
VOCAB = 49152
MAX_BODY = 32 * 1024
MAX_HEAD = 1024  # the smallest --max-header-bytes allows
MAX_QUEUED = 20
MAX_PER_REQUEST = 24
MAX_N = 16
MAX_LOGPROBS = 20
C, CH, G, R = "/v1/completions", "/v1/chat/completions", "/generate", "/v1/responses"
CHAT = [{"role": "user", "content": "Hi"}]
PROMPT = [100 + i % 1000 for i in range(CONTEXT)]  # token ids, no two neighbours alike


@pytest.fixture(scope="module")
def server():
    with launched_server(
        tiny_model_dir("llama"),
        "--context-length",
        str(CONTEXT),
        "--max-request-bytes",
        str(MAX_BODY),
        "--max-header-bytes",
        str(MAX_HEAD),
        "--max-queued-requests",
        str(MAX_QUEUED),
        "--max-sequences-per-request",
        str(MAX_PER_REQUEST),
        "--enable-priority-scheduling",
    ) as server:
        yield server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def refused(response: httpx.Response, status: int, *words: str, param: str | None = "-") -> dict:
    if status == 503:  # (assert_error_response takes 4xx only)
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == 503, error
        assert all(word in error["message"] for word in words), (words, error)
    else:
        error = assert_error_response(response, status, *words)
    if param != "-":
        assert error["param"] == param, error
    return error


# ------------------------------------------------------------------------------------------- the context


def test_prompt_plus_max_tokens_at_the_context_length(http):
    for path, body in (
        (C, lambda n, m: {"prompt": PROMPT[:n], "max_tokens": m, "ignore_eos": True}),
        (G, lambda n, m: {"input_ids": PROMPT[:n], "sampling_params": {"max_new_tokens": m, "ignore_eos": True}}),
    ):
        reply = ok(http.post(path, json=body(CONTEXT - 6, 6)))
        completion = reply["usage"]["completion_tokens"] if path == C else reply["meta_info"]["completion_tokens"]
        assert completion == 6
        for n, m in ((CONTEXT - 5, 6), (CONTEXT - 6, 7)):
            refused(
                http.post(path, json=body(n, m)),
                400,
                f"maximum context length is {CONTEXT} tokens",
                f"requested {CONTEXT + 1} tokens ({n} in the messages, {m} in the completion)",
            )


def test_chat_prompt_plus_max_tokens_at_the_context_length(http):
    messages = [{"role": "user", "content": "hello " * (CONTEXT - 40)}]
    count = ok(http.post("/v1/tokenize", json={"messages": messages}))["count"]
    room = CONTEXT - count
    assert 1 <= room <= 64, count  # the premise: a prompt that leaves a few tokens of the context
    reply = ok(http.post(CH, json={"messages": messages, "max_tokens": room, "ignore_eos": True}))
    assert reply["usage"]["prompt_tokens"] == count and reply["usage"]["total_tokens"] == CONTEXT
    for field in ("max_tokens", "max_completion_tokens"):
        refused(
            http.post(CH, json={"messages": messages, field: room + 1}),
            400,
            f"requested {CONTEXT + 1} tokens ({count} in the messages, {room + 1} in the completion)",
        )


def test_default_max_tokens_is_the_rest_of_the_context(http):
    # An explicit null: the rest of the context, down to one token; none left is a 400 before anything runs.
    reply = ok(http.post(C, json={"prompt": PROMPT[: CONTEXT - 1], "max_tokens": None, "ignore_eos": True}))
    assert reply["usage"]["completion_tokens"] == 1 and reply["choices"][0]["finish_reason"] == "length"
    refused(
        http.post(C, json={"prompt": PROMPT, "max_tokens": None}),
        400,
        f"maximum context length is {CONTEXT} tokens. However, your request has {CONTEXT} input tokens",
    )
    reply = ok(
        http.post(
            G,
            json={"input_ids": PROMPT[: CONTEXT - 1], "sampling_params": {"max_new_tokens": None, "ignore_eos": True}},
        )
    )
    assert reply["meta_info"]["completion_tokens"] == 1
    refused(
        http.post(G, json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": None}}),
        400,
        f"your request has {CONTEXT} input tokens",
    )


# ------------------------------------------------------------------------------ sequences, n, logprobs


def prompts(k: int) -> list[list[int]]:
    return [[100 + i, 7] for i in range(k)]


def test_sequences_per_request_at_the_queue_and_at_the_cap(http):
    reply = ok(http.post(C, json={"prompt": prompts(5), "n": 4, "max_tokens": 1}))  # 20: the whole queue
    assert len(reply["choices"]) == MAX_QUEUED
    refused(
        http.post(C, json={"prompt": prompts(3), "n": 7, "max_tokens": 1}),
        400,
        "21 sequences (3 prompts x n=7)",
        f"ever holds in flight ({MAX_QUEUED}, --max-queued-requests)",
        param="n",
    )

    # At the per-request cap the queue still answers (24 > 20); one past the cap, the cap does.
    def generate(k: int) -> httpx.Response:
        return http.post(G, json={"input_ids": prompts(k), "sampling_params": {"max_new_tokens": 1}})

    error = refused(generate(MAX_PER_REQUEST), 400, f"{MAX_PER_REQUEST} sequences", "--max-queued-requests")
    assert "--max-sequences-per-request" not in error["message"]
    refused(
        generate(MAX_PER_REQUEST + 1),
        400,
        f"{MAX_PER_REQUEST + 1} sequences",
        f"limit of {MAX_PER_REQUEST} per request (--max-sequences-per-request)",
    )


def test_sequences_in_flight_at_the_limit(http, server):
    # A stream of 4 sequences stays in flight (a thousand tokens each) while the queue's last 16 places are taken.
    body = {"prompt": "hi", "n": 4, "max_tokens": CONTEXT - 8, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}{C}", json=body, timeout=60) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()  # (kept: a dropped iterator closes the connection, which aborts the stream)
        assert next(lines).startswith("data: ")
        assert server.server_info()["num_requests_in_flight"] == 4  # the premise
        reply = ok(http.post(C, json={"prompt": "hi", "n": MAX_N, "max_tokens": 1}))  # 4 + 16 = 20
        assert len(reply["choices"]) == MAX_N
        assert server.server_info()["num_requests_in_flight"] == 4
        response = http.post(C, json={"prompt": prompts(17), "max_tokens": 1})  # 4 + 17 = 21
        refused(
            response,
            503,
            "4 sequences in flight and this request adds 17",
            f"limit of {MAX_QUEUED} (--max-queued-requests)",
        )
        assert response.headers["retry-after"]


def test_n_at_the_limit(http):
    reply = ok(http.post(CH, json={"messages": CHAT, "n": MAX_N, "max_tokens": 1}))
    assert sorted(c["index"] for c in reply["choices"]) == list(range(MAX_N))
    for path, body in ((CH, {"messages": CHAT, "max_tokens": 1}), (C, {"prompt": "x", "max_tokens": 1})):
        refused(
            http.post(path, json={**body, "n": MAX_N + 1}), 400, f"n must be between 1 and {MAX_N}, got 17", param="n"
        )
    reply = ok(http.post(G, json={"text": "x", "sampling_params": {"n": MAX_N, "max_new_tokens": 1}}))
    assert len(reply) == MAX_N
    refused(
        http.post(G, json={"text": "x", "sampling_params": {"n": MAX_N + 1, "max_new_tokens": 1}}),
        400,
        f"n must be between 1 and {MAX_N}",
    )


def test_logprobs_at_the_limit(http):
    reply = ok(
        http.post(
            CH,
            json={
                "messages": CHAT,
                "max_tokens": 2,
                "ignore_eos": True,
                "logprobs": True,
                "top_logprobs": MAX_LOGPROBS,
            },
        )
    )
    tokens = reply["choices"][0]["logprobs"]["content"]
    assert len(tokens) == 2 and all(len(t["top_logprobs"]) == MAX_LOGPROBS for t in tokens)
    reply = ok(
        http.post(
            G,
            json={
                "text": "x",
                "sampling_params": {"max_new_tokens": 2, "ignore_eos": True},
                "return_logprob": True,
                "top_logprobs_num": MAX_LOGPROBS,
            },
        )
    )
    top = reply["meta_info"]["output_top_logprobs"]
    assert len(top) == 2 and all(len(t) == MAX_LOGPROBS for t in top)
    # /v1/completions: the top k and the sampled token (OpenAI's "up to logprobs + 1"), keyed by text (two tokens may
    # share one); with echo, the prompt's tokens too.
    reply = ok(http.post(C, json={"prompt": "one two", "max_tokens": 1, "logprobs": MAX_LOGPROBS, "echo": True}))
    logprobs = reply["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == reply["usage"]["prompt_tokens"] + 1
    assert all(0 < len(t) <= MAX_LOGPROBS + 1 for t in logprobs["top_logprobs"][1:])
    past = f"must be between 0 and {MAX_LOGPROBS}, got 21"
    refused(
        http.post(CH, json={"messages": CHAT, "logprobs": True, "top_logprobs": 21}), 400, past, param="top_logprobs"
    )
    refused(http.post(G, json={"text": "x", "return_logprob": True, "top_logprobs_num": 21}), 400, past)
    for echo in (False, True):
        refused(http.post(C, json={"prompt": "x", "logprobs": 21, "echo": echo}), 400, past, param="logprobs")


# ------------------------------------------------------------------------------- body and header sizes


def padded(size: int) -> bytes:
    """A valid completion body of exactly `size` bytes (JSON allows whitespace after the value)."""
    raw = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    return raw + b" " * (size - len(raw))


def test_body_size_at_the_limit(http):
    headers = {"content-type": "application/json"}
    ok(http.post(C, content=padded(MAX_BODY), headers=headers))
    refused(
        http.post(C, content=padded(MAX_BODY + 1), headers=headers),
        413,
        f"{MAX_BODY + 1} bytes; the limit is {MAX_BODY} bytes (--max-request-bytes)",
    )
    # Chunked (no Content-Length): counted as it arrives.
    for size, status in ((MAX_BODY, 200), (MAX_BODY + 1, 413)):
        body = padded(size)
        response = http.post(C, content=iter([body[:1000], body[1000:]]), headers=headers)
        assert "content-length" not in response.request.headers
        if status == 200:
            ok(response)
        else:
            refused(response, 413, f"more than {MAX_BODY} bytes")


def head(size: int) -> bytes:
    """A GET /v1/models whose head counts exactly `size` bytes as the server counts them (--max-header-bytes): the
    URL, and each header's name and value with 4 more (': ' and the line end)."""
    fixed = len("/v1/models") + len("Host") + len("localhost") + 4 + len("X-Pad") + 4
    return b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nX-Pad: " + b"a" * (size - fixed) + b"\r\n\r\n"


def status_in_pieces(port: int, data: bytes, cuts: list[int]) -> int:
    """Send data in pieces, a pause between them (so that the server reads each apart); the response's status."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for start, end in zip([0, *cuts], [*cuts, len(data)]):
            sock.sendall(data[start:end])
            time.sleep(0.05)
        response = b""
        while b"\r\n" not in response:
            chunk = sock.recv(65536)
            if not chunk:
                break
            response += chunk
    return int(response.split(b" ", 2)[1])


def test_header_size_at_the_limit(server):
    status, _, body = raw_request(server.port, head(MAX_HEAD))
    assert status == 200, body
    status, _, body = raw_request(server.port, head(MAX_HEAD + 1))
    assert status == 431 and b"--max-header-bytes" in body, (status, body)
    # The same heads arriving in pieces (as a long head does over a network) are counted the same.
    for cuts in ([10], [len(head(MAX_HEAD)) // 2], [60, 600], [len(head(MAX_HEAD)) - 1]):
        assert status_in_pieces(server.port, head(MAX_HEAD), cuts) == 200, cuts
        assert status_in_pieces(server.port, head(MAX_HEAD + 1), cuts) == 431, cuts


# -------------------------------------------------------------------------- the bounds of every field


def cmp(**fields):
    return {"prompt": [5, 6], "max_tokens": 1, **fields}


def chat(**fields):
    return {"messages": CHAT, "max_tokens": 1, **fields}


def gen(top=None, **sampling):
    return {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1, **sampling}, **(top or {})}


def resp(**fields):
    return {"input": "Hi", "max_output_tokens": 1, **fields}


def up(x: float) -> float:
    return math.nextafter(x, math.inf)


def down(x: float) -> float:
    return math.nextafter(x, -math.inf)


def bias(n: int, value: float = 1.0) -> dict:
    return {str(i): value for i in range(n)}


# (id, route, body at the limit, body one past it, words of the error, its param ("-": not checked; the request
# models' own checks name it, SamplingParams.validate's second line of checks names none), status at the limit)
BOUNDS = [
    ("n lower", C, cmp(n=1), cmp(n=0), ["n must be between 1 and 16, got 0"], "n", 200),
    (
        "max_tokens",
        C,
        cmp(max_tokens=1),
        cmp(max_tokens=0),
        ["max_tokens must be at least 1, got 0"],
        "max_tokens",
        200,
    ),
    (
        "max_completion_tokens",
        CH,
        chat(max_tokens=None, max_completion_tokens=1),
        chat(max_tokens=None, max_completion_tokens=0),
        ["max_completion_tokens must be at least 1"],
        "max_completion_tokens",
        200,
    ),
    (
        "max_new_tokens",
        G,
        gen(max_new_tokens=1),
        gen(max_new_tokens=0),
        ["max_new_tokens must be at least 1"],
        "sampling_params",
        200,
    ),
    (
        "max_output_tokens",
        R,
        resp(max_output_tokens=1),
        resp(max_output_tokens=0),
        ["max_output_tokens must be at least 1"],
        "-",
        200,
    ),
    ("min_tokens lower", C, cmp(min_tokens=0), cmp(min_tokens=-1), ["min_tokens must be >= 0"], "min_tokens", 200),
    (
        "min_tokens = max_tokens",
        C,
        cmp(max_tokens=2, min_tokens=2),
        cmp(max_tokens=2, min_tokens=3),
        ["min_tokens (3) must not exceed max_tokens (2)"],
        "-",
        200,
    ),
    (
        "min_new_tokens = max_new_tokens",
        G,
        gen(max_new_tokens=2, min_new_tokens=2),
        gen(max_new_tokens=2, min_new_tokens=3),
        ["min_new_tokens (3) must not exceed max_new_tokens (2)"],
        "sampling_params",
        200,
    ),
    ("logprobs lower", C, cmp(logprobs=0), cmp(logprobs=-1), ["between 0 and 20, got -1"], "logprobs", 200),
    (
        "top_logprobs lower",
        CH,
        chat(logprobs=True, top_logprobs=0),
        chat(logprobs=True, top_logprobs=-1),
        ["between 0 and 20, got -1"],
        "top_logprobs",
        200,
    ),
    (
        "stop strings",
        C,
        cmp(stop=[f"s{i}" for i in range(64)]),
        cmp(stop=[f"s{i}" for i in range(65)]),
        ["stop may contain at most 64 strings, got 65"],
        "stop",
        200,
    ),
    (
        "cache_salt",
        C,
        cmp(cache_salt="s" * 256),
        cmp(cache_salt="s" * 257),
        ["cache_salt may have at most 256 characters, got 257"],
        "cache_salt",
        200,
    ),
    (
        "cache_salt generate",
        G,
        gen({"cache_salt": "s" * 256}),
        gen({"cache_salt": "s" * 257}),
        ["at most 256 characters"],
        "cache_salt",
        200,
    ),
    (
        "logit_bias entries",
        C,
        cmp(logit_bias=bias(1024)),
        cmp(logit_bias=bias(1025)),
        ["logit_bias may have at most 1024 entries, got 1025"],
        "-",
        200,
    ),
    (
        "logit_bias max",
        CH,
        chat(logit_bias={"5": 100}),
        chat(logit_bias={"5": up(100.0)}),
        ["logit_bias[5] must be in [-100, 100]"],
        "logit_bias",
        200,
    ),
    (
        "logit_bias min",
        C,
        cmp(logit_bias={"5": -100}),
        cmp(logit_bias={"5": down(-100.0)}),
        ["logit_bias[5] must be in [-100, 100]"],
        "logit_bias",
        200,
    ),
    (
        "logit_bias token",
        C,
        cmp(logit_bias={str(VOCAB - 1): 1}),
        cmp(logit_bias={str(VOCAB): 1}),
        [f"logit_bias names token {VOCAB}, outside the vocabulary [0, {VOCAB})"],
        "-",
        200,
    ),
    (
        "prompt token id",
        C,
        cmp(prompt=[VOCAB - 1]),
        cmp(prompt=[VOCAB]),
        [f"prompt contains token id {VOCAB}, outside the vocabulary [0, {VOCAB})"],
        "prompt",
        200,
    ),
    ("prompt token id lower", C, cmp(prompt=[0]), cmp(prompt=[-1]), ["non-negative token ids, got -1"], "prompt", 200),
    (
        "input_ids token id",
        G,
        {**gen(), "input_ids": [[5], [VOCAB - 1]]},
        {**gen(), "input_ids": [[5], [VOCAB]]},
        [f"input_ids contains token id {VOCAB}"],
        "input_ids",
        200,
    ),
    (
        "stop_token_ids",
        C,
        cmp(stop_token_ids=[VOCAB - 1]),
        cmp(stop_token_ids=[VOCAB]),
        [f"stop_token_ids contains {VOCAB}, outside the vocabulary"],
        "-",
        200,
    ),
    (
        "priority max",
        C,
        cmp(priority=2**31 - 1),
        cmp(priority=2**31),
        [f"priority must fit in a signed 32-bit integer, got {2**31}"],
        "priority",
        200,
    ),
    (
        "priority min",
        G,
        gen({"priority": -(2**31)}),
        gen({"priority": -(2**31) - 1}),
        ["signed 32-bit integer"],
        "priority",
        200,
    ),
    # n > 1: choice j samples with seed + j, past the int64 range at the top
    (
        "seed max",
        C,
        cmp(seed=2**63 - 1, n=MAX_N),
        cmp(seed=2**63),
        [f"signed 64-bit integer, got {2**63}"],
        "seed",
        200,
    ),
    ("seed min", CH, chat(seed=-(2**63), n=2), chat(seed=-(2**63) - 1), ["signed 64-bit integer"], "seed", 200),
    (
        "temperature",
        C,
        cmp(temperature=0.0),
        cmp(temperature=down(0.0)),
        ["temperature must be a finite number >= 0"],
        "temperature",
        200,
    ),
    ("top_p max", C, cmp(top_p=1.0), cmp(top_p=up(1.0)), ["top_p must be in (0, 1]"], "top_p", 200),
    ("top_p min", G, gen(top_p=up(0.0)), gen(top_p=0.0), ["top_p must be in (0, 1]"], "sampling_params", 200),
    (
        "top_k",
        C,
        cmp(top_k=-1),
        cmp(top_k=-2),
        ["top_k must be -1 or 0 (disabled) or a positive integer, got -2"],
        "top_k",
        200,
    ),
    ("min_p max", C, cmp(min_p=1.0), cmp(min_p=up(1.0)), ["min_p must be in [0, 1]"], "min_p", 200),
    ("min_p min", CH, chat(min_p=0.0), chat(min_p=down(0.0)), ["min_p must be in [0, 1]"], "min_p", 200),
    (
        "presence_penalty max",
        C,
        cmp(presence_penalty=2.0),
        cmp(presence_penalty=up(2.0)),
        ["presence_penalty must be in [-2, 2]"],
        "presence_penalty",
        200,
    ),
    (
        "presence_penalty min",
        C,
        cmp(presence_penalty=-2.0),
        cmp(presence_penalty=down(-2.0)),
        ["presence_penalty must be in [-2, 2]"],
        "presence_penalty",
        200,
    ),
    (
        "frequency_penalty max",
        CH,
        chat(frequency_penalty=2.0),
        chat(frequency_penalty=up(2.0)),
        ["frequency_penalty must be in [-2, 2]"],
        "frequency_penalty",
        200,
    ),
    (
        "frequency_penalty min",
        G,
        gen(frequency_penalty=-2.0),
        gen(frequency_penalty=down(-2.0)),
        ["frequency_penalty must be in [-2, 2]"],
        "sampling_params",
        200,
    ),
    (
        "repetition_penalty max",
        C,
        cmp(repetition_penalty=2.0),
        cmp(repetition_penalty=up(2.0)),
        ["repetition_penalty must be in (0, 2]"],
        "repetition_penalty",
        200,
    ),
    (
        "repetition_penalty min",
        C,
        cmp(repetition_penalty=up(0.0)),
        cmp(repetition_penalty=0.0),
        ["repetition_penalty must be in (0, 2]"],
        "repetition_penalty",
        200,
    ),
    (
        "metadata pairs",
        R,
        resp(metadata={f"k{i}": "v" for i in range(16)}),
        resp(metadata={f"k{i}": "v" for i in range(17)}),
        ["metadata may hold 16 pairs"],
        "metadata",
        200,
    ),
    (
        "metadata key",
        R,
        resp(metadata={"k" * 64: "v"}),
        resp(metadata={"k" * 65: "v"}),
        ["keys of at most 64"],
        "metadata",
        200,
    ),
    (
        "metadata value",
        R,
        resp(metadata={"k": "v" * 512}),
        resp(metadata={"k": "v" * 513}),
        ["values of at most 512 characters"],
        "metadata",
        200,
    ),
    # At the limit an id is looked up (none has that name: 404); one past, it is refused unread.
    (
        "previous_response_id",
        R,
        resp(previous_response_id="r" * 256),
        resp(previous_response_id="r" * 257),
        ["previous_response_id must have 1 to 256 characters"],
        "previous_response_id",
        404,
    ),
]


@pytest.mark.parametrize("name,path,at_limit,past,words,param,status", BOUNDS, ids=[b[0] for b in BOUNDS])
def test_field_bound(http, name, path, at_limit, past, words, param, status):
    response = http.post(path, json=at_limit)
    if status == 200:
        ok(response)
    else:
        refused(response, status)
    refused(http.post(path, json=past), 400, *words, param=param)
