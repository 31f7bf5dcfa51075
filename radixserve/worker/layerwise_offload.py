"""Layer-wise KV offload (--enable-layerwise-offload): requests whose prompt + max_tokens exceed the GPU KV pool keep
their KV in the host pool (radixserve/worker/kv_cache.py HostKVCache, the --hicache-size memory) and run one layer
at a time, as nano-vLLM does, so that the GPU holds one layer's K/V of them at a time.

The scheduler (scheduler_service/long_context.py) cuts each such request's work into jobs and each job into units,
and sends a few units per step (a ForwardBatch whose `long` is set) between ordinary steps:
- a prefill job is the prompt's new tokens through every layer: unit (layer, chunk) runs one chunk of at most
  --layerwise-offload-chunk-size tokens through one layer. All chunks of layer i go before layer i + 1, so layer
  i's K/V of the whole prompt builds up in one ring buffer (radixserve/worker/layer_ring.py) and each chunk reads
  the chunks before it there; each chunk's K/V is copied to the host right after it is computed, on the side
  stream, while the next chunk computes. The hidden states of every new token wait in a workspace between layers.
  A cached prefix (a follow-up turn over the same document) is loaded into the buffer before its layer runs.
- a decode job is one token for each of several long requests whose contexts fit one ring buffer side by side:
  unit i is layer i. Each request's layer-i K/V streams from the host into buffer i % ring size while earlier
  layers compute (loads are queued ring size - 1 layers ahead); attention reads the buffer, new token included;
  the new token's K/V goes back to the host.
The model's own layers run both (LlamaDecoderLayer.before_attention / after_attention), with their Attention
pointed at the ring buffer for the call and the usual kernels (extend / decode attention through a table of
buffer rows). A job's sampling happens in its last step, through ModelRunner.sample like any step's."""

from __future__ import annotations

import math

import numpy as np
import torch

import kernels
from radixserve.forward_context import ForwardContext, set_forward_context
from radixserve.protocol import ForwardBatch, unpack_i32
from radixserve.worker.layer_ring import LayerRing, host_runs


class LayerwiseOffload:
    def __init__(self, runner):
        self.runner = runner
        args, cfg = runner.args, runner.model_config
        self.model = runner.model.model  # a LlamaModel: embed_tokens, layers, norm
        self.device, dtype = runner.device, runner.dtype
        self.num_layers = cfg.num_layers
        from radixserve.runtime.distributed import get_tp_size

        tokens = args.layerwise_offload_buffer_tokens or runner.context_len
        self.ring = LayerRing(
            args.layerwise_offload_ring_size,
            tokens,
            cfg.kv_heads_per_rank(get_tp_size()),
            cfg.head_dim,
            dtype,
            self.device,
        )
        # The prefill workspace: every new token's hidden state and residual between layers (allocated here, before
        # the KV pool is sized from what memory is left, so that the pool leaves room for it).
        self.hidden = torch.empty((tokens, cfg.hidden_size), dtype=dtype, device=self.device)
        self.residual = torch.empty_like(self.hidden)
        self.host_slots: dict[int, np.ndarray] = {}  # by req_to_token row: host slot of every position
        # The job in progress of each kind: a decode job may run between two layers of a prefill job.
        self.jobs: dict[bool, PrefillJob | DecodeJob] = {}
        self._step_done = None  # event after the last long step's work (GPU)

    @property
    def host(self):
        """The host KV pool (created after this, once the GPU pool is sized)."""
        return self.runner.host_kv_cache

    @property
    def nbytes(self) -> int:
        """GPU memory this path holds: the ring and the workspace."""
        return self.ring.nbytes + 2 * self.hidden.numel() * self.hidden.element_size()

    def compute_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the batch's units of its job; logits of the job's requests when this step ends the job, else an empty
        tensor (the batch samples nothing)."""
        if self._step_done is not None:
            # At most one long step queued ahead of the device: without this a prefill's steps, which sample
            # nothing and so are answered at once, would queue the whole prompt's work before the next ordinary
            # step, and that step would wait for all of it.
            self._step_done.synchronize()
        runner, work = self.runner, batch.long
        for req in batch.new_requests:
            runner._register(req)
        for new in work.new_requests:
            self.host_slots[new.req_pool_idx] = unpack_i32(new.host_slots).copy()
        if work.first_unit == 0:
            rows, prefix_lens = unpack_i32(batch.req_pool_indices), unpack_i32(batch.prefix_lens)
            ids = self._input_ids(unpack_i32(batch.input_ids))
            if work.prefill:
                self.jobs[True] = PrefillJob(self, work.job, int(rows[0]), int(prefix_lens[0]), ids, work.chunk_size)
            else:
                self.jobs[False] = DecodeJob(self, work.job, rows, prefix_lens, ids)
        job = self.jobs.get(work.prefill)
        if job is None or job.id != work.job or job.next_unit != work.first_unit:
            raise RuntimeError(
                f"long step out of order: job {work.job} unit {work.first_unit}, but this worker is at "
                f"{None if job is None else (job.id, job.next_unit)}"
            )
        hidden = job.run(work.num_units)
        if self.device.type == "cuda":
            self._step_done = torch.cuda.Event()
            self._step_done.record()
        if hidden is None:
            return hidden
        del self.jobs[work.prefill]
        if runner.cpu_logits is not None:
            return runner.cpu_logits.compute(runner.model.lm_head, hidden)
        return runner.model.compute_logits(hidden)

    def _input_ids(self, host_ids: np.ndarray) -> torch.Tensor:
        ids = torch.from_numpy(host_ids.astype(np.int64)).to(self.device)
        if (host_ids < 0).any():  # placeholders of tokens the step before sampled (the overlapped loop)
            ids = kernels.step_input_ids(ids, self.runner.future_tokens)
        return ids

    def before_host_tier_copies(self) -> None:
        """The host tier's saves and loads run on the compute stream: after this path's copies to and from the same
        host pool (a finished document's last K/V, slots freed and handed out again)."""
        self.ring.wait_for_copies()

    def layer(self, i: int, b: int, positions, hidden, residual, ctx: ForwardContext):
        """Decoder layer i over ring buffer b as its KV cache: (hidden, residual) after the layer."""
        layer = self.model.layers[i]
        attn = layer.self_attn.attn
        kept = attn.k_cache, attn.v_cache
        attn.k_cache, attn.v_cache = self.ring.k[b], self.ring.v[b]
        set_forward_context(ctx)
        try:
            qkv, residual = layer.before_attention(positions, hidden, residual)
            # Norms apart: the workspaces between units hold hidden rows, never a norm left to the next kernel.
            return layer.after_attention(attn.attend(*qkv), residual, fuse_norms=False)
        finally:
            attn.k_cache, attn.v_cache = kept
            set_forward_context(None)

    def ints(self, values) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values, dtype=np.int32)).to(self.device)


