"""Request bodies the HTTP front end accepts (OpenAI routes and native /generate), with validation.

Models are strict: a known field with the wrong JSON type (`"stream": 1`, `"temperature": "0.5"`) is an
error, as with OpenAI. Unknown fields are ignored, as OpenAI and vLLM do, so newer clients keep working
(the native `sampling_params` is the exception: a typo there would silently change sampling).
Every check here needs only the body; checks that need the model (vocabulary size, context length,
model name) belong to the server.

Error messages name the field and the allowed range, because clients show them to people verbatim.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tokenizer_service.structured_fields import (AssistantToolCall, ChatStructuredFields, NativeStructuredFields,
                                                 StructuredOutputFields, sampling_fields)

MAX_N = 16  # choices per request; each one is a sequence in the batch and holds KV
MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's limit for chat)
MAX_STOP_STRINGS = 64  # every stop string is checked on every generated token
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
# chat_template_kwargs a request may set: harmless switches that chat templates read (Qwen3, DeepSeek).
CHAT_TEMPLATE_KWARGS = frozenset({"enable_thinking", "thinking", "add_generation_prompt"})

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_NATIVE_MAX_NEW_TOKENS = 128  # SGLang's default for /generate


# ------------------------------------------------------------------------------------------ errors


def openai_error(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: int = 400
) -> dict:
    """The body of an OpenAI error response: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_UNION_MEMBER_TAGS = {"str", "int", "float", "bool", "list", "dict"}


def _format_loc(loc: tuple) -> str:
    path = ""
    for part in loc:
        if isinstance(part, str) and (not part.isidentifier() or part in _UNION_MEMBER_TAGS):
            continue  # pydantic's tag of a union member, e.g. "list[TextContentPart]"
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def validation_error_param(exc: ValidationError) -> str | None:
    """The top-level request field of the first error (OpenAI's `param`), or None for the whole body."""
    errors = exc.errors()
    if not errors or not errors[0]["loc"]:
        return None
    return str(errors[0]["loc"][0])


def validation_error_message(exc: ValidationError) -> str:
    """One readable sentence for the first error, naming the field, e.g.
    "temperature must be a finite number >= 0, got nan" or "messages[0].role: Input should be ...".
    """
    errors = exc.errors()
    if not errors:
        return "Invalid request"
    error = errors[0]
    loc, kind = error["loc"], error["type"]
    path = _format_loc(loc)
    if kind == "value_error":
        # Our own validators write complete sentences that name the field already.
        message = str(error["ctx"]["error"]) if "ctx" in error else error["msg"].removeprefix("Value error, ")
        return message if len(loc) <= 1 else f"{path}: {message}"
    if kind == "missing":
        return f"'{path}' is a required field"
    if kind == "extra_forbidden":
        return f"'{path}' is not a recognised field"
    if kind == "json_invalid":
        return f"Request body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}"
    if not loc:
        if kind in ("model_type", "dict_type", "model_attributes_type"):
            return "Request body must be a JSON object"
        return error["msg"]
    return f"{path}: {error['msg']}"


def openai_error_from_validation(exc: ValidationError) -> dict:
    return openai_error(validation_error_message(exc), param=validation_error_param(exc))


# ------------------------------------------------------------------------------ field checks


def _check_token_ids(name: str, ids: list) -> list[int]:
    # bool is an int subclass in Python; JSON true/false is never a token id.
    for token in ids:
        if not isinstance(token, int) or isinstance(token, bool):
            raise ValueError(f"{name} must contain only integer token ids, got {token!r}")
        if token < 0:
            raise ValueError(f"{name} must contain only non-negative token ids, got {token}")
    return ids


def _check_prompt(name: str, value: Any, allow_text: bool = True, allow_ids: bool = True):
    """Accepts the OpenAI prompt shapes: str, list[str], list[int], list[list[int]], none empty."""
    shapes = []
    if allow_text:
        shapes += ["a string", "a list of strings"]
    if allow_ids:
        shapes += ["a list of token ids", "a list of token-id lists"]
    shape_error = ValueError(f"{name} must be {', '.join(shapes[:-1])} or {shapes[-1]}")

    if isinstance(value, str):
        if not allow_text:
            raise shape_error
        if not value:
            raise ValueError(f"{name} must not be empty")
        return value
    if not isinstance(value, list):
        raise shape_error
    if not value:
        raise ValueError(f"{name} must not be empty")
    if allow_text and all(isinstance(item, str) for item in value):
        if any(not item for item in value):
            raise ValueError(f"{name} must not contain empty strings")
        return value
    if allow_ids and all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        return _check_token_ids(name, value)
    if allow_ids and all(isinstance(item, list) for item in value):
        for ids in value:
            if not ids:
                raise ValueError(f"{name} must not contain empty token-id lists")
            _check_token_ids(name, ids)
        return value
    raise shape_error


# ------------------------------------------------------------------------------------ models


class _StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_StrictModel):
    include_usage: bool = False


