"""The HTTP API end to end: `launch.py` in a subprocess with the tiny random Llama on the CPU, spoken to with the
official `openai` package and plain httpx. The model's weights are random, so its text is gibberish, but greedy
decoding is deterministic: tests derive what to expect (stop strings, token boundaries) from a first greedy run."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest
import torch

from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import tiny_model_dir

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

MODEL_DIR = tiny_model_dir("llama")
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


@pytest.fixture(scope="module")
def server(tiny_llama_server):
    return tiny_llama_server  # shared with other modules (tests/conftest.py)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


def greedy(**kw):
    return {"temperature": 0, **kw}


def sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# --------------------------------------------------------------------------------------------- basics


def test_models_health_metrics(server, client, model_name):
    assert model_name == MODEL_DIR.name
    card = client.models.retrieve(model_name)
    assert card.id == model_name and card.owned_by == "radixserve"
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    client.completions.create(model=model_name, prompt="metrics", max_tokens=3, **greedy())
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "radixserve:time_to_first_token_seconds_count",
        "radixserve:inter_token_latency_seconds_count",
        "radixserve:e2e_request_latency_seconds_count",
        "radixserve:queue_time_seconds_count",
        "radixserve:prompt_tokens_total",
        "radixserve:generation_tokens_total",
        "radixserve:cached_tokens_total",
        "radixserve:num_running_reqs",
        "radixserve:num_waiting_reqs",
        "radixserve:kv_cache_usage_perc",
    ):
        assert name in text, name
    generated = [line for line in text.splitlines() if line.startswith("radixserve:generation_tokens_total")]
    assert float(generated[0].split()[-1]) >= 3


# ------------------------------------------------------------------------------------ streaming == non-streaming


def test_completion_stream_equals_non_stream(client, model_name):
    full = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=24, **greedy())
    chunks = list(
        client.completions.create(
            model=model_name,
            prompt=PROMPT,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            **greedy(),
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == full.choices[0].text and len(text) > 0
    assert reasons == [full.choices[0].finish_reason]
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_stream_equals_non_stream_and_role_first(client, model_name):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story."}]
    full = client.chat.completions.create(model=model_name, messages=messages, max_tokens=20, **greedy())
    assert full.choices[0].message.role == "assistant" and full.object == "chat.completion"
    chunks = list(
        client.chat.completions.create(model=model_name, messages=messages, max_tokens=20, stream=True, **greedy())
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content and len(text) > 0
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


# ------------------------------------------------------------------------------------------------- n


def test_n3_choices_each_with_own_seed_stop_and_finish_reason(client, model_name):
    kw = dict(
        model=model_name,
        prompt=PROMPT,
        max_tokens=16,
        temperature=1.0,
        seed=1234,
        n=3,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    first = client.completions.create(**kw)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 3, "choice j samples with seed + j: the three must differ"
    assert all(c.finish_reason == "length" for c in first.choices)
    assert first.usage.completion_tokens == 3 * 16
    assert first.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in first.choices)

    # A stop string that occurs in choice 1's text only: seeded sampling repeats the same three texts, and now
    # choice 1 alone ends early with finish_reason "stop".
    stop = next(
        texts[1][i : i + 4]
        for i in range(1, len(texts[1]) - 4)
        if texts[1][i : i + 4] not in texts[0]
        and texts[1][i : i + 4] not in texts[2]
        and texts[1].find(texts[1][i : i + 4]) == i
    )
    again = client.completions.create(stop=[stop], **kw)
    by_index = {c.index: c for c in again.choices}
    assert by_index[1].finish_reason == "stop" and by_index[1].text == texts[1][: texts[1].find(stop)]
    assert by_index[0].finish_reason == by_index[2].finish_reason == "length"
    assert by_index[0].text == texts[0] and by_index[2].text == texts[2]
    assert again.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in again.choices) < 3 * 16

    # Streaming: every index gets exactly one finish_reason.
    chunks = list(client.completions.create(stream=True, stop=[stop], **kw))
    finished = [(c.choices[0].index, c.choices[0].finish_reason) for c in chunks if c.choices[0].finish_reason]
    assert sorted(finished) == [(0, "length"), (1, "stop"), (2, "length")]
    for index in range(3):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == index) == by_index[index].text


# ----------------------------------------------------------------------------------------- stop strings


@pytest.fixture(scope="module")
def reference(client, model_name):
    """A greedy completion with per-token text, where every token is plain ASCII (so token text offsets are
    character offsets)."""
    for prompt in (PROMPT, "Hello world, this is a test of", "In the beginning"):
        out = client.completions.create(
            model=model_name, prompt=prompt, max_tokens=24, logprobs=1, extra_body={"ignore_eos": True}, **greedy()
        )
        choice = out.choices[0]
        if "".join(choice.logprobs.tokens) == choice.text and choice.text.isascii():
            return prompt, choice
    pytest.fail("no all-ASCII greedy completion found among the prompts")


def mid_token_stop(choice) -> tuple[str, int]:
    """A 3-character stop string starting inside a multi-character token (not at its start), its first occurrence,
    and the number of tokens up to the one where it ends."""
    text, offsets = choice.text, choice.logprobs.text_offset
    for token, start in zip(choice.logprobs.tokens, offsets):
        for inner in range(1, len(token)):
            stop = text[start + inner : start + inner + 3]
            if len(stop) == 3 and text.find(stop) == start + inner:
                end = start + inner + 3  # one past the stop string's last character
                tokens_needed = sum(1 for o in offsets if o < end)
                return stop, tokens_needed
    pytest.fail(f"no mid-token stop string candidate in {choice.logprobs.tokens}")


def test_stop_string_starting_mid_token(client, model_name, reference):
    prompt, ref = reference
    stop, tokens_needed = mid_token_stop(ref)
    cut = ref.text.find(stop)
    kw = dict(
        model=model_name,
        prompt=prompt,
        max_tokens=24,
        stop=[stop, "unlikely-stop-zzz"],
        extra_body={"ignore_eos": True},
        **greedy(),
    )
    out = client.completions.create(**kw)
    assert out.choices[0].text == ref.text[:cut]
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop
    assert out.usage.completion_tokens == tokens_needed  # generation ended at the token completing the stop

    streamed = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == ref.text[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"

    included = client.completions.create(
        **{**kw, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}}
    )
    assert included.choices[0].text == ref.text[: cut + len(stop)]


def test_stop_token_ids(server, client, model_name, reference):
    prompt, ref = reference
    token_ids = httpx.post(
        f"{server.url}/generate",
        json={"text": prompt, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}},
        timeout=60,
    ).json()["output_ids"]
    stop_at = 5
    stop_token = token_ids[stop_at]
    first = token_ids.index(stop_token)  # the stop token may occur earlier too
    out = client.completions.create(
        model=model_name,
        prompt=prompt,
        max_tokens=24,
        logprobs=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_token]},
        **greedy(),
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop_token
    assert out.usage.completion_tokens == first + 1  # the stop token counts...
    assert choice.text == "".join(ref.logprobs.tokens[:first])  # ...but its text is not part of the output


# ------------------------------------------------------------------------------------------------ usage


def test_usage_is_exact(client, model_name, tokenizer):
    out = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=7, extra_body={"ignore_eos": True}, **greedy()
    )
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == 7 and out.choices[0].finish_reason == "length"
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7

    messages = [{"role": "user", "content": "How many tokens is this?"}]
    chat = client.chat.completions.create(
        model=model_name, messages=messages, max_completion_tokens=5, extra_body={"ignore_eos": True}, **greedy()
    )
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat.usage.prompt_tokens == len(expected)
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"

    batch = client.completions.create(
        model=model_name,
        prompt=["one two", "three four five"],
        max_tokens=3,
        n=2,
        extra_body={"ignore_eos": True},
        **greedy(),
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]  # prompt p, sample j -> p * n + j
    assert batch.usage.prompt_tokens == len(tokenizer.encode("one two")) + len(tokenizer.encode("three four five"))
    assert batch.usage.completion_tokens == 4 * 3


def common_prefix_len(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_cached_tokens_on_shared_long_prefix(client, model_name, tokenizer):
    prefix = f"Session {uuid.uuid4().hex}. " + " ".join(f"word{i}" for i in range(150))
    first = client.completions.create(model=model_name, prompt=prefix + " First question?", max_tokens=2, **greedy())
    second = client.completions.create(model=model_name, prompt=prefix + " Second question?", max_tokens=2, **greedy())
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # Exactly the tokens the two prompts share: the first left its prompt in the tree, the second diverges after.
    shared = common_prefix_len(
        tokenizer.encode(prefix + " First question?"), tokenizer.encode(prefix + " Second question?")
    )
    assert shared > 150  # the premise: a long shared prefix
    assert second.usage.prompt_tokens_details.cached_tokens == shared

    # Chat: a second turn re-sends the first turn, which the cache holds (prompt + the answer).
    system = {"role": "system", "content": prefix}
    turn1 = [system, {"role": "user", "content": "Hi"}]
    chat1 = client.chat.completions.create(model=model_name, messages=turn1, max_tokens=4, **greedy())
    turn2 = turn1 + [
        {"role": "assistant", "content": chat1.choices[0].message.content},
        {"role": "user", "content": "And then?"},
    ]
    chat2 = client.chat.completions.create(model=model_name, messages=turn2, max_tokens=4, **greedy())
    assert chat2.usage.prompt_tokens_details.cached_tokens >= chat1.usage.prompt_tokens - 1


# --------------------------------------------------------------------------------------------- logprobs


def test_completion_logprobs_shape(client, model_name):
    out = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=6, logprobs=3, extra_body={"ignore_eos": True}, **greedy()
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0
        assert 3 <= len(top) <= 4 and token in top
        assert logprob == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the most likely token

    streamed = list(
        client.completions.create(
            model=model_name,
            prompt=PROMPT,
            max_tokens=6,
            logprobs=3,
            stream=True,
            extra_body={"ignore_eos": True},
            **greedy(),
        )
    )
    tokens = [t for c in streamed for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in streamed for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_chat_logprobs_shape(client, model_name):
    out = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
        **greedy(),
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    for item in content:
        assert item.logprob <= 0 and isinstance(item.token, str) and item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-5)
    without = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, **greedy()
    )
    assert without.choices[0].logprobs is None


# ------------------------------------------------------------------------------ parity with Engine and HF


def test_greedy_http_matches_engine_and_hf(server, client, model_name):
    from transformers import AutoModelForCausalLM

    from radixserve import Engine

    prompts = [PROMPT, "Hello world", "1 2 3 4 5 6"]
    max_new = 12
    http_ids = []
    for prompt in prompts:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}}
        result = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
        http_ids.append(result["output_ids"])
        # The OpenAI route gives the same text as /generate.
        completion = client.completions.create(model=model_name, prompt=prompt, max_tokens=max_new, **greedy())
        assert completion.choices[0].text == result["text"]

    with Engine(str(MODEL_DIR), device="cpu") as engine:
        engine_out = engine.generate(prompts, SamplingParams(max_new_tokens=max_new, temperature=0))
    assert [r.token_ids for r in engine_out] == http_ids

    hf = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    for prompt, ids in zip(prompts, http_ids):
        input_ids = torch.tensor([engine.tokenizer.encode(prompt)])
        with torch.no_grad():
            generated = hf.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new, do_sample=False
            )
        assert generated[0, input_ids.shape[1] :].tolist() == ids


# ------------------------------------------------------------------------------------------ native routes


def test_generate_native(server, tokenizer):
    url = f"{server.url}/generate"
    # An empty cache, so cached_tokens below have exact values whatever ran before.
    assert httpx.post(f"{server.url}/flush_cache", timeout=30).json()["success"] is True
    single = httpx.post(
        url,
        json={"text": PROMPT, "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}},
        timeout=60,
    ).json()
    assert len(single["output_ids"]) == 5 and isinstance(single["text"], str)
    meta = single["meta_info"]
    assert meta["prompt_tokens"] == len(tokenizer.encode(PROMPT)) and meta["completion_tokens"] == 5
    assert meta["finish_reason"] == {"type": "length", "length": 5} and meta["cached_tokens"] == 0

    by_ids = httpx.post(
        url,
        json={
            "input_ids": tokenizer.encode(PROMPT),
            "return_logprob": True,
            "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
        },
        timeout=60,
    ).json()
    assert by_ids["output_ids"] == single["output_ids"] and by_ids["text"] == single["text"]
    assert by_ids["meta_info"]["cached_tokens"] == meta["prompt_tokens"] - 1  # the same prompt again
    assert [t for _, t, _ in by_ids["meta_info"]["output_token_logprobs"]] == single["output_ids"]
    assert all(len(top) == 2 for top in by_ids["meta_info"]["output_top_logprobs"])

    batch = httpx.post(
        url, json={"text": [PROMPT, "Another"], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}, timeout=60
    ).json()
    assert isinstance(batch, list) and [r["index"] for r in batch] == [0, 1]
    assert batch[0]["output_ids"] == single["output_ids"][: len(batch[0]["output_ids"])]

    with httpx.stream(
        "POST",
        url,
        json={
            "text": PROMPT,
            "stream": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
        },
        timeout=60,
    ) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["text"] == single["text"] and last["output_ids"] == single["output_ids"]  # cumulative
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-2])


def test_flush_cache_and_server_info(server, client, model_name):
    prompt = f"Flush {uuid.uuid4().hex} " + "lorem ipsum " * 40
    client.completions.create(model=model_name, prompt=prompt, max_tokens=2, **greedy())
    hit = client.completions.create(model=model_name, prompt=prompt, max_tokens=2, **greedy())
    # All of the prompt but its last token, whose KV is computed again to get the first output's logits.
    assert hit.usage.prompt_tokens_details.cached_tokens == hit.usage.prompt_tokens - 1
    response = httpx.post(f"{server.url}/flush_cache", timeout=30)
    assert response.status_code == 200 and response.json()["success"] is True
    miss = client.completions.create(model=model_name, prompt=prompt, max_tokens=2, **greedy())
    assert miss.usage.prompt_tokens_details.cached_tokens == 0

    info = httpx.get(f"{server.url}/server_info", timeout=30).json()
    assert info["num_running"] == 0 and info["num_waiting"] == 0 and info["kv_invariant_ok"] is True
    assert info["model"] == model_name and info["context_len"] == 4096 and info["vocab_size"] == 49152
