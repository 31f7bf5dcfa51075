"""Tool calls: parsing the Qwen and Llama 3 formats whole and streamed (the streamed deltas add up to the whole
parse, however the text is cut), tool_choice resolution and its enforcing schemas, and prompt rendering through a
chat template that knows tools and one that does not."""

import json
import random

import jsonschema
import pytest

from tokenizer_service.tool_calls import (
    ToolChoice,
    check_tools,
    make_streamer,
    parse_reply,
    render_messages,
    resolve_parser_name,
    resolve_tool_choice,
    tool_choice_schema,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
TOOLS = [WEATHER, TIME]
AUTO = ToolChoice("auto")


def streamed(text: str, parser: str, choice: ToolChoice, seed: int):
    """Feed text in random pieces; return (content, [(name, arguments)]) rebuilt from the deltas alone."""
    rng, streamer, deltas, pos = random.Random(seed), make_streamer(parser, choice), [], 0
    while pos < len(text):
        step = rng.randint(1, 7)
        deltas += streamer.feed(text[pos : pos + step])
        pos += step
    deltas += streamer.finish()
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"name": "", "arguments": "", "id": None})
            entry["id"] = entry["id"] or call.get("id")
            entry["name"] += call.get("function", {}).get("name", "")
            entry["arguments"] += call["function"].get("arguments", "")
    assert all(c["id"] and c["id"].startswith("call_") for c in calls.values())
    return content, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]


def whole(text: str, parser: str, choice: ToolChoice):
    reply = parse_reply(text, parser, choice)
    return reply.content, [(c.name, c.arguments) for c in reply.tool_calls]


QWEN_CASES = [
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
        "Let me check.",
        [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"zone": "CET"}')],
    ),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}', None, [("get_time", '{"zone": "UTC"}')]),
    (
        "It is sunny in Paris, I think. 1 < 2 and <tool is a word.",
        "It is sunny in Paris, I think. 1 < 2 and <tool is a word.",
        [],
    ),
    ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
]


@pytest.mark.parametrize("text, content, calls", QWEN_CASES)
def test_qwen_format_parses_whole_and_streamed_alike(text, content, calls):
    assert whole(text, "qwen", AUTO) == (content, calls)
    for seed in range(5):
        streamed_content, streamed_calls = streamed(text, "qwen", AUTO, seed)
        assert streamed_calls == calls
        assert (streamed_content.strip() or None) == content


LLAMA3_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", '{"city": "Paris"}')]),
    (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
        '{"name": "get_time", "parameters": {"zone": "a;b"}}',
        None,
        [("get_weather", '{"city": "Rome"}'), ("get_time", '{"zone": "a;b"}')],
    ),
    ("The weather is fine.", "The weather is fine.", []),
    ('{"name": "get_weather", "parameters": {"city": ', '{"name": "get_weather", "parameters": {"city": ', []),
]


@pytest.mark.parametrize("text, content, calls", LLAMA3_CASES)
def test_llama3_format_parses_whole_and_streamed_alike(text, content, calls):
    assert whole(text, "llama3", AUTO) == (content, calls)
    for seed in range(5):
        streamed_content, streamed_calls = streamed(text, "llama3", AUTO, seed)
        assert streamed_calls == calls and (streamed_content or None) == content


def test_tool_choice_none_keeps_everything_as_content():
    text = QWEN_CASES[0][0]
    assert whole(text, "qwen", ToolChoice("none")) == (text, [])


def test_resolve_tool_choice():
    assert resolve_tool_choice(None, TOOLS) == ToolChoice("auto")
    assert resolve_tool_choice(None, None) == ToolChoice("none")
    assert resolve_tool_choice("required", TOOLS) == ToolChoice("required")
    assert resolve_tool_choice({"type": "function", "function": {"name": "get_time"}}, TOOLS) == ToolChoice(
        "named", "get_time"
    )
    for bad, words in [
        ("always", "must be 'none'"),
        ({"type": "function", "function": {"name": "nope"}}, "nope"),
        ({"function": {"name": "get_time"}}, "must be a string or"),
    ]:
        with pytest.raises(ValueError, match=words):
            resolve_tool_choice(bad, TOOLS)
    with pytest.raises(ValueError, match="needs at least one tool"):
        resolve_tool_choice("required", [])


def test_check_tools_names_the_problem():
    check_tools(TOOLS)
    for tools, words in [
        ([{"type": "function"}], r"tools\[0\] must be"),
        ([WEATHER, WEATHER], "used by another tool"),
        ([{"type": "function", "function": {"name": ""}}], "non-empty string"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "JSON Schema object"),
    ]:
        with pytest.raises(ValueError, match=words):
            check_tools(tools)


def test_forced_choices_parse_what_their_schema_admits():
    required = json.loads(tool_choice_schema(ToolChoice("required"), TOOLS, parallel_tool_calls=True))
    reply = (
        '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", "parameters": {"city": "X"}}]'
    )
    jsonschema.validate(json.loads(reply), required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}], required)  # zone is required
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], required)
    single = json.loads(tool_choice_schema(ToolChoice("required"), TOOLS, parallel_tool_calls=False))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(reply), single)
    expected = [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "X"}')]
    assert whole(reply, "qwen", ToolChoice("required")) == (None, expected)
    assert streamed(reply, "qwen", ToolChoice("required"), 0) == ("", expected)

    named = ToolChoice("named", "get_weather")
    assert json.loads(tool_choice_schema(named, TOOLS)) == WEATHER["function"]["parameters"]
    assert whole('{"city": "Oslo"}', "llama3", named) == (None, [("get_weather", '{"city": "Oslo"}')])
    assert tool_choice_schema(AUTO, TOOLS) is None and tool_choice_schema(ToolChoice("none"), TOOLS) is None
    # Cut short by max_tokens: no call, the text stays as content.
    assert whole('[{"name": "get_ti', "qwen", ToolChoice("required")) == ('[{"name": "get_ti', [])


