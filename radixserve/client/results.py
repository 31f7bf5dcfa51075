"""What the radixserve client returns: typed results of the OpenAI and native routes, streaming chunks and
iterators. What it raises is in errors.py; the clients themselves are in sync_client.py and async_client.py; the
package (radixserve/client/__init__.py) exports everything public here."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable, Iterator


from radixserve.client.errors import RadixServeError, error_from_body


# ------------------------------------------------------------------------------------------------ results


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the radix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def from_openai(cls, usage: dict | None) -> "Usage | None":
        if not usage:
            return None
        details = usage.get("prompt_tokens_details") or {}
        return cls(
            usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0), details.get("cached_tokens", 0) or 0
        )


@dataclass
class ToolCall:
    """A function the assistant called (chat with `tools`): `arguments` is the parsed JSON of `arguments_json`, the
    text as the server sent it (None if that text is not JSON: a reply cut by max_tokens)."""

    id: str | None
    name: str
    arguments: Any
    arguments_json: str

    @classmethod
    def from_openai(cls, call: dict) -> "ToolCall":
        function = call.get("function") or {}
        text = function.get("arguments") or ""
        try:
            arguments = json.loads(text)
        except ValueError:
            arguments = None
        return cls(call.get("id"), function.get("name") or "", arguments, text)


def tool_calls_from_deltas(deltas: Iterable[dict]) -> list[ToolCall]:
    """Streamed tool-call deltas (StreamChunk.tool_call_deltas of one choice, in order) put together: the first delta
    of a call carries its id and name, the following ones pieces of its arguments."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        call = calls.setdefault(delta.get("index", 0), {"id": None, "function": {"name": "", "arguments": ""}})
        call["id"] = delta.get("id") or call["id"]
        function = delta.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""
    return [ToolCall.from_openai(calls[i]) for i in sorted(calls)]


@dataclass
class Choice:
    index: int
    text: str
    finish_reason: str | None  # "stop" | "length" | "tool_calls"
    logprobs: Any = None
    stop_reason: int | str | None = None  # the stop string or token id that matched, when the server says
    tool_calls: list[ToolCall] = field(default_factory=list)  # chat: the functions the assistant called
    reasoning_content: str | None = None  # chat with --reasoning-parser: the thinking before the answer


@dataclass
class CompletionResult:
    """A /v1/completions answer; `text` and `finish_reason` are the first choice's."""

    text: str
    finish_reason: str | None
    usage: Usage
    choices: list[Choice]
    model: str | None = None
    id: str | None = None
    raw: dict = field(default_factory=dict, repr=False)


@dataclass
class ChatResult(CompletionResult):
    """A /v1/chat/completions answer; `text`, `finish_reason`, `tool_calls` and `reasoning_content` are the first
    choice's."""

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.choices[0].tool_calls if self.choices else []

    @property
    def reasoning_content(self) -> str | None:
        return self.choices[0].reasoning_content if self.choices else None


@dataclass
class GenerateResult:
    """A native /generate answer. finish_reason is "stop" or "length"; matched_stop the stop token id or string."""

    text: str
    output_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    matched_stop: int | str | None = None
    index: int = 0
    meta_info: dict = field(default_factory=dict, repr=False)
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


@dataclass
class StreamChunk:
    """One piece of a streamed answer: `text` is new text only. For /v1/* streams with several choices, `index`
    says which; the usage chunk has text "" and `usage` set. For /generate, `output_ids` are the new token ids
    and the finished chunk carries `usage` (prompt, completion and cached tokens) and `matched_stop`."""

    text: str
    index: int = 0
    finish_reason: str | None = None
    usage: Usage | None = None
    output_ids: list[int] = field(default_factory=list)
    role: str | None = None
    logprobs: Any = None
    matched_stop: int | str | None = None
    tool_call_deltas: list[dict] = field(default_factory=list)  # chat: pieces of tool calls (tool_calls_from_deltas)
    reasoning_content: str = ""  # chat with --reasoning-parser: new reasoning text (text is the answer's)
    raw: dict = field(default_factory=dict, repr=False)


@dataclass
class Model:
    id: str
    owned_by: str | None = None
    max_model_len: int | None = None
    raw: dict = field(default_factory=dict, repr=False)


# ------------------------------------------------------------------------------------------------ parsing


def _parse_choices(body: dict, chat: bool) -> list[Choice]:
    choices = []
    for c in body.get("choices") or []:
        message = c.get("message") or {}
        text = (message.get("content") if chat else c.get("text")) or ""
        calls = [ToolCall.from_openai(call) for call in message.get("tool_calls") or []] if chat else []
        choices.append(
            Choice(
                c.get("index", 0),
                text,
                c.get("finish_reason"),
                c.get("logprobs"),
                c.get("stop_reason"),
                calls,
                message.get("reasoning_content") if chat else None,
            )
        )
    return sorted(choices, key=lambda c: c.index)


def parse_openai(body: dict, chat: bool):
    choices = _parse_choices(body, chat)
    first = choices[0] if choices else Choice(0, "", None)
    cls = ChatResult if chat else CompletionResult
    return cls(
        first.text,
        first.finish_reason,
        Usage.from_openai(body.get("usage")) or Usage(),
        choices,
        body.get("model"),
        body.get("id"),
        body,
    )


