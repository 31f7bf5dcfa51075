"""What a streamed chat request costs the HTTP process per request, kept down (bench/results/front-end-burst-cpu.md):

* a prompt's ids are validated once (serving.build_prompts), and ids the tokenizer produced by a min / max range
  check rather than check_prompt_ids' per-token passes, with the same answers and errors as check_request;
* an OpenAI stream writes the chunks of one wake-up as one event, and its last chunk, the usage chunk, [DONE] and
  the end of the body as one write, with the same bytes as one write per chunk.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from radixserve import request_validation
from radixserve.request_pipeline import SequenceOutput
from radixserve.request_validation import InvalidRequest, check_request
from radixserve.sampling import SamplingParams
from tokenizer_service import serving
from tokenizer_service.request_group import Usage
from tokenizer_service.streaming import (
    SSE_DONE,
    EventStreamResponse,
    OpenAIStream,
    error_event,
    merged_outputs,
    openai_events,
    sse,
)

VOCAB, CONTEXT, POOL = 100, 64, 48


def ctx(kv_pool_tokens=POOL):
    return SimpleNamespace(
        vocab_size=VOCAB, context_len=CONTEXT, manager=SimpleNamespace(kv_pool_tokens=kv_pool_tokens)
    )


def fields(**overrides) -> dict:
    return {**{"max_new_tokens": 4, "temperature": 0.0}, **overrides}


CASES = [  # (ids, fields, kv pool): accepted or refused, alike by build_prompts and check_request
    ([1, 2, 3], fields(), POOL),
    ([0, 99], fields(max_new_tokens=None), None),
    ([], fields(), POOL),
    ([1, 100], fields(), POOL),
    ([-1, 5], fields(), POOL),
    ([1] * 60, fields(max_new_tokens=5), None),
    ([1] * 40, fields(max_new_tokens=9), POOL),
    ([1, 2], fields(temperature=-1.0), POOL),
    ([1] * CONTEXT, fields(max_new_tokens=None), None),
]


def outcome(fn):
    try:
        return fn()
    except InvalidRequest as e:
        return ("refused", e.message, e.param)


@pytest.mark.parametrize("ids, f, pool", CASES)
@pytest.mark.parametrize("from_tokenizer", [False, True])
def test_build_prompts_answers_as_check_request(ids, f, pool, from_tokenizer):
    def reference():
        n = f["max_new_tokens"]
        if n is None:
            n = serving.default_max_new_tokens(len(ids), CONTEXT) if ids else 1
        params = SamplingParams(**{**f, "max_new_tokens": n})
        return [(check_request(ids, params, VOCAB, CONTEXT, "messages", pool), params)]

    got = outcome(lambda: serving.build_prompts(ctx(pool), dict(f), [list(ids)], "messages", from_tokenizer))
    assert got == outcome(reference)


def test_prompt_ids_are_checked_once_and_the_tokenizers_without_a_pass_per_token(monkeypatch):
    calls = []
    full_check = serving.check_prompt_ids
    for module in (serving, request_validation):  # check_request's own call counts too
        monkeypatch.setattr(module, "check_prompt_ids", lambda *a: calls.append(a) or full_check(*a))
    ids = list(range(40))
    assert serving.build_prompts(ctx(), fields(), [ids], "prompt")[0][0] == ids
    assert len(calls) == 1  # a client's ids: the full check, once
    calls.clear()
    assert serving.build_prompts(ctx(), fields(), [ids], "messages", from_tokenizer=True)[0][0] == ids
    assert calls == []
    with pytest.raises(InvalidRequest, match="token id 100"):  # out of range: the full check says which id
        serving.build_prompts(ctx(), fields(), [[3, 100]], "messages", from_tokenizer=True)
    assert len(calls) == 1


# ------------------------------------------------------------------------------------------- streams


class FakeGroup:
    """What openai_events and EventStreamResponse use of a RequestGroup: its sequences, batches and usage."""

    def __init__(self, n: int, batches: list[list[SequenceOutput]]):
        self.request_id = "chatcmpl-x"
        self.sequences = [
            SimpleNamespace(index=i, prompt_index=0, prompt_ids=[1, 2, 3], completion_tokens=2, cached_tokens=1)
            for i in range(n)
        ]
        self.batches, self.aborted, self.finished = batches, 0, True

    async def stream(self):
        for batch in self.batches:
            await asyncio.sleep(0)
            yield batch

    def usage(self) -> Usage:
        return Usage(3, 2 * len(self.sequences), 1)

    def abort(self):
        self.aborted += 1


def out(index, text, finished=False, error=None):
    return SequenceOutput(index, text, [7], [], finished, "length" if finished else None, None, error, 500)


async def reference_events(stream, group, include_usage):
    """openai_events before it joined a wake-up's chunks: one event per chunk, then usage, then [DONE]."""
    for chunk in stream.preamble("chatcmpl-x", 1, "m", group, include_usage):
        yield sse(chunk)
    by_index = {seq.index: seq for seq in group.sequences}
    async for o in merged_outputs(group):
        if o.error is not None:
            yield error_event(o)
            return
        if o.finish_reason == "abort" or not (o.text or o.finished):
            continue
        yield sse(stream.chunk("chatcmpl-x", 1, "m", o, by_index[o.index], False, include_usage))
    if include_usage:
        yield sse(stream.usage_chunk("chatcmpl-x", 1, "m", group))
    yield SSE_DONE


