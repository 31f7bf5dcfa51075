"""The KV pool's limits at exactly their value and one past it, against one real server (`launch.py` subprocess, tiny
model, a 128-token KV pool, far below the 4096-token context): prompt + max_tokens against the pool's total, and the
pinned tokens (--max-pinned-tokens, by default half the pool) for one pin and for pins together, and a pin's TTL.
At the limit the request runs or the pin is made; one past it gets a 4xx in OpenAI's error format that names the
limit, and the server keeps serving."""

from __future__ import annotations

import math

import httpx
import pytest

from http_checks import assert_error_response
from radixserve.testing.tiny_models import tiny_model_dir
from server_fixture import launched_server

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

POOL = 128
MAX_PINNED = POOL // 2  # the default of --max-pinned-tokens
MAX_TTL_S = 365 * 24 * 3600.0
C, CH, G = "/v1/completions", "/v1/chat/completions", "/generate"


@pytest.fixture(scope="module")
def server():
    with launched_server(tiny_model_dir("llama"), "--max-total-tokens", str(POOL)) as server:
        yield server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
        client.post("/flush_cache?drop_pins=true")


def ids(first: int, n: int) -> list[int]:
    return [first + i for i in range(n)]


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def over_the_pool(response: httpx.Response, prompt: int, completion: int) -> None:
    error = assert_error_response(
        response,
        400,
        f"holds at most {POOL} tokens per sequence",
        f"requested {prompt + completion} tokens ({prompt} in the prompt, {completion} in the completion)",
    )
    assert error["param"] == "max_tokens"


def test_prompt_plus_max_tokens_at_the_kv_pool(http):
    reply = ok(http.post(C, json={"prompt": ids(100, POOL - 28), "max_tokens": 28, "ignore_eos": True}))
    assert reply["usage"]["completion_tokens"] == 28 and reply["usage"]["total_tokens"] == POOL
    reply = ok(
        http.post(
            G, json={"input_ids": ids(100, POOL - 1), "sampling_params": {"max_new_tokens": 1, "ignore_eos": True}}
        )
    )
    assert reply["meta_info"]["completion_tokens"] == 1
    for prompt, completion in ((POOL - 27, 28), (POOL - 28, 29), (POOL, 1)):
        over_the_pool(http.post(C, json={"prompt": ids(100, prompt), "max_tokens": completion}), prompt, completion)
    over_the_pool(http.post(G, json={"input_ids": ids(100, POOL), "sampling_params": {"max_new_tokens": 1}}), POOL, 1)
    messages = [{"role": "user", "content": "hi"}]
    count = ok(http.post("/v1/tokenize", json={"messages": messages}))["count"]
    ok(http.post(CH, json={"messages": messages, "max_tokens": POOL - count}))
    over_the_pool(http.post(CH, json={"messages": messages, "max_tokens": POOL - count + 1}), count, POOL - count + 1)


def test_two_sequences_of_the_whole_pool_take_turns(http):
    # Each of the two choices needs the whole pool: they cannot run side by side, and both must still finish.
    reply = ok(http.post(C, json={"prompt": ids(300, POOL - 28), "max_tokens": 28, "n": 2, "ignore_eos": True}))
    assert [c["finish_reason"] for c in reply["choices"]] == ["length", "length"]
    assert reply["usage"]["completion_tokens"] == 56


def pin(http: httpx.Client, tokens: list[int], **fields) -> httpx.Response:
    return http.post("/v1/cache/pin", json={"input_ids": tokens, **fields})


def over_the_pins(response: httpx.Response, *words: str) -> None:
    assert_error_response(response, 409, f"limit of {MAX_PINNED} pinned tokens (--max-pinned-tokens)", *words)


