"""How a request lets go of what it holds, and ends: off the running batch, its req_to_token row and KV slots given
back (into the radix tree when it finished, freed when it was aborted or retracted), then marked finished and dropped
from the table of live requests. Each happens exactly once per request (docs/architecture.md, "KV slots").

Retraction (memory_pressure.py), results (results.py) and aborts (Scheduler.abort) all end requests through here, so
that there is one place that knows where a request's row and slots go."""

from __future__ import annotations

import logging

from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.slot_allocator import ReqPoolAllocator, TokenSlotAllocator
from scheduler_service.long_context import LongContext
from scheduler_service.request import Req, ReqStatus
from scheduler_service.step_output import StepOutput

logger = logging.getLogger(__name__)


class Endings:
    def __init__(
        self,
        tree: RadixCache,
        slot_allocator: TokenSlotAllocator,
        row_allocator: ReqPoolAllocator,
        long: LongContext | None,
        running: list[Req],
        finishing: list[Req],
        requests: dict[str, Req],
        outputs: list[StepOutput],
    ):
        """running, finishing, requests and outputs are the Scheduler's own containers (changed in place, never
        rebound); long: layer-wise offload's requests, which keep their KV in host memory (long_context.py)."""
        self.tree = tree
        self.slot_allocator = slot_allocator
        self.row_allocator = row_allocator
        self.long = long
        self.running = running
        self.finishing = finishing
        self.requests = requests
        self.outputs = outputs

    def num_running(self) -> int:
        """Requests holding a row: running, set aside to finish, and long ones."""
        return len(self.running) + len(self.finishing) + (len(self.long.running) if self.long is not None else 0)

    def stop_running(self, req: Req) -> None:
        if req.offloaded:
            return self.long.stop(req)
        (self.finishing if req.finishing else self.running).remove(req)
        req.finishing = False

    def release(self, req: Req, insert: bool) -> None:
        """Give back the request's row and KV: inserted into the tree (finished) or freed (aborted, retracted)."""
        if req.offloaded:
            return self.long.release(req, insert)
        if insert and not self.tree.disable:
            # The last sampled token has no KV yet; everything before it does. The tree holds the first tree_len
            # tokens already (the path to last_node): only the rest goes in.
            start, end = req.tree_len, req.kv_len
            self.tree.insert_below(req.last_node, req.fill_ids()[start:end], req.slots[start:end], req.priority)
        elif insert:
            self.slot_allocator.free(req.slots[: req.kv_len])
        else:
            self.slot_allocator.free(req.slots[req.tree_len : req.kv_len])
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
            req.last_node = None
        self.row_allocator.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_len = req.tree_len = 0

    def end(self, req: Req, reason: str, num_outputs: int) -> None:
        """A running request ends with its num_outputs-th output. The step in flight may hold its next decode: that
        placeholder goes, and the slot the decode writes is in kv_len, so it is released with the rest (once)."""
        del req.output_ids[num_outputs:]
        self.stop_running(req)
        self.release(req, insert=True)
        self.finish(req, reason)

    def finish(self, req: Req, reason: str) -> None:
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.rid, None)

    def fail(self, req: Req, message: str) -> None:
        """End a request that holds nothing any more (its KV given back, or never taken) with an error."""
        req.error = message
        self.finish(req, "error")
        self.outputs.append(StepOutput(req, [], finished=True))
        logger.warning("request %s failed: %s", req.rid, message)
