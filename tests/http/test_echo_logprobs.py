"""`echo` on /v1/completions (with prompt-token logprobs, TP=2 included) and on /v1/chat/completions (with
continue_final_message), and `stream_options.continuous_usage_stats`, through a real server (`launch.py` on the CPU)
with the official `openai` package.

The prompt logprobs are checked against the engine's own sampled-token logprobs: the logprob the prefill gives a
prompt token must be the one decoding gave that same token when it was generated. Prompts span several prefill
chunks (--chunked-prefill-size 16), so a token whose predecessor ended the previous chunk is covered, and a prompt
whose prefix sits in the radix cache must still get every logprob (the match is skipped for it)."""

import httpx
import openai
import pytest

from radixserve.testing import tiny_model_dir
from radixserve.tokenizer_loading import load_tokenizer
from server_fixture import launched_server

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

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
    body = {
        "input_ids": PROMPT_IDS,
        "sampling_params": {"temperature": 0, "max_new_tokens": GENERATED, "ignore_eos": True},
        "return_logprob": True,
    }
    result = httpx.post(f"{server.url}/generate", json=body, timeout=300).json()
    return result["output_ids"], [lp for lp, _, _ in result["meta_info"]["output_token_logprobs"]]


def test_prompt_logprobs_equal_the_logprobs_the_tokens_were_generated_with(client, model, generated):
    output_ids, output_logprobs = generated
    prompt = PROMPT_IDS + output_ids  # its prefix is in the radix cache from the generation
    reply = client.completions.create(model=model, prompt=prompt, echo=True, logprobs=2, max_tokens=1, temperature=0)
    choice = reply.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt) + 1 and len(lp.token_logprobs) == len(prompt) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert all(isinstance(v, float) for v in lp.token_logprobs[1:])  # chunk boundaries included
    echoed = lp.token_logprobs[len(PROMPT_IDS) : len(prompt)]
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
    again = client.completions.create(model=model, prompt=prompt, echo=True, logprobs=2, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    again_logprobs = again.choices[0].logprobs.token_logprobs
    assert again_logprobs[0] is None and again_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


def test_echo_without_logprobs_prepends_each_prompt_to_each_choice(client, model):
    prompts = ["The capital of France is", "Once upon a time"]
    reply = client.completions.create(model=model, prompt=prompts, echo=True, n=2, max_tokens=4, temperature=1, seed=3)
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
    whole = client.completions.create(
        model=model, prompt=prompt, echo=True, logprobs=1, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    text, tokens, logprobs = "", [], []
    for chunk in client.completions.create(
        model=model,
        prompt=prompt,
        echo=True,
        logprobs=1,
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
        stream=True,
    ):
        for choice in chunk.choices:
            text += choice.text
            tokens += choice.logprobs.tokens
            logprobs += choice.logprobs.token_logprobs
    assert text == whole.choices[0].text
    assert tokens == whole.choices[0].logprobs.tokens
    assert logprobs[0] is None and logprobs[1:] == pytest.approx(whole.choices[0].logprobs.token_logprobs[1:], abs=1e-4)


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, model, chat):
    kw = dict(
        model=model,
        max_tokens=16,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    if chat:
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "Hello"}], **kw))
    else:
        chunks = list(client.completions.create(prompt="Hello there", **kw))
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 16
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 16
    # The usage so far, not the final one copied onto every chunk. A chunk may carry more than one token: a token
    # whose text is held back until the next one completes it, and every token that arrived while the client was
    # still reading the chunk before (request_group.py: a slow reader gets bigger chunks; on a loaded CI box five
    # of six tokens once came as one chunk). So the counts only have to grow from the first chunk to the last.
    assert len(counts) >= 2 and counts[0] < counts[-1], counts
    assert {c.usage.prompt_tokens for c in chunks} == {final.usage.prompt_tokens}
    # Without include_usage there is no usage at all, as vLLM: continuous_usage_stats alone changes nothing.
    kw["stream_options"] = {"continuous_usage_stats": True}
    stream = (
        client.chat.completions.create(messages=[{"role": "user", "content": "Hello"}], **kw)
        if chat
        else client.completions.create(prompt="Hello there", **kw)
    )
    assert all(getattr(c, "usage", None) is None for c in stream)


