"""Reasoning models and the Responses API through a real server (`launch.py` on the CPU, a tiny random model with
the Qwen3 tokenizer and its thinking chat template, --reasoning-parser qwen3, an API key and a store of 4 responses)
with the official `openai` package. A random model does not think on its own, so replies are forced into the
`<think>...</think>answer` shape by a regex, which holds the whole reply (a JSON schema waits for </think>)."""

import json
import re

import jsonschema
import openai
import pytest

from radixserve.client import Client
from radixserve.testing import tiny_model_dir
from server_fixture import launched_server

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

API_KEY = "test-key-responses"
STORE_SIZE = 4
THINK_END = 151668  # </think> of the Qwen3 tokenizer
THINK = r"<think>\n[a-z]{1,8}( [a-z]{1,8}){0,3}\n</think>\n\n"
ANSWER = r"[A-Z][a-z]{1,8}( [a-z]{1,8}){0,3}\."
CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,8}"\}\}\n</tool_call>'
PLAIN = r"[a-z]{1,8}( [a-z]{1,8}){0,3}\."
ENUM = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}}
WEATHER = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS}
HI = [{"role": "user", "content": "Hi, think first."}]


@pytest.fixture(scope="module")
def server():
    with launched_server(
        tiny_model_dir("qwen3", tokenizer="qwen3"),
        "--reasoning-parser",
        "qwen3",
        "--api-key",
        API_KEY,
        "--responses-store-size",
        str(STORE_SIZE),
    ) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.openai_base_url, api_key=API_KEY, max_retries=0, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def streamed_chat(client, **kw):
    reasoning, content, calls, finish = "", "", [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, calls, finish


# ------------------------------------------------------------------------------------------ chat


def test_chat_reasoning_split_whole_streamed_cut_and_in_the_client(server, client, model):
    kw = dict(model=model, messages=HI, temperature=0, extra_body={"regex": THINK + ANSWER})
    whole = client.chat.completions.create(logprobs=True, **kw)
    message = whole.choices[0].message
    assert re.fullmatch(r"[a-z]{1,8}( [a-z]{1,8}){0,3}", message.reasoning_content), message
    assert re.fullmatch(ANSWER, message.content) and whole.choices[0].finish_reason == "stop"
    assert streamed_chat(client, **kw) == (message.reasoning_content, message.content, [], "stop")
    with Client(server.url, api_key=API_KEY) as bundled:
        reply = bundled.chat(HI, temperature=0, regex=THINK + ANSWER)
        assert (reply.reasoning_content, reply.text) == (message.reasoning_content, message.content)
        chunks = list(bundled.chat(HI, stream=True, temperature=0, regex=THINK + ANSWER))
        assert "".join(c.reasoning_content for c in chunks) == message.reasoning_content
    # Cut by max_tokens inside the thinking, right before </think>: all of it is reasoning (the blank line held back
    # in case </think> followed included), and there is no content.
    tokens = [t.token for t in whole.choices[0].logprobs.content]
    assert tokens[tokens.index("</think>") - 1] == "\n"
    cut = dict(kw, max_tokens=tokens.index("</think>"))
    short = client.chat.completions.create(**cut).choices[0]
    assert short.finish_reason == "length" and short.message.content is None
    assert short.message.reasoning_content and message.reasoning_content.startswith(short.message.reasoning_content)
    assert streamed_chat(client, **cut) == (short.message.reasoning_content, "", [], "length")


def test_chat_with_thinking_turned_off_is_all_content(client, model):
    reply = (
        client.chat.completions.create(
            model=model,
            messages=HI,
            temperature=0,
            extra_body={"regex": THINK + ANSWER, "chat_template_kwargs": {"enable_thinking": False}},
        )
        .choices[0]
        .message
    )
    assert getattr(reply, "reasoning_content", None) is None and reply.content.startswith("<think>\n")


def test_chat_tool_calls_are_parsed_from_the_content_after_the_reasoning(client, model):
    kw = dict(model=model, messages=HI, temperature=0, tools=[CHAT_WEATHER], extra_body={"regex": THINK + CALL})
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content and choice.message.tool_calls[0].function.name == "get_weather"
    city = json.loads(choice.message.tool_calls[0].function.arguments)["city"]
    reasoning, content, calls, finish = streamed_chat(client, **kw)
    assert (reasoning, content, finish) == (choice.message.reasoning_content, "", "tool_calls")
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"city": city}