class PrefillJob:
    """One request's new prompt tokens (after a cached prefix of prefix_len), layer by layer in chunks. Buffer row
    1 + p holds position p (row 0 is padding)."""

    def __init__(
        self, offload: LayerwiseOffload, job_id: int, row: int, prefix_len: int, input_ids: torch.Tensor, chunk: int
    ):
        self.o, self.id, self.next_unit = offload, job_id, 0
        n = len(input_ids)
        self.prefix_len, self.num_new, self.chunk = prefix_len, n, chunk
        if prefix_len + n > offload.ring.tokens:
            raise ValueError(
                f"a prompt of {prefix_len + n} tokens does not fit a ring buffer of "
                f"{offload.ring.tokens} (--layerwise-offload-buffer-tokens)"
            )
        self.num_chunks = math.ceil(n / chunk)
        self.num_units = offload.num_layers * self.num_chunks
        slots = offload.host_slots[row]
        self.prefix_runs = host_runs(slots[:prefix_len])
        self.new_slots = slots[prefix_len : prefix_len + n]
        dev = offload.device
        self.positions = torch.arange(prefix_len, prefix_len + n, dtype=torch.int64, device=dev)
        self.table = torch.arange(1, 1 + prefix_len + n, dtype=torch.int32, device=dev)[None]  # position -> row
        starts = np.arange(self.num_chunks) * chunk
        ends = np.minimum(starts + chunk, n)
        self.starts, self.ends = starts.tolist(), ends.tolist()
        self.prefix_t, self.lens_t = offload.ints(prefix_len + starts), offload.ints(ends - starts)
        self.seq_t, self.zero = offload.ints(prefix_len + ends), offload.ints([0])
        for start, end in zip(self.starts, self.ends):  # layer 0's input: the embeddings, chunk by chunk
            offload.hidden[start:end] = offload.model.embed_tokens(input_ids[start:end])

    def _fill(self, layer: int):
        def fill(b: int) -> None:
            if self.prefix_len:  # a cached prefix: its K/V of this layer from the host
                self.o.ring.load(b, 1, *self.o.host.layer(layer), self.prefix_runs)

        return fill

    def run(self, num_units: int) -> torch.Tensor | None:
        o, ring = self.o, self.o.ring
        for unit in range(self.next_unit, min(self.next_unit + num_units, self.num_units)):
            layer, c = divmod(unit, self.num_chunks)
            key = (self.id, layer)
            if c == 0:
                b = ring.acquire(key, layer, self._fill(layer))
                for ahead in range(layer + 1, min(layer + ring.size, o.num_layers)):
                    if self.prefix_len:
                        ring.prefetch((self.id, ahead), ahead, self._fill(ahead))
            else:
                b = ring.buffer(layer)
                assert ring.owner[b] == key, "a layer's chunks were split by another job"
            start, end = self.starts[c], self.ends[c]
            p0 = self.prefix_len + start
            ctx = ForwardContext(
                num_extend_reqs=1,
                num_extend_tokens=end - start,
                req_to_token=self.table,
                req_pool_indices=self.zero,
                prefix_lens=self.prefix_t[c : c + 1],
                extend_lens=self.lens_t[c : c + 1],
                extend_start_loc=self.zero,
                seq_lens=self.seq_t[c : c + 1],
                out_cache_loc=self.table[0, p0 : self.prefix_len + end],
                max_extend_len=end - start,
                max_seq_len=0,
            )
            residual = o.residual[start:end] if layer else None
            hidden, residual = o.layer(layer, b, self.positions[start:end], o.hidden[start:end], residual, ctx)
            # The residual first: at layer 0 it may be a view of these hidden rows (the norms add in place).
            o.residual[start:end] = residual
            o.hidden[start:end] = hidden
            # This chunk's K/V to the host while the next chunk computes (layer_ring.py: why it is safe).
            ring.save(b, [(1 + p0, end - start)], *o.host.layer(layer), host_runs(self.new_slots[start:end]))
            self.next_unit = unit + 1
        if self.next_unit < self.num_units:
            return None
        last = slice(self.num_new - 1, self.num_new)
        return o.model.norm(o.hidden[last], o.residual[last])[0]


