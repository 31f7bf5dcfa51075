"""Chat prompts tokenized per piece, through one real server (`launch.py` on the CPU, tiny Qwen3 with the Qwen3
tokenizer):

* the issue's demonstration: 128 concurrent /v1/tokenize calls whose messages share 8 long system prompts finish at
  least 5x faster than the same calls with 128 distinct system prompts of the same length, timed in one run;
* /v1/chat/completions, /v1/tokenize and pins by messages all give the ids of the whole prompt, through the cache;
* a cache_salt never finds a piece that requests of another salt (or none) left: /metrics counts the pieces found.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import string
import time

import httpx
import pytest

from radixserve.testing import tiny_model_dir
from radixserve.tokenizer_loading import load_tokenizer
from server_fixture import SSL_CONTEXT, launched_server

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

MODEL_DIR = tiny_model_dir("qwen3", tokenizer="qwen3")
BURST = 128
SHARED_PROMPTS = 8
PROMPT_WORDS = 5000  # ~21,000 tokens a system prompt: encoding one (~20 ms) dwarfs an HTTP round trip
ROUNDS = 2  # each shape timed twice, alternating, with new texts each time; the faster time of each counts


@pytest.fixture(scope="module")
def server():
    with launched_server(MODEL_DIR) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL_DIR)


def whole_ids(tokenizer, messages, **options) -> list[int]:
    options.setdefault("add_generation_prompt", True)
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **options))


def system_prompt(rng: random.Random) -> str:
    """Text of made-up words, each prompt its own: the Rust tokenizer's word cache (10,000 words, filled once) then
    helps neither shape, and the time a prompt takes to encode does not depend on the prompts before it."""
    words = ("".join(rng.choices(string.ascii_lowercase, k=rng.randint(5, 10))) for _ in range(PROMPT_WORDS))
    return "You are the assistant of a company. " + " ".join(words) + "."


def conversations(rng: random.Random, distinct_prompts: int) -> list[list[dict]]:
    prompts = [system_prompt(rng) for _ in range(distinct_prompts)]
    return [
        [
            {"role": "system", "content": prompts[i % distinct_prompts]},
            {"role": "user", "content": f"Question {i}: what does rule {rng.randint(1, 99)} say?"},
        ]
        for i in range(BURST)
    ]


async def burst(url: str, chats: list[list[dict]]) -> tuple[float, list[bytes]]:
    """All of `chats` to /v1/tokenize at once: (seconds until the last answer, the answers' bodies). One client (one
    connection) per call: httpx's pool scans all its connections for every request event, which with 128 in one
    pool costs the test process ~1.5 s of CPU per burst (cProfile: httpcore _assign_requests_to_connections). The
    clients share one SSL context: each would build its own, loading the CA bundle (~17 ms, ~2.2 s a burst)."""
    clients = [httpx.AsyncClient(base_url=url, timeout=300, verify=SSL_CONTEXT) for _ in chats]
    try:
        await asyncio.gather(*(client.get("/health") for client in clients))  # connected before the clock starts

        async def one(client, body: bytes):
            response = await client.post("/v1/tokenize", content=body, headers={"Content-Type": "application/json"})
            assert response.status_code == 200, response.text
            return response.content

        requests = [json.dumps({"messages": messages}).encode() for messages in chats]
        start = time.perf_counter()
        bodies = await asyncio.gather(*(one(client, body) for client, body in zip(clients, requests)))
        return time.perf_counter() - start, bodies
    finally:
        await asyncio.gather(*(client.aclose() for client in clients))


def test_shared_system_prompts_tokenize_5x_faster_than_distinct_ones(server, tokenizer):
    rng = random.Random(27)
    asyncio.run(burst(server.url, conversations(rng, 4)[:16]))  # warm-up: code paths, threads, connections
    times: dict[str, list[float]] = {"shared": [], "distinct": []}
    for _ in range(ROUNDS):
        for shape, prompts in (("shared", SHARED_PROMPTS), ("distinct", BURST)):
            chats = conversations(rng, prompts)
            seconds, bodies = asyncio.run(burst(server.url, chats))
            times[shape].append(seconds)
            for index in (0, SHARED_PROMPTS, BURST - 1):  # what came back is the whole prompt's ids
                assert httpx.Response(200, content=bodies[index]).json()["tokens"] == whole_ids(tokenizer, chats[index])
    tokens = len(whole_ids(tokenizer, chats[0]))
    shared, distinct = min(times["shared"]), min(times["distinct"])
    print(
        f"\n{BURST} concurrent /v1/tokenize calls, ~{tokens} tokens each: {SHARED_PROMPTS} shared system prompts "
        f"{shared * 1e3:.0f} ms, {BURST} distinct {distinct * 1e3:.0f} ms ({distinct / shared:.1f}x); "
        f"all rounds: {times}"
    )
    assert distinct >= 5 * shared, times


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    match = re.search(rf"^radixserve:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"no {name} in /metrics"
    return float(match.group(1))


def test_every_chat_route_takes_the_whole_prompt_ids_from_the_pieces(server, tokenizer):
    system = {"role": "system", "content": "You answer in one line. " * 30}
    turns = [
        system,
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": " And now? "},
    ]
    expected = whole_ids(tokenizer, turns)
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for _ in range(2):  # cold, then every piece from the cache
            hits = metric(server, "chat_segment_cache_hits_total")
            assert http.post("/v1/tokenize", json={"messages": turns}).json()["tokens"] == expected
            reply = http.post("/v1/chat/completions", json={"messages": turns, "max_tokens": 1}).json()
            assert reply["usage"]["prompt_tokens"] == len(expected)
            pin = http.post("/v1/cache/pin", json={"messages": turns[:2]}).json()
            assert pin["num_tokens"] == len(whole_ids(tokenizer, turns[:2], add_generation_prompt=False))
            assert http.delete(f"/v1/cache/pin/{pin['id']}").status_code == 200
            assert metric(server, "chat_segment_cache_hits_total") > hits


def test_a_cache_salt_finds_no_piece_another_tenant_left(server):
    secret = [
        {"role": "system", "content": "The launch code of tenant A is 4417. " * 10},
        {"role": "user", "content": "Remind me."},
    ]
    with httpx.Client(base_url=server.url, timeout=120) as http:

        def hits_of(body: dict) -> float:
            before = metric(server, "chat_segment_cache_hits_total")
            assert http.post("/v1/chat/completions", json={**body, "max_tokens": 1}).status_code == 200
            return metric(server, "chat_segment_cache_hits_total") - before

        assert hits_of({"messages": secret, "cache_salt": "tenant-a"}) == 0
        every_piece = hits_of({"messages": secret, "cache_salt": "tenant-a"})  # its own pieces: all found
        assert every_piece >= 4  # system, user, the newlines and the generation prompt between the special tokens
        assert hits_of({"messages": secret, "cache_salt": "tenant-b"}) == 0  # tenant A's: not found
        # Nor without a salt (whose namespace may hold the template's newlines from other tests, not the secret).
        assert hits_of({"messages": secret}) < every_piece
        # A pin in tenant B's namespace fills tenant B's pieces, nobody else's.
        pin = http.post("/v1/cache/pin", json={"messages": secret, "cache_salt": "tenant-c"}).json()
        assert http.delete(f"/v1/cache/pin/{pin['id']}").status_code == 200
        assert hits_of({"messages": secret, "cache_salt": "tenant-c"}) > 0
        assert hits_of({"messages": secret, "cache_salt": "tenant-d"}) == 0