def test_response_format_applies_after_the_reasoning(client, model):
    """</think> gets a huge bias: the model writes it first thing. With thinking on, the schema waits for it and
    holds what follows; with thinking off the template closed the block, so the schema holds the reply from its
    first token and </think> can never be written."""
    kw = dict(
        model=model,
        messages=HI,
        temperature=0,
        logprobs=True,
        max_tokens=30,
        logit_bias={str(THINK_END): 100},
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ENUM}},
    )
    for thinking in (True, False):
        choice = client.chat.completions.create(
            **kw, extra_body={"chat_template_kwargs": {"enable_thinking": thinking}}
        ).choices[0]
        first = choice.logprobs.content[0].token
        assert (first == "</think>") == thinking, (thinking, choice.logprobs.content)
        jsonschema.validate(json.loads(choice.message.content), ENUM)
        assert getattr(choice.message, "reasoning_content", None) is None  # an empty block


# ------------------------------------------------------------------------------------------ /v1/responses


def test_responses_create_whole_and_streamed_then_retrieve(client, model):
    kw = dict(
        model=model,
        input="Hi, think first.",
        instructions="Be brief.",
        temperature=0,
        metadata={"ticket": "42"},
        extra_body={"regex": THINK + ANSWER},
    )
    whole = client.responses.create(**kw)
    assert whole.status == "completed" and [item.type for item in whole.output] == ["reasoning", "message"]
    assert re.fullmatch(ANSWER, whole.output_text) and whole.metadata == {"ticket": "42"}
    reasoning = whole.output[0].content[0].text
    assert re.fullmatch(r"[a-z]{1,8}( [a-z]{1,8}){0,3}", reasoning)
    usage = whole.usage
    assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert (
        kinds[:4]
        == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
        and kinds[-1] == "response.completed"
    )
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert (final.output_text, final.output[0].content[0].text) == (whole.output_text, reasoning)
    for stored in (whole, final):
        again = client.responses.retrieve(stored.id)
        assert (again.id, again.output_text, again.usage.input_tokens) == (
            stored.id,
            stored.output_text,
            stored.usage.input_tokens,
        )


def test_previous_response_id_across_three_turns_hits_the_cache(client, model):
    kw = dict(model=model, temperature=0, extra_body={"regex": PLAIN})
    turns = [client.responses.create(input="Say a few words.", **kw)]
    with client.responses.stream(input="And some more.", previous_response_id=turns[0].id, **kw) as stream:
        turns.append(stream.get_final_response())
    turns.append(client.responses.create(input="Once more.", previous_response_id=turns[1].id, **kw))
    for before, after in zip(turns, turns[1:]):
        # The whole previous turn, prompt and reply, is in the new prompt and served from the radix cache.
        assert after.usage.input_tokens > before.usage.input_tokens + before.usage.output_tokens
        assert (
            after.usage.input_tokens_details.cached_tokens >= before.usage.input_tokens + before.usage.output_tokens - 1
        ), (before.usage, after.usage)
    assert client.responses.retrieve(turns[2].id).previous_response_id == turns[1].id


def test_responses_tools_and_text_format(client, model):
    no_thinking = {"effort": "none"}  # the template closes the block: a schema holds the reply from its start
    call = client.responses.create(
        model=model,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        reasoning=no_thinking,
        temperature=0,
        max_output_tokens=60,
    )
    assert [item.type for item in call.output] == ["function_call"] and call.output[0].name == "get_weather"
    assert set(json.loads(call.output[0].arguments)) == {"city"}
    answer = client.responses.create(
        model=model,
        previous_response_id=call.id,
        tools=[WEATHER],
        reasoning=no_thinking,
        temperature=0,
        extra_body={"regex": PLAIN},
        input=[{"type": "function_call_output", "call_id": call.output[0].call_id, "output": "Sunny, 21 C"}],
    )
    assert answer.status == "completed" and re.fullmatch(PLAIN, answer.output_text)
    # Cached: the previous prompt but the empty think block its generation prompt ended with (4 tokens), which
    # the template does not write for a past turn.
    assert answer.usage.input_tokens_details.cached_tokens >= call.usage.input_tokens - 4
    # Thinking, then a call in the model's own format, streamed.
    with client.responses.stream(
        model=model, input="Weather?", tools=[WEATHER], temperature=0, extra_body={"regex": THINK + CALL}
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    assert "response.function_call_arguments.done" in kinds and final.output[1].name == "get_weather"
    formatted = client.responses.create(
        model=model,
        input="Yes or no?",
        reasoning=no_thinking,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "a", "schema": ENUM}},
    )
    jsonschema.validate(json.loads(formatted.output_text), ENUM)