def test_parser_is_picked_from_the_template():
    assert resolve_parser_name("auto", "{{ '<tool_call>' }} {{ tools }}") == "qwen"
    assert resolve_parser_name("auto", '{{ "<|python_tag|>" }} "parameters" {{ tools }}') == "llama3"
    assert resolve_parser_name("auto", "{{ message['content'] }}") == "qwen"
    assert resolve_parser_name("qwen3", None) == "qwen"
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        resolve_parser_name("mistral", None)


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


def test_render_through_a_template_without_tools_describes_them_in_the_system_message():
    from radixserve.testing import smollm2_dir
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    messages = render_messages(HISTORY, TOOLS, tokenizer.chat_template)
    prompt = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nYou may call the functions")
    assert '"name": "get_weather"' in prompt and '"description": "Current weather in a city"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<|im_start|>tool\n{"temp": 21}<|im_end|>' in prompt
    # An existing system message keeps its text and gains the tools.
    with_system = render_messages([{"role": "system", "content": "Be brief."}] + HISTORY[:1], TOOLS, None)
    assert with_system[0]["content"].startswith("Be brief.\n\nYou may call") and len(with_system) == 2


def test_render_through_a_template_with_tools_passes_arguments_as_objects():
    template = (
        "{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}{% for m in messages %}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }}\n"
        "{% endfor %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    from jinja2 import Template

    messages = render_messages(HISTORY, TOOLS, template)
    text = Template(template).render(messages=messages, tools=TOOLS)
    assert "TOOL get_weather\nTOOL get_time\n" in text and "CALL get_weather Paris\n" in text
    assert messages[1]["content"] == ""  # None would break templates that concatenate content


# ------------------------------------------------------------------------------------------ request fields


def _chat_fields(body: dict):
    from tokenizer_service.structured_fields import ChatStructuredFields

    return ChatStructuredFields.model_validate_json(json.dumps(body))


def test_request_fields_become_sampling_fields():
    from tokenizer_service.structured_fields import sampling_fields

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    assert sampling_fields(_chat_fields({"response_format": fmt, "logit_bias": {"7": -100}})) == {
        "json_schema": json.dumps(schema),
        "logit_bias": {7: -100.0},
    }
    assert sampling_fields(_chat_fields({"response_format": {"type": "json_object"}})) == {
        "json_schema": '{"type": "object"}'
    }
    assert sampling_fields(_chat_fields({"response_format": {"type": "text"}, "regex": "a+"})) == {"regex": "a+"}
    named = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    assert json.loads(sampling_fields(_chat_fields(named))["json_schema"]) == TIME["function"]["parameters"]
    assert sampling_fields(_chat_fields({"tools": TOOLS})) == {}  # auto: the model is free


@pytest.mark.parametrize(
    "body, words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{oops"}}},
            "not valid JSON",
        ),
        ({"response_format": {"type": "json_schema"}}, "needs a json_schema object"),
        ({"response_format": {"type": "json_object"}, "regex": "a"}, "only one of"),
        ({"logit_bias": {"x": 1}}, "keys must be token ids"),
        ({"logit_bias": {"1": 101}}, "[-100, 100]"),
        ({"logit_bias": {"1": True}}, "must be a number"),
        ({"tools": TOOLS, "tool_choice": "required", "regex": "a"}, "cannot be combined"),
        ({"tools": [WEATHER, WEATHER]}, "used by another tool"),
        ({"tool_choice": "required"}, "needs at least one tool"),
    ],
)
def test_bad_request_fields_name_the_problem(body, words):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        _chat_fields(body)
    assert words in str(info.value)


def test_chat_tools_stream_and_whole_replies_agree():
    from transformers import AutoTokenizer

    from radixserve.testing import smollm2_dir
    from tokenizer_service.structured_outputs import ChatTools

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    tools = ChatTools(_chat_fields({"tools": TOOLS}), "auto", tokenizer)
    text = QWEN_CASES[1][0]
    message, finish = tools.message(text, "stop")
    assert finish == "tool_calls" and message["content"] == "Let me check."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    pieces = [text[i : i + 9] for i in range(0, len(text), 9)]
    deltas = [
        tools.stream_delta(0, piece, i == len(pieces) - 1, "stop" if i == len(pieces) - 1 else None)
        for i, piece in enumerate(pieces)
    ]
    assert deltas[-1][1] == "tool_calls"
    calls = [c for delta, _ in deltas for c in delta.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (i, c["function"]["name"], c["function"]["arguments"]) for i, c in enumerate(message["tool_calls"])
    ]
    assert "".join(delta.get("content", "") for delta, _ in deltas).strip() == "Let me check."
    plain = ChatTools(_chat_fields({}), "auto", tokenizer)
    assert plain.message("hi", "stop") == ({"role": "assistant", "content": "hi"}, "stop")
    assert plain.stream_delta(0, "hi", False, None) == ({"content": "hi"}, None)
