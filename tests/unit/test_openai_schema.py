"""Validation of OpenAI / native request bodies and their mapping to sampling fields."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tokenizer_service.openai_schema import (
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    openai_error,
    openai_error_from_validation,
    to_sampling_fields,
    validation_error_message,
    validation_error_param,
)

CHAT = [{"role": "user", "content": "Hi"}]


def parse(cls, body):
    """Validate as the server does: from the raw JSON bytes of the request."""
    raw = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return cls.model_validate_json(raw)


def error_of(cls, body) -> dict:
    with pytest.raises(ValidationError) as info:
        parse(cls, body)
    return openai_error_from_validation(info.value)["error"]


# ------------------------------------------------------------------------------- error cases

ERROR_CASES = [
    # (model, body, words the message must contain, param)
    (CompletionRequest, '{"prompt": "x", "temperature": NaN}', ["temperature", "nan"], "temperature"),
    (CompletionRequest, '{"prompt": "x", "temperature": Infinity}', ["temperature", "inf"], "temperature"),
    (CompletionRequest, {"prompt": "x", "temperature": -0.5}, ["temperature", ">= 0"], "temperature"),
    (CompletionRequest, {"prompt": "x", "top_p": 0}, ["top_p", "(0, 1]"], "top_p"),
    (CompletionRequest, {"prompt": "x", "top_p": 1.5}, ["top_p", "(0, 1]"], "top_p"),
    (CompletionRequest, '{"prompt": "x", "top_p": NaN}', ["top_p"], "top_p"),
    (CompletionRequest, {"prompt": "x", "top_k": -2}, ["top_k"], "top_k"),
    (CompletionRequest, {"prompt": "x", "min_p": 1.5}, ["min_p", "[0, 1]"], "min_p"),
    (CompletionRequest, {"prompt": "x", "n": 0}, ["n must be between 1 and 16"], "n"),
    (CompletionRequest, {"prompt": "x", "n": MAX_N + 1}, ["n must be between 1 and 16", "17"], "n"),
    (CompletionRequest, {"prompt": "x", "logprobs": 21}, ["logprobs", "0 and 20"], "logprobs"),
    (CompletionRequest, {"prompt": "x", "logprobs": -1}, ["logprobs", "0 and 20"], "logprobs"),
    (CompletionRequest, {"prompt": "x", "max_tokens": -1}, ["max_tokens", "at least 1"], "max_tokens"),
    (CompletionRequest, {"prompt": "x", "max_tokens": 0}, ["max_tokens", "at least 1"], "max_tokens"),
    (CompletionRequest, {"prompt": ""}, ["prompt must not be empty"], "prompt"),
    (CompletionRequest, {"prompt": []}, ["prompt must not be empty"], "prompt"),
    (CompletionRequest, {"prompt": ["a", ""]}, ["prompt", "empty strings"], "prompt"),
    (CompletionRequest, {"prompt": [[1, 2], []]}, ["prompt", "empty token-id lists"], "prompt"),
    (CompletionRequest, {"prompt": [1, -5]}, ["prompt", "non-negative", "-5"], "prompt"),
    (CompletionRequest, {"prompt": [[1], [2, -1]]}, ["prompt", "non-negative", "-1"], "prompt"),
    (CompletionRequest, {"prompt": [1, "a"]}, ["prompt must be a string, a list of strings"], "prompt"),
    (CompletionRequest, {"prompt": [True]}, ["prompt must be"], "prompt"),
    (CompletionRequest, {"prompt": [1.5]}, ["prompt must be"], "prompt"),
    (CompletionRequest, {"prompt": 42}, ["prompt must be"], "prompt"),
    (CompletionRequest, {"max_tokens": 5}, ["'prompt' is a required field"], "prompt"),
    (
        CompletionRequest,
        {"prompt": "x", "stream_options": {"include_usage": True}},
        ["stream_options", "stream"],
        "stream_options",
    ),
    (CompletionRequest, {"prompt": "x", "stream": False, "stream_options": {}}, ["stream_options"], "stream_options"),
    (
        CompletionRequest,
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}},
        ["stream_options.include_usage", "boolean"],
        "stream_options",
    ),
    # Wrong JSON types of known fields are errors, not coerced.
    (CompletionRequest, {"prompt": "x", "stream": 1}, ["stream", "boolean"], "stream"),
    (CompletionRequest, {"prompt": "x", "stream": "true"}, ["stream", "boolean"], "stream"),
    (CompletionRequest, {"prompt": "x", "temperature": "0.5"}, ["temperature", "number"], "temperature"),
    (CompletionRequest, {"prompt": "x", "max_tokens": 1.5}, ["max_tokens", "integer"], "max_tokens"),
    (CompletionRequest, {"prompt": "x", "n": True}, ["n", "integer"], "n"),
    (CompletionRequest, {"prompt": "x", "model": 3}, ["model", "string"], "model"),
    (CompletionRequest, {"prompt": "x", "stop": 5}, ["stop must be a string or a list of strings"], "stop"),
    (CompletionRequest, {"prompt": "x", "stop": ["a", 1]}, ["stop must be a string or a list of strings"], "stop"),
    (CompletionRequest, {"prompt": "x", "stop": ["s"] * 65}, ["stop may contain at most 64"], "stop"),
    (CompletionRequest, {"prompt": "x", "stop_token_ids": [1, -2]}, ["stop_token_ids", "-2"], "stop_token_ids"),
    (CompletionRequest, {"prompt": "x", "stop_token_ids": 7}, ["stop_token_ids"], "stop_token_ids"),
    (CompletionRequest, {"prompt": "x", "seed": 2**64}, ["seed", "64-bit"], "seed"),
    (CompletionRequest, {"prompt": "x", "presence_penalty": 2.5}, ["presence_penalty", "[-2, 2]"], "presence_penalty"),
    (
        CompletionRequest,
        {"prompt": "x", "frequency_penalty": -3},
        ["frequency_penalty", "[-2, 2]"],
        "frequency_penalty",
    ),
    (
        CompletionRequest,
        {"prompt": "x", "repetition_penalty": 0},
        ["repetition_penalty", "(0, 2]"],
        "repetition_penalty",
    ),
    (
        CompletionRequest,
        {"prompt": "x", "repetition_penalty": 2.5},
        ["repetition_penalty", "(0, 2]"],
        "repetition_penalty",
    ),
    (CompletionRequest, {"prompt": "x", "min_tokens": -1}, ["min_tokens", ">= 0"], "min_tokens"),
    (
        CompletionRequest,
        {"prompt": "x", "min_tokens": 20, "max_tokens": 10},
        ["min_tokens (20)", "max_tokens (10)"],
        None,
    ),
    (CompletionRequest, {"prompt": "x", "echo": 1}, ["echo"], "echo"),
    (CompletionRequest, {"prompt": "x", "priority": 2**31}, ["priority", "32-bit"], "priority"),
    (CompletionRequest, '{"prompt": "x",', ["not valid JSON"], None),
    (CompletionRequest, "[1, 2]", ["must be a JSON object"], None),
    (ChatCompletionRequest, {"messages": []}, ["messages must not be empty"], "messages"),
    (ChatCompletionRequest, {"model": "m"}, ["'messages' is a required field"], "messages"),
    (ChatCompletionRequest, {"messages": "hi"}, ["messages", "array"], "messages"),
    (ChatCompletionRequest, {"messages": [{"role": "robot", "content": "x"}]}, ["messages[0].role"], "messages"),
    (
        ChatCompletionRequest,
        {"messages": [{"role": "user"}]},
        ["'messages[0].content' is a required field"],
        "messages",
    ),
    (
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": 5}]},
        ["messages[0].content", "string or a list"],
        "messages",
    ),
    (
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        ["messages[0].content", "only 'text' content parts", "image_url"],
        "messages",
    ),
    (
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        ["messages[0].content", "content[0].text must be a string"],
        "messages",
    ),
    (ChatCompletionRequest, {"messages": CHAT, "top_logprobs": 3}, ["top_logprobs requires logprobs"], "top_logprobs"),
    (
        ChatCompletionRequest,
        {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
        ["top_logprobs", "0 and 20"],
        "top_logprobs",
    ),
    (ChatCompletionRequest, {"messages": CHAT, "logprobs": 5}, ["logprobs", "boolean"], "logprobs"),
    (
        ChatCompletionRequest,
        {"messages": CHAT, "max_completion_tokens": 0},
        ["max_completion_tokens", "at least 1"],
        "max_completion_tokens",
    ),
    (ChatCompletionRequest, {"messages": CHAT, "max_tokens": -3}, ["max_tokens", "at least 1"], "max_tokens"),
    (ChatCompletionRequest, {"messages": CHAT, "n": 100}, ["n must be between 1 and 16"], "n"),
    (
        ChatCompletionRequest,
        {"messages": CHAT, "stream_options": {"include_usage": True}},
        ["stream_options"],
        "stream_options",
    ),
    (
        ChatCompletionRequest,
        {"messages": CHAT, "min_tokens": 9, "max_completion_tokens": 4},
        ["min_tokens (9)", "max_completion_tokens (4)"],
        None,
    ),
    (GenerateRequest, {"sampling_params": {}}, ["exactly one of text and input_ids"], None),
    (GenerateRequest, {"text": "x", "input_ids": [1]}, ["exactly one of text and input_ids"], None),
    (GenerateRequest, {"text": ""}, ["text must not be empty"], "text"),
    (GenerateRequest, {"text": [1, 2]}, ["text must be a string or a list of strings"], "text"),
    (GenerateRequest, {"input_ids": [3, -1]}, ["input_ids", "non-negative"], "input_ids"),
    (
        GenerateRequest,
        {"input_ids": "abc"},
        ["input_ids must be a list of token ids or a list of token-id lists"],
        "input_ids",
    ),
    (
        GenerateRequest,
        {"text": "x", "sampling_params": {"max_tokens": 5}},
        ["'sampling_params.max_tokens' is not a recognised field"],
        "sampling_params",
    ),
    (
        GenerateRequest,
        {"text": "x", "sampling_params": {"temperature": -1}},
        ["sampling_params.temperature", "temperature must be a finite number >= 0"],
        "sampling_params",
    ),
    (
        GenerateRequest,
        {"text": "x", "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}},
        ["min_new_tokens (5)", "max_new_tokens (2)"],
        "sampling_params",
    ),
    (GenerateRequest, {"text": "x", "top_logprobs_num": 50}, ["top_logprobs_num", "0 and 20"], "top_logprobs_num"),
]


@pytest.mark.parametrize(
    "cls,body,words,param", ERROR_CASES, ids=[f"{c.__name__}-{i}" for i, (c, *_) in enumerate(ERROR_CASES)]
)
def test_invalid_bodies_give_clear_errors(cls, body, words, param):
    error = error_of(cls, body)
    for word in words:
        assert word in error["message"], error["message"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    # One sentence, no pydantic boilerplate for the client to wade through.
    assert "errors.pydantic.dev" not in error["message"] and "\n" not in error["message"]


def test_python_nan_is_rejected_like_json_nan():
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x", "temperature": float("nan")})
    assert validation_error_param(info.value) == "temperature"
    assert "temperature" in validation_error_message(info.value)


def test_openai_error_shape():
    assert openai_error("bad", param="n") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": 400}
    }
    assert openai_error("gone", type="service_unavailable", code=503)["error"]["code"] == 503


# ------------------------------------------------------------------------------- valid bodies


def test_completion_defaults():
    req = parse(CompletionRequest, {"model": "m", "prompt": "Hello"})
    assert to_sampling_fields(req) == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "seed": None,
        "max_new_tokens": 16,
        "min_new_tokens": 0,
        "stop": [],
        "stop_token_ids": [],
        "ignore_eos": False,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "n": 1,
        "logprobs": None,
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
    }


def test_completion_all_fields_and_unknown_fields_ignored():
    body = {
        "model": "m",
        "prompt": [[1, 2, 3], [4]],
        "max_tokens": 50,
        "temperature": 0,  # an integer is a valid JSON number
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "n": 3,
        "stop": ["\n\n", "", "\n\n", "END"],
        "stop_token_ids": [7, 8],
        "seed": -1,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "logprobs": 0,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "min_tokens": 5,
        "ignore_eos": True,
        "include_stop_str_in_output": True,
        "echo": False,
        "user": "u1",
        "best_of": 1,  # unknown to us: ignored, like OpenAI and vLLM do
        "some_future_field": {"nested": [1]},
    }
    req = parse(CompletionRequest, body)
    assert req.stream and req.stream_options.include_usage
    assert req.prompt == [[1, 2, 3], [4]]
    assert to_sampling_fields(req) == {
        "temperature": 0.0,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "seed": -1,
        "max_new_tokens": 50,
        "min_new_tokens": 5,
        "stop": ["\n\n", "END"],  # empty dropped, duplicates merged, order kept
        "stop_token_ids": [7, 8],
        "ignore_eos": True,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "n": 3,
        "logprobs": 0,
        "include_stop_str_in_output": True,
        "skip_special_tokens": True,
    }


@pytest.mark.parametrize("prompt", ["Hello", ["a", "b"], [0, 5, 151643], [[1], [2, 3]]])
def test_completion_prompt_shapes(prompt):
    assert parse(CompletionRequest, {"prompt": prompt}).prompt == prompt


@pytest.mark.parametrize("top_k,expected", [(None, -1), (-1, -1), (0, -1), (1, 1), (50, 50)])
def test_top_k_off_values_map_to_minus_one(top_k, expected):
    assert to_sampling_fields(parse(CompletionRequest, {"prompt": "x", "top_k": top_k}))["top_k"] == expected


def test_single_stop_string_and_limits_accepted():
    req = parse(CompletionRequest, {"prompt": "x", "stop": "###", "n": MAX_N, "logprobs": 20, "top_p": 1})
    fields = to_sampling_fields(req)
    assert fields["stop"] == ["###"] and fields["n"] == MAX_N and fields["logprobs"] == 20


def test_chat_request_fields():
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Line one"}, {"type": "text", "text": "Line two"}]},
            {"role": "assistant", "content": "Ok", "name": "bot", "tool_calls": []},
        ],
        "max_tokens": 100,
        "max_completion_tokens": 30,
        "logprobs": True,
        "top_logprobs": 5,
        "temperature": 0.7,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    req = parse(ChatCompletionRequest, body)
    assert req.effective_max_tokens == 30  # max_completion_tokens wins over the deprecated max_tokens
    assert req.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Line one\nLine two"},
        {"role": "assistant", "content": "Ok", "name": "bot"},
    ]
    assert req.add_generation_prompt and req.chat_template_kwargs == {"enable_thinking": False}
    fields = to_sampling_fields(req)
    assert fields["max_new_tokens"] == 30 and fields["logprobs"] == 5 and fields["temperature"] == 0.7


@pytest.mark.parametrize(
    "extra,max_new_tokens,logprobs",
    [
        ({}, None, None),  # no limit given: up to the context length, resolved by the server
        ({"max_tokens": 12}, 12, None),
        ({"logprobs": True}, None, 0),  # logprob of the chosen token only
        ({"logprobs": False}, None, None),
    ],
)
def test_chat_max_tokens_and_logprobs_mapping(extra, max_new_tokens, logprobs):
    fields = to_sampling_fields(parse(ChatCompletionRequest, {"messages": CHAT, **extra}))
    assert fields["max_new_tokens"] == max_new_tokens and fields["logprobs"] == logprobs


def test_generate_request_native_names():
    req = parse(
        GenerateRequest,
        {
            "text": "Hello",
            "sampling_params": {
                "max_new_tokens": 8,
                "min_new_tokens": 2,
                "temperature": 0,
                "stop": "x",
                "skip_special_tokens": False,
            },
            "stream": True,
            "return_logprob": True,
            "top_logprobs_num": 3,
        },
    )
    fields = to_sampling_fields(req)
    assert req.stream
    assert fields["max_new_tokens"] == 8 and fields["min_new_tokens"] == 2
    assert fields["stop"] == ["x"] and fields["logprobs"] == 3 and fields["skip_special_tokens"] is False


@pytest.mark.parametrize("body", [{"input_ids": [1, 2]}, {"input_ids": [1, 2], "sampling_params": None}])
def test_generate_request_defaults(body):
    req = parse(GenerateRequest, body)
    fields = to_sampling_fields(req)
    assert req.input_ids == [1, 2] and fields["max_new_tokens"] == 128 and fields["logprobs"] is None


def test_fields_build_valid_sampling_params():
    # The fields feed radixserve.sampling.SamplingParams (n is fanned out by the server instead).
    from radixserve.sampling import SamplingParams

    req = parse(
        ChatCompletionRequest,
        {
            "messages": CHAT,
            "max_tokens": 9,
            "top_k": 0,
            "stop": "x",
            "repetition_penalty": 2,
            "logprobs": True,
            "top_logprobs": 20,
        },
    )
    fields = to_sampling_fields(req)
    params = SamplingParams(**{k: v for k, v in fields.items() if k != "n"})
    params.validate()
    assert params.max_new_tokens == 9 and params.top_k == -1 and params.logprobs == 20


def test_to_sampling_fields_rejects_other_objects():
    with pytest.raises(TypeError):
        to_sampling_fields({"prompt": "x"})
