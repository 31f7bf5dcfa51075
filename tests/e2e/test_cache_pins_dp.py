"""Pinned prefixes with data parallelism: `launch.py --dp-size 2` with the tiny Llama on the CPU, each
replica with a KV pool small enough that a flood evicts everything unpinned. A pin is kept on every replica under
one id (scheduler_service/dp_pins.py); round_robin routing sends consecutive requests to alternate replicas, and
/server_info's dp<i>_ numbers show what each replica holds and served from its cache. After every test the autouse
idle check (tests/conftest.py) verifies the KV-slot invariant of the server; the tests check each replica's too.
The last test drives the controller's bookkeeping directly through the cases the identical replicas of a test server
never produce (one replica refuses while the other pinned, a TTL that ran out on one replica only)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from http_checks import assert_error_response
from pin_checks import cached_tokens, pin, pins, prompt_ids
from radixserve.protocol import ListPinsRequest, PinEntry, PinPrefixRequest, PinsReply, UnpinPrefixRequest, pack_i32
from radixserve.testing.tiny_models import tiny_model_dir
from scheduler_service.dp_pins import UNDO_PREFIX, ReplicatedPins
from server_fixture import launched_server

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

DP = 2
POOL_TOKENS = 640  # per replica
MAX_PINNED = 300
SYSTEM = [{"role": "system", "content": "You are the pinned assistant of the data-parallel tests."}]
FLOOD_PROMPTS, FLOOD_TOKENS = 16, 100  # 800 tokens through each replica's 640-token pool, of which ~500 unpinned


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pins = tmp_path_factory.mktemp("pins") / "pins.jsonl"
    pins.write_text(json.dumps({"messages": SYSTEM}) + "\n")
    with launched_server(
        tiny_model_dir("llama"),
        "--dp-size",
        str(DP),
        "--load-balance-method",
        "round_robin",
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


def per_replica(server, key: str) -> list:
    info = server.server_info()
    return [info[f"dp{i}_{key}"] for i in range(DP)]


def assert_each_replica_idle_and_sound(server) -> None:
    server.assert_idle_kv_invariant()
    info = server.server_info()
    for i in range(DP):
        r = {
            key: info[f"dp{i}_{key}"]
            for key in (
                "kv_invariant_ok",
                "kv_owned",
                "kv_protected",
                "kv_pinned",
                "kv_free",
                "kv_evictable",
                "kv_total",
            )
        }
        assert r["kv_invariant_ok"] and r["kv_owned"] == 0 and r["kv_protected"] == r["kv_pinned"], (i, r)
        assert r["kv_free"] + r["kv_evictable"] + r["kv_pinned"] == r["kv_total"] == POOL_TOKENS, (i, r)


def test_startup_pin_is_on_every_replica_and_listed_once(http, server):
    listed = list(pins(http).values())
    assert len(listed) == 1 and listed[0]["replicas"] == [0, 1] and listed[0]["num_tokens"] > 5, listed
    assert per_replica(server, "num_pins") == [1, 1] and server.server_info()["num_pins"] == 1
    served = per_replica(server, "cached_prompt_tokens")
    for _ in range(DP):  # round_robin: one request on each replica
        chat = http.post(
            "/v1/chat/completions",
            json={"messages": [*SYSTEM, {"role": "user", "content": "hello"}], "max_tokens": 1, "temperature": 0},
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= listed[0]["num_tokens"]
    after = per_replica(server, "cached_prompt_tokens")
    assert all(a - s >= listed[0]["num_tokens"] for a, s in zip(after, served)), (served, after)

    stats = http.get("/v1/cache/stats").json()
    assert stats["num_pins"] == 1 and stats["dp0_num_pins"] == stats["dp1_num_pins"] == 1
    assert stats["dp0_kv_pinned"] == stats["dp1_kv_pinned"] == listed[0]["num_tokens"]
    assert sum(p["pinned"] for p in stats["largest_prefixes"]) == 1  # the same prefix on both replicas: one row
    assert_each_replica_idle_and_sound(server)


def test_pin_survives_a_flood_on_every_replica_and_ttl_expiry_unpins_everywhere(http, server):
    kept, expiring = prompt_ids(1, 120), prompt_ids(2, 60)
    kept_pin = pin(http, input_ids=kept)
    expiring_pin = pin(http, input_ids=expiring, ttl_seconds=1)
    assert kept_pin["num_tokens"] == 120 and kept_pin["replicas"] == [0, 1] and kept_pin["expires_at"] is None
    assert per_replica(server, "num_pins") == [3, 3]
    time.sleep(1.5)
    listed = pins(http)
    assert kept_pin["id"] in listed and expiring_pin["id"] not in listed
    assert per_replica(server, "num_pins") == [2, 2]  # the TTL ran out on each replica

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: cached_tokens(http, prompt_ids(10 + i, FLOOD_TOKENS)), range(FLOOD_PROMPTS)))
    served = per_replica(server, "cached_prompt_tokens")
    for k in range(2 * DP):  # round_robin: twice on each replica (each time another end, or the last one hits)
        assert cached_tokens(http, kept + [5 + k, 6]) == len(kept)
    after = per_replica(server, "cached_prompt_tokens")
    assert all(a - s == 2 * len(kept) for a, s in zip(after, served)), (served, after)
    for _ in range(DP):
        assert cached_tokens(http, expiring + [5, 6]) == 0  # unpinned on both, so the flood evicted it on both
    assert_each_replica_idle_and_sound(server)


def test_unpin_removes_it_everywhere(http, server):
    made = pin(http, prompt=prompt_ids(60, 40), ttl_seconds=600)
    before = per_replica(server, "num_pins")
    deleted = http.delete(f"/v1/cache/pin/{made['id']}")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert per_replica(server, "num_pins") == [n - 1 for n in before]
    assert made["id"] not in pins(http)
    assert_error_response(http.delete(f"/v1/cache/pin/{made['id']}"), 404, made["id"])
    assert_error_response(http.delete("/v1/cache/pin/pin-0000"), 404, "pin-0000")


def test_pin_over_the_bound_gets_409_and_pins_nothing_anywhere(http, server):
    before = (set(pins(http)), per_replica(server, "num_pins"), per_replica(server, "kv_pinned"))
    assert_error_response(
        http.post("/v1/cache/pin", json={"input_ids": prompt_ids(40, MAX_PINNED + 1)}), 409, "--max-pinned-tokens"
    )
    # Computed on both replicas, found over the bound there (the kept 120 + the start-up pin + 200 > 300), undone.
    assert_error_response(http.post("/v1/cache/pin", json={"input_ids": prompt_ids(41, 200)}), 409, "300")
    assert (set(pins(http)), per_replica(server, "num_pins"), per_replica(server, "kv_pinned")) == before
    assert_each_replica_idle_and_sound(server)


def test_flush_keeps_pins_on_every_replica_unless_asked(http, server):
    listed = pins(http)
    assert http.post("/flush_cache").json()["success"] is True
    assert pins(http) == listed and per_replica(server, "num_pins") == [len(listed)] * DP
    assert http.post("/flush_cache?drop_pins=true").json()["success"] is True
    assert pins(http) == {} and per_replica(server, "num_pins") == [0, 0] and per_replica(server, "kv_pinned") == [0, 0]
    assert_each_replica_idle_and_sound(server)


def entry(pin_id: str, created_at: float = 1.0, expires_at: float | None = None) -> PinEntry:
    return PinEntry(pin_id, None, 8, created_at, expires_at)


def test_controller_undoes_a_pin_that_one_replica_refused():
    pins = ReplicatedPins(3)
    request = PinPrefixRequest("r1", pack_i32(list(range(8))))
    sends, reply = pins.from_front(request)
    assert [i for i, _ in sends] == [0, 1, 2] and all(m is request for _, m in sends) and reply is None
    assert pins.from_replica(0, PinsReply("r1", 200, "", [entry("a0")], 8)) == ([], None)
    assert pins.from_replica(2, PinsReply("r1", 409, "over the bound", [], 290)) == ([], None)
    undo, reply = pins.from_replica(1, PinsReply("r1", 200, "", [entry("a1")], 8))
    assert [(i, m.pin_id) for i, m in undo] == [(0, "a0"), (1, "a1")]
    assert all(isinstance(m, UnpinPrefixRequest) and m.request_id.startswith(UNDO_PREFIX) for _, m in undo)
    assert (reply.status, reply.message, reply.pins) == (409, "replica 2: over the bound", [])
    assert pins.pins == {}
    assert pins.from_replica(0, PinsReply(undo[0][1].request_id, 200)) == ([], None)  # undo answers go nowhere

    # A pin all replicas made; its TTL has run out on replica 0 only: listed with the replicas that hold it.
    pins.from_front(PinPrefixRequest("r2", pack_i32([1])))
    made = [
        pins.from_replica(i, PinsReply("r2", 200, "", [entry(f"b{i}", 1.0 + i, 100.0 + i)], 1))[1] for i in range(3)
    ][-1]
    pin_id = made.pins[0].id
    assert (made.status, made.pins[0].replicas, made.pins[0].created_at, made.pins[0].expires_at) == (
        200,
        [0, 1, 2],
        3.0,
        102.0,
    )
    pins.from_front(ListPinsRequest("r3"))
    held = [[], [entry("b1", 2.0, 101.0)], [entry("b2", 3.0, 102.0), entry("stray")]]
    listed = [pins.from_replica(i, PinsReply("r3", 200, "", held[i], 1))[1] for i in range(3)][-1]
    assert [(p.id, p.replicas) for p in listed.pins] == [(pin_id, [1, 2])]  # "stray": being made, not listed

    sends, _ = pins.from_front(UnpinPrefixRequest("r4", pin_id))
    assert [(i, m.pin_id) for i, m in sends] == [(0, "b0"), (1, "b1"), (2, "b2")]
    answers = [PinsReply("r4", 404), PinsReply("r4", 200, "", [entry("b1")]), PinsReply("r4", 404)]
    unpinned = [pins.from_replica(i, answers[i])[1] for i in range(3)][-1]
    assert unpinned.status == 200 and unpinned.pins[0].id == pin_id and pins.pins == {}
    assert pins.from_front(UnpinPrefixRequest("r5", pin_id))[1].status == 404
