"""A table of hostile and malformed requests against one real server (`launch.py` subprocess, tiny model, default
flags): each gets its status and OpenAI error JSON (or, for odd but valid input, a normal answer), then a normal
request succeeds and every server process is still alive. Raw malformed HTTP goes over a plain socket."""

from __future__ import annotations

import json

import httpx
import pytest

from http_checks import assert_error_response, assert_openai_error, assert_processes_alive, process_tree, raw_request

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

CONTEXT = 4096
VOCAB = 49152
MB = 1 << 20
CHAT = [{"role": "user", "content": "Hi"}]
C, CH, G, R = "/v1/completions", "/v1/chat/completions", "/generate", "/v1/responses"


@pytest.fixture(scope="module")
def server(tiny_llama_server):
    # Shared with other modules (tests/conftest.py): its processes as this module finds them stay alive throughout.
    server = tiny_llama_server
    server.pids = process_tree(server.process.pid)
    assert len(server.pids) >= 4, server.pids  # launch.py, tokenizer, scheduler, worker
    return server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def assert_server_fine(server, http: httpx.Client) -> None:
    response = http.post(C, json={"prompt": "still alive?", "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert_processes_alive(server.process.pid, server.pids)


def cmp(**fields):
    return {"prompt": "x", "max_tokens": 1, **fields}


def chat(**fields):
    return {"messages": CHAT, "max_tokens": 1, **fields}


def resp(**fields):
    return {"input": "Hi", "max_output_tokens": 1, **fields}


def gen(**sampling):
    return {"text": "x", "sampling_params": {"max_new_tokens": 1, **sampling}}


def nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}"


# (id, path, body: dict/list -> JSON, bytes -> as is, status, words in the message)
CASES = [
    # malformed JSON and bodies that are not objects
    ("truncated", C, b'{"prompt": "x",', 400, ["not valid JSON"]),
    ("empty body", C, b"", 400, ["not valid JSON"]),
    ("empty body chat", CH, b"", 400, ["not valid JSON"]),
    ("empty body generate", G, b"", 400, ["not valid JSON"]),
    ("null body", C, b"null", 400, ["JSON object"]),
    ("list body", CH, b"[]", 400, ["JSON object"]),
    ("string body", G, b'"hello"', 400, ["JSON object"]),
    ("number body", C, b"42", 400, ["JSON object"]),
    ("bool body", CH, b"true", 400, ["JSON object"]),
    ("trailing garbage", C, b'{"prompt": "x"} xyz', 400, ["not valid JSON"]),
    ("single quotes", C, b"{'prompt': 'x'}", 400, ["not valid JSON"]),
    ("comment", C, b'{"prompt": "x" /* hi */}', 400, ["not valid JSON"]),
    ("invalid utf-8", C, b'{"prompt": "\xff\xfe\xfd", "max_tokens": 1}', 400, ["not valid JSON"]),
    ("invalid utf-8 chat", CH, b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', 400, ["not valid JSON"]),
    ("raw NUL byte in string", C, b'{"prompt": "a\x00b", "max_tokens": 1}', 400, ["not valid JSON"]),
    ("NUL byte outside strings", G, b'{"text": "a"}\x00', 400, ["not valid JSON"]),
    ("escaped NUL is text", C, cmp(prompt="a\u0000b"), 200, []),
    ("lone surrogate", C, b'{"prompt": "\\ud800", "max_tokens": 1}', 400, []),
    ("utf-16 body", C, json.dumps(cmp()).encode("utf-16"), 400, ["not valid JSON"]),
    ("BOM", C, b"\xef\xbb\xbf" + json.dumps(cmp()).encode(), 400, ["not valid JSON"]),
    ("10000-level nesting", C, nested(10_000), 400, []),
    ("10000-level nesting chat", CH, b'{"messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", 400, []),
    ("deep object", G, b'{"text": "x", "sampling_params": ' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}", 400, []),
    ("NaN literal", C, b'{"prompt": "x", "temperature": NaN}', 400, ["temperature"]),
    ("Infinity literal", C, b'{"prompt": "x", "top_p": Infinity}', 400, ["top_p"]),
    ("1e999", C, b'{"prompt": "x", "temperature": 1e999}', 400, ["temperature"]),
    ("duplicate keys", C, b'{"prompt": "x", "prompt": "y", "max_tokens": 1}', 200, []),
    # 5 MB bodies
    ("5 MB prompt", C, cmp(prompt="x" * 5 * MB), 400, ["maximum context length", "characters"]),
    ("5 MB chat message", CH, chat(messages=[{"role": "user", "content": "y" * 5 * MB}]), 400, ["characters"]),
    ("5 MB generate text", G, {"text": ["z " * (5 * MB // 2)]}, 400, ["characters"]),
    ("5 MB of token ids", C, cmp(prompt=[7] * (5 * MB // 3)), 400, ["maximum context length"]),
    ("5 MB of spaces", C, b" " * 5 * MB, 400, ["not valid JSON"]),
    ("5 MB unknown field", C, cmp(junk="j" * 5 * MB), 200, []),
    ("5 MB stop string", C, cmp(stop="s" * 5 * MB), 200, []),
    ("many messages", CH, chat(messages=[{"role": "user", "content": "a"}] * 100_000), 400, ["context length"]),
    ("9 MB body", C, cmp(prompt="x" * 9 * MB), 413, ["too large"]),
    # wrong types
    ("prompt number", C, cmp(prompt=5), 400, ["prompt"]),
    ("prompt object", C, cmp(prompt={"a": 1}), 400, ["prompt"]),
    ("prompt null", C, cmp(prompt=None), 400, ["prompt"]),
    ("prompt bools", C, cmp(prompt=[True, False]), 400, ["prompt"]),
    ("prompt floats", C, cmp(prompt=[1.5, 2.0]), 400, ["prompt"]),
    ("prompt mixed", C, cmp(prompt=[[1], "x"]), 400, ["prompt"]),
    ("prompt empty list in list", C, cmp(prompt=[[]]), 400, ["empty"]),
    ("prompt empty string in list", C, cmp(prompt=["a", ""]), 400, ["empty"]),
    ("missing prompt", C, {"max_tokens": 1}, 400, ["prompt"]),
    ("stream string", C, cmp(stream="yes"), 400, ["stream"]),
    ("stream number", CH, chat(stream=1), 400, ["stream"]),
    ("max_tokens string", C, cmp(max_tokens="5"), 400, ["max_tokens"]),
    ("max_tokens float", C, cmp(max_tokens=1.5), 400, ["max_tokens"]),
    ("max_tokens bool", CH, chat(max_tokens=True), 400, ["max_tokens"]),
    ("temperature string", C, cmp(temperature="hot"), 400, ["temperature"]),
    ("n string", C, cmp(n="3"), 400, ["n"]),
    ("n float", C, cmp(n=1.5), 400, ["n"]),
    ("seed string", C, cmp(seed="x"), 400, ["seed"]),
    ("stop number", C, cmp(stop=123), 400, ["stop"]),
    ("stop ints", C, cmp(stop=[1, 2]), 400, ["stop"]),
    ("stop_token_ids string", C, cmp(stop_token_ids="x"), 400, ["stop_token_ids"]),
    ("stop_token_ids floats", C, cmp(stop_token_ids=[1.5]), 400, ["stop_token_ids"]),
    ("logprobs string", C, cmp(logprobs="5"), 400, ["logprobs"]),
    ("chat logprobs int", CH, chat(logprobs=5), 400, ["logprobs"]),
    ("model number", C, cmp(model=5), 400, ["model"]),
    ("user object", C, cmp(user={"id": 1}), 400, ["user"]),
    ("stream_options string", C, cmp(stream=True, stream_options="yes"), 400, ["stream_options"]),
    ("include_usage string", C, cmp(stream=True, stream_options={"include_usage": "yes"}), 400, ["include_usage"]),
    ("ignore_eos string", C, cmp(ignore_eos="true"), 400, ["ignore_eos"]),
    # messages
    ("messages string", CH, chat(messages="hi"), 400, ["messages"]),
    ("messages empty", CH, chat(messages=[]), 400, ["messages must not be empty"]),
    ("message empty object", CH, chat(messages=[{}]), 400, ["messages[0]"]),
    ("message without content", CH, chat(messages=[{"role": "user"}]), 400, ["content"]),
    ("message content number", CH, chat(messages=[{"role": "user", "content": 123}]), 400, ["content"]),
    ("message content null", CH, chat(messages=[{"role": "user", "content": None}]), 400, ["content"]),
    ("message role unknown", CH, chat(messages=[{"role": "robot", "content": "x"}]), 400, ["role"]),
    (
        "image content part",
        CH,
        chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        400,
        ["only 'text' content parts"],
    ),
    ("content part without text", CH, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400, ["text"]),
    ("content part string", CH, chat(messages=[{"role": "user", "content": ["x"]}]), 400, ["content[0]"]),
    ("name number", CH, chat(messages=[{"role": "user", "content": "x", "name": 5}]), 400, ["name"]),
    ("content nested lists", CH, chat(messages=[{"role": "user", "content": [[[[]]]]}]), 400, ["content"]),
    (
        "template kwarg chat_template",
        CH,
        chat(chat_template_kwargs={"chat_template": "{{ 'x' * 50000000 }}"}),
        400,
        ["'chat_template'"],
    ),
    ("template kwarg not bool", CH, chat(chat_template_kwargs={"enable_thinking": "no"}), 400, ["boolean"]),
    ("template kwargs list", CH, chat(chat_template_kwargs=["enable_thinking"]), 400, ["chat_template_kwargs"]),
    ("template kwarg tools", CH, chat(chat_template_kwargs={"tools": [{"x": 1}]}), 400, ["'tools'"]),
    # out-of-range values
    ("n zero", C, cmp(n=0), 400, ["n must be between 1 and 16"]),
    ("n negative", C, cmp(n=-1), 400, ["n must be between"]),
    ("n huge", C, cmp(n=10**9), 400, ["n must be between"]),
    ("n bigger than int64", CH, chat(n=10**30), 400, ["n"]),
    ("max_tokens zero", C, cmp(max_tokens=0), 400, ["max_tokens must be at least 1"]),
    ("max_tokens negative", CH, chat(max_tokens=-5), 400, ["max_tokens"]),
    ("max_tokens huge", C, cmp(max_tokens=10**12), 400, ["maximum context length"]),
    ("max_tokens beyond int64", C, cmp(max_tokens=10**30), 400, ["maximum context length"]),
    ("max_completion_tokens huge", CH, chat(max_completion_tokens=10**9), 400, ["maximum context length"]),
    ("max_new_tokens huge", G, gen(max_new_tokens=10**9), 400, ["maximum context length"]),
    ("temperature negative", C, cmp(temperature=-0.1), 400, [">= 0"]),
    ("top_p zero", C, cmp(top_p=0), 400, ["top_p"]),
    ("top_p above 1", CH, chat(top_p=1.5), 400, ["top_p"]),
    ("top_k -2", C, cmp(top_k=-2), 400, ["top_k"]),
    ("min_p 2", C, cmp(min_p=2), 400, ["min_p"]),
    ("presence_penalty 3", C, cmp(presence_penalty=3), 400, ["presence_penalty"]),
    ("frequency_penalty -3", CH, chat(frequency_penalty=-3), 400, ["frequency_penalty"]),
    ("repetition_penalty 0", C, cmp(repetition_penalty=0), 400, ["repetition_penalty"]),
    ("seed 2**64", C, cmp(seed=2**64), 400, ["seed"]),
    ("logprobs 21", C, cmp(logprobs=21), 400, ["between 0 and 20"]),
    ("logprobs -1", C, cmp(logprobs=-1), 400, ["logprobs"]),
    ("top_logprobs without logprobs", CH, chat(top_logprobs=2), 400, ["requires logprobs"]),
    ("top_logprobs 100", CH, chat(logprobs=True, top_logprobs=100), 400, ["top_logprobs"]),
    ("min_tokens over max", C, cmp(min_tokens=5, max_tokens=2), 400, ["min_tokens"]),
    ("min_tokens negative", CH, chat(min_tokens=-1), 400, ["min_tokens"]),
    ("65 stop strings", C, cmp(stop=[f"s{i}" for i in range(65)]), 400, ["at most 64"]),
    ("100k stop strings", CH, chat(stop=["s"] * 100_000), 400, ["at most 64"]),
    ("100k stop token ids", C, cmp(stop_token_ids=list(range(100_000))), 400, ["stop_token_ids"]),
    ("echo not a boolean", C, cmp(echo="yes"), 400, ["echo"]),
    ("stream_options without stream", CH, chat(stream_options={"include_usage": True}), 400, ["stream_options"]),
    ("unknown model", C, cmp(model="gpt-4"), 404, ["does not exist"]),
    ("unknown model chat", CH, chat(model="nope"), 404, ["does not exist"]),
    ("prompt over context (ids)", C, cmp(prompt=[100] * CONTEXT), 400, ["maximum context length"]),
    (
        "chat over context",
        CH,
        {"messages": [{"role": "user", "content": "word " * CONTEXT}]},
        400,
        ["maximum context length"],
    ),
    # OOV token ids
    ("prompt id = vocab", C, cmp(prompt=[1, VOCAB]), 400, ["outside the vocabulary"]),
    ("prompt id huge", C, cmp(prompt=[10**30]), 400, ["outside the vocabulary"]),
    ("prompt id negative", C, cmp(prompt=[1, -3]), 400, ["non-negative"]),
    ("batch with one bad id", C, cmp(prompt=[[1], [2, VOCAB + 1]]), 400, ["outside the vocabulary"]),
    ("input_ids oov", G, {"input_ids": [VOCAB]}, 400, ["outside the vocabulary"]),
    ("input_ids batch oov", G, {"input_ids": [[1], [2**63]]}, 400, ["outside the vocabulary"]),
    ("stop_token_ids oov", C, cmp(stop_token_ids=[VOCAB]), 400, ["vocabulary"]),
    ("stop_token_ids negative", G, gen(stop_token_ids=[-1]), 400, ["stop_token_ids"]),
    # /generate
    ("generate neither", G, {"sampling_params": {"max_new_tokens": 1}}, 400, ["exactly one of text and input_ids"]),
    ("generate both", G, {"text": "x", "input_ids": [1]}, 400, ["exactly one"]),
    ("generate unknown sampling key", G, gen(temprature=0.5), 400, ["temprature"]),
    ("generate sampling_params string", G, {"text": "x", "sampling_params": "greedy"}, 400, ["sampling_params"]),
    ("generate text empty list", G, {"text": []}, 400, ["text"]),
    ("generate text empty string", G, {"text": [""]}, 400, ["text"]),
    ("generate input_ids empty", G, {"input_ids": [[]]}, 400, ["input_ids"]),
    ("generate text ids", G, {"text": [1, 2]}, 400, ["text"]),
    ("generate return_logprob string", G, {"text": "x", "return_logprob": "yes"}, 400, ["return_logprob"]),
    ("generate top_logprobs_num 21", G, {"text": "x", "top_logprobs_num": 21}, 400, ["top_logprobs_num"]),
    ("generate max_new_tokens 0", G, gen(max_new_tokens=0), 400, ["max_new_tokens"]),
    (
        "generate 1000 prompts x n 16",
        G,
        {"text": ["x"] * 1000, "sampling_params": {"max_new_tokens": 1, "n": 16}},
        (400, 503),
        [],
    ),  # 16,000 sequences: more than the queue can ever hold
    # /v1/responses
    ("responses empty body", R, b"", 400, ["not valid JSON"]),
    ("responses without input", R, {"max_output_tokens": 1}, 400, ["'input' is a required field"]),
    ("responses input number", R, resp(input=5), 400, ["input"]),
    ("responses input empty", R, resp(input=""), 400, ["input must not be empty"]),
    ("responses no items", R, resp(input=[]), 400, ["at least one"]),
    ("responses only reasoning items", R, resp(input=[{"type": "reasoning", "summary": []}]), 400, ["at least one"]),
    ("responses item string", R, resp(input=["hi"]), 400, ["input[0] must be an object"]),
    ("responses role unknown", R, resp(input=[{"role": "robot", "content": "x"}]), 400, ["input[0].role"]),
    ("responses content number", R, resp(input=[{"role": "user", "content": 5}]), 400, ["input[0].content"]),
    (
        "responses part without text",
        R,
        resp(input=[{"role": "user", "content": [{"type": "input_text"}]}]),
        400,
        ["input[0].content[0].text"],
    ),
    (
        "responses call without name",
        R,
        resp(input=[{"type": "function_call", "call_id": "c", "arguments": "{}"}]),
        400,
        ["input[0].name"],
    ),
    (
        "responses call arguments object",
        R,
        resp(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]),
        400,
        ["input[0].arguments"],
    ),
    (
        "responses output without call_id",
        R,
        resp(input=[{"type": "function_call_output", "output": "x"}]),
        400,
        ["input[0].call_id"],
    ),
    ("responses 5 MB input", R, resp(input="y" * 5 * MB), 400, ["characters"]),
    ("responses many items", R, resp(input=[{"role": "user", "content": "a"}] * 100_000), 400, ["context length"]),
    ("responses 10000-level nesting", R, b'{"input": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", 400, []),
    ("responses tools string", R, resp(tools="x"), 400, ["tools"]),
    ("responses tool without name", R, resp(tools=[{"type": "function"}]), 400, ["tools[0].name"]),
    ("responses tool_choice unknown", R, resp(tool_choice="sometimes"), 400, ["tool_choice"]),
    (
        "responses tool_choice not in tools",
        R,
        resp(tools=[{"type": "function", "name": "f"}], tool_choice={"type": "function", "name": "g"}),
        400,
        ["'g'"],
    ),
    ("responses text.format type", R, resp(text={"format": {"type": "xml"}}), 400, ["text.format.type"]),
    ("responses effort unknown", R, resp(reasoning={"effort": "maximal"}), 400, ["reasoning.effort"]),
    ("responses temperature string", R, resp(temperature="hot"), 400, ["temperature"]),
    ("responses top_p zero", R, resp(top_p=0), 400, ["top_p"]),
    ("responses max_output_tokens huge", R, resp(max_output_tokens=10**9), 400, ["maximum context length"]),
    ("responses stream string", R, resp(stream="yes"), 400, ["stream"]),
    ("responses store number", R, resp(store=1), 400, ["store"]),
    ("responses previous id 1000 chars", R, resp(previous_response_id="r" * 1000), 400, ["previous_response_id"]),
    ("responses metadata 17 pairs", R, resp(metadata={f"k{i}": "v" for i in range(17)}), 400, ["metadata"]),
    ("responses cache_salt empty", R, resp(cache_salt=""), 400, ["cache_salt"]),
    ("responses unknown model", R, resp(model="nope"), 404, ["does not exist"]),
    ("responses unknown previous id", R, resp(previous_response_id="resp_gone"), 404, ["resp_gone"]),
    ("responses unknown field", R, resp(junk={"a": 1}), 200, []),
    # odd but valid
    ("emoji and RTL", C, cmp(prompt="🙂 שלום مرحبا \u202e"), 200, []),
    ("combining marks", CH, chat(messages=[{"role": "user", "content": "e\u0301" * 1000}]), 200, []),
    ("special token text", C, cmp(prompt="<|im_end|><|im_start|>system"), 200, []),
]


@pytest.mark.parametrize("name,path,body,status,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_then_normal_request(server, http, name, path, body, status, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = http.post(path, content=content, headers={"content-type": "application/json"})
    if status == 200:
        assert response.status_code == 200, response.text[:500]
    elif isinstance(status, tuple):
        assert response.status_code in status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == response.status_code
    else:
        assert_error_response(response, status, *words)
    assert_server_fine(server, http)


METHOD_CASES = [
    ("GET", C, 405),
    ("DELETE", G, 405),
    ("PUT", CH, 405),
    ("GET", "/nothing-here", 404),
    ("POST", "/v1/models", 405),
    ("GET", "/v1/models/other-model", 404),
    ("PATCH", "/health", 405),
    ("PUT", R, 405),
    ("GET", f"{R}/resp_unknown", 404),
    ("DELETE", f"{R}/resp_unknown", 404),
    ("POST", f"{R}/resp_unknown", 405),
]


@pytest.mark.parametrize("method,path,status", METHOD_CASES, ids=[f"{m} {p}" for m, p, _ in METHOD_CASES])
def test_wrong_route_or_method(server, http, method, path, status):
    assert_error_response(http.request(method, path, headers={"content-type": "application/json"}), status)
    assert_server_fine(server, http)


RAW_CASES = [
    ("bad method", b"G@T /health HTTP/1.1\r\nHost: localhost\r\n\r\n", 400),
    ("garbage request line", b"HELLO THERE\r\n\r\n", 400),
    ("binary garbage", bytes(range(256)) * 4, 400),
    (
        "bad chunk size",
        b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nXYZ\r\n{}\r\n0\r\n\r\n",
        400,
    ),
    (
        "CL and TE",
        b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        400,
    ),
    (
        "two content lengths",
        b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        400,
    ),
    ("negative content length", b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Length: -1\r\n\r\n", 400),
    ("header without colon", b"GET /health HTTP/1.1\r\nHost: localhost\r\nNoColonHere\r\n\r\n", 400),
    ("NUL in header value", b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-A: a\x00b\r\n\r\n", 400),
    ("bad HTTP version", b"GET /health HTTP/7.0\r\nHost: localhost\r\n\r\n", 400),
    ("LF only line ends", b"GET /health HTTP/1.1\nHost: localhost\n\n", 400),
    ("HTTP/1.0 without Host", b"GET /health HTTP/1.0\r\n\r\n", 200),
    ("100 KB header", b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n", 431),
    ("100 KB URL", b"GET /health?" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: localhost\r\n\r\n", 431),
    ("non-ASCII path", b"GET /v1/mod\xffels HTTP/1.1\r\nHost: localhost\r\n\r\n", 400),
    (
        "chunked body not JSON",
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        400,
    ),
]


@pytest.mark.parametrize("name,data,status", RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_raw_malformed_http(server, http, name, data, status):
    code, headers, body = raw_request(server.port, data)
    if status == 200:
        assert code == 200, body
    else:
        assert headers.get("content-type") == "application/json", (code, headers, body[:200])
        assert_openai_error(code, body, status)
    assert_server_fine(server, http)


def test_cors_off_by_default(http):
    response = http.get("/v1/models", headers={"origin": "http://localhost:5173"})
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
    preflight = http.options(C, headers={"origin": "http://localhost:5173", "access-control-request-method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers
    assert_error_response(preflight, 405)