class _SamplingFields(_StrictModel):
    """Sampling fields shared by the OpenAI routes and the native sampling_params."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # -1 or 0: off
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # vLLM extension; False shows e.g. <|im_end|> in the text

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {value}")
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: float | None) -> float | None:
        if value is not None and not (0 < value <= 1):  # NaN fails both comparisons
            raise ValueError(f"top_p must be in (0, 1], got {value}")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or a positive integer, got {value}")
        return value

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, value: float | None) -> float | None:
        if value is not None and not (0 <= value <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {value}")
        return value

    @field_validator("n")
    @classmethod
    def _n(cls, value: int) -> int:
        if not 1 <= value <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N}, got {value}")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("stop must be a string or a list of strings")
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may contain at most {MAX_STOP_STRINGS} strings, got {len(value)}")
        return value

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_token_ids(cls, value: Any) -> Any:
        if value is None:
            return value
        if not isinstance(value, list):
            raise ValueError("stop_token_ids must be a list of token ids")
        return _check_token_ids("stop_token_ids", value)

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int | None) -> int | None:
        if value is not None and not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(f"seed must fit in a signed 64-bit integer, got {value}")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _additive_penalty(cls, value: float, info) -> float:
        if not (-2 <= value <= 2):
            raise ValueError(f"{info.field_name} must be in [-2, 2], got {value}")
        return value

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty(cls, value: float) -> float:
        # Same range as radixserve.sampling.SamplingParams.validate, so nothing passes here and fails there.
        if not (0 < value <= 2):
            raise ValueError(f"repetition_penalty must be in (0, 2], got {value}")
        return value


def _check_max_tokens(name: str, value: int | None) -> int | None:
    if value is not None and value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


def _check_min_tokens(name: str, value: int) -> int:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _check_logprobs_count(name: str, value: int | None) -> int | None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ValueError(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}")
    return value


class _OpenAIRequest(_SamplingFields):
    model: str | None = None  # checked against the served model by the server
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_tokens: int = 0
    user: str | None = None

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, value: int) -> int:
        return _check_min_tokens("min_tokens", value)

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info) -> StreamOptions | None:
        # A field validator (not a model one) so the error names stream_options; stream comes first.
        if value is not None and not info.data.get("stream", False):
            raise ValueError("stream_options can only be set when stream is true")
        return value

    def _check_min_le_max(self, max_tokens: int | None, max_name: str) -> None:
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed {max_name} ({max_tokens})")


class CompletionRequest(_OpenAIRequest, StructuredOutputFields):
    """POST /v1/completions"""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: int | None = None  # number of top logprobs per token
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        return _check_prompt("prompt", value)

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None) -> int | None:
        return _check_max_tokens("max_tokens", value)

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: int | None) -> int | None:
        return _check_logprobs_count("logprobs", value)

    @field_validator("echo")
    @classmethod
    def _echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value

    @model_validator(mode="after")
    def _min_le_max(self):
        self._check_min_le_max(self.max_tokens, "max_tokens")
        return self


class TextContentPart(_StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(_StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None  # null (or left out) only beside an assistant's tool_calls
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an earlier assistant turn's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="before")
    @classmethod
    def _tool_calls_may_leave_out_content(cls, data: Any) -> Any:
        if isinstance(data, dict) and "content" not in data and data.get("role") == "assistant" \
                and data.get("tool_calls"):
            return {**data, "content": None}
        return data

    @model_validator(mode="after")
    def _content_or_tool_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required, except in an assistant message with tool_calls")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("content must be a string or a list of content parts")
        # Checked here in full so that errors name the problem rather than each member of the union.
        for index, part in enumerate(value):
            if not isinstance(part, dict):
                raise ValueError(f'content[{index}] must be an object like {{"type": "text", "text": "..."}}')
            if part.get("type") != "text":
                raise ValueError(f"only 'text' content parts are supported, got type {part.get('type')!r}")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content[{index}].text must be a string")
        return value

    def text_content(self) -> str:
        """Content as one string: chat templates (Qwen3's among them) expect a string. Parts are
        joined with newlines, as vLLM does."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_OpenAIRequest, ChatStructuredFields):
    """POST /v1/chat/completions"""

    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, bool] | None = None  # e.g. {"enable_thinking": false} for Qwen3

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _chat_template_kwargs(cls, value: Any) -> Any:
        # Only named switches of the server's own template: a client-supplied template (or any other argument of
        # apply_chat_template) would let a request run arbitrary Jinja in the server.
        if value is None:
            return value
        if not isinstance(value, dict):
            raise ValueError("chat_template_kwargs must be an object")
        for key, flag in value.items():
            if key not in CHAT_TEMPLATE_KWARGS:
                raise ValueError(f"chat_template_kwargs key {key!r} is not accepted; the chat template is the "
                                 f"server's own and only {', '.join(sorted(CHAT_TEMPLATE_KWARGS))} may be set")
            if not isinstance(flag, bool):
                raise ValueError(f"chat_template_kwargs.{key} must be a boolean, got {flag!r}")
        return value

    @field_validator("messages")
    @classmethod
    def _messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages must not be empty")
        return value

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None, info) -> int | None:
        return _check_max_tokens(info.field_name, value)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None, info) -> int | None:
        if value is not None and not info.data.get("logprobs", False):
            raise ValueError("top_logprobs requires logprobs to be true")
        return _check_logprobs_count("top_logprobs", value)

    @model_validator(mode="after")
    def _min_le_max(self):
        if self.max_completion_tokens is not None:
            self._check_min_le_max(self.max_completion_tokens, "max_completion_tokens")
        else:
            self._check_min_le_max(self.max_tokens, "max_tokens")
        return self

    @property
    def effective_max_tokens(self) -> int | None:
        """None: until the context is full (the server fills it in)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as plain dicts with string content, for `tokenizer.apply_chat_template`."""
        out = []
        for message in self.messages:
            item = {"role": message.role, "content": message.text_content()}
            if message.name is not None:
                item["name"] = message.name
            if message.tool_calls:
                item["tool_calls"] = [call.model_dump() for call in message.tool_calls]
            if message.tool_call_id is not None:
                item["tool_call_id"] = message.tool_call_id
            out.append(item)
        return out


