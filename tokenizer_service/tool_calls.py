"""Tool calling on /v1/chat/completions: tools rendered into the prompt, tool_choice turned into a grammar where it
must be obeyed, and the model's reply parsed back into OpenAI tool calls, whole or as streamed deltas.

Formats by model family (`--tool-call-parser`, or picked from the chat template):
    qwen     Qwen2.5 / Qwen3 (Hermes style): <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, repeated
    llama3   Llama 3.1+ JSON: {"name": ..., "parameters": {...}} (several separated by ";"), maybe after <|python_tag|>

`tool_choice` "required" or a named function does not rely on the model's format at all: the reply is constrained
by a JSON schema (a list of {"name", "parameters"} objects, or the named function's arguments), so it always parses.

Non-streamed replies are parsed by running the streaming parser over the whole text, so a streamed reply's deltas
always add up to what the same text gives unstreamed.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_PARSERS = ("auto", "qwen", "llama3")
_PARSER_ALIASES = {"qwen": "qwen", "qwen25": "qwen", "qwen3": "qwen", "hermes": "qwen", "llama3": "llama3"}

QWEN_START, QWEN_END = "<tool_call>", "</tool_call>"
LLAMA3_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedReply:
    content: str | None
    tool_calls: list[ToolCall]


# ------------------------------------------------------------------------------------------ tool_choice


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # none | auto | required | named
    name: str | None = None  # the function, when mode is named


def resolve_tool_choice(tool_choice: Any, tools: list[dict] | None) -> ToolChoice:
    """OpenAI's tool_choice (a string or {"type": "function", "function": {"name": ...}}); ValueError names the
    problem. Without tools the default is none, with tools auto, as OpenAI does."""
    names = [t["function"]["name"] for t in tools or []]
    if tool_choice is None:
        return ToolChoice("auto" if names else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}")
        if tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs at least one tool in tools")
        return ToolChoice(tool_choice)
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str) or tool_choice.get("type") != "function":
        raise ValueError('tool_choice must be a string or {"type": "function", "function": {"name": "..."}}')
    if name not in names:
        raise ValueError(f"tool_choice names the function {name!r}, which is not among tools ({', '.join(names)})")
    return ToolChoice("named", name)


def check_tools(tools: list[dict]) -> None:
    """Every tool is {"type": "function", "function": {"name", "description"?, "parameters"?}}; names are unique."""
    seen = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}')
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        if name in seen:
            raise ValueError(f"tools[{i}].function.name {name!r} is used by another tool too")
        seen.add(name)
        if not isinstance(function.get("parameters", {}), dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON Schema object")


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def tool_choice_schema(choice: ToolChoice, tools: list[dict], parallel_tool_calls: bool = True) -> str | None:
    """The JSON schema that enforces a tool_choice, or None when the model is free (none, auto)."""
    if choice.mode == "named":
        tool = next(t for t in tools if t["function"]["name"] == choice.name)
        return json.dumps(_parameters(tool))
    if choice.mode != "required":
        return None
    one_call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t)},
                "required": ["name", "parameters"],
            }
            for t in tools
        ]
    }
    schema = {"type": "array", "items": one_call, "minItems": 1}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return json.dumps(schema)


# ------------------------------------------------------------------------------------------ rendering


def template_supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def _arguments_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _tools_system_text(tools: list[dict]) -> str:
    lines = [json.dumps(t["function"], ensure_ascii=False) for t in tools]
    return (
        "You may call the functions listed below. To call one, answer with a JSON object inside "
        f"{QWEN_START}{QWEN_END} tags, one tag pair per call:\n"
        f'{QWEN_START}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{QWEN_END}\n'
        "Functions:\n" + "\n".join(lines)
    )


def render_messages(messages: list[dict], tools: list[dict] | None, chat_template: str | None) -> list[dict]:
    """Messages ready for `apply_chat_template(messages, tools=tools)`.

    A template that knows tools (Qwen's, Llama 3.1's) gets assistant tool calls with their arguments as objects, as
    those templates expect. A template that does not (plain ChatML, e.g. SmolLM2's) would drop the tools silently,
    so they are described in the system message instead, and earlier tool calls written out in that same format.
    """
    native = template_supports_tools(chat_template)
    out = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None) or []
        if calls and native:
            message["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": _arguments_object(c["function"].get("arguments"))}}
                for c in calls
            ]
        elif calls:
            text = "\n".join(
                QWEN_START
                + "\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": _arguments_object(c["function"].get("arguments"))},
                    ensure_ascii=False,
                )
                + "\n"
                + QWEN_END
                for c in calls
            )
            message["content"] = (message.get("content") or "") + ("\n" if message.get("content") else "") + text
        if message.get("content") is None:
            message["content"] = ""  # templates concatenate content as a string
        out.append(message)
    if tools and not native:
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + _tools_system_text(tools)}
        else:
            out.insert(0, {"role": "system", "content": _tools_system_text(tools)})
    return out


# ------------------------------------------------------------------------------------------ parsing


def _call_from_object(obj: Any) -> ToolCall | None:
    """{"name": str, "arguments" | "parameters": object} -> ToolCall; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _arguments_object(arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _json_values(text: str) -> list[Any] | None:
    """Consecutive JSON values separated by whitespace or ';' (Llama 3's parallel calls); None unless all parse."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
        if pos == len(text):
            return values or None
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        values.append(value)


def _call_delta(index: int, call: ToolCall) -> list[dict]:
    # OpenAI streams a call as a first delta with its id and name, then its arguments in pieces; ours is one piece.
    return [
        {
            "tool_calls": [
                {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            ]
        },
        {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]},
    ]


class ToolCallStreamer:
    """Turns the reply's text, fed piece by piece, into chat-completion deltas: {"content": ...} and
    {"tool_calls": [...]}. `calls` and `content` hold what has been found so far."""

    def __init__(self):
        self.calls: list[ToolCall] = []
        self.content = ""

    def feed(self, text: str) -> list[dict]:
        raise NotImplementedError

    def finish(self) -> list[dict]:
        raise NotImplementedError

    def _emit_content(self, text: str) -> list[dict]:
        if not text:
            return []
        self.content += text
        return [{"content": text}]

    def _emit_call(self, call: ToolCall) -> list[dict]:
        self.calls.append(call)
        return _call_delta(len(self.calls) - 1, call)


class TaggedStreamer(ToolCallStreamer):
    """Calls between start and end tags (Qwen's <tool_call>...</tool_call>). Text before the first call is content;
    text between and after calls is dropped, as it is only whitespace in the formats these tags belong to."""

    def __init__(self, start: str = QWEN_START, end: str = QWEN_END):
        super().__init__()
        self.start, self.end = start, end
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> list[dict]:
        self._buffer += text
        out: list[dict] = []
        while True:
            if self._in_call:
                pos = self._buffer.find(self.end)
                if pos < 0:
                    return out
                out += self._close_block(self._buffer[:pos])
                self._buffer = self._buffer[pos + len(self.end) :]
                self._in_call = False
                continue
            pos = self._buffer.find(self.start)
            if pos >= 0:
                if not self.calls:
                    out += self._emit_content(self._buffer[:pos])
                self._buffer = self._buffer[pos + len(self.start) :]
                self._in_call = True
                continue
            # Hold back a tail that may be the start of a tag split across pieces.
            keep = next(
                (
                    k
                    for k in range(min(len(self.start) - 1, len(self._buffer)), 0, -1)
                    if self.start.startswith(self._buffer[-k:])
                ),
                0,
            )
            ready, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep :]
            if not self.calls:
                out += self._emit_content(ready)
            return out

    def _close_block(self, block: str) -> list[dict]:
        values = _json_values(block)
        call = _call_from_object(values[0]) if values and len(values) == 1 else None
        if call is None:  # not a call after all: keep the text rather than lose it
            return self._emit_content(self.start + block + (self.end if self._in_call else ""))
        return self._emit_call(call)

    def finish(self) -> list[dict]:
        if self._in_call:  # stopped (EOS, length) before the end tag: a complete JSON object still counts
            self._in_call = False
            return self._close_block(self._buffer)
        return [] if self.calls else self._emit_content(self._buffer)


class JsonStreamer(ToolCallStreamer):
    """A reply that is nothing but JSON calls (Llama 3), or nothing but content. Which one shows at the first
    non-blank character; calls are held until the end, when the whole text can be parsed."""

    def __init__(self):
        super().__init__()
        self._text = ""
        self._mode: str | None = None  # None: undecided, "content", "calls"

    def feed(self, text: str) -> list[dict]:
        self._text += text
        if self._mode is None:
            head = self._text.lstrip()
            if not head or (LLAMA3_PYTHON_TAG.startswith(head) and len(head) < len(LLAMA3_PYTHON_TAG)):
                return []
            self._mode = "calls" if head.startswith(("{", "[", LLAMA3_PYTHON_TAG)) else "content"
            if self._mode == "content":
                return self._emit_content(self._text)
            return []
        return self._emit_content(text) if self._mode == "content" else []

    def finish(self) -> list[dict]:
        if self._mode == "content":
            return []
        calls = self._parse_calls(self._text.strip().removeprefix(LLAMA3_PYTHON_TAG))
        if calls is None:
            return self._emit_content(self._text)
        return [delta for call in calls for delta in self._emit_call(call)]

    @staticmethod
    def _parse_calls(text: str) -> list[ToolCall] | None:
        values = _json_values(text)
        if values is None:
            return None
        objects = [v for value in values for v in (value if isinstance(value, list) else [value])]
        calls = [_call_from_object(o) for o in objects]
        return calls if calls and all(calls) else None


class ForcedStreamer(JsonStreamer):
    """The reply to tool_choice required (a JSON list of {"name", "parameters"}) or a named function (its arguments
    object), both written under a grammar: never content, always calls, unless cut short by max_tokens."""

    def __init__(self, choice: ToolChoice):
        super().__init__()
        self.choice = choice
        self._mode = "calls"

    def _parse_calls(self, text: str) -> list[ToolCall] | None:
        if self.choice.mode == "named":
            try:
                arguments = json.loads(text)
            except json.JSONDecodeError:
                return None
            return (
                [ToolCall(self.choice.name, json.dumps(arguments, ensure_ascii=False))]
                if isinstance(arguments, dict)
                else None
            )
        return JsonStreamer._parse_calls(text)


def resolve_parser_name(name: str, chat_template: str | None) -> str:
    """`--tool-call-parser` (auto, or a family) to a parser name; auto looks at the chat template."""
    if name != "auto":
        if name not in _PARSER_ALIASES:
            raise ValueError(f"unknown tool-call parser {name!r}; expected one of {sorted(_PARSER_ALIASES)} or auto")
        return _PARSER_ALIASES[name]
    template = chat_template or ""
    if LLAMA3_PYTHON_TAG in template or ('"parameters"' in template and QWEN_START not in template):
        return "llama3"
    return "qwen"  # Qwen's own format, and the one render_messages teaches templates that know no tools


def make_streamer(parser: str, choice: ToolChoice) -> ToolCallStreamer:
    if choice.mode in ("required", "named"):
        return ForcedStreamer(choice)
    return JsonStreamer() if parser == "llama3" else TaggedStreamer()


def parse_reply(text: str, parser: str, choice: ToolChoice) -> ParsedReply:
    """The whole reply's content and tool calls (tool_choice none: all content)."""
    if choice.mode == "none":
        return ParsedReply(text, [])
    streamer = make_streamer(parser, choice)
    streamer.feed(text)
    streamer.finish()
    content = streamer.content if streamer.content.strip() else None
    return ParsedReply(content.strip() if content and streamer.calls else content, streamer.calls)