def test_bad_echo_and_usage_fields_are_400s(server):
    for body, param in [
        ({"prompt": "hi", "echo": 1}, "echo"),
        ({"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": "yes"}}, "stream_options"),
    ]:
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    assert (
        httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60).status_code
        == 200
    )


def test_a_priority_without_enable_priority_scheduling_is_a_400(server):
    """As vLLM: a priority the server would ignore is refused; 0 (the default) is always fine."""
    bodies = {
        "/v1/completions": {"prompt": "hi", "max_tokens": 1},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 1}},
    }
    for path, body in bodies.items():
        refused = httpx.post(f"{server.url}{path}", json={**body, "priority": 1}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority", refused.text
        assert "--enable-priority-scheduling" in refused.json()["error"]["message"]
        assert httpx.post(f"{server.url}{path}", json={**body, "priority": 0}, timeout=60).status_code == 200


def test_prompt_logprobs_with_tensor_parallelism_equal_those_of_one_rank(client, model, generated):
    """--tp-size 2 (gloo): each rank holds half the vocabulary of the tied LM head, and the prompt rows go through
    it a second time on every rank. The prompt spans four prefill chunks, so the carried row of a chunk's last
    position is covered too."""
    prompt = PROMPT_IDS + generated[0]
    kw = dict(prompt=prompt, echo=True, logprobs=3, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    one = client.completions.create(model=model, **kw).choices[0]
    with launched_server(tiny_model_dir("llama"), "--chunked-prefill-size", str(CHUNK), "--tp-size", "2") as tp:
        assert tp.server_info()["tp_size"] == 2
        with openai.OpenAI(base_url=tp.openai_base_url, api_key="unused", max_retries=0, timeout=300) as tp_client:
            two = tp_client.completions.create(model=model, **kw).choices[0]
        tp.assert_idle_kv_invariant()
    assert two.text == one.text
    assert two.logprobs.tokens == one.logprobs.tokens and len(one.logprobs.tokens) == len(prompt) + 3
    assert two.logprobs.token_logprobs[0] is None
    assert two.logprobs.token_logprobs[1:] == pytest.approx(one.logprobs.token_logprobs[1:], abs=1e-4)
    for got, want in zip(two.logprobs.top_logprobs[1:], one.logprobs.top_logprobs[1:]):
        assert got.keys() == want.keys()
        assert list(got.values()) == pytest.approx([want[k] for k in got], abs=1e-4)


# ------------------------------------------------------------------------------------------------ chat echo
# A client pre-fills the start of the reply as a final assistant message. continue_final_message renders that message
# open, so the model goes on with it; echo puts it back in front of the generated content (non-streamed: in the
# content; streamed: as its own delta right after the role), as vLLM does. A final message from any other role is
# not echoed. The logprobs of an echoed chat are those of the generated tokens only: vLLM sends none for a chat's
# prompt.

PREFILL = "The answer is"
QUESTION = [{"role": "user", "content": "What is six times seven?"}]
PREFILLED = QUESTION + [{"role": "assistant", "content": PREFILL}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}
GREEDY = dict(max_tokens=6, temperature=0)


def greedy_chat(client, model, messages, **extra):
    """A greedy chat reply; extra: fields the openai package does not know (echo, ignore_eos, ...)."""
    logprobs = extra.pop("logprobs", None)
    kw = {"logprobs": logprobs} if logprobs is not None else {}
    return client.chat.completions.create(
        model=model, messages=messages, **GREEDY, **kw, extra_body={"ignore_eos": True, **extra}
    )


def test_continue_final_message_goes_on_with_the_prefilled_reply(client, model):
    """The prompt ends inside the assistant's message (no end of turn, no new header): the completion of exactly
    those tokens."""
    reply = greedy_chat(client, model, PREFILLED, **CONTINUE)
    tokenizer = load_tokenizer(tiny_model_dir("llama"))  # the server's own loader
    ids = tokenizer.apply_chat_template(PREFILLED, continue_final_message=True, tokenize=True, return_dict=False)
    assert tokenizer.decode(ids).endswith(PREFILL)
    completion = client.completions.create(model=model, prompt=list(ids), **GREEDY, extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == completion.choices[0].text
    assert reply.usage.prompt_tokens == len(ids)


def test_echo_puts_the_prefilled_reply_before_the_generated_content(client, model):
    plain = greedy_chat(client, model, PREFILLED, **CONTINUE)
    echoed = greedy_chat(client, model, PREFILLED, echo=True, **CONTINUE)
    message = echoed.choices[0].message
    assert message.role == "assistant"
    assert message.content == PREFILL + plain.choices[0].message.content
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens == GREEDY["max_tokens"]
    assert echoed.usage.prompt_tokens == plain.usage.prompt_tokens
    # Without continue_final_message the reply is a new assistant turn after the given one: echoed all the same.
    new_turn = greedy_chat(client, model, PREFILLED)
    assert (
        greedy_chat(client, model, PREFILLED, echo=True).choices[0].message.content
        == PREFILL + new_turn.choices[0].message.content
    )


def test_echo_of_a_final_user_message_adds_nothing(client, model):
    plain = greedy_chat(client, model, QUESTION)
    echoed = greedy_chat(client, model, QUESTION, echo=True)
    assert echoed.choices[0].message.content == plain.choices[0].message.content
    # Content parts of a final assistant message are joined as the template sees them (newlines, as vLLM).
    parts = QUESTION + [
        {"role": "assistant", "content": [{"type": "text", "text": "The"}, {"type": "text", "text": "answer"}]}
    ]
    reply = greedy_chat(client, model, parts, echo=True, **CONTINUE)
    assert reply.choices[0].message.content.startswith("The\nanswer")


def test_echo_with_logprobs_gives_the_generated_tokens_only(client, model):
    plain = greedy_chat(client, model, PREFILLED, logprobs=True, top_logprobs=2, **CONTINUE)
    echoed = greedy_chat(client, model, PREFILLED, logprobs=True, top_logprobs=2, echo=True, **CONTINUE)
    got, want = echoed.choices[0].logprobs.content, plain.choices[0].logprobs.content
    assert len(got) == len(want) == echoed.usage.completion_tokens
    assert [e.token for e in got] == [e.token for e in want]
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=1e-5)
    assert all(len(e.top_logprobs) == 2 for e in got)
    # No prompt logprobs asked of the engine, so the prompt the previous request cached is used (unlike
    # /v1/completions echo with logprobs, which computes its whole prompt).
    assert echoed.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("messages,prefix", [(PREFILLED, PREFILL), (QUESTION, "")], ids=["assistant", "user"])
def test_streamed_echo_is_its_own_delta_after_the_role(client, model, messages, prefix):
    extra = {"echo": True, **(CONTINUE if prefix else {})}
    whole = greedy_chat(client, model, messages, **extra)
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            **GREEDY,
            n=2,
            stream=True,
            logprobs=True,
            extra_body={"ignore_eos": True, **extra},
        )
    )
    for index in (0, 1):
        deltas = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert deltas[0].delta.role == "assistant" and not deltas[0].delta.content
        if prefix:
            assert deltas[1].delta.content == prefix and deltas[1].logprobs is None
        else:
            assert deltas[1].logprobs is not None  # the first generated token's chunk
        assert "".join(d.delta.content or "" for d in deltas) == whole.choices[0].message.content
        generated = [e.token for d in deltas if d.logprobs for e in d.logprobs.content]
        assert len(generated) == GREEDY["max_tokens"]


def test_bad_chat_echo_fields_are_400s(server):
    url = f"{server.url}/v1/chat/completions"
    for body, param in [
        ({"echo": "yes"}, "echo"),
        ({"continue_final_message": 1}, "continue_final_message"),
        ({"continue_final_message": True}, "continue_final_message"),  # with a generation prompt
        (
            {
                "continue_final_message": True,
                "chat_template_kwargs": {"add_generation_prompt": True},
                "add_generation_prompt": False,
            },
            "continue_final_message",
        ),
    ]:
        response = httpx.post(url, json={"messages": PREFILLED, "max_tokens": 1, **body}, timeout=60)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param, response.text
    ok = httpx.post(url, json={"messages": PREFILLED, "max_tokens": 1, "echo": True, **CONTINUE}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"].startswith(PREFILL)
