"""Server-sent events for the three generating routes, and aborting a request the moment its client goes away.

A stream is a sequence of `data: <json>\\n\\n` events ended by `data: [DONE]`. An error after the stream started
(the scheduler failed the request) cannot change the status any more: it is sent as one event holding the OpenAI
error object, then [DONE].
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

import msgspec
from starlette.responses import Response

from radixserve.request_pipeline import SequenceOutput
from tokenizer_service import openai_responses as R
from tokenizer_service.errors import RequestError, error_for_status
from tokenizer_service.request_group import RequestGroup, Sequence, Usage

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: Any) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


@asynccontextmanager
async def abort_on_disconnect(receive, group: RequestGroup):
    """While the body of the `with` runs, a client disconnect aborts the group's sequences at once (the scheduler
    frees their KV within a step), whether or not the handler is sending anything at that moment."""

    async def watch():
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not group.finished:
                    logger.info("client disconnected: aborting %s", group.request_id)
                group.abort()
                return

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        group.abort()  # handler failed or was cancelled: never leave sequences behind (no-op when finished)


class EventStreamResponse(Response):
    """Server-sent events from an async iterator of already-encoded events, aborting the request group when the
    client goes away."""

    def __init__(self, events: AsyncIterator[bytes], group: RequestGroup):
        super().__init__(status_code=200, media_type="text/event-stream")
        self.events, self.group = events, group

    async def __call__(self, scope, receive, send):
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                ],
            }
        )
        ended = False
        async with abort_on_disconnect(receive, self.group):
            try:
                async for event in self.events:
                    # [DONE] ends every stream: it goes out with the end of the body, in one write.
                    ended = event.endswith(SSE_DONE)
                    await send({"type": "http.response.body", "body": event, "more_body": not ended})
                    if ended:
                        break
            finally:
                await self.events.aclose()
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def merge_outputs(batch: list[SequenceOutput]) -> list[SequenceOutput]:
    """Outputs of one wake-up merged per choice (text and tokens concatenated), in order of first appearance. (The
    outputs are not changed: a merge builds new ones.)"""
    if len(batch) == 1:  # the usual wake-up in a stream that keeps up: nothing to merge
        return batch
    merged: dict[int, SequenceOutput] = {}
    for out in batch:
        into = merged.get(out.index)
        if into is None:
            merged[out.index] = SequenceOutput(
                out.index,
                out.text,
                list(out.token_ids),
                list(out.logprobs),
                out.finished,
                out.finish_reason,
                out.matched_stop,
                out.error,
                out.error_status,
            )
            continue
        into.text += out.text
        into.token_ids += out.token_ids
        into.logprobs += out.logprobs
        if out.finished:
            into.finished, into.finish_reason, into.matched_stop = True, out.finish_reason, out.matched_stop
            into.error, into.error_status = out.error, out.error_status
    return list(merged.values())


def first_error(outputs) -> RequestError | None:
    for out in outputs:
        if out.error is not None:
            return error_for_status(out.error, out.error_status)
    return None


async def merged_outputs(group: RequestGroup) -> AsyncIterator[SequenceOutput]:
    """The group's outputs as they arrive; what queued up meanwhile comes merged, one output per sequence."""
    async for batch in group.stream():
        for out in merge_outputs(batch):
            yield out


def error_event(out: SequenceOutput) -> bytes:
    """An error in the middle of a stream: the OpenAI error object as an event, then the end of the stream."""
    return sse(error_for_status(out.error, out.error_status).response_body()) + SSE_DONE


# ------------------------------------------------------------------------------------------- OpenAI