UNSUPPORTED = [  # (what the request adds, the param named, words of the message)
    (dict(tools=[{"type": "web_search"}]), "tools", ["web_search", "not supported"]),
    (dict(tool_choice={"type": "web_search_preview"}), "tool_choice", ["web_search_preview"]),
    (
        dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]),
        "input",
        ["input[0].content[0].type", "input_image"],
    ),
    (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input", ["item_reference"]),
    (dict(background=True), "background", ["background mode"]),
    (dict(include=["reasoning.encrypted_content"]), "include", ["not supported"]),
    (dict(truncation="auto"), "truncation", ["truncation 'auto'"]),
    (dict(extra_body={"conversation": "conv_1"}), "conversation", ["Conversations API"]),
    (dict(extra_body={"prompt": {"id": "pmpt_1"}}), "prompt", ["prompt templates"]),
    (dict(reasoning={"effort": "low", "summary": "auto"}), "reasoning", ["summaries"]),
    (dict(top_logprobs=2), "top_logprobs", ["not supported"]),
    (dict(max_output_tokens=0), "max_output_tokens", ["at least 1"]),
    (
        dict(
            text={
                "format": {
                    "type": "json_schema",
                    "name": "a",
                    "schema": {"type": "integer", "minimum": 5, "maximum": 1},
                }
            }
        ),
        "text.format",
        ["schema"],
    ),
]


@pytest.mark.parametrize("extra,param,words", UNSUPPORTED, ids=[u[1] for u in UNSUPPORTED])
def test_unsupported_fields_are_400s_naming_them(client, model, extra, param, words):
    body = {"model": model, "input": "Hi", "max_output_tokens": 1, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**body)
    error = info.value.response.json()["error"]
    assert error["param"] == param and error["code"] == 400, error
    assert all(word in error["message"] for word in words), error


def test_unknown_expired_deleted_and_other_salts_ids_are_404s(client, model):
    def assert_404(call, param=None):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        error = info.value.response.json()["error"]
        assert error["code"] == 404 and error["type"] == "not_found_error" and error["param"] == param, error

    assert_404(lambda: client.responses.retrieve("resp_unknown"))
    assert_404(lambda: client.responses.delete("resp_unknown"))
    assert_404(
        lambda: client.responses.create(model=model, input="Hi", previous_response_id="resp_unknown"),
        "previous_response_id",
    )
    kw = dict(model=model, input="Hi", max_output_tokens=1)
    unstored = client.responses.create(store=False, **kw)
    assert_404(lambda: client.responses.retrieve(unstored.id))
    salted = client.responses.create(**kw, extra_body={"cache_salt": "tenant-a"})
    for salt in (None, "tenant-b"):  # never across cache_salts: as unknown
        assert_404(lambda: client.responses.retrieve(salted.id, extra_query={"cache_salt": salt} if salt else None))
        assert_404(
            lambda: client.responses.create(**kw, previous_response_id=salted.id, extra_body={"cache_salt": salt}),
            "previous_response_id",
        )
    assert client.responses.retrieve(salted.id, extra_query={"cache_salt": "tenant-a"}).id == salted.id
    client.responses.create(**kw, previous_response_id=salted.id, extra_body={"cache_salt": "tenant-a"})
    assert_404(lambda: client.responses.delete(salted.id))
    client.responses.delete(salted.id, extra_query={"cache_salt": "tenant-a"})
    assert_404(lambda: client.responses.retrieve(salted.id, extra_query={"cache_salt": "tenant-a"}))
    # The store keeps the newest --responses-store-size responses of an API key.
    made = [client.responses.create(**kw) for _ in range(STORE_SIZE + 1)]
    assert_404(lambda: client.responses.retrieve(made[0].id))
    assert client.responses.retrieve(made[-1].id).id == made[-1].id
