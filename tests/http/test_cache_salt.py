"""Tenant isolation in the prefix cache through the real server: requests with different
`cache_salt`s never share cached KV (cached_tokens 0 across salts), requests with the same salt do, on the OpenAI
routes and native /generate; --require-cache-salt refuses a request without one with a 400 in OpenAI's error
format. One `launch.py` with the tiny Llama on the CPU, started with --require-cache-salt (and with
--radix-eviction-policy lfu, which /server_info reports). A salted request against the unsalted shared cache is in
tests/http/test_cache_pins.py, whose server does not require salts."""

from __future__ import annotations

import httpx
import openai
import pytest

from http_checks import assert_error_response
from radixserve.client import Client
from radixserve.testing.tiny_models import tiny_model_dir
from server_fixture import launched_server

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

PROMPT = [300 + (i * 31) % 20000 for i in range(80)]
MESSAGES = [
    {"role": "system", "content": "A long shared system prompt that every tenant of this server sends."},
    {"role": "user", "content": "hello"},
]


@pytest.fixture(scope="module")
def server():
    with launched_server(tiny_model_dir("llama"), "--require-cache-salt", "--radix-eviction-policy", "lfu") as server:
        yield server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def completion_cached(http: httpx.Client, prompt: list[int], salt: str) -> int:
    response = http.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0, "cache_salt": salt}
    )
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def generate_cached(http: httpx.Client, prompt: list[int], salt: str) -> int:
    response = http.post(
        "/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}, "cache_salt": salt}
    )
    assert response.status_code == 200, response.text
    return response.json()["meta_info"]["cached_tokens"]


def test_two_salts_never_share_and_one_salt_does(http):
    assert completion_cached(http, PROMPT, "tenant-a") == 0
    assert completion_cached(http, PROMPT, "tenant-a") == len(PROMPT) - 1  # all but the token that is computed
    assert completion_cached(http, PROMPT, "tenant-b") == 0  # the same prompt, cached, but for tenant a only
    assert completion_cached(http, PROMPT, "tenant-b") == len(PROMPT) - 1
    # Native /generate uses the same namespaces.
    assert generate_cached(http, PROMPT, "tenant-a") == len(PROMPT) - 1
    assert generate_cached(http, PROMPT, "tenant-c") == 0
    assert generate_cached(http, PROMPT[:60] + [7, 8, 9], "tenant-c") == 60  # a shared prefix within one tenant


def test_salts_on_chat_with_the_openai_package(server):
    with openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id

        def cached(salt: str) -> int:
            reply = client.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=2, temperature=0, extra_body={"cache_salt": salt}
            )
            return reply.usage.prompt_tokens_details.cached_tokens

        assert cached("x") == 0
        assert cached("x") > 0
        assert cached("y") == 0
        # And the radixserve client passes the field through.
        with Client(server.url, timeout=60) as ours:
            assert ours.chat(MESSAGES, max_tokens=2, temperature=0, cache_salt="y").usage.cached_tokens > 0
            assert (
                ours.generate(
                    input_ids=PROMPT, sampling_params={"max_new_tokens": 2}, cache_salt="tenant-z"
                ).cached_tokens
                == 0
            )


def test_require_cache_salt_refuses_requests_without_one(http):
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
        ("/v1/cache/pin", {"prompt": "hi"}),
    ):
        error = assert_error_response(http.post(path, json=body), 400, "cache_salt", "--require-cache-salt")
        assert error["param"] == "cache_salt" and error["type"] == "invalid_request_error"


def test_bad_salts_are_400(http):
    for salt, words in (("", "non-empty"), (5, "string"), ("s" * 257, "at most 256")):
        for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}), ("/generate", {"text": "hi"})):
            response = http.post(path, json={**body, "cache_salt": salt})
            assert_error_response(response, 400, "cache_salt", words)


def test_eviction_policy_flag_reaches_the_tree(server):
    assert server.server_info()["eviction_policy"] == "lfu"
