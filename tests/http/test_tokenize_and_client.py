"""Through one real server (`launch.py` on the CPU, tiny Qwen3, --enable-priority-scheduling):

* /v1/tokenize and /v1/detokenize with vLLM's shapes: a prompt as the tokenizer encodes it, chat messages exactly as
  /v1/chat/completions counts them, token ids back to text, and bad bodies as OpenAI-format 400s;
* `priority` accepted on every generating route when the flag is on (tests/scheduler/test_priority.py shows the order);
* the Python client's response_format, tools and tool_choice, with parsed tool calls, sync and async, streamed or
  not."""

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from radixserve.client import AsyncClient, Client, tool_calls_from_deltas
from radixserve.testing import tiny_model_dir
from server_fixture import launched_server

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

MODEL_DIR = tiny_model_dir("qwen3")
CITIES = ["Paris", "Oslo", "Lima"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": CITIES}},
            "required": ["city"],
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": CITIES}, "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "rank"],
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    with launched_server(MODEL_DIR, "--enable-priority-scheduling") as server:
        yield server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


# ----------------------------------------------------------------------------------------- tokenize / detokenize


def test_tokenize_a_prompt_as_the_tokenizer_does(http, tokenizer):
    text = "Hello, radix world! 123"
    max_model_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    body = http.post("/v1/tokenize", json={"prompt": text}).json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == max_model_len and body["token_strs"] is None
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    assert plain.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert plain.json()["token_strs"] == tokenizer.convert_ids_to_tokens(plain.json()["tokens"])
    back = http.post("/v1/detokenize", json={"tokens": plain.json()["tokens"]}).json()
    assert back == {"prompt": text}
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("tools", [None, [WEATHER]])
def test_tokenized_messages_count_what_the_chat_route_counts(http, tools):
    messages = [{"role": "system", "content": "Be brief."}, *ASK]
    extra = {"tools": tools} if tools else {}
    counted = http.post("/v1/tokenize", json={"messages": messages, **extra}).json()
    reply = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, **extra}).json()
    assert counted["count"] == reply["usage"]["prompt_tokens"] == len(counted["tokens"])
    without_prompt = http.post("/v1/tokenize", json={"messages": messages, "add_generation_prompt": False, **extra})
    assert without_prompt.json()["count"] < counted["count"]
    # A final assistant message left open (continue_final_message) counts what the chat route renders for it.
    prefilled = [*messages, {"role": "assistant", "content": "The weather"}]
    fields = {"messages": prefilled, "add_generation_prompt": False, "continue_final_message": True, **extra}
    open_counted = http.post("/v1/tokenize", json=fields).json()
    open_reply = http.post("/v1/chat/completions", json={**fields, "max_tokens": 1}).json()
    closed = http.post("/v1/tokenize", json={**fields, "continue_final_message": False}).json()
    assert open_counted["count"] == open_reply["usage"]["prompt_tokens"] < closed["count"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/tokenize", {"prompt": "a", "messages": ASK}, None),
        ("/v1/tokenize", {}, None),
        ("/v1/tokenize", {"prompt": 5}, "prompt"),
        ("/v1/tokenize", {"messages": [{"role": "user"}]}, "messages"),
        (
            "/v1/tokenize",
            {"messages": ASK, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
            "chat_template_kwargs",
        ),
        ("/v1/tokenize", {"messages": ASK, "continue_final_message": True}, "continue_final_message"),
        ("/v1/detokenize", {"tokens": [1, -2]}, "tokens"),
        ("/v1/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/v1/detokenize", {"tokens": "12"}, "tokens"),
        ("/v1/detokenize", {}, "tokens"),
    ],
)
def test_bad_tokenize_bodies_are_openai_400s(http, path, body, param):
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400 and error["message"]
    if param is not None:
        assert error["param"] == param
    assert http.post(path, json={**body, "model": "nope"}).status_code in (400, 404)


def test_unknown_model_is_a_404(http):
    response = http.post("/v1/tokenize", json={"prompt": "hi", "model": "nope"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"


# ------------------------------------------------------------------------------------------------- priority


def test_priority_is_accepted_on_every_route_with_the_flag(http):
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": 5}).status_code == 200
    assert http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, "priority": -3}).status_code == 200
    assert (
        http.post("/generate", json={"text": "hi", "priority": 9, "sampling_params": {"max_new_tokens": 2}}).status_code
        == 200
    )
    too_big = http.post("/v1/completions", json={"prompt": "hi", "priority": 2**40})
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "priority"


# ---------------------------------------------------------------------------------------------- Python client


def check_weather_call(calls):
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].arguments["city"] in CITIES and json.loads(calls[0].arguments_json) == calls[0].arguments


def test_client_response_format_and_tool_calls(server):
    with Client(server.url) as client:
        reply = client.chat(ASK, response_format=RESPONSE_FORMAT, max_tokens=60, temperature=1)
        jsonschema.validate(json.loads(reply.text), SCHEMA)
        completion = client.completions("City as JSON:", response_format=RESPONSE_FORMAT, max_tokens=60)
        jsonschema.validate(json.loads(completion.text), SCHEMA)

        reply = client.chat(ASK, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0)
        assert reply.finish_reason == "tool_calls" and reply.choices[0].finish_reason == "tool_calls"
        check_weather_call(reply.tool_calls)
        named = {"type": "function", "function": {"name": "get_weather"}}
        check_weather_call(client.chat(ASK, tools=[WEATHER], tool_choice=named, max_tokens=60).tool_calls)

        chunks = list(
            client.chat(ASK, stream=True, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0)
        )
        streamed = tool_calls_from_deltas(d for c in chunks for d in c.tool_call_deltas)
        assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in reply.tool_calls]
        assert any(c.finish_reason == "tool_calls" for c in chunks)
        assert client.chat(ASK, tools=[WEATHER], tool_choice="none", max_tokens=5).tool_calls == []


def test_async_client_response_format_and_tool_calls(server):
    async def run():
        async with AsyncClient(server.url) as client:
            reply = await client.chat(ASK, response_format=RESPONSE_FORMAT, max_tokens=60, temperature=1)
            jsonschema.validate(json.loads(reply.text), SCHEMA)
            reply = await client.chat(ASK, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0)
            check_weather_call(reply.tool_calls)
            stream = await client.chat(
                ASK, stream=True, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0
            )
            deltas = [d async for c in stream for d in c.tool_call_deltas]
            assert [c.arguments for c in tool_calls_from_deltas(deltas)] == [c.arguments for c in reply.tool_calls]

    asyncio.run(run())


def test_client_tool_call_matches_the_openai_package(server):
    with (
        openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0, timeout=300) as official,
        Client(server.url) as client,
    ):
        model = official.models.list().data[0].id
        theirs = (
            official.chat.completions.create(
                model=model, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0
            )
            .choices[0]
            .message.tool_calls[0]
        )
        ours = client.chat(ASK, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0).tool_calls[0]
        assert (ours.name, ours.arguments_json) == (theirs.function.name, theirs.function.arguments)
        assert ours.id is not None and ours.id.startswith("call")
