"""What one step produced for one request (StepOutput), and its message on the socket to its front end."""

from __future__ import annotations

import struct
from array import array

import msgspec

from radixserve.protocol import RequestOutput
from scheduler_service.request import Req

_INT32 = struct.Struct("=i")


class StepOutput(msgspec.Struct, gc=False):
    """What one step produced for one request. (A msgspec Struct for its speed alone: a step makes one per running
    request, and this constructs in half the time of a slotted dataclass, untracked by the garbage collector as it
    can hold no cycle. It never goes on a socket.)"""

    req: Req
    new_token_ids: list[int]
    new_logprobs: list = []
    finished: bool = False
    num_outputs: int | None = None  # the request's outputs so far (None: all of output_ids; aborts, errors)
    message: RequestOutput | None = None  # built with the step's results (decode batches); None: to_message builds it

    def to_message(self) -> RequestOutput:
        if self.message is not None:
            return self.message
        req = self.req
        num_outputs = self.num_outputs
        if num_outputs is None:  # not counting placeholders of steps still in flight (an abort mid-step)
            num_outputs = len(req.output_ids)
            while num_outputs and req.output_ids[num_outputs - 1] < 0:
                num_outputs -= 1
        first = num_outputs == len(self.new_token_ids)
        token_ids = self.new_token_ids
        # The same int32 bytes as protocol.pack_i32, without a numpy array per request (one token: one struct call).
        token_bytes = _INT32.pack(token_ids[0]) if len(token_ids) == 1 else array("i", token_ids).tobytes()
        # Queue time and prompt logprobs ride on the output with the first token only.
        message = RequestOutput(
            rid=req.rid,
            token_ids=token_bytes,
            logprobs=self.new_logprobs,
            finished=self.finished,
            finish_reason=req.finish_reason if self.finished else None,
            matched_stop=req.matched_stop,
            error=req.error,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=num_outputs,
            cached_tokens=req.cached_tokens or 0,
            queue_time=(req.admitted_time - req.arrival_time) if first and req.admitted_time else None,
        )
        if first and req.prompt_logprobs and token_ids:
            message.prompt_logprobs = req.prompt_logprobs[1:]
        return message


def messages(outputs: list[StepOutput]) -> list[RequestOutput]:
    """The front end's message of each output (what a BatchOutput carries). Most outputs of a decode step carry theirs
    already: read as an attribute, not through a method call per output."""
    return [out.message or out.to_message() for out in outputs]


def per_front_end(outputs: list[StepOutput], count: int) -> list[tuple[int, list[RequestOutput]]]:
    """A step's messages split by the front end each request came from (--api-server-count): (index, messages) for
    each front end that has any, so that each gets one BatchOutput a step with only its own requests. With one front
    end nothing is looked at per request."""
    if not outputs:
        return []
    if count == 1:
        return [(0, messages(outputs))]
    split: list[list[StepOutput]] = [[] for _ in range(count)]
    for out in outputs:
        split[out.req.front_end].append(out)
    return [(i, messages(batch)) for i, batch in enumerate(split) if batch]
