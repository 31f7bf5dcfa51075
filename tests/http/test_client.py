"""radixserve.client against a real server: launch.py as a subprocess on the CPU with the tiny Llama (and, for the
README example, the SmolLM2 demo model)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from server_fixture import free_port, launched_server

from radixserve.client import (
    AsyncClient,
    AsyncStream,
    ChatResult,
    Client,
    CompletionResult,
    GenerateResult,
    RadixServeConnectionError,
    RadixServeError,
    RadixServeTimeoutError,
    Stream,
    StreamChunk,
)
from radixserve.testing.smollm2 import smollm2_dir

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]

MESSAGES = [{"role": "user", "content": "Tell me a story about a radix tree."}]


@pytest.fixture(scope="module")
def url(tiny_llama_server):
    return tiny_llama_server.url  # shared with other modules (tests/conftest.py)


@pytest.fixture
def client(url):
    with Client(url, timeout=60) as c:
        yield c


def _join(chunks) -> tuple[str, list[StreamChunk]]:
    chunks = list(chunks)
    return "".join(c.text for c in chunks), chunks


# ------------------------------------------------------------------------------------------ OpenAI routes


def test_chat(client):
    reply = client.chat(MESSAGES, max_tokens=12, temperature=0)
    assert isinstance(reply, ChatResult)
    assert reply.text and reply.text == reply.choices[0].text
    assert reply.finish_reason == "length" and len(reply.choices) == 1
    assert reply.usage.completion_tokens == 12 and reply.usage.prompt_tokens > 10
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12
    assert reply.model == client.models()[0].id
    assert reply.raw["object"] == "chat.completion"
    # Same prompt again: greedy gives the same text and the prompt comes from the radix cache.
    again = client.chat(MESSAGES, max_tokens=12, temperature=0, model=reply.model)
    assert again.text == reply.text and again.usage.cached_tokens > 0


def test_completions_several_choices(client):
    reply = client.completions(["The quick brown fox", "Once upon a time"], max_tokens=5, temperature=0)
    assert isinstance(reply, CompletionResult)
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.finish_reason == "length" and c.text for c in reply.choices)
    assert reply.text == reply.choices[0].text and reply.usage.completion_tokens == 10
    single = client.completions("Once upon a time", max_tokens=5, temperature=0)
    assert single.text == reply.choices[1].text


def test_generate(client):
    result = client.generate("The quick brown fox", sampling_params={"max_new_tokens": 6, "temperature": 0})
    assert isinstance(result, GenerateResult)
    assert len(result.output_ids) == 6 and result.completion_tokens == 6 and result.finish_reason == "length"
    assert result.prompt_tokens > 0 and result.text
    # The native route and /v1/completions agree on greedy text; input_ids give the same output as text.
    assert client.completions("The quick brown fox", max_tokens=6, temperature=0).text == result.text
    ids = client.generate(input_ids=[504, 2365, 6354, 16438], sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert len(ids.output_ids) == 4
    batch = client.generate(["The quick brown fox", "Hello"], sampling_params={"max_new_tokens": 6, "temperature": 0})
    assert isinstance(batch, list) and len(batch) == 2 and batch[0].text == result.text
    # A stop token id ends generation with finish_reason stop and says which token matched.
    stop_at = result.output_ids[2]
    stopped = client.generate(
        "The quick brown fox", sampling_params={"max_new_tokens": 6, "temperature": 0, "stop_token_ids": [stop_at]}
    )
    assert stopped.finish_reason == "stop" and stopped.matched_stop == stop_at
    assert stopped.output_ids == result.output_ids[: result.output_ids.index(stop_at) + 1]


def test_generate_needs_one_input(client):
    with pytest.raises(ValueError):
        client.generate()
    with pytest.raises(ValueError):
        client.generate("a", input_ids=[1])


# ------------------------------------------------------------------------------------------ streaming


def test_chat_stream_equals_non_stream(client):
    full = client.chat(MESSAGES, max_tokens=16, temperature=0)
    stream = client.chat(MESSAGES, max_tokens=16, temperature=0, stream=True)
    assert isinstance(stream, Stream)
    text, chunks = _join(stream)
    assert text == full.text
    assert chunks[0].role == "assistant"
    assert len([c for c in chunks if c.text]) > 1  # really streamed, not one blob
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"]
    usage = chunks[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (full.usage.prompt_tokens, 16)


def test_completions_stream_equals_non_stream(client):
    full = client.completions("The capital of France is", max_tokens=10, temperature=0)
    text, chunks = _join(client.completions("The capital of France is", max_tokens=10, temperature=0, stream=True))
    assert text == full.text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_generate_stream_equals_non_stream(client):
    params = {"max_new_tokens": 10, "temperature": 0}
    full = client.generate("Radix trees share prefixes", sampling_params=params)
    text, chunks = _join(client.generate("Radix trees share prefixes", sampling_params=params, stream=True))
    assert text == full.text
    # Chunks carry deltas of ids too, and the last one how it finished, with usage.
    assert [i for c in chunks for i in c.output_ids] == full.output_ids
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == full.prompt_tokens


def test_closing_a_stream_aborts_the_request(client):
    with client.generate(
        "Endless", sampling_params={"max_new_tokens": 3000, "ignore_eos": True, "temperature": 0}, stream=True
    ) as stream:
        first = next(stream)
        assert first.text or first.output_ids
    deadline = time.monotonic() + 5
    while client.server_info()["num_running"] != 0:
        assert time.monotonic() < deadline, "the server kept generating after the client closed the stream"
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------ async


def test_async_client(url, client):
    expected_chat = client.chat(MESSAGES, max_tokens=8, temperature=0).text
    expected_gen = client.generate("Hello", sampling_params={"max_new_tokens": 8, "temperature": 0}).text

    async def main():
        async with AsyncClient(url) as ac:
            assert await ac.health()
            chat, gen, cmpl, stream = await asyncio.gather(
                ac.chat(MESSAGES, max_tokens=8, temperature=0),
                ac.generate("Hello", sampling_params={"max_new_tokens": 8, "temperature": 0}),
                ac.completions("Hello", max_tokens=8, temperature=0),
                ac.chat(MESSAGES, max_tokens=8, temperature=0, stream=True),
            )
            assert isinstance(stream, AsyncStream)
            streamed = [c async for c in stream]
            gen_streamed = [
                c
                async for c in await ac.generate(
                    "Hello", sampling_params={"max_new_tokens": 8, "temperature": 0}, stream=True
                )
            ]
            with pytest.raises(RadixServeError) as err:
                await ac.completions("Hello", max_tokens=0)
            assert err.value.status_code == 400 and "max_tokens" in err.value.message
            models = await ac.models()
            return chat, gen, cmpl, streamed, gen_streamed, models

    chat, gen, cmpl, streamed, gen_streamed, models = asyncio.run(main())
    assert chat.text == expected_chat
    assert gen.text == expected_gen == cmpl.text
    assert "".join(c.text for c in streamed) == expected_chat
    assert streamed[-1].usage is not None and streamed[-1].usage.completion_tokens == 8
    assert "".join(c.text for c in gen_streamed) == expected_gen
    assert models[0].id == chat.model


# ------------------------------------------------------------------------------------------ errors


def test_server_error_carries_message(client):
    with pytest.raises(RadixServeError) as err:
        client.chat(MESSAGES, max_tokens=-1)
    e = err.value
    assert e.status_code == 400 and e.type == "invalid_request_error" and e.param == "max_tokens"
    assert "max_tokens must be at least 1, got -1" in e.message and e.message in str(e)

    with pytest.raises(RadixServeError) as err:
        client.completions("hi", model="no-such-model", max_tokens=2)
    assert err.value.status_code == 404 and "no-such-model" in err.value.message

    # Refused before streaming starts: raised by the call, not by iterating.
    with pytest.raises(RadixServeError) as err:
        client.generate("hi", sampling_params={"max_new_tokens": 4, "temprature": 0.5}, stream=True)
    assert err.value.status_code == 400 and "temprature" in err.value.message

    with pytest.raises(RadixServeError) as err:
        client.generate(input_ids=[10**9], sampling_params={"max_new_tokens": 2})
    assert err.value.status_code == 400

    # The server is unharmed.
    assert client.chat(MESSAGES, max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_timeout(url, client):
    with Client(url, timeout=0.3) as impatient:
        start = time.monotonic()
        with pytest.raises(RadixServeTimeoutError):
            impatient.generate("Slow", sampling_params={"max_new_tokens": 3000, "ignore_eos": True})
        assert time.monotonic() - start < 5
    # A per-call timeout overrides the client's.
    start = time.monotonic()
    with pytest.raises(RadixServeTimeoutError):
        client.completions("Slow", max_tokens=3000, ignore_eos=True, timeout=0.3)
    assert time.monotonic() - start < 5
    assert client.completions("fast", max_tokens=2).usage.completion_tokens == 2


def test_connection_refused():
    dead = Client(f"http://127.0.0.1:{free_port()}", timeout=5)
    assert dead.health() is False
    with pytest.raises(RadixServeConnectionError) as err:
        dead.chat(MESSAGES, max_tokens=2)
    assert "could not connect" in str(err.value)
    with pytest.raises(RadixServeConnectionError):
        dead.generate("hi", stream=True)
    with pytest.raises(RadixServeConnectionError):
        asyncio.run(AsyncClient(dead.base_url).server_info())


# ------------------------------------------------------------------------------------------ admin routes


def test_admin_routes(url, client):
    assert client.health() is True
    models = client.models()
    assert len(models) == 1 and models[0].max_model_len == 4096
    client.wait_until_ready(timeout=5)
    info = client.server_info()
    assert info["num_running"] == 0 and info["kv_invariant_ok"] is True
    assert client.flush_cache()["success"] is True
    assert "radixserve" in client.metrics_text()
    # The openai package's base_url (ending in /v1) works too.
    assert Client(url + "/v1").models()[0].id == models[0].id


# ------------------------------------------------------------------------------------------ README example


def _readme_example() -> str:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    example = next(b for b in blocks if "radixserve.client" in b)
    return example


def test_module_docstring_has_the_readme_example():
    import radixserve.client as module

    lines = [line for line in _readme_example().splitlines() if line.strip()]
    assert len(lines) == 4 or len(lines) == 5
    doc_lines = [line for line in module.__doc__.splitlines() if line.strip()]
    start = doc_lines.index(lines[0])
    assert doc_lines[start : start + len(lines)] == lines


def _readme_curl() -> str:
    readme = (ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "curl" in b)
    return block.replace("\\\n", " ")


def test_readme_examples_answer_paris():
    """`python launch.py` with no model serves the demo model; the README's curl and client examples, run as
    written (only the port changed), both answer the Paris question."""
    example = _readme_example()
    assert 'Client("http://127.0.0.1:30000")' in example
    smollm2_dir()  # build the demo model (cached) before the server's start-up clock runs
    with launched_server(None) as server:
        code = example.replace("http://127.0.0.1:30000", server.url)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), {})
        curl = subprocess.run(
            _readme_curl().replace("http://127.0.0.1:30000", server.url),
            shell=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert "Paris" in out.getvalue(), out.getvalue()
    answer = json.loads(curl.stdout)["choices"][0]["message"]["content"]
    assert "Paris" in answer, curl.stdout
