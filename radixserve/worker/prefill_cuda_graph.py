"""Piecewise CUDA graphs for prefill and mixed steps (--disable-prefill-cuda-graph turns them off).

An eager step launches a few hundred kernels from Python: on an H100 a 128-token step of an 8B model kept the
device busy ~7 ms of ~33 ms, so a cache hit cost what a cold prompt does. The decode graphs (cuda_graph.py) cannot
serve these steps: the extend attention kernel's launch depends on the batch's makeup (requests, chunk lengths).

So, as vLLM's and SGLang's piecewise graphs do, everything between one layer's attention and the next is captured
(LlamaModel.piece: output projection, norms, MLP, the next layer's Q/K/V, RoPE and KV store), one graph per piece
and token-count bucket, and attention alone runs eagerly between the replays: num_layers + 1 replays and the
attention kernels' launches per step, instead of every kernel. A step is padded up to its bucket; padding tokens
are row-independent work that writes KV slot 0, which is reserved for padding.

Memory: pieces pass Q/K/V and the attention output through static buffers of the largest bucket, shared by every
layer and bucket. Everything else a piece makes lives in one private graph pool; a piece's outputs are only read by
the next piece, so the pool may reuse them for the pieces after it (graphs of one pool are replayed in the order
they were captured). Buckets are captured largest first and share the pool the same way.

Inside a piece only ForwardContext.out_cache_loc may be read (the KV store): it is a static buffer while capturing.

A step that is one prompt chunk alone (a lone request's first token: the latency case) replays instead one graph of
the whole forward, attention included: the extend kernel reads its request's row, lengths and start from a static
block and is launched with the grid of the bucket's length, so the programs past the chunk's real length exit at
once. That step then costs one graph launch instead of a launch per layer (a 128-token cache hit on Qwen3-0.6B:
2.2 ms of host time with the pieces).
"""

from __future__ import annotations

import logging
import time

import torch

import kernels
from kernels.launch_replay import LaunchRecording, recording
from radixserve.forward_context import ForwardContext, set_forward_context
from radixserve.worker.cuda_graph import garbage_collected_and_paused

logger = logging.getLogger(__name__)


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, 128, then steps of 64 to 512, of 128 to 2048 and of 256 beyond, up to max_tokens: a step is padded
    by under a third of its size above 256 tokens (where steps start to be GPU-bound), by under an eighth from 1,024
    (where a step's time is its tokens': 256-token steps there made a cold 1,152-token prompt on Qwen3-8B 32.2 ms
    against 29.5 with 128, bench/results/prefill-buckets-h100.md) and by at most 16 tokens or its own size below."""
    sizes = [16, 32, 64, 128] + list(range(192, 513, 64)) + list(range(640, 2049, 128))
    sizes += list(range(2304, max_tokens + 1, 256))
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens}) if max_tokens >= 1 else []


def _attention_layout(attention) -> tuple:
    """What a layer's attention launches depend on besides the step: equal for two layers, the first's recorded
    launches are the second's with its caches (kernels/launch_replay.py). Triton specialises on 16-byte alignment."""
    caches = (attention.k_cache, attention.v_cache)
    return (attention.num_heads, attention.num_kv_heads, attention.head_dim, attention.scale) + tuple(
        (c.shape, c.stride(), c.dtype, c.data_ptr() % 16 == 0) for c in caches
    )