class OpenAIStream:
    """What differs between a /v1/completions stream and a /v1/chat/completions stream: how one choice's new
    output becomes a chunk, what comes before the first token, and the usage chunk."""

    def __init__(
        self,
        chat: bool,
        token_text: Callable[[int], str],
        tools=None,
        echo_texts: list[str] | None = None,
        continuous_usage: bool = False,
    ):
        """echo_texts (completions with echo): each prompt's text, by prompt index, sent before its choices' first
        tokens; for chat, the pre-filled start of the reply, sent as its own delta after the role. continuous_usage:
        every chunk carries its choice's usage so far (vLLM's continuous_usage_stats)."""
        self.chat, self.token_text = chat, token_text
        self.tools = tools  # chat: structured_outputs.ChatTools, which turns tool-call text into tool_calls deltas
        self.echo_texts = echo_texts
        self.continuous_usage = continuous_usage
        self._text_offsets: dict[int, int] = {}  # completions logprobs: where each choice's next token starts
        self._echoed: set[int] = set()  # choices whose prompt went out already

    def choice_usage(self, seq: Sequence) -> dict | None:
        if not self.continuous_usage:
            return None
        return R.usage_json(Usage(len(seq.prompt_ids), seq.completion_tokens, seq.cached_tokens))

    def preamble(self, request_id, created, model, group: RequestGroup, include_usage: bool) -> list[dict]:
        # Chat sends the role first, before any token, as OpenAI and vLLM do; then, with echo, the pre-filled start
        # of the reply (vLLM's order).
        if not self.chat:
            return []
        chunks = [
            R.chat_chunk(
                request_id,
                created,
                model,
                seq.index,
                {"role": "assistant", "content": ""},
                None,
                None,
                include_usage,
                usage=self.choice_usage(seq),
            )
            for seq in group.sequences
        ]
        if self.echo_texts:
            chunks += [
                R.chat_chunk(
                    request_id,
                    created,
                    model,
                    seq.index,
                    {"content": self.echo_texts[seq.prompt_index]},
                    None,
                    None,
                    include_usage,
                    usage=self.choice_usage(seq),
                )
                for seq in group.sequences
            ]
        return chunks

    def chunk(
        self, request_id, created, model, out: SequenceOutput, seq: Sequence, want_logprobs: bool, include_usage: bool
    ) -> dict:
        stop_reason = out.matched_stop if out.finished else None
        usage = self.choice_usage(seq)
        if self.chat:
            logprobs = R.chat_logprobs(out.token_ids, out.logprobs, self.token_text) if want_logprobs else None
            delta = {"content": out.text} if out.text or not out.finished else {}
            finish_reason = out.finish_reason
            if self.tools is not None:
                delta, finish_reason = self.tools.stream_delta(out.index, out.text, out.finished, out.finish_reason)
            return R.chat_chunk(
                request_id, created, model, out.index, delta, finish_reason, logprobs, include_usage, stop_reason, usage
            )
        echo = None
        if self.echo_texts is not None and out.index not in self._echoed:
            # The first chunk of a choice: its prompt logprobs came with its first token, before this chunk.
            self._echoed.add(out.index)
            echo = R.echo_of(self.echo_texts[seq.prompt_index], seq.prompt_ids, seq.prompt_logprobs)
        logprobs = None
        if want_logprobs:
            offset = self._text_offsets.get(out.index, 0)
            logprobs = R.echoed_logprobs(echo, out.token_ids, out.logprobs, self.token_text, offset)
            self._text_offsets[out.index] = offset + sum(len(t) for t in logprobs["tokens"])
        text = out.text if echo is None else echo.text + out.text
        return R.completion_chunk(
            request_id, created, model, out.index, text, out.finish_reason, logprobs, include_usage, stop_reason, usage
        )

    def usage_chunk(self, request_id, created, model, group: RequestGroup) -> dict:
        usage_chunk = R.chat_usage_chunk if self.chat else R.completion_usage_chunk
        return usage_chunk(request_id, created, model, group.usage())


async def openai_events(
    stream: OpenAIStream,
    group: RequestGroup,
    request_id: str,
    created: int,
    model: str,
    want_logprobs: bool,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """The chunks of each wake-up as one event string (one write), the last with the usage chunk and [DONE]."""
    by_index = {seq.index: seq for seq in group.sequences}
    for chunk in stream.preamble(request_id, created, model, group, include_usage):
        yield sse(chunk)
    finished, events = 0, []
    async for batch in group.stream():
        for out in merge_outputs(batch):
            finished += out.finished
            if out.error is not None:
                yield b"".join(events) + error_event(out)
                return
            if out.finish_reason == "abort" or not (out.text or out.finished or (want_logprobs and out.token_ids)):
                continue
            events.append(
                sse(stream.chunk(request_id, created, model, out, by_index[out.index], want_logprobs, include_usage))
            )
        if events and finished < len(by_index):  # the last batch's go out with the end of the stream
            yield b"".join(events)
            events = []
    if include_usage:
        events.append(sse(stream.usage_chunk(request_id, created, model, group)))
    yield b"".join(events) + SSE_DONE


# ------------------------------------------------------------------------------------------- native


async def generate_events(
    group: RequestGroup, request_id: str, arrival: float, want_logprobs: bool
) -> AsyncIterator[bytes]:
    """SGLang's /generate stream: every chunk carries the cumulative text and output_ids of its choice."""
    by_index = {s.index: s for s in group.sequences}
    text = {i: "" for i in by_index}
    ids = {i: [] for i in by_index}
    logprobs = {i: [] for i in by_index}
    async for out in merged_outputs(group):
        if out.error is not None:
            yield error_event(out)
            return
        if out.finish_reason == "abort":
            continue
        i = out.index
        text[i] += out.text
        ids[i] += out.token_ids
        logprobs[i] += out.logprobs
        if not (out.text or out.finished or out.token_ids):
            continue
        seq = by_index[i]
        yield sse(
            R.native_result(
                request_id,
                i,
                text[i],
                ids[i],
                out.finish_reason,
                out.matched_stop,
                len(seq.prompt_ids),
                seq.cached_tokens,
                logprobs[i] if want_logprobs else None,
                time.monotonic() - arrival if out.finished else None,
            )
        )
    yield SSE_DONE
