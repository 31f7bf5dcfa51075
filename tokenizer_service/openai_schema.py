"""Request bodies of the OpenAI routes (/v1/completions, /v1/chat/completions), with validation, and the mapping of
every request (native /generate too) to plain sampling fields.

Models are strict: a known field with the wrong JSON type (`"stream": 1`, `"temperature": "0.5"`) is an
error, as with OpenAI. Unknown fields are ignored, as OpenAI and vLLM do, so newer clients keep working
(the native `sampling_params` is the exception: a typo there would silently change sampling).
Every check here needs only the body; checks that need the model (vocabulary size, context length,
model name) belong to the server.

Error messages name the field and the allowed range, because clients show them to people verbatim.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator, model_validator

from tokenizer_service.native_schema import GenerateRequest, NativeSamplingParams  # noqa: F401  (re-exported)
from tokenizer_service.request_errors import (  # noqa: F401  (re-exported)
    openai_error,
    openai_error_from_validation,
    validation_error_message,
    validation_error_param,
)
from tokenizer_service.request_fields import (  # noqa: F401
    CHAT_TEMPLATE_KWARGS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    DEFAULT_NATIVE_MAX_NEW_TOKENS,
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRINGS,
    StreamOptions,
    _check_cache_salt,
    _check_logprobs_count,
    _check_max_tokens,
    _check_min_tokens,
    _check_priority,
    _check_prompt,
    _SamplingFields,
    _StrictModel,
)
from tokenizer_service.structured_fields import (
    AssistantToolCall,
    ChatStructuredFields,
    StructuredOutputFields,
    sampling_fields,
)

# Split by concern: error bodies and messages (request_errors.py), shared limits, field checks and sampling fields
# (request_fields.py), the native /generate models (native_schema.py). Their public names stay importable from here.


# ------------------------------------------------------------------------------------ models


class _OpenAIRequest(_SamplingFields):
    model: str | None = None  # checked against the served model by the server
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_tokens: int = 0
    user: str | None = None
    cache_salt: str | None = None  # tenant isolation in the prefix cache (vLLM's field name)

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _cache_salt(cls, value: Any) -> Any:
        return _check_cache_salt(value)

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, value: int) -> int:
        return _check_min_tokens("min_tokens", value)

    priority: int = 0  # vLLM's and SGLang's extension: admission order with --enable-priority-scheduling

    @field_validator("priority")
    @classmethod
    def _priority(cls, value: int) -> int:
        return _check_priority("priority", value)

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
    echo: bool = False  # the prompt before each completion; with logprobs, the prompt tokens' logprobs too

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
        if (
            isinstance(data, dict)
            and "content" not in data
            and data.get("role") == "assistant"
            and data.get("tool_calls")
        ):
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
    # vLLM's: the final message (the start of the reply, written by the client) rendered open, so the model goes on
    # with it rather than starting a new turn; needs add_generation_prompt false.
    continue_final_message: bool = False
    # vLLM's: the reply's content starts with the final message's when that one is the assistant's (a pre-filled
    # reply); without logprobs for it, as vLLM sends none for the prompt of a chat.
    echo: bool = False
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
                raise ValueError(
                    f"chat_template_kwargs key {key!r} is not accepted; the chat template is the "
                    f"server's own and only {', '.join(sorted(CHAT_TEMPLATE_KWARGS))} may be set"
                )
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

    def echoed_text(self) -> str:
        """What goes before the generated content with echo: the final message's text if it is the assistant's."""
        last = self.messages[-1]
        return last.text_content() if self.echo and last.role == "assistant" else ""

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
    prompt_logprobs = None
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
        if req.echo:
            prompt_logprobs = logprobs  # echo with logprobs: the prompt's tokens get them too, top k included
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
        **({"prompt_logprobs": prompt_logprobs} if prompt_logprobs is not None else {}),  # echo with logprobs
        **sampling_fields(params),  # json_schema / regex / ebnf / logit_bias (structured_fields.py)
    }
