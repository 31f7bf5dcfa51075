"""One HTTP request on the HTTP side: a RequestGroup of Sequences, one per prompt and per choice (n), and the queue
their outputs arrive on, which the handler streams or collects. tokenizer_service/request_manager.py makes the groups,
sends their sequences to the scheduler and delivers each output to its group."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

from radixserve.request_pipeline import RequestPipeline, SequenceOutput, SequenceResult
from radixserve.sampling import SamplingParams

if TYPE_CHECKING:
    from tokenizer_service.request_manager import RequestManager


class Sequence(RequestPipeline):
    """One scheduler request: one choice of one prompt, with what the HTTP side tracks about it."""

    def __init__(
        self,
        rid: str,
        index: int,
        prompt_index: int,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer,
        group: "RequestGroup",
        arrival: float,
    ):
        super().__init__(rid, prompt_ids, params, tokenizer, index)
        self.prompt_index = prompt_index
        self.group = group
        self.arrival = arrival  # time.monotonic() when the HTTP request arrived
        self.last_token_at: float | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class RequestGroup:
    """The sequences of one HTTP request and the queue their outputs arrive on."""

    def __init__(self, request_id: str, manager: "RequestManager"):
        self.request_id = request_id
        self.sequences: list[Sequence] = []
        self._manager = manager
        # Outputs not yet taken by the handler, and the future its stream waits on when there are none: one list swap
        # per wake-up instead of an asyncio.Queue's get per output (the HTTP process does this for every token).
        self._pending: list[SequenceOutput] = []
        self._waiter: asyncio.Future | None = None
        self._unfinished = 0

    @property
    def finished(self) -> bool:
        return self._unfinished == 0

    def add(self, seq: Sequence) -> None:
        self.sequences.append(seq)
        self._unfinished += 1

    def deliver(self, output: SequenceOutput) -> None:
        """Called by the RequestManager for each output of one of our sequences; the last one has finished=True."""
        if output.finished:
            self._unfinished -= 1
        self._pending.append(output)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def stream(self) -> AsyncIterator[list[SequenceOutput]]:
        """Outputs as they come, everything already queued at each wake-up in one list (a client reading slower
        than tokens arrive gets bigger chunks, not a growing backlog), until every sequence has finished."""
        delivered_finished = 0
        while delivered_finished < len(self.sequences):
            while not self._pending:
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            batch, self._pending = self._pending, []
            delivered_finished += sum(o.finished for o in batch)
            yield batch

    async def collect(self) -> list[SequenceResult]:
        """Wait for every sequence to finish; results in choice order."""
        results = {s.index: SequenceResult(s.index) for s in self.sequences}
        async for batch in self.stream():
            for out in batch:
                results[out.index].add(out)
        return [results[i] for i in sorted(results)]

    def usage(self) -> Usage:
        """Prompt tokens count once per prompt however many choices share it (as OpenAI counts them); cached
        tokens are the fewest any choice of that prompt found in the cache."""
        prompt_tokens, cached_tokens = 0, 0
        for prompt_index in sorted({s.prompt_index for s in self.sequences}):
            same_prompt = [s for s in self.sequences if s.prompt_index == prompt_index]
            prompt_tokens += len(same_prompt[0].prompt_ids)
            cached_tokens += min(s.cached_tokens for s in same_prompt)
        return Usage(prompt_tokens, sum(s.completion_tokens for s in self.sequences), cached_tokens)

    def abort(self) -> None:
        """Stop every unfinished sequence (client gone, handler failed); a no-op once all have finished."""
        self._manager.abort_group(self)