class PrefillCudaGraphs:
    def __init__(self, model: torch.nn.Module, max_tokens: int, req_to_token: torch.Tensor):
        self.model = model.model  # the LlamaModel: layers, piece()
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        self.num_layers = len(self.model.layers)
        self.attention = [layer.self_attn.attn for layer in self.model.layers]
        self.uniform_attention = len({_attention_layout(a) for a in self.attention}) == 1
        device = req_to_token.device
        t = self.max_tokens
        attn0 = self.attention[0]
        dtype = self.model.embed_tokens.weight.dtype
        # Static inputs and the buffers that cross a piece boundary (the graphs read and write these addresses).
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(t, dtype=torch.int32, device=device)
        self.q = torch.zeros(t, attn0.num_heads, attn0.head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(t, attn0.num_kv_heads, attn0.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.o = torch.zeros_like(self.q)
        self.req_to_token = req_to_token
        # The lone chunk's layout for the whole-forward graphs: req_to_token row, prefix length, chunk length, sequence
        # length (filled with one copy per step), and its start in the batch (always 0).
        self.lone = torch.zeros(4, dtype=torch.int32, device=device)
        self.lone_start = torch.zeros(1, dtype=torch.int32, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # each bucket's output (final-norm hidden states)
        self.whole: dict[int, torch.cuda.CUDAGraph] = {}
        self.whole_hidden: dict[int, torch.Tensor] = {}
        start = time.perf_counter()
        with garbage_collected_and_paused():  # (cuda_graph.py says why)
            self._capture_all()
        self.capture_seconds = time.perf_counter() - start
        logger.info(
            "captured %d piecewise prefill CUDA graphs (%d pieces x %d token buckets up to %d) and %d of "
            "a lone chunk's whole forward in %.1f s",
            sum(map(len, self.graphs.values())),
            self.num_layers + 1,
            len(self.buckets),
            self.max_tokens,
            len(self.whole),
            self.capture_seconds,
        )

    def replays_attention(self) -> bool:
        """Whether a step's layers after the first replay the first's attention launches: kernels.OPTIONS'
        attention_launch_replay, and layers whose attention differs in nothing but its caches."""
        return kernels.OPTIONS["attention_launch_replay"] and self.uniform_attention

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens

    def _piece(self, i: int, b: int, residual):
        """Piece i over b tokens, its Q/K/V copied into the static buffers; returns the residual stream (or the
        final hidden states for the last piece)."""
        x = self.input_ids[:b] if i == 0 else self.o[:b]
        out, residual = self.model.piece(i, self.positions[:b], x, residual)
        if i == self.num_layers:
            return out
        q, k, v, pending = out
        assert pending is None  # a prefill step: its Q/K/V are done (Attention.store_rotated)
        self.q[:b].copy_(q)
        self.k[:b].copy_(k)
        self.v[:b].copy_(v)
        return residual

    def _lone_context(self, b: int) -> ForwardContext:
        lone = self.lone
        return ForwardContext(
            num_extend_reqs=1,
            num_extend_tokens=b,
            req_to_token=self.req_to_token,
            req_pool_indices=lone[0:1],
            prefix_lens=lone[1:2],
            extend_lens=lone[2:3],
            extend_start_loc=self.lone_start,
            seq_lens=lone[3:4],
            out_cache_loc=self.out_cache_loc[:b],
            max_extend_len=b,
            max_seq_len=0,
        )

    def _capture_context(self, b: int) -> ForwardContext:
        empty = self.out_cache_loc[:0]
        return ForwardContext(
            num_extend_reqs=0,
            num_extend_tokens=0,
            req_to_token=self.req_to_token,
            req_pool_indices=empty,
            prefix_lens=empty,
            extend_lens=empty,
            extend_start_loc=empty,
            seq_lens=empty,
            out_cache_loc=self.out_cache_loc[:b],
            max_extend_len=0,
            max_seq_len=0,
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # (see DecodeCudaGraphs._capture_all)
        for b in reversed(self.buckets):
            set_forward_context(self._capture_context(b))
            try:
                with torch.cuda.stream(stream):  # compile Triton kernels and settle allocations outside the capture
                    residual = None
                    for i in range(self.num_layers + 1):
                        residual = self._piece(i, b, residual)
                torch.cuda.synchronize()
                graphs, residual = [], None
                for i in range(self.num_layers + 1):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        residual = self._piece(i, b, residual)
                    pool = graph.pool()
                    graphs.append(graph)
            finally:
                set_forward_context(None)
            self.graphs[b] = graphs
            self.hidden[b] = residual  # the last piece's output: the final hidden states
            pool = self._capture_whole(b, stream, pool)
        torch.cuda.synchronize()

    def _capture_whole(self, b: int, stream, pool):
        """The whole forward over a lone chunk of up to b tokens (row 0 and a chunk of b while capturing)."""
        self.lone.copy_(torch.tensor([0, 0, b, b], dtype=torch.int32))
        stream.wait_stream(torch.cuda.current_stream())
        set_forward_context(self._lone_context(b))
        try:
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.model(self.input_ids[:b], self.positions[:b])
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.whole_hidden[b] = self.model(self.input_ids[:b], self.positions[:b])
        finally:
            set_forward_context(None)
        self.whole[b] = graph
        return graph.pool()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states [T, H] of the step's T new tokens (valid until the next step): the pieces replayed with
        attention run eagerly over the step's real layout (ctx) in between."""
        n = input_ids.shape[0]
        b = next(size for size in self.buckets if size >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.out_cache_loc[:n].copy_(ctx.out_cache_loc)
        if b > n:  # padding tokens: token 0 at position 0, stored into the reserved slot 0
            self.input_ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.out_cache_loc[n:b].zero_()
        if ctx.num_extend_reqs == 1 and ctx.num_extend_tokens == n:  # a lone chunk: the whole-forward graph
            torch.cat([ctx.req_pool_indices, ctx.prefix_lens, ctx.extend_lens, ctx.seq_lens], out=self.lone)
            self.whole[b].replay()
            return self.whole_hidden[b][:n]
        graphs = self.graphs[b]
        # Every layer's attention makes the same launches over the static buffers, only its caches differ: the first
        # layer's are recorded and replayed for the others (kernels/launch_replay.py), unless the recording says no.
        first = self.attention[0]
        plan = LaunchRecording(first.k_cache, first.v_cache) if self.replays_attention() else None
        set_forward_context(ctx)
        try:
            for i, attention in enumerate(self.attention):
                graphs[i].replay()
                if i and plan is not None and plan.replayable:
                    plan.replay(attention.k_cache, attention.v_cache)
                else:
                    with recording(plan if i == 0 else None):
                        attention.attend(self.q[:n], self.k[:n], self.v[:n], out=self.o)
            graphs[-1].replay()
        finally:
            set_forward_context(None)
        return self.hidden[b][:n]
