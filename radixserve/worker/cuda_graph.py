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

import logging
import time

import torch

from radixserve.forward_context import DecodeGroups, ForwardContext, pack_decode_groups, set_forward_context
from radixserve.protocol import PrefixGroups

logger = logging.getLogger(__name__)


def max_groups(bs: int) -> int:
    """The group count a grouped graph of batch size bs is captured with: every group has two members or more."""
    return max(1, bs // 2)


def batch_size_buckets(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16))
    return sorted({min(s, max_bs) for s in sizes} | {max_bs})


class DecodeCudaGraphs:
    def __init__(self, model: torch.nn.Module, req_to_token: torch.Tensor, context_len: int, max_bs: int,
                 grouped: bool = False, staging=None):
        self.model = model
        self.staging = staging  # a worker.pinned_staging.PinnedStaging for the group table's copy, if given
        self.req_to_token = req_to_token
        self.context_len = context_len
        self.buckets = batch_size_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        device = req_to_token.device
        # Static inputs: the graphs read these addresses; replay copies each step's values into them.
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.zeros(self.max_bs, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int32, device=device)
        self.out_cache_loc = torch.zeros(self.max_bs, dtype=torch.int32, device=device)
        # The grouped graphs' tables: each bucket reads its own layout from the start of this one buffer.
        self.group_table = torch.zeros(DecodeGroups.flat_size(max_groups(self.max_bs), self.max_bs),
                                       dtype=torch.int32, device=device) if grouped else None
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # by (batch size, grouped)
        self.logits: dict[tuple[int, bool], torch.Tensor] = {}
        start = time.perf_counter()
        self._capture_all()
        logger.info("captured %d decode CUDA graphs (batch sizes up to %d) in %.1f s", len(self.graphs),
                    self.max_bs, time.perf_counter() - start)

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.max_bs

    def _context(self, bs: int, grouped: bool) -> ForwardContext:
        unused = self.seq_lens[:0]
        groups = None
        if grouped:
            # Captured with no members (every group empty): all decodes take the plain suffix path meanwhile.
            self._write_group_table(PrefixGroups(b"", b"", b"", b""), bs)
            groups = DecodeGroups.view(self.group_table, max_groups(bs), bs, self.context_len, bs)
        return ForwardContext(
            num_extend_reqs=0, num_extend_tokens=0, req_to_token=self.req_to_token,
            req_pool_indices=self.req_pool_indices[:bs], prefix_lens=unused, extend_lens=unused,
            extend_start_loc=unused, seq_lens=self.seq_lens[:bs], out_cache_loc=self.out_cache_loc[:bs],
            max_extend_len=0, max_seq_len=self.context_len, decode_groups=groups)

    def _run(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs])
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        stream = torch.cuda.Stream()
        # Capture runs on a side stream: it must first see the static buffers' initial values and the weights,
        # written on the default stream (without this wait it read stale memory of a freed engine).
        stream.wait_stream(torch.cuda.current_stream())
        # A group has two members at least: a batch of one never replays a grouped graph.
        for bs, grouped in [(bs, grouped) for bs in reversed(self.buckets)
                            for grouped in ([False, True] if self.group_table is not None and bs >= 2 else [False])]:
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

    def _write_group_table(self, groups: PrefixGroups, bs: int) -> None:
        flat, _, _ = pack_decode_groups(groups, 0, max_groups(bs), bs)
        source = self.staging.to_device(flat) if self.staging is not None else torch.from_numpy(flat)
        self.group_table[:len(flat)].copy_(source, non_blocking=True)

    def replay(self, input_ids, positions, req_pool_indices, seq_lens, out_cache_loc,
               prefix_groups: PrefixGroups | None = None) -> torch.Tensor:
        """Logits [B, V] of one decode step; the arguments are this step's device tensors of length B, and the
        batch's prefix groups (if any: then the grouped graph replays)."""
        n = input_ids.shape[0]
        bs = next(b for b in self.buckets if b >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.req_pool_indices[:n].copy_(req_pool_indices)
        self.seq_lens[:n].copy_(seq_lens)
        self.out_cache_loc[:n].copy_(out_cache_loc)
        if bs > n:
            # Padding requests: row 0 and slot 0 are reserved, so what they read and write harms no one.
            self.req_pool_indices[n:bs].zero_()
            self.seq_lens[n:bs].fill_(1)
            self.out_cache_loc[n:bs].zero_()
        grouped = prefix_groups is not None and self.group_table is not None
        if grouped:
            self._write_group_table(prefix_groups, bs)
        elif prefix_groups is not None:
            raise RuntimeError("prefix groups sent to a worker whose CUDA graphs were captured without them")
        self.graphs[bs, grouped].replay()
        return self.logits[bs, grouped][:n]
