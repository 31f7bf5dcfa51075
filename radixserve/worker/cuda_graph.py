"""CUDA graphs for decode steps. A decode step of a small model launches hundreds of tiny kernels; replaying them
as one captured graph removes the launch and Python overhead that otherwise dominates the step.

One graph per batch-size bucket, captured at start-up into one shared memory pool (largest first). A batch is
padded up to its bucket with dummy requests that use req_to_token row 0 and KV slot 0, both reserved for padding.
The decode kernel's split count is fixed at capture time from the context length; each request still cuts its
own context into that many slices at run time, so any lengths replay correctly.

With shared-prefix attention on, every bucket also gets a grouped graph (kernels.decode_attention_grouped), used for
decode steps whose batch has prefix groups. Its group table has a fixed shape: as many groups as the bucket can hold
(bs // 2, groups having >= 2 members), padded with empty groups, and fixed bounds (the context length for prefixes,
the bucket size for a group), so that one capture serves every grouping."""

from __future__ import annotations

import contextlib
import gc
import logging
import time

import numpy as np
import torch

import kernels
from radixserve.forward_context import DecodeGroups, ForwardContext, pack_decode_groups, set_forward_context
from radixserve.protocol import PrefixGroups

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def garbage_collected_and_paused():
    """Python's cyclic garbage collector run now, then kept from running until the block ends: around CUDA graph
    captures. Why: torch no longer collects when a capture begins (torch.compiler.config.force_cudagraph_gc), so a
    collection triggered by an allocation inside a capture could free a dead engine's graphs and memory pool, whose
    release cannot be captured. Likely cause of a decode-graph capture failing with cudaErrorStreamCaptureInvalidated
    in a GPU test run only after other tests' engines (bench/results/mixed-step-groups-h200.md)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def max_groups(bs: int) -> int:
    """The group count a grouped graph of batch size bs is captured with: every group the scheduler makes has two
    members or more; lone decodes made groups of one (forward_context.lone_decode_groups) take the room left."""
    return max(1, bs // 2)


def batch_size_buckets(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16))
    return sorted({min(s, max_bs) for s in sizes} | {max_bs})


class DecodeCudaGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        req_to_token: torch.Tensor,
        future_tokens: torch.Tensor,
        context_len: int,
        max_bs: int,
        grouped: bool = False,
        staging=None,
        pack_groups=pack_decode_groups,
    ):
        self.model = model
        self.pack_groups = pack_groups  # forward_context.pack_decode_groups with the model's slices and lone decodes
        self.staging = staging  # a worker.pinned_staging.PinnedStaging: each step's inputs in one copy
        self.req_to_token = req_to_token
        self.future_tokens = future_tokens
        self.context_len = context_len
        self.buckets = batch_size_buckets(max_bs)
        self.max_bs = b = self.buckets[-1]
        # Static inputs: the graphs read these addresses. They are views of one block that each step fills with one
        # copy from pinned memory (a copy_ per input cost ~20 us of host time each on an H100 machine): input ids
        # (placeholders of the overlapped loop included, resolved inside the graph), positions, req_to_token rows,
        # sequence lengths, KV slots of the new tokens, and the grouped graphs' group table.
        self.group_table_size = DecodeGroups.flat_size(max_groups(b), b) if grouped else 0
        int64_part, int32_part = 2 * b, 3 * b + self.group_table_size
        self.block = torch.zeros(8 * int64_part + 4 * int32_part, dtype=torch.uint8, device=req_to_token.device)
        self.host_block = np.zeros(self.block.numel(), dtype=np.uint8)
        longs = self.block[: 8 * int64_part].view(torch.int64)
        ints = self.block[8 * int64_part :].view(torch.int32)
        self.input_ids, self.positions = longs[:b], longs[b:]
        self.req_pool_indices, self.seq_lens, self.out_cache_loc = ints[:b], ints[b : 2 * b], ints[2 * b : 3 * b]
        self.group_table = ints[3 * b :] if grouped else None
        host_longs = self.host_block[: 8 * int64_part].view(np.int64)
        host_ints = self.host_block[8 * int64_part :].view(np.int32)
        self.host = (
            host_longs[:b],
            host_longs[b:],
            host_ints[:b],
            host_ints[b : 2 * b],
            host_ints[2 * b : 3 * b],
            host_ints[3 * b :],
        )
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # by (batch size, grouped)
        self.logits: dict[tuple[int, bool], torch.Tensor] = {}
        start = time.perf_counter()
        with garbage_collected_and_paused():
            self._capture_all()
        logger.info(
            "captured %d decode CUDA graphs (batch sizes up to %d) in %.1f s",
            len(self.graphs),
            self.max_bs,
            time.perf_counter() - start,
        )

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.max_bs

    def _context(self, bs: int, grouped: bool) -> ForwardContext:
        unused = self.seq_lens[:0]
        groups = None
        if grouped:
            # Captured with no members (every group empty): all decodes take the plain suffix path meanwhile.
            flat, _, _ = pack_decode_groups(PrefixGroups(b"", b"", b"", b""), 0, max_groups(bs), bs)
            self.group_table[: len(flat)].copy_(torch.from_numpy(flat))
            groups = DecodeGroups.view(
                self.group_table,
                max_groups(bs),
                bs,
                self.context_len,
                bs,
                kernels.prefix_slices_bound(self.context_len),
            )
        return ForwardContext(
            num_extend_reqs=0,
            num_extend_tokens=0,
            req_to_token=self.req_to_token,
            req_pool_indices=self.req_pool_indices[:bs],
            prefix_lens=unused,
            extend_lens=unused,
            extend_start_loc=unused,
            seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            max_extend_len=0,
            max_seq_len=self.context_len,
            decode_groups=groups,
        )

    def _run(self, bs: int) -> torch.Tensor:
        """The captured step: placeholders resolved, req_to_token written (a decode's token goes at position
        seq_len - 1 of its row; padding rows write row 0, which is reserved), the model, the LM head."""
        positions = self.positions[:bs]
        table_write = (self.req_to_token, self.req_pool_indices[:bs], positions, self.out_cache_loc[:bs])
        ids = kernels.step_input_ids(self.input_ids[:bs], self.future_tokens, table_write)  # one kernel
        hidden = self.model(ids, positions)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        stream = torch.cuda.Stream()
        # Capture runs on a side stream: it must first see the static buffers' initial values and the weights,
        # written on the default stream (without this wait it read stale memory of a freed engine).
        stream.wait_stream(torch.cuda.current_stream())
        self.seq_lens.fill_(1)
        # A group has two members at least: a batch of one never replays a grouped graph.
        for bs, grouped in [
            (bs, grouped)
            for bs in reversed(self.buckets)
            for grouped in ([False, True] if self.group_table is not None and bs >= 2 else [False])
        ]:
            set_forward_context(self._context(bs, grouped))
            stream.wait_stream(torch.cuda.current_stream())  # the group table _context just wrote for this bucket
            try:
                with torch.cuda.stream(stream):
                    for _ in range(2):  # compile Triton kernels and settle allocations outside the capture
                        self._run(bs)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[bs, grouped] = self._run(bs)
            finally:
                set_forward_context(None)
            pool = graph.pool()
            self.graphs[bs, grouped] = graph
        torch.cuda.synchronize()

    def replay(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        req_pool_indices: np.ndarray,
        seq_lens: np.ndarray,
        out_cache_loc: np.ndarray,
        prefix_groups: PrefixGroups | None = None,
    ) -> torch.Tensor:
        """Logits [B, V] of one decode step; the arguments are this step's host arrays of length B (input ids may
        be placeholders of the previous step's tokens), and the batch's prefix groups (if any: then the grouped
        graph replays). The step's inputs go to the device in one copy, then one graph launch."""
        n = len(input_ids)
        bs = next(b for b in self.buckets if b >= n)
        ids, pos, rows, lens, slots, table = self.host
        ids[:n], pos[:n], rows[:n] = input_ids, positions, req_pool_indices
        lens[:n], slots[:n] = seq_lens, out_cache_loc
        # Padding requests: row 0 and slot 0 are reserved, so what they read and write harms no one.
        ids[n:bs], pos[n:bs], rows[n:bs], lens[n:bs], slots[n:bs] = 0, 0, 0, 1, 0
        grouped = prefix_groups is not None and self.group_table is not None
        if grouped:
            flat, _, _ = self.pack_groups(prefix_groups, 0, max_groups(bs), bs, decodes=(req_pool_indices, seq_lens))
            table[: len(flat)] = flat
        elif prefix_groups is not None:
            raise RuntimeError("prefix groups sent to a worker whose CUDA graphs were captured without them")
        self.staging.copy_into(self.block, self.host_block)
        self.graphs[bs, grouped].replay()
        return self.logits[bs, grouped][:n]
