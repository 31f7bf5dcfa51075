"""Browser safety, limits and a responsive event loop, against a real server (`launch.py` subprocess) without an
API key: Host check (DNS rebinding), JSON-only POST bodies, CORS only for --allowed-origins, a header size limit,
HTTP parser errors as OpenAI error JSON, no client-supplied chat template, tokenization off the event loop, and no
torch in the HTTP process's imports. Each of these failed before the front end was hardened."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from http_checks import assert_error_response, assert_openai_error, raw_request
from radixserve.testing.tiny_models import tiny_model_dir
from server_fixture import REPO_ROOT, launched_server

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

GOOD_ORIGIN = "http://good.example"
CONTEXT = 262144  # beyond the tiny model's 4096: a 7 MB prompt passes the cheap length check and is tokenized
MAX_HEADER = 16 * 1024
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server():
    with launched_server(
        tiny_model_dir("llama"),
        "--allowed-origins",
        GOOD_ORIGIN,
        "--context-length",
        str(CONTEXT),
        "--max-header-bytes",
        str(MAX_HEADER),
        "--tokenizer-workers",
        "1",
    ) as server:
        yield server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def completion(http: httpx.Client, **headers) -> httpx.Response:
    return http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}, headers=headers)


def test_host_header_must_name_this_server(server, http):
    for host in ("evil.example", f"evil.example:{server.port}", "192.168.1.10", "127.0.0.1.evil.example"):
        for method, path in (("GET", "/server_info"), ("GET", "/v1/models"), ("POST", "/v1/completions")):
            response = http.request(method, path, headers={"host": host, **JSON}, content=b'{"prompt": "x"}')
            assert_error_response(response, 403, "Host", "--allowed-hosts")
    for host in (
        "localhost",
        f"localhost:{server.port}",
        "127.0.0.1",
        f"127.0.0.1:{server.port}",
        f"[::1]:{server.port}",
        "LOCALHOST",
    ):
        assert http.get("/v1/models", headers={"host": host}).status_code == 200, host
        assert completion(http, host=host).status_code == 200, host


def test_post_bodies_must_be_json(http):
    body = json.dumps({"prompt": "hello", "max_tokens": 2})
    for content_type in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonx",
        "text/json",
    ):
        response = http.post("/v1/completions", content=body, headers={"content-type": content_type})
        assert_error_response(response, 415, "application/json", content_type.split(";")[0])
    no_type = http.build_request("POST", "/v1/completions", content=body)
    assert "content-type" not in no_type.headers
    assert_error_response(http.send(no_type), 415, "application/json")
    for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        response = http.post("/v1/completions", content=body, headers={"content-type": content_type})
        assert response.status_code == 200, (content_type, response.text)
    assert http.post("/flush_cache").status_code == 200  # no body, no Content-Type: curl -X POST works


def test_cross_origin_requests(http):
    evil = {"origin": "http://evil.example"}
    assert_error_response(completion(http, **evil), 403, "Origin", "--allowed-origins")
    assert_error_response(http.post("/flush_cache", headers=evil), 403, "Origin")
    # A refused preflight is JSON too, and carries no permission.
    preflight = {"access-control-request-method": "POST", "access-control-request-headers": "content-type"}
    refused = http.options("/v1/completions", headers={**evil, **preflight})
    assert_error_response(refused, 400, "CORS")
    assert "access-control-allow-origin" not in refused.headers

    good = {"origin": GOOD_ORIGIN}
    allowed = http.options("/v1/completions", headers={**good, **preflight})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == GOOD_ORIGIN
    response = completion(http, **good)
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == GOOD_ORIGIN
    assert "access-control-allow-origin" not in http.get("/v1/models", headers=evil).headers


def test_header_size_limit_is_431(server, http):
    response = http.get("/v1/models", headers={"x-padding": "a" * (MAX_HEADER + 10)})
    assert_error_response(response, 431, "header", str(MAX_HEADER))
    # One endless header line (16 MB, more than any read, never ended) is cut off while it arrives: the parser
    # alone would buffer it until its end, and answer only then (here: never).
    head = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * (16 << 20)
    status, headers, body = raw_request(server.port, head)
    assert_openai_error(status, body, 431, "--max-header-bytes")
    many = (
        b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n"
        + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100) for i in range(400))
        + b"\r\n"
    )
    status, _, body = raw_request(server.port, many)
    assert_openai_error(status, body, 431)
    assert http.get("/v1/models", headers={"x-padding": "a" * 1000}).status_code == 200


PARSER_ERRORS = [
    ("bad method", b"FOO@ /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n", ["Invalid HTTP request"]),
    (
        "bad chunk size",
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nZZ\r\n{}\r\n0\r\n\r\n",
        ["Invalid HTTP request"],
    ),
    (
        "CL with TE",
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        ["Invalid HTTP"],
    ),
    ("bad version", b"GET /v1/models HTTP/9.9\r\nHost: localhost\r\n\r\n", ["Invalid HTTP request"]),
    ("space in header name", b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nBad Header: x\r\n\r\n", ["Invalid"]),
    ("bad content length", b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Length: abc\r\n\r\n", ["Invalid"]),
]


@pytest.mark.parametrize("name,data,words", PARSER_ERRORS, ids=[c[0] for c in PARSER_ERRORS])
def test_http_parser_errors_are_openai_json(server, http, name, data, words):
    status, headers, body = raw_request(server.port, data)
    assert headers["content-type"] == "application/json"
    assert_openai_error(status, body, 400, *words)
    assert completion(http).status_code == 200


def test_request_cannot_supply_a_chat_template(http):
    messages = [{"role": "user", "content": "hi"}]
    for kwargs, key in (
        ({"chat_template": "{% for i in range(99999) %}x{% endfor %}"}, "chat_template"),
        ({"enable_thinking": False, "tools": []}, "tools"),
        ({"tokenize": False}, "tokenize"),
    ):
        response = http.post(
            "/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "chat_template_kwargs": kwargs}
        )
        error = assert_error_response(response, 400, repr(key), "server's own")
        assert error["param"] == "chat_template_kwargs"
    response = http.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_health_answers_while_a_7mb_prompt_is_tokenized(server, http, route):
    # Every path: a completion's prompt is tokenized, a chat message (or a Responses input) is rendered by the chat
    # template and then tokenized; each must run off the event loop. (Another text for the Responses input, so that
    # nothing the chat case left behind makes it quicker.)
    phrase = "good day, how is it going? " if route == "/v1/responses" else "hello world, how are you? "
    prompt = phrase * (7_000_000 // len(phrase))
    body = {
        "/v1/completions": {"prompt": prompt, "max_tokens": 1},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1},
        "/v1/responses": {"input": prompt, "max_output_tokens": 1},
    }[route]
    outcome = {}

    def send_big():
        with httpx.Client(base_url=server.url, timeout=120) as client:
            outcome["response"] = client.post(route, json=body)
            outcome["done"] = time.monotonic()

    sender = threading.Thread(target=send_big)
    sender.start()
    time.sleep(0.5)  # the body is across and being tokenized
    latencies = []
    while sender.is_alive() and len(latencies) < 20:
        start = time.monotonic()
        assert http.get("/health", timeout=10).status_code == 200
        latencies.append((time.monotonic() - start, time.monotonic()))
        time.sleep(0.1)
    sender.join()
    measured = [latency for latency, at in latencies if at < outcome["done"]]
    assert len(measured) >= 3, "the prompt was tokenized before /health could be measured"
    assert max(measured) < 0.5, measured
    # Tokenized (~1.9M tokens), then refused against the context.
    assert_error_response(outcome["response"], 400, f"maximum context length is {CONTEXT} tokens")
    assert completion(http).status_code == 200


def test_http_process_imports_no_torch():
    code = (
        "import sys, radixserve.config, tokenizer_service.server, tokenizer_service.__main__\n"
        "radixserve.config.ServerArgs(device='cpu', port=1)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'scheduler_service', 'triton'))\n"
        "print(bad)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
