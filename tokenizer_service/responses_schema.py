"""The body of POST /v1/responses (OpenAI's Responses API, text only) and its translation into the chat route's
request, so that the prompt, tools, structured output and sampling go through the chat route's own code.

Supported: `input` (a string, or message / function_call / function_call_output / reasoning items with text content),
`instructions`, `max_output_tokens`, `temperature`, `top_p`, function `tools`, `tool_choice`, `parallel_tool_calls`,
`text.format` (text, json_object, json_schema), `reasoning.effort` ("none" turns a hybrid model's thinking off through
the template's enable_thinking; other efforts leave it on), `stream`, `store`, `previous_response_id`, `metadata`;
and the extensions of the chat route `cache_salt`, `regex` and `ebnf` (a regex or grammar for the whole reply).

Fields that ask for what this server cannot do are a 400 that names them, never a silent ignore: built-in tools
(web search, file search, code interpreter, ...), image, file and audio input, `background`, `conversation`,
`prompt` (stored prompt templates), `include`, `truncation: "auto"`, `top_logprobs`, `max_tool_calls`, reasoning
summaries. Unknown fields are ignored, as on the other OpenAI routes.

Reasoning items in `input` are accepted and left out of the prompt: the chat templates of thinking models drop the
thinking of earlier turns themselves.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator

from tokenizer_service.errors import RequestError
from tokenizer_service.openai_schema import ChatCompletionRequest
from tokenizer_service.request_errors import openai_error_from_validation
from tokenizer_service.request_fields import _check_cache_salt, _check_max_tokens, _StrictModel

INPUT_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits
MAX_RESPONSE_ID_CHARS = 256
# A chat request's field -> the Responses field it came from, for error params.
CHAT_TO_RESPONSES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "chat_template_kwargs": "reasoning",
}


def _text_of(content: Any, path: str) -> str:
    """A message's content (a string, or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{path} must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise ValueError(
                f"{path}[{j}].type {kind!r} is not supported: this server takes text parts "
                f"({', '.join(TEXT_PARTS)}) only"
            )
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{path}[{j}].text must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict, key: str, path: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{path}.{key} must be a non-empty string")
    return value


def input_messages(value: str | list) -> list[dict]:
    """`input` as chat messages: each message item one message, a function_call joined to the assistant turn before
    it (or a turn of its own), a function_call_output a tool message. ValueError names the item at fault."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict] = []
    for i, item in enumerate(value):
        path = f"input[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{path} must be an object: a message or a function call item")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise ValueError(f"{path}.role must be one of {', '.join(INPUT_ROLES)}, got {role!r}")
            messages.append({"role": INPUT_ROLES[role], "content": _text_of(item.get("content"), f"{path}.content")})
        elif kind == "function_call":
            arguments = item.get("arguments")
            if not isinstance(arguments, str):
                raise ValueError(f"{path}.arguments must be a string (JSON text)")
            call = {
                "id": _string(item, "call_id", path),
                "type": "function",
                "function": {"name": _string(item, "name", path), "arguments": arguments},
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", path),
                    "content": _text_of(item.get("output"), f"{path}.output"),
                }
            )
        elif kind != "reasoning":
            raise ValueError(
                f"{path}.type {kind!r} is not supported: only message, function_call, "
                "function_call_output and reasoning items"
            )
    if not messages:
        raise ValueError("input must hold at least one message or function call item")
    return messages


def chat_tools(tools: list) -> list[dict]:
    """Responses function tools ({"type", "name", "parameters", ...}) in the chat shape."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ValueError(
                f"tools[{i}].type {kind!r} is not supported: only function tools (built-in tools such "
                "as web_search or file_search are not served here)"
            )
        name = _string(tool, "name", f"tools[{i}]")
        if not isinstance(tool.get("parameters") or {}, dict):
            raise ValueError(f"tools[{i}].parameters must be a JSON Schema object")
        function = {"name": name, **{k: tool[k] for k in ("description", "parameters") if tool.get(k) is not None}}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice  # none | auto | required, checked with the tools by the chat request
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind != "function":
        raise ValueError(
            f"tool_choice of type {kind!r} is not supported: use none, auto, required or "
            '{"type": "function", "name": ...}'
        )
    return {"type": "function", "function": {"name": choice.get("name")}}


