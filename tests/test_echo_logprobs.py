"""`echo` on /v1/completions (with prompt-token logprobs) and `stream_options.continuous_usage_stats`, through a real
server (`launch.py` on the CPU) with the official `openai` package.

The prompt logprobs are checked against the engine's own sampled-token logprobs: the logprob the prefill gives a
prompt token must be the one decoding gave that same token when it was generated. Prompts span several prefill
chunks (--chunked-prefill-size 16), so a token whose predecessor ended the previous chunk is covered, and a prompt
whose prefix sits in the radix cache must still get every logprob (the match is skipped for it)."""

import httpx
import openai
import pytest

from radixserve.testing import tiny_model_dir
from server_fixture import launched_server

CHUNK = 16
# 45 tokens: with the 6 generated ones the echoed prompt (51) is chunked [0, 16) [16, 32) [32, 48) [48, 51), so the
# generated token at position 48 is scored from the row that ended the previous chunk (the carry).
PROMPT_IDS = list(range(300, 345))
GENERATED = 6


@pytest.fixture(scope="module")
def server():
    with launched_server(tiny_model_dir("llama"), "--chunked-prefill-size", str(CHUNK)) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def generated(server):
    """PROMPT_IDS continued greedily, with the logprob decoding gave each generated token."""
    body = {"input_ids": PROMPT_IDS, "sampling_params": {"temperature": 0, "max_new_tokens": GENERATED,
                                                          "ignore_eos": True}, "return_logprob": True}
    result = httpx.post(f"{server.url}/generate", json=body, timeout=300).json()
    return result["output_ids"], [lp for lp, _, _ in result["meta_info"]["output_token_logprobs"]]


def test_prompt_logprobs_equal_the_logprobs_the_tokens_were_generated_with(client, model, generated):
    output_ids, output_logprobs = generated
    prompt = PROMPT_IDS + output_ids  # its prefix is in the radix cache from the generation
    reply = client.completions.create(model=model, prompt=prompt, echo=True, logprobs=2, max_tokens=1,
                                      temperature=0)
    choice = reply.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt) + 1 and len(lp.token_logprobs) == len(prompt) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert all(isinstance(v, float) for v in lp.token_logprobs[1:])  # chunk boundaries included
    echoed = lp.token_logprobs[len(PROMPT_IDS):len(prompt)]
    assert echoed == pytest.approx(output_logprobs, abs=1e-3)
    for position in range(1, len(prompt)):
        top = lp.top_logprobs[position]
        assert lp.tokens[position] in top and 2 <= len(top) <= 3  # the top 2, plus the token itself
        assert max(top.values()) >= lp.token_logprobs[position] - 1e-6
    # The echoed text is the prompt's text, then the completion; offsets run on over both.
    prompt_text = httpx.post(f"{client.base_url}detokenize", json={"tokens": prompt}, timeout=60).json()["prompt"]
    assert choice.text.startswith(prompt_text) and len(choice.text) > len(prompt_text)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # Every prompt token was computed, none taken from the cache (a cached prefix has no logits).
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=model, prompt=prompt, echo=True, logprobs=2, max_tokens=1,
                                      temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    again_logprobs = again.choices[0].logprobs.token_logprobs
    assert again_logprobs[0] is None and again_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


def test_echo_without_logprobs_prepends_each_prompt_to_each_choice(client, model):
    prompts = ["The capital of France is", "Once upon a time"]
    reply = client.completions.create(model=model, prompt=prompts, echo=True, n=2, max_tokens=4, temperature=1,
                                      seed=3)
    assert len(reply.choices) == 4
    for choice in reply.choices:
        assert choice.text.startswith(prompts[choice.index // 2]) and choice.logprobs is None
    plain = client.completions.create(model=model, prompt=prompts[0], max_tokens=4, temperature=0)
    echoed = client.completions.create(model=model, prompt=prompts[0], max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == prompts[0] + plain.choices[0].text
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    assert echoed.usage.prompt_tokens == plain.usage.prompt_tokens


def test_streamed_echo_concatenates_to_the_whole_reply(client, model, generated):
    prompt = PROMPT_IDS + generated[0]
    whole = client.completions.create(model=model, prompt=prompt, echo=True, logprobs=1, max_tokens=5,
                                      temperature=0, extra_body={"ignore_eos": True})
    text, tokens, logprobs = "", [], []
    for chunk in client.completions.create(model=model, prompt=prompt, echo=True, logprobs=1, max_tokens=5,
                                           temperature=0, extra_body={"ignore_eos": True}, stream=True):
        for choice in chunk.choices:
            text += choice.text
            tokens += choice.logprobs.tokens
            logprobs += choice.logprobs.token_logprobs
    assert text == whole.choices[0].text
    assert tokens == whole.choices[0].logprobs.tokens
    assert logprobs[0] is None and logprobs[1:] == pytest.approx(whole.choices[0].logprobs.token_logprobs[1:],
                                                                 abs=1e-4)


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, model, chat):
    kw = dict(model=model, max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True},
              stream_options={"include_usage": True, "continuous_usage_stats": True})
    if chat:
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "Hello"}], **kw))
    else:
        chunks = list(client.completions.create(prompt="Hello there", **kw))
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 6
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 6
    # The usage so far, not the final one copied onto every chunk. A chunk may carry more than one token (a token
    # whose text is held back until the next one completes it), so the first count is not always 0 (chat's role
    # chunk) or 1.
    assert len(counts) > 2 and counts[0] < counts[-1], counts
    assert {c.usage.prompt_tokens for c in chunks} == {final.usage.prompt_tokens}
    # Without include_usage there is no usage at all, as vLLM: continuous_usage_stats alone changes nothing.
    kw["stream_options"] = {"continuous_usage_stats": True}
    stream = client.chat.completions.create(messages=[{"role": "user", "content": "Hello"}], **kw) if chat else \
        client.completions.create(prompt="Hello there", **kw)
    assert all(getattr(c, "usage", None) is None for c in stream)


def test_bad_echo_and_usage_fields_are_400s(server):
    for body, param in [({"prompt": "hi", "echo": 1}, "echo"),
                        ({"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
                        ({"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
                         "stream_options")]:
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                      timeout=60).status_code == 200


def test_a_priority_without_enable_priority_scheduling_is_a_400(server):
    """As vLLM: a priority the server would ignore is refused; 0 (the default) is always fine."""
    bodies = {"/v1/completions": {"prompt": "hi", "max_tokens": 1},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
              "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 1}}}
    for path, body in bodies.items():
        refused = httpx.post(f"{server.url}{path}", json={**body, "priority": 1}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority", refused.text
        assert "--enable-priority-scheduling" in refused.json()["error"]["message"]
        assert httpx.post(f"{server.url}{path}", json={**body, "priority": 0}, timeout=60).status_code == 200