def test_one_pin_at_the_pinned_token_limit(http, server):
    made = ok(pin(http, ids(500, MAX_PINNED)))
    assert made["num_tokens"] == made["pinned_tokens"] == MAX_PINNED
    assert server.server_info()["kv_pinned"] == MAX_PINNED
    assert http.delete(f"/v1/cache/pin/{made['id']}").status_code == 200
    error = assert_error_response(
        pin(http, ids(600, MAX_PINNED + 1)),
        409,
        f"pinning these {MAX_PINNED + 1} tokens, more than this server's limit of {MAX_PINNED} pinned tokens",
    )
    assert "would make" not in error["message"]  # refused as it came, before its prefix was computed
    assert server.server_info()["kv_pinned"] == 0


def test_pins_together_at_the_pinned_token_limit(http, server):
    first = ok(pin(http, ids(700, MAX_PINNED - 4)))
    second = ok(pin(http, ids(800, 4)))  # another branch of the tree: 60 + 4 = 64 pinned
    assert second["pinned_tokens"] == MAX_PINNED
    over_the_pins(pin(http, ids(900, 1)), f"would make {MAX_PINNED + 1} tokens pinned")
    # Growing a pinned prefix by one token is one token more, too.
    over_the_pins(pin(http, ids(700, MAX_PINNED - 3)), f"would make {MAX_PINNED + 1} tokens pinned")
    assert server.server_info()["kv_pinned"] == MAX_PINNED
    for made in (first, second):
        assert http.delete(f"/v1/cache/pin/{made['id']}").status_code == 200


def test_pin_ttl_at_the_limit(http):
    made = ok(pin(http, ids(1000, 8), ttl_seconds=MAX_TTL_S))
    assert made["expires_at"] == pytest.approx(made["created_at"] + MAX_TTL_S)
    assert http.delete(f"/v1/cache/pin/{made['id']}").status_code == 200
    ok(pin(http, ids(1100, 8), ttl_seconds=math.nextafter(0.0, 1.0)))  # the shortest TTL: expired at once
    for ttl in (math.nextafter(MAX_TTL_S, math.inf), 0.0):
        error = assert_error_response(
            pin(http, ids(1200, 8), ttl_seconds=ttl), 400, f"ttl_seconds must be a number in (0, {MAX_TTL_S:.0f}]"
        )
        assert error["param"] == "ttl_seconds"


def test_pinned_tokens_leave_the_rest_of_the_pool(http, server):
    """With half the pool pinned, a request has the other half plus what it shares of the pinned prefix: exactly that
    runs, one token more is a 400 naming the pins (it once ran, then failed midway with a 500)."""
    made = ok(pin(http, ids(1300, MAX_PINNED)))
    room = POOL - MAX_PINNED
    reply = ok(http.post(C, json={"prompt": ids(2000, room - 4), "max_tokens": 4, "ignore_eos": True}))
    assert reply["usage"]["completion_tokens"] == 4
    error = assert_error_response(
        http.post(C, json={"prompt": ids(2000, room - 4), "max_tokens": 5}),
        400,
        f"of which {MAX_PINNED} are pinned",
        f"needs {room + 1} more",
        f"above the {room} left",
    )
    assert "--pin-prompts" in error["message"]
    # Over the pinned prefix: only its own tokens count against what is left.
    shared = ids(1300, MAX_PINNED) + ids(3000, 10)
    reply = ok(http.post(C, json={"prompt": shared, "max_tokens": room - 10, "ignore_eos": True}))
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == MAX_PINNED
    # Over half of it: the other half counts too.
    half = ids(1300, MAX_PINNED // 2) + ids(4000, 40)
    fits = room + MAX_PINNED // 2 - len(half)  # prompt + completion - the 32 shared tokens == room
    ok(http.post(C, json={"prompt": half, "max_tokens": fits, "ignore_eos": True}))
    assert_error_response(http.post(C, json={"prompt": half, "max_tokens": fits + 1}), 400, f"needs {room + 1} more")
    assert http.delete(f"/v1/cache/pin/{made['id']}").status_code == 200
    assert server.server_info()["kv_invariant_ok"]
