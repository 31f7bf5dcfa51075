"""One generated sequence on the front-end side, from its validated prompt to its last output. Engine.generate and
the HTTP server (tokenizer_service/request_manager.py) both run every scheduler output through this class, so the
two return the same text for the same request.

Who decides what:
* Validation happens before (radixserve/request_validation.py), once per request, so that a request with one bad
  prompt among several queues none of them.
* The scheduler decides every finish: stop token, stop string, length, error (scheduler_service/results.py). It
  frees the KV at once and sends the reason and the stop that matched with the last token.
* This class turns token ids into text (radixserve/detokenizer.py), hides what the client must not see (the
  matched stop string, and the text of a stop token, as vLLM and SGLang do, unless include_stop_str_in_output),
  passes logprobs through, and maps the finish to what the client sees. A sequence the client gave up on ends
  here with end(); the front end then tells the scheduler to drop it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from radixserve.detokenizer import IncrementalDetokenizer
from radixserve.protocol import RequestOutput, TokenLogprobs, unpack_i32
from radixserve.sampling import SamplingParams


@dataclass
class SequenceOutput:
    """What one sequence produced since its previous output: new text and tokens, and on the last one how it
    ended."""

    index: int  # the sequence's choice index in its request
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]  # one per token of token_ids when the request asked for logprobs, else empty
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    matched_stop: int | str | None = None  # the stop token id or stop string that ended the sequence
    error: str | None = None
    error_status: int = 500  # HTTP status for `error`


@dataclass
class SequenceResult:
    """Everything one sequence produced: its outputs added up."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    error: str | None = None
    error_status: int = 500

    def add(self, out: SequenceOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        if out.finished:
            self.finish_reason, self.matched_stop = out.finish_reason, out.matched_stop
            self.error, self.error_status = out.error, out.error_status


class RequestPipeline:
    """One scheduler request (rid): detokenization, stop trimming, logprobs, finish and abort."""

    def __init__(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams, tokenizer, index: int = 0):
        self.rid = rid
        self.index = index
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, self.prompt_ids, params.skip_special_tokens, params.stop, params.include_stop_str_in_output
        )
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.admitted = False  # the scheduler has started it (sent a token, or anything but an immediate finish)
        # params.prompt_logprobs: those of prompt positions 1.. (the first has none), set with the first token
        self.prompt_logprobs: list[TokenLogprobs | None] = []
        self.finished = False

    def process(self, out: RequestOutput) -> SequenceOutput:
        """Turn one scheduler output into what the client may see now."""
        if not self.admitted and (out.token_ids or not out.finished):
            self.admitted = True
            self.cached_tokens = out.cached_tokens
        token_ids = unpack_i32(out.token_ids).tolist()
        self.completion_tokens += len(token_ids)
        if out.prompt_logprobs:
            self.prompt_logprobs = list(out.prompt_logprobs)
        logprobs = [lp for lp in out.logprobs if lp is not None] if self.params.logprobs is not None else []
        output = SequenceOutput(self.index, "", token_ids, logprobs)
        if not out.finished:
            output.text = self.detokenizer.add_tokens(token_ids).text
            return output

        self.finished = output.finished = True
        output.finish_reason = out.finish_reason
        if out.finish_reason in ("stop", "length"):
            stop = out.matched_stop
            visible = token_ids
            if (
                isinstance(stop, int)
                and token_ids
                and token_ids[-1] == stop
                and not self.params.include_stop_str_in_output
            ):
                # A stop token (EOS or stop_token_ids) ends the text without being part of it, though it counts
                # as a completion token and stays in token_ids.
                visible = token_ids[:-1]
            output.text = self.detokenizer.finish(stop if isinstance(stop, str) else None, visible).text
            output.matched_stop = stop
        elif out.finish_reason == "error":
            output.error = out.error or "the scheduler failed this request"
            # A request the scheduler refused before generating anything is the request's fault (too long for
            # the KV cache, ...); a failure midway is ours.
            output.error_status = 400 if self.completion_tokens == 0 else 500
        else:  # "abort" that the front end did not ask for (it ends those with end()): the engine dropped it
            output.finish_reason = "error"
            output.error = out.error or "the engine aborted this request"
            output.error_status = 503
        return output

    def end(self, finish_reason: str, error: str | None = None, error_status: int = 500) -> SequenceOutput:
        """Finish here, for a reason of the front end's (client gone: "abort"; engine lost: "error"). The caller
        tells the scheduler to drop the request; outputs that still arrive for it are to be ignored."""
        self.finished = True
        return SequenceOutput(
            self.index, "", [], [], finished=True, finish_reason=finish_reason, error=error, error_status=error_status
        )