class TextFormat(_StrictModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # ("schema" is a BaseModel attribute)
    strict: bool | None = None


class TextConfig(_StrictModel):
    format: TextFormat | None = None


class ReasoningConfig(_StrictModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None

    @field_validator("summary")
    @classmethod
    def _summary(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("reasoning summaries are not supported: the reasoning comes whole, as reasoning_text")
        return value


class ResponsesRequest(_StrictModel):
    """POST /v1/responses"""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    cache_salt: str | None = None  # as on the chat route: tenant isolation in the prefix cache (and in the store)
    regex: str | None = None  # as on the chat route (SGLang's extension): the whole reply, reasoning included
    ebnf: str | None = None
    # OpenAI's, refused unless they ask for nothing (see the module doc)
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value: Any) -> Any:
        if isinstance(value, str) and not value:
            raise ValueError("input must not be empty")
        if isinstance(value, (str, list)):
            input_messages(value)  # the checks, with messages that name the item
        return value

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list | None) -> list | None:
        chat_tools(value or [])
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        chat_tool_choice(value)
        return value

    @field_validator("max_output_tokens")
    @classmethod
    def _max_output_tokens(cls, value: int | None) -> int | None:
        return _check_max_tokens("max_output_tokens", value)

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _cache_salt(cls, value: Any) -> Any:
        return _check_cache_salt(value)

    @field_validator("previous_response_id")
    @classmethod
    def _previous_response_id(cls, value: str | None) -> str | None:
        if value is not None and not 0 < len(value) <= MAX_RESPONSE_ID_CHARS:
            raise ValueError(f"previous_response_id must have 1 to {MAX_RESPONSE_ID_CHARS} characters")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (
            len(value) > MAX_METADATA_PAIRS
            or any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in value.items())
        ):
            raise ValueError(
                f"metadata may hold {MAX_METADATA_PAIRS} pairs, keys of at most {MAX_METADATA_KEY} and "
                f"values of at most {MAX_METADATA_VALUE} characters"
            )
        return value

    @field_validator("background", "conversation", "prompt", "include", "truncation", "top_logprobs", "max_tool_calls")
    @classmethod
    def _unsupported(cls, value: Any, info) -> Any:
        if value in (None, False, [], "disabled"):
            return value
        what = {
            "background": "background mode",
            "conversation": "the Conversations API",
            "prompt": "stored prompt templates",
            "truncation": "truncation 'auto'",
        }.get(info.field_name)
        raise ValueError(f"{info.field_name} is not supported on this server" + (f" ({what})" if what else ""))

    def response_format(self) -> dict | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type != "json_schema":
            return None if fmt is None else {"type": fmt.type}
        return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}

    def chat_request(self, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
        """(the chat request that renders this turn, the conversation so far without the instructions). history: the
        conversation of the previous response."""
        conversation = history + input_messages(self.input)
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        thinking_off = self.reasoning is not None and self.reasoning.effort == "none"
        body = {
            "messages": system + conversation,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tools": chat_tools(self.tools or []) or None,
            "tool_choice": chat_tool_choice(self.tool_choice),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self.response_format(),
            "regex": self.regex,
            "ebnf": self.ebnf,
            "cache_salt": self.cache_salt,
            "chat_template_kwargs": {"enable_thinking": False} if thinking_off else None,
        }
        try:
            chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            error = openai_error_from_validation(e)["error"]
            raise RequestError(error["message"], param=CHAT_TO_RESPONSES.get(error["param"], error["param"])) from None
        return chat, conversation
