"""Structured outputs and tool calls through a real server (`launch.py` on the CPU) with the official `openai`
package: random JSON schemas sampled at temperature 1 always validate, regex and EBNF replies fullmatch, forced tool
calls always parse (streamed or not), bad grammars are 400s that leave the server healthy, and unconstrained requests
batched with constrained ones get exactly the tokens they get alone."""

import asyncio
import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from radixserve.grammar import WorkerGrammars
from radixserve.sampling import SamplingParams
from radixserve.testing import smollm2_dir, tiny_model_dir
from server_fixture import launched_server
from tokenizer_service.errors import RequestError
from tokenizer_service.structured_outputs import GrammarCheck

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

MODEL_DIR = tiny_model_dir("qwen3")
MAX_TOKENS = 400  # far more than any schema below needs; a reply cut at this length fails the test


@pytest.fixture(scope="module")
def server():
    with launched_server(MODEL_DIR, "--max-running-requests", "32") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0, timeout=600) as client:
        yield client


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def chat(client, model, content="Reply in JSON.", **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], **kw)


# ------------------------------------------------------------------------------------------ without a server


def test_grammar_backend_none_refuses_grammars_and_constrains_nothing():
    tokenizer = _tokenizer()
    check = GrammarCheck("none", tokenizer, 49152, [2])
    asyncio.run(check.check({"temperature": 1.0}))  # unconstrained requests pass
    with pytest.raises(RequestError, match="--grammar-backend none") as info:
        asyncio.run(check.check({"temperature": 1.0, "regex": "a+"}))
    assert info.value.status == 400 and info.value.param == "regex"
    assert WorkerGrammars("none", MODEL_DIR, 49152, [2]).matcher(SamplingParams(regex="a+")) is None
    with pytest.raises(ValueError, match="--grammar-backend"):
        WorkerGrammars("outlines", MODEL_DIR, 49152, [2])


def test_worker_grammars_replay_the_outputs_of_a_retracted_request():
    tokenizer = _tokenizer()
    grammars = WorkerGrammars("xgrammar", MODEL_DIR, 49152, [2])
    params = SamplingParams(regex="(ab)+c")
    assert grammars.matcher(SamplingParams()) is None
    done = tokenizer.encode("ababc", add_special_tokens=False)
    grammar = grammars.matcher(params, done)
    assert grammar.active and grammar.allowed_tokens().nonzero().flatten().tolist() == [2]  # only EOS is left
    # A spec that never went through the front end's check: that request goes unconstrained, the worker lives on.
    assert grammars.matcher(SamplingParams(regex="([a-z")) is None


# ------------------------------------------------------------------------------------------ random schemas


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "number", "boolean", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind == "number":
        low = round(rng.uniform(-100, 100), 2)
        return {"type": "number", "minimum": low, "maximum": low + round(rng.uniform(0.5, 1000), 2)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "a b", 'x"y', "ünï"], rng.randint(1, 4))}
    if kind == "array":
        low = rng.randint(0, 2)
        return {
            "type": "array",
            "items": random_schema(rng, depth + 1),
            "minItems": low,
            "maxItems": low + rng.randint(0, 3),
        }
    names = rng.sample(["id", "name", "size", "tags", "owner", "kind", "when", "ok"], rng.randint(1, 4))
    properties = {name: random_schema(rng, depth + 1) for name in names}
    return {"type": "object", "properties": properties, "required": [n for n in names if rng.random() < 0.7]}


def random_object_schema(rng: random.Random) -> dict:
    schema = random_schema(rng, depth=1) if rng.random() < 0.2 else random_schema(rng, depth=0)
    while schema.get("type") != "object":
        schema = random_schema(rng)
    return schema


def test_fifty_random_schemas_at_temperature_one_all_validate(client, model):
    rng = random.Random(12)
    schemas = [random_object_schema(rng) for _ in range(50)]

    def ask(i: int):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schemas[i], "strict": True}}
        return chat(client, model, response_format=fmt, temperature=1.0, seed=i, max_tokens=MAX_TOKENS)

    with ThreadPoolExecutor(16) as pool:  # concurrent, so constrained rows share batches
        replies = list(pool.map(ask, range(len(schemas))))
    for schema, reply in zip(schemas, replies):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_mode_and_the_completions_route(client, model):
    reply = client.completions.create(
        model=model,
        prompt="{",
        temperature=0.7,
        seed=1,
        max_tokens=MAX_TOKENS,
        extra_body={"regex": r"\{\"n\": [0-9]{1,3}\}"},
    )
    assert re.fullmatch(r"\{\"n\": [0-9]{1,3}\}", reply.choices[0].text)
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}
    reply = client.completions.create(
        model=model,
        prompt="x",
        temperature=1.0,
        seed=2,
        max_tokens=MAX_TOKENS,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}},
    )
    jsonschema.validate(json.loads(reply.choices[0].text), schema)


@pytest.mark.parametrize(
    "pattern", [r"(yes|no|maybe)", r"[A-Z][a-z]{2,8} [0-9]{4}", r"\d{3}-\d{2}-[a-f]{4}", r"(ab|cd){1,6}!"]
)
def test_regex_replies_fullmatch(client, model, pattern):
    replies = chat(client, model, temperature=1.0, seed=5, n=3, max_tokens=64, extra_body={"regex": pattern})
    for choice in replies.choices:
        assert choice.finish_reason == "stop" and re.fullmatch(pattern, choice.message.content), choice