STREAMS = {  # name: (choices, batches, events openai_events yields: preamble, then one per wake-up)
    "one choice": (1, [[out(0, "a")], [out(0, "b")], [out(0, "c")], [out(0, "d", True)]], 1 + 4),
    "a wake-up of two tokens": (1, [[out(0, "a")], [out(0, "b"), out(0, "c", True)]], 1 + 2),
    "two choices": (2, [[out(0, "a"), out(1, "x")], [out(1, "y", True)], [out(0, "", True)]], 2 + 3),
    "an error": (2, [[out(0, "a")], [out(1, "x"), out(0, "", True, error="boom")]], 2 + 2),
    "empty last output": (1, [[out(0, "a")], [out(0, "", True)]], 1 + 2),
}


async def events_of(gen) -> list[bytes]:
    return [e async for e in gen]


@pytest.mark.parametrize("name", STREAMS)
@pytest.mark.parametrize("include_usage", [False, True])
def test_openai_events_join_a_wake_up_and_end_with_done_in_one_event(name, include_usage):
    n, batches, expected_events = STREAMS[name]
    new = asyncio.run(
        events_of(
            openai_events(OpenAIStream(True, str), FakeGroup(n, batches), "chatcmpl-x", 1, "m", False, include_usage)
        )
    )
    old = asyncio.run(events_of(reference_events(OpenAIStream(True, str), FakeGroup(n, batches), include_usage)))
    assert b"".join(new) == b"".join(old)  # the same bytes
    assert len(new) == expected_events  # in fewer writes
    assert new[-1].endswith(SSE_DONE) and not any(SSE_DONE in e for e in new[:-1])


def run_response(events: list[bytes]) -> tuple[list[dict], FakeGroup]:
    group = FakeGroup(1, [])
    sent: list[dict] = []

    async def gen():
        for event in events:
            yield event

    async def receive():
        await asyncio.Event().wait()  # the client never leaves

    async def send(message):
        sent.append(message)

    asyncio.run(EventStreamResponse(gen(), group)({"type": "http"}, receive, send))
    return sent, group


def test_the_done_event_ends_the_body_in_the_same_write():
    sent, group = run_response([b"data: 1\n\n", b"data: 2\n\n" + SSE_DONE])
    assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * 2
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [
        (b"data: 1\n\n", True),
        (b"data: 2\n\n" + SSE_DONE, False),
    ]
    assert group.aborted == 1  # the group is still let go of (a no-op for a finished one)


def test_a_stream_without_done_ends_with_an_empty_body():
    sent, _ = run_response([b"event: a\ndata: 1\n\n"])  # the Responses API's streams send no [DONE]
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [(b"event: a\ndata: 1\n\n", True), (b"", False)]
