"""Pinned prefixes through the real server: POST /v1/cache/pin, GET /v1/cache/pins,
DELETE /v1/cache/pin/{id}, --pin-prompts, --max-pinned-tokens, TTLs, and pins across /flush_cache. One `launch.py`
with the tiny Llama on the CPU and a KV pool small enough that a flood of other prompts evicts everything unpinned;
`cached_tokens` in the usage of later requests shows what stayed cached. After every test the autouse idle check
(tests/conftest.py) verifies the KV-slot invariant with the pins in place."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from http_checks import assert_error_response
from pin_checks import cached_tokens, pin, pins, prompt_ids
from radixserve.client import Client, RadixServeError
from radixserve.testing.tiny_models import tiny_model_dir
from server_fixture import launched_server

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

POOL_TOKENS = 1024
MAX_PINNED = 300
SYSTEM = [{"role": "system", "content": "You are the pinned assistant of the radixserve tests."}]
FLOOD_PROMPTS, FLOOD_TOKENS = 12, 150  # 1800 tokens through a 1024-token pool


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pins = tmp_path_factory.mktemp("pins") / "pins.jsonl"
    pins.write_text(json.dumps({"messages": SYSTEM}) + "\n\n")
    with launched_server(
        tiny_model_dir("llama"),
        "--max-total-tokens",
        str(POOL_TOKENS),
        "--max-pinned-tokens",
        str(MAX_PINNED),
        "--pin-prompts",
        str(pins),
    ) as server:
        yield server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def flood(http: httpx.Client, first: int) -> None:
    """Prompts that together need more KV than the pool has: every unpinned prefix is evicted."""
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: cached_tokens(http, prompt_ids(first + i, FLOOD_TOKENS)), range(FLOOD_PROMPTS)))


def test_startup_pin_is_listed_and_hit_by_chat(http):
    startup = [p for p in pins(http).values() if p["cache_salt"] is None and p["expires_at"] is None]
    assert len(startup) == 1 and startup[0]["num_tokens"] > 5, startup
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": [*SYSTEM, {"role": "user", "content": "hello"}], "max_tokens": 1, "temperature": 0},
    )
    assert chat.status_code == 200, chat.text
    # The system prompt rendered without a generation prompt is a token prefix of the chat prompt.
    assert chat.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= startup[0]["num_tokens"]


def test_pinned_prompt_survives_a_flood_and_ttl_expiry_unpins(http):
    kept, expiring = prompt_ids(1, 120), prompt_ids(2, 60)
    kept_pin = pin(http, input_ids=kept)
    expiring_pin = pin(http, input_ids=expiring, ttl_seconds=1)
    assert kept_pin["num_tokens"] == 120 and kept_pin["expires_at"] is None
    assert expiring_pin["expires_at"] == pytest.approx(expiring_pin["created_at"] + 1, abs=1e-3)
    assert {kept_pin["id"], expiring_pin["id"]} <= set(pins(http))
    time.sleep(1.5)
    listed = pins(http)
    assert kept_pin["id"] in listed and expiring_pin["id"] not in listed  # the TTL passed: unpinned

    flood(http, first=10)
    assert cached_tokens(http, kept + [5, 6]) == len(kept)  # pinned: whole
    assert cached_tokens(http, expiring + [5, 6]) == 0  # its pin expired, so the flood evicted it
    assert cached_tokens(http, prompt_ids(10, FLOOD_TOKENS)) == 0  # the flood's first prompt went too
    assert http.delete(f"/v1/cache/pin/{kept_pin['id']}").status_code == 200


def test_pins_survive_flush_unless_asked(http):
    prompt = prompt_ids(30, 40)
    pinned = pin(http, prompt=prompt)
    assert http.post("/flush_cache").json()["success"] is True
    assert pinned["id"] in pins(http)
    assert cached_tokens(http, prompt + [7]) == len(prompt)
    unpinned = prompt_ids(31, 40)
    cached_tokens(http, unpinned)
    assert http.post("/flush_cache").status_code == 200
    assert cached_tokens(http, unpinned + [7]) == 0  # flushed: only pinned prefixes stay

    assert_error_response(http.post("/flush_cache?drop_pins=maybe"), 400, "drop_pins")
    assert http.post("/flush_cache?drop_pins=true").json()["success"] is True
    assert pins(http) == {}  # the start-up pin went too
    assert cached_tokens(http, prompt + [7]) == 0


def test_max_pinned_tokens_gives_409(http, server):
    too_long = prompt_ids(40, MAX_PINNED + 1)
    error = assert_error_response(http.post("/v1/cache/pin", json={"input_ids": too_long}), 409, "--max-pinned-tokens")
    assert error["type"] and error["param"] is None
    first = pin(http, input_ids=prompt_ids(41, 200))
    # 200 + 200 tokens over 300: computed, found over the bound, undone.
    assert_error_response(http.post("/v1/cache/pin", json={"input_ids": prompt_ids(42, 200)}), 409, "300")
    assert set(pins(http)) >= {first["id"]} and server.server_info()["kv_invariant_ok"]
    # A pin that shares its tokens with another counts them once.
    shared = pin(http, input_ids=prompt_ids(41, 150))
    assert shared["pinned_tokens"] == first["pinned_tokens"]
    for pin_id in (first["id"], shared["id"]):
        assert http.delete(f"/v1/cache/pin/{pin_id}").status_code == 200


def test_salted_pin_serves_only_its_salt(http):
    prompt = prompt_ids(50, 64)
    salted = pin(http, input_ids=prompt, cache_salt="tenant-a")
    assert salted["cache_salt"] == "tenant-a"
    assert cached_tokens(http, prompt + [9], cache_salt="tenant-b") == 0
    assert cached_tokens(http, prompt + [9]) == 0
    assert cached_tokens(http, prompt + [9], cache_salt="tenant-a") == len(prompt)
    assert http.delete(f"/v1/cache/pin/{salted['id']}").status_code == 200


def test_unpin_and_bad_bodies(http):
    pinned = pin(http, input_ids=prompt_ids(60, 20))
    assert http.delete(f"/v1/cache/pin/{pinned['id']}").json()["deleted"] is True
    assert_error_response(http.delete(f"/v1/cache/pin/{pinned['id']}"), 404, pinned["id"])
    for body, words in (
        ({"prompt": "x", "input_ids": [1, 2]}, "exactly one"),
        ({}, "exactly one"),
        ({"input_ids": [1, 2], "ttl_seconds": -1}, "ttl_seconds"),
        ({"input_ids": [1, 2], "ttl_seconds": "soon"}, "ttl_seconds"),
        ({"input_ids": [[1, 2], [3]]}, "one list"),
        ({"prompt": ["a", "b"]}, "one string"),
        ({"prompt": 5}, "one string"),
        ({"input_ids": [10**9]}, "vocabulary"),
        ({"messages": []}, "messages"),
        ({"prompt": "x", "cache_salt": ""}, "cache_salt"),
    ):
        assert_error_response(http.post("/v1/cache/pin", json=body), 400, words)


def test_client_methods(server):
    with Client(server.url, timeout=60) as client:
        made = client.pin_prefix(input_ids=prompt_ids(70, 30), ttl_seconds=600, cache_salt="c")
        assert made["num_tokens"] == 30 and made["cache_salt"] == "c" and made["expires_at"] is not None
        assert made["id"] in {p["id"] for p in client.list_pins()}
        assert client.unpin(made["id"])["deleted"] is True
        text = client.pin_prefix(prompt="Once upon a time, in a radix tree far away")
        assert text["num_tokens"] > 5 and text["expires_at"] is None
        assert client.unpin(text["id"])["deleted"] is True
        with pytest.raises(RadixServeError) as refused:
            client.pin_prefix(input_ids=prompt_ids(71, MAX_PINNED + 1))
        assert refused.value.status_code == 409
        with pytest.raises(RadixServeError) as unknown:
            client.unpin(made["id"])
        assert unknown.value.status_code == 404
        with pytest.raises(ValueError):
            client.pin_prefix(prompt="a", input_ids=[1])
        assert client.flush_cache(drop_pins=True)["success"] is True