def _native_finish(meta: dict) -> tuple[str | None, int | str | None]:
    """SGLang's finish_reason {"type": "stop", "matched": x} / {"type": "length", ...}, or a plain string."""
    reason = meta.get("finish_reason")
    if isinstance(reason, dict):
        return reason.get("type"), reason.get("matched")
    return reason, None


def _parse_generate(body: dict) -> GenerateResult:
    meta = body.get("meta_info") or {}
    reason, matched = _native_finish(meta)
    output_ids = list(body.get("output_ids") or [])
    return GenerateResult(
        body.get("text", ""),
        output_ids,
        reason,
        meta.get("prompt_tokens", 0),
        meta.get("completion_tokens", len(output_ids)),
        meta.get("cached_tokens", 0) or 0,
        matched,
        body.get("index", 0),
        meta,
        body,
    )


def parse_generate_body(body: Any) -> GenerateResult | list[GenerateResult]:
    if isinstance(body, list):  # a batch: a list of texts or of token-id lists
        return [_parse_generate(b) for b in body]
    return _parse_generate(body)


class OpenAIChunks:
    """Turns the data objects of a /v1/* SSE stream into StreamChunks."""

    def __init__(self, chat: bool):
        self.chat = chat

    def __call__(self, data: dict) -> list[StreamChunk]:
        out = []
        for c in data.get("choices") or []:
            deltas, delta = [], c.get("delta") or {}
            if self.chat:
                text, role, deltas = delta.get("content") or "", delta.get("role"), delta.get("tool_calls") or []
            else:
                text, role = c.get("text") or "", None
            out.append(
                StreamChunk(
                    text,
                    c.get("index", 0),
                    c.get("finish_reason"),
                    None,
                    role=role,
                    logprobs=c.get("logprobs"),
                    matched_stop=c.get("stop_reason"),
                    tool_call_deltas=list(deltas),
                    reasoning_content=delta.get("reasoning_content") or "",
                    raw=data,
                )
            )
        usage = Usage.from_openai(data.get("usage"))
        if usage is not None:
            if out:
                out[-1].usage = usage
            else:
                out.append(StreamChunk("", usage=usage, raw=data))
        return out


class NativeChunks:
    """Turns the data objects of a /generate SSE stream into StreamChunks with delta text and ids.

    Each data object has the shape of a /generate result carrying the text and output_ids of its choice so far
    (cumulative, as radixserve and SGLang send them); the new part is what follows the previous chunk of the same
    index. A chunk that does not extend the previous one (a server sending deltas) is taken as a delta."""

    def __init__(self):
        self._text: dict[int, str] = {}
        self._ids: dict[int, list[int]] = {}

    def __call__(self, data: dict) -> list[StreamChunk]:
        index = data.get("index", 0)
        meta = data.get("meta_info") or {}
        text, ids = data.get("text") or "", list(data.get("output_ids") or [])
        seen_text, seen_ids = self._text.get(index, ""), self._ids.get(index, [])
        if text.startswith(seen_text) and ids[: len(seen_ids)] == seen_ids:
            new_text, new_ids = text[len(seen_text) :], ids[len(seen_ids) :]
        else:
            new_text, new_ids = text, ids
        self._text[index], self._ids[index] = seen_text + new_text, seen_ids + new_ids
        reason, matched = _native_finish(meta)
        usage = None
        if reason is not None:
            usage = Usage(meta.get("prompt_tokens", 0), len(self._ids[index]), meta.get("cached_tokens", 0) or 0)
        return [StreamChunk(new_text, index, reason, usage, new_ids, matched_stop=matched, raw=data)]


def sse_data(line: str) -> str | None:
    """The payload of a `data:` line; None for blank lines, comments and other fields."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def decode_event(payload: str, status_code: int) -> dict | None:
    """The JSON object of one SSE event; None at [DONE]; raises for an error event."""
    if payload == "[DONE]":
        return None
    try:
        data = json.loads(payload)
    except ValueError as e:
        raise RadixServeError(
            status_code, f"the server sent a malformed stream event: {payload[:200]!r}", type="stream_error"
        ) from e
    if isinstance(data, dict) and "error" in data and not data.get("choices") and "text" not in data:
        raise error_from_body(None, data)
    return data


# ------------------------------------------------------------------------------------------------ streams


class Stream:
    """An iterator of StreamChunks over an open HTTP response; closes it when exhausted, on `close()`, when the
    `with` block ends or when garbage-collected."""

    def __init__(self, chunks: Iterator[StreamChunk]):
        self._chunks = chunks

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> StreamChunk:
        return next(self._chunks)

    def close(self) -> None:
        self._chunks.close()  # type: ignore[attr-defined]  # a generator: runs its finally (closes the response)

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncStream:
    """The async twin of Stream: `async for chunk in stream`, `await stream.aclose()`, `async with`."""

    def __init__(self, chunks: AsyncIterator[StreamChunk]):
        self._chunks = chunks

    def __aiter__(self) -> "AsyncStream":
        return self

    async def __anext__(self) -> StreamChunk:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        await self._chunks.aclose()  # type: ignore[attr-defined]

    async def __aenter__(self) -> "AsyncStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