class DecodeJob:
    """One new token for each of several long requests, their contexts side by side in one ring buffer: request r's
    positions 0..ctx_lens[r] at rows bases[r].., its new token at position ctx_lens[r]."""

    def __init__(
        self, offload: LayerwiseOffload, job_id: int, rows: np.ndarray, ctx_lens: np.ndarray, input_ids: torch.Tensor
    ):
        self.o, self.id, self.next_unit = offload, job_id, 0
        self.num_units = offload.num_layers
        ctx = ctx_lens.astype(np.int64)
        self.bases = 1 + np.concatenate([[0], np.cumsum(ctx + 1)[:-1]])
        if int(self.bases[-1] + ctx[-1]) > offload.ring.tokens:
            raise ValueError(
                f"decode contexts of {int((ctx + 1).sum())} tokens do not fit a ring buffer of {offload.ring.tokens}"
            )
        slots = [offload.host_slots[int(r)] for r in rows]
        self.context_runs = [host_runs(s[:n]) for s, n in zip(slots, ctx.tolist())]
        self.new_rows = [(int(b + n), 1) for b, n in zip(self.bases, ctx)]
        self.new_runs = host_runs(np.asarray([s[n] for s, n in zip(slots, ctx.tolist())], dtype=np.int32))
        max_len = int(ctx.max()) + 1
        table = self.bases[:, None] + np.arange(max_len)[None]
        b = len(rows)
        self.ctx = ForwardContext(
            num_extend_reqs=0,
            num_extend_tokens=0,
            req_to_token=offload.ints(table),
            req_pool_indices=offload.ints(np.arange(b)),
            prefix_lens=offload.ints(ctx),
            extend_lens=offload.ints(np.ones(b)),
            extend_start_loc=offload.ints(np.arange(b)),
            seq_lens=offload.ints(ctx + 1),
            out_cache_loc=offload.ints(self.bases + ctx),
            max_extend_len=0,
            max_seq_len=max_len,
        )
        self.positions = torch.from_numpy(ctx).to(offload.device)
        self.hidden, self.residual = offload.model.embed_tokens(input_ids), None

    def _fill(self, layer: int):
        def fill(b: int) -> None:
            host_k, host_v = self.o.host.layer(layer)
            for base, runs in zip(self.bases.tolist(), self.context_runs):
                self.o.ring.load(b, base, host_k, host_v, runs)

        return fill

    def run(self, num_units: int) -> torch.Tensor | None:
        o, ring = self.o, self.o.ring
        for layer in range(self.next_unit, min(self.next_unit + num_units, self.num_units)):
            b = ring.acquire((self.id, layer), layer, self._fill(layer))
            for ahead in range(layer + 1, min(layer + ring.size, o.num_layers)):
                ring.prefetch((self.id, ahead), ahead, self._fill(ahead))
            self.hidden, self.residual = o.layer(layer, b, self.positions, self.hidden, self.residual, self.ctx)
            ring.save(b, self.new_rows, *o.host.layer(layer), self.new_runs)
            self.next_unit = layer + 1
        if self.next_unit < self.num_units:
            return None
        return o.model.norm(self.hidden, self.residual)[0]
