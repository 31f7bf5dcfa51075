"""The front ends' shared parts without a server: request validation (radixserve/request_validation.py) and the
per-sequence pipeline (radixserve/request_pipeline.py) fed with the RequestOutput messages a scheduler sends.
End to end, tests/e2e/test_pipeline_parity.py shows that Engine and HTTP agree."""

from __future__ import annotations

import pytest

from radixserve.protocol import RequestOutput, TokenLogprobs, pack_i32
from radixserve.request_pipeline import RequestPipeline, SequenceResult
from radixserve.request_validation import InvalidRequest, check_request, default_max_new_tokens
from radixserve.sampling import SamplingParams

VOCAB, CONTEXT = 1000, 64


@pytest.mark.parametrize(
    "ids, params, words, param",
    [
        ([], SamplingParams(), "prompt must not be empty", "prompt"),
        ([1, VOCAB], SamplingParams(), f"token id {VOCAB}, outside the vocabulary [0, {VOCAB})", "prompt"),
        ([1, -2], SamplingParams(), "token id -2", "prompt"),
        ([1, 10**30], SamplingParams(), f"token id {10**30}", "prompt"),
        ([1] * 60, SamplingParams(max_new_tokens=10), "you requested 70 tokens (60 in the messages, 10 in the", None),
        ([1], SamplingParams(temperature=-1.0), "temperature", None),
        ([1], SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids", None),
    ],
)
def test_check_request_refuses_with_the_field_named(ids, params, words, param):
    with pytest.raises(InvalidRequest) as refused:
        check_request(ids, params, VOCAB, CONTEXT)
    assert words in refused.value.message and refused.value.param == param
    assert isinstance(refused.value, ValueError)  # what Engine.generate raises to its caller


def test_check_request_accepts_and_defaults():
    assert check_request((3, 4), SamplingParams(max_new_tokens=CONTEXT - 2), VOCAB, CONTEXT) == [3, 4]
    assert default_max_new_tokens(10, CONTEXT) == CONTEXT - 10
    with pytest.raises(InvalidRequest, match="your request has 64 input tokens"):
        default_max_new_tokens(CONTEXT, CONTEXT)


def output(token_ids, finished=False, reason=None, matched=None, error=None, logprobs=()):
    return RequestOutput(
        "r", pack_i32(token_ids), list(logprobs), finished, reason, matched, error, 3, len(token_ids), 2, None
    )


def run(pipeline, outputs):
    result = SequenceResult(pipeline.index)
    for out in outputs:
        result.add(pipeline.process(out))
    return result


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


def test_stop_token_text_hidden_unless_asked(tok):
    ids = tok.encode("Hello world")
    for include, expected in [(False, "Hello"), (True, "Hello world")]:
        pipeline = RequestPipeline("r", [1, 2, 3], SamplingParams(include_stop_str_in_output=include), tok)
        result = run(pipeline, [output(ids[:1]), output(ids[1:], True, "stop", ids[-1])])
        assert result.text == expected and result.token_ids == ids and result.matched_stop == ids[-1]
        assert pipeline.finished and pipeline.completion_tokens == len(ids)


def test_stop_string_cut_where_the_scheduler_stopped(tok):
    ids = tok.encode("one, two, three")
    assert [tok.decode([i]) for i in ids] == ["one", ",", " two", ",", " three"]
    # Below min_new_tokens the scheduler ignored the first ", t"; it stops at the second: only that one is cut.
    pipeline = RequestPipeline("r", [1], SamplingParams(stop=[", t"], min_new_tokens=3), tok)
    outputs = [output([t]) for t in ids[:-1]] + [output(ids[-1:], True, "stop", ", t")]
    shown = [pipeline.process(out).text for out in outputs]
    # "," might start the stop string: held back until the next token decides.
    assert shown == ["one", "", ", two", "", ""]


def test_finishes_the_front_end_did_not_ask_for(tok):
    refused = RequestPipeline("r", [1], SamplingParams(), tok).process(output([], True, "error", error="too long"))
    assert (refused.finish_reason, refused.error, refused.error_status) == ("error", "too long", 400)
    midway = RequestPipeline("r", [1], SamplingParams(), tok)
    midway.process(output([5]))
    failed = midway.process(output([], True, "error"))
    assert failed.error_status == 500
    dropped = RequestPipeline("r", [1], SamplingParams(), tok).process(output([5], True, "abort"))
    assert (dropped.finish_reason, dropped.error_status) == ("error", 503)
    ended = RequestPipeline("r", [1], SamplingParams(), tok)
    assert ended.end("abort").finish_reason == "abort" and ended.finished


def test_logprobs_only_when_asked(tok):
    lp = TokenLogprobs(-0.5, pack_i32([5]), b"")
    without = RequestPipeline("r", [1], SamplingParams(), tok).process(output([5], logprobs=[lp]))
    with_them = RequestPipeline("r", [1], SamplingParams(logprobs=1), tok).process(output([5], logprobs=[lp]))
    assert without.logprobs == [] and with_them.logprobs == [lp]