def test_ebnf_reply_fullmatches(client, model):
    grammar = 'root ::= "(" expr ")"\nexpr ::= [0-9] | [0-9] "+" expr'
    reply = chat(client, model, temperature=1.0, seed=3, max_tokens=128, extra_body={"ebnf": grammar})
    assert re.fullmatch(r"\([0-9](\+[0-9])*\)", reply.choices[0].message.content)


@pytest.mark.parametrize(
    "body, words",
    [
        ({"extra_body": {"regex": "([a-z"}}, "invalid regex"),
        ({"extra_body": {"ebnf": "root ::= undefined_rule"}}, "undefined_rule"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{not json"}}},
            "not valid JSON",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
            "frob",
        ),
        ({"logit_bias": {"99999999": 5}}, "outside the vocabulary"),
        ({"logit_bias": {"5": 500}}, "[-100, 100]"),
        (
            {
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
            "nope",
        ),
    ],
)
def test_bad_grammar_is_a_400_and_the_next_request_succeeds(client, model, body, words):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, model, max_tokens=4, **body)
    assert words in info.value.body["message"] if isinstance(info.value.body, dict) else words in str(info.value)
    assert chat(client, model, max_tokens=4, temperature=0).choices[0].finish_reason in ("stop", "length")


def test_logit_bias_forces_and_bans_tokens(server, client, model):
    tokenizer = _tokenizer()
    forced = client.completions.create(
        model=model,
        prompt="Hello",
        temperature=0,
        max_tokens=5,
        logit_bias={"1000": 100},
        extra_body={"ignore_eos": True},
    )
    assert forced.choices[0].text == tokenizer.decode([1000] * 5)

    # The native route takes logit_bias too, and shows token ids.
    def first_token(**sampling):
        body = {"text": "Hello", "sampling_params": {"temperature": 0, "max_new_tokens": 1, **sampling}}
        return httpx.post(f"{server.url}/generate", json=body, timeout=60).json()["output_ids"][0]

    free = first_token()
    assert first_token(logit_bias={str(free): -100}) != free
    assert first_token(logit_bias={"777": 100}) == 777


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


def test_unconstrained_requests_get_the_same_greedy_tokens_beside_constrained_ones(client, model):
    prompts = [f"Count to {i}:" for i in range(4)]

    def plain(prompt):
        return (
            client.completions.create(
                model=model, prompt=prompt, temperature=0, max_tokens=24, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
        )

    alone = [plain(p) for p in prompts]
    schema = {
        "type": "object",
        "properties": {"v": {"type": "array", "items": {"type": "integer"}, "maxItems": 30}},
        "required": ["v"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "v", "schema": schema}}
    with ThreadPoolExecutor(8) as pool:
        constrained = [
            pool.submit(chat, client, model, response_format=fmt, temperature=1.0, seed=i, max_tokens=MAX_TOKENS, n=2)
            for i in range(4)
        ]
        beside = list(pool.map(plain, prompts))
        for future in constrained:
            for choice in future.result().choices:
                jsonschema.validate(json.loads(choice.message.content), schema)
    assert beside == alone


# ------------------------------------------------------------------------------------------ tool calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"hours": {"type": "integer", "minimum": 0, "maximum": 23}},
            "required": ["hours"],
        },
    },
}
TOOLS = [WEATHER, CLOCK]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def streamed_calls(stream):
    calls, finish = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = entry["id"] or call.id
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required_always_parses(client, model, parallel):
    def ask(seed):
        return chat(
            client,
            model,
            "What time is it, and the weather in Oslo?",
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            temperature=1.0,
            seed=seed,
            max_tokens=MAX_TOKENS,
        ).choices[0]

    with ThreadPoolExecutor(4) as pool:
        choices = list(pool.map(ask, range(4)))
    for choice in choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        assert parallel or len(choice.message.tool_calls) == 1
        for call in choice.message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_named_tool_choice_and_streamed_deltas_equal_the_whole_call(client, model):
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kw = dict(tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=MAX_TOKENS)
        whole = chat(client, model, "Weather in Paris?", **kw).choices[0]
        calls, finish = streamed_calls(chat(client, model, "Weather in Paris?", stream=True, **kw))
        assert finish == whole.finish_reason == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls
        ]
        assert all(c["id"].startswith("call_") for c in calls)
    assert whole.message.tool_calls[0].function.name == "get_weather"


def test_tool_history_is_accepted_and_tool_choice_none_gives_content(client, model):
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
    ]
    reply = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8
    )
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason in ("stop", "length")


def test_smollm2_calls_get_weather():
    """The demo model with tool_choice auto. SmolLM2-135M is small: if it answers in prose instead of calling, the
    test says so and checks that tool_choice required gets a valid call from it."""
    with (
        launched_server(smollm2_dir()) as server,
        openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0, timeout=600) as client,
    ):
        model = client.models.list().data[0].id
        client.completions.create(model=model, prompt="Hi", max_tokens=1)  # warm-up: the first step is the slowest
        question = [{"role": "user", "content": "What is the weather in Paris?"}]
        auto = client.chat.completions.create(
            model=model, messages=question, tools=[WEATHER], temperature=0, max_tokens=40
        ).choices[0]
        if auto.message.tool_calls:
            call = auto.message.tool_calls[0]
            assert auto.finish_reason == "tool_calls"
        else:
            print(
                f"SmolLM2 did not call get_weather with tool_choice auto; it said {auto.message.content!r}. "
                f"Checking tool_choice required instead."
            )
            forced = client.chat.completions.create(
                model=model, messages=question, tools=[WEATHER], temperature=0, tool_choice="required", max_tokens=60
            ).choices[0]
            call = forced.message.tool_calls[0]
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