class NativeSamplingParams(_SamplingFields, NativeStructuredFields):
    """`sampling_params` of POST /generate, with SGLang's names."""

    model_config = ConfigDict(strict=True, extra="forbid")

    max_new_tokens: int | None = DEFAULT_NATIVE_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    # SGLang's name (sglang-router and SGLang clients send it): keep the matched stop string in the output.
    no_stop_trim: bool = False

    @field_validator("max_new_tokens")
    @classmethod
    def _max_new_tokens(cls, value: int | None) -> int | None:
        return _check_max_tokens("max_new_tokens", value)

    @field_validator("min_new_tokens")
    @classmethod
    def _min_new_tokens(cls, value: int) -> int:
        return _check_min_tokens("min_new_tokens", value)

    @model_validator(mode="after")
    def _min_le_max(self):
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens ({self.max_new_tokens})"
            )
        return self


class GenerateRequest(_StrictModel):
    """POST /generate (native): exactly one of `text` and `input_ids`."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0

    @field_validator("text", mode="before")
    @classmethod
    def _text(cls, value: Any) -> Any:
        return None if value is None else _check_prompt("text", value, allow_ids=False)

    @field_validator("input_ids", mode="before")
    @classmethod
    def _input_ids(cls, value: Any) -> Any:
        return None if value is None else _check_prompt("input_ids", value, allow_text=False)

    @field_validator("sampling_params", mode="before")
    @classmethod
    def _sampling_params(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("top_logprobs_num")
    @classmethod
    def _top_logprobs_num(cls, value: int) -> int:
        return _check_logprobs_count("top_logprobs_num", value)

    @model_validator(mode="after")
    def _exactly_one_input(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text and input_ids must be given")
        return self


# ------------------------------------------------------------------------ to plain fields


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    strings = [stop] if isinstance(stop, str) else stop
    # An empty stop string would match at once; clients send [""] to mean "none".
    return list(dict.fromkeys(s for s in strings if s))


def to_sampling_fields(req: CompletionRequest | ChatCompletionRequest | GenerateRequest) -> dict:
    """Plain sampling fields of a request, defaults filled in. max_new_tokens None means "up to the
    context length" (the server resolves it); logprobs None means none, k means k top logprobs."""
    if isinstance(req, GenerateRequest):
        params: _SamplingFields = req.sampling_params
        max_new_tokens = req.sampling_params.max_new_tokens
        min_new_tokens = req.sampling_params.min_new_tokens
        logprobs = req.top_logprobs_num if req.return_logprob else None
    elif isinstance(req, ChatCompletionRequest):
        params = req
        max_new_tokens = req.effective_max_tokens
        min_new_tokens = req.min_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    elif isinstance(req, CompletionRequest):
        params = req
        max_new_tokens = req.max_tokens
        min_new_tokens = req.min_tokens
        logprobs = req.logprobs
    else:
        raise TypeError(f"not a request model: {type(req).__name__}")

    top_k = params.top_k if params.top_k is not None and params.top_k > 0 else -1
    # Any top_k from the vocabulary size up keeps every token; capped so that it fits the socket message's integers.
    top_k = min(top_k, INT32_MAX)
    return {
        "temperature": 1.0 if params.temperature is None else params.temperature,
        "top_p": 1.0 if params.top_p is None else params.top_p,
        "top_k": top_k,
        "min_p": 0.0 if params.min_p is None else params.min_p,
        "seed": params.seed,
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": min_new_tokens,
        "stop": _stop_list(params.stop),
        "stop_token_ids": list(params.stop_token_ids or []),
        "ignore_eos": params.ignore_eos,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "n": params.n,
        "logprobs": logprobs,
        "include_stop_str_in_output": params.include_stop_str_in_output or getattr(params, "no_stop_trim", False),
        "skip_special_tokens": params.skip_special_tokens,
        **sampling_fields(params),  # json_schema / regex / ebnf / logit_bias (structured_fields.py)
    }
