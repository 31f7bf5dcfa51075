"""The front end's part of structured outputs and tool calling, around the request fields of structured_fields:
compiling every grammar before admission (a bad one is a 400 that names the problem), rendering tools into the chat
template, and shaping replies with tool calls, whole or streamed.

Hooks in the routes: `GrammarCheck.check` on the request's sampling fields; `chat_template_inputs` where the chat
template is rendered; `ChatTools.message` for a whole reply and `ChatTools.stream_delta` for each streamed output.
"""

from __future__ import annotations

import asyncio
import copy
import threading

from radixserve.grammar import GRAMMAR_KINDS, GrammarCompiler, GrammarError
from radixserve.sampling import SamplingParams
from tokenizer_service.errors import RequestError
from tokenizer_service.structured_fields import ToolFields
from tokenizer_service.tool_calls import (
    ParsedReply,
    ToolCallStreamer,
    ToolChoice,
    make_streamer,
    parse_reply,
    render_messages,
    resolve_parser_name,
    template_supports_tools,
)


class GrammarCheck:
    """Compiles each request's grammar in the front end before it is admitted: a spec that does not compile is a
    400 naming the problem (it never reaches a worker), and with --grammar-backend none any grammar is a 400.

    The compiler (and with it xgrammar and torch) is created on the first constrained request. Compilation runs in a
    worker thread so that a large schema does not stall the event loop; compiled grammars are cached by spec."""

    def __init__(
        self, backend: str, tokenizer, vocab_size: int, stop_token_ids: list[int], unroll_bounded_strings: bool = True
    ):
        self.backend, self.tokenizer = backend, tokenizer
        self.unroll_bounded_strings = unroll_bounded_strings  # off: --disable-grammar-string-unrolling
        self.vocab_size, self.stop_token_ids = vocab_size, list(stop_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()

    def _compile(self, spec: tuple[str, str]) -> None:
        with self._compiler_lock:
            if self._compiler is None:
                # Its own copy of the tokenizer: the HF fast tokenizer is not safe to share across threads, and the
                # event loop keeps using the server's.
                self._compiler = GrammarCompiler(
                    copy.deepcopy(self.tokenizer),
                    self.vocab_size,
                    self.stop_token_ids,
                    unroll_bounded_strings=self.unroll_bounded_strings,
                )
        self._compiler.check(spec)

    async def check(self, fields: dict) -> None:
        """fields: a request's SamplingParams fields (to_sampling_fields), whose grammar is checked."""
        spec = SamplingParams(**{k: fields[k] for k in GRAMMAR_KINDS if fields.get(k) is not None}).grammar_spec
        if spec is None:
            return
        param = {"json_schema": "response_format"}.get(spec[0], spec[0])
        if self.backend == "none":
            raise RequestError(
                "structured outputs (response_format, regex, ebnf, tool_choice required or named) "
                "are turned off on this server (--grammar-backend none)",
                param=param,
            )
        try:
            await asyncio.to_thread(self._compile, spec)
        except GrammarError as e:
            raise RequestError(str(e), param=param) from None


def _chat_template_text(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) else None


def chat_template_inputs(messages: list[dict], tools: list[dict] | None, tokenizer) -> tuple[list[dict], dict]:
    """(messages, extra apply_chat_template kwargs) for a chat with tools and tool-call history. A template that
    knows tools gets them as `tools=`; one that does not has them described in the system message."""
    template = _chat_template_text(tokenizer)
    rendered = render_messages(messages, tools, template)
    extra = {"tools": tools} if tools and template_supports_tools(template) else {}
    return rendered, extra


class ChatTools:
    """One chat request's tool handling: parse each choice's reply into content + tool calls, whole or streamed.
    `active` is False when the request has no tools or tool_choice none: the reply is plain content."""

    def __init__(self, req: ToolFields, parser_flag: str, tokenizer):
        self.choice = req.tool_choice_resolved if req.tools else ToolChoice("none")
        self.parser = resolve_parser_name(parser_flag, _chat_template_text(tokenizer))
        self._streamers: dict[int, ToolCallStreamer] = {}  # by choice index

    @property
    def active(self) -> bool:
        return self.choice.mode != "none"

    def parse(self, text: str) -> ParsedReply:
        return parse_reply(text, self.parser, self.choice)

    def streamer(self) -> ToolCallStreamer:
        return make_streamer(self.parser, self.choice)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(the assistant message, the finish reason) of a whole reply: "tool_calls" when the model called any."""
        if not self.active:
            return {"role": "assistant", "content": text}, finish_reason
        reply = self.parse(text)
        message = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = [c.to_openai() for c in reply.tool_calls]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        return message, finish_reason

    def stream_delta(self, index: int, text: str, finished: bool, finish_reason: str | None) -> tuple[dict, str | None]:
        """(the chunk's delta, its finish reason) for one streamed output of choice `index`. Text that may still
        turn out to be part of a tool call is held back until it is known."""
        if not self.active:
            return ({"content": text} if text or not finished else {}), finish_reason
        streamer = self._streamers.setdefault(index, self.streamer())
        deltas = streamer.feed(text) + (streamer.finish() if finished else [])
        if finished and streamer.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return merge_deltas(deltas), finish_reason


def merge_deltas(deltas: list[dict]) -> dict:
    """Deltas of one step as one: content joined, and each call's pieces joined into one entry per call index."""
    content = "".join(d["content"] for d in deltas if "content" in d)
    calls: dict[int, dict] = {}
    for delta in deltas:
        for piece in delta.get("tool_calls", []):
            entry = calls.get(piece["index"])
            if entry is None:
                calls[piece["index"]] = {**piece, "function": dict(piece["function"])}
            else:
                entry["function"]["arguments"] = entry["function"].get("arguments", "") + piece["function"].get(
                    "arguments", ""
                )
    merged: dict = {"content": content} if content else {}
    if calls:
        merged["tool_calls"] = [calls[i] for i in sorted(calls)]
    return merged
