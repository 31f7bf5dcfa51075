"""One rank's model: weights, the KV cache, the req_to_token table, and one forward + sample per ForwardBatch."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

import kernels
from radixserve.cache.memory_pool import KVCache, ReqToTokenPool
from radixserve.config import ModelConfig, ServerArgs
from radixserve.distributed import get_tp_rank, get_tp_size
from radixserve.forward_context import ForwardContext, set_forward_context
from radixserve.layers.sampler import Sampler, SamplingRequestState
from radixserve.loader import load_dummy, load_safetensors
from radixserve.models.registry import model_class
from radixserve.worker.cuda_graph import DecodeCudaGraphs
from radixserve.protocol import ForwardBatch, SampledTokens, TokenLogprobs, WorkerRequest, unpack_i32

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_TOKENS = 16384


def batch_positions(prefix_lens: np.ndarray, extend_lens: np.ndarray) -> np.ndarray:
    """Position of every new token: prefix_lens[i] + 0..extend_lens[i]-1, concatenated."""
    starts = np.cumsum(extend_lens) - extend_lens
    return (np.repeat(prefix_lens - starts, extend_lens) + np.arange(int(extend_lens.sum()))).astype(np.int64)


class ModelRunner:
    def __init__(self, server_args: ServerArgs, model_dir: str | Path):
        self.args = server_args
        self.model_config = ModelConfig.from_dir(model_dir)
        self.model_config.check_tp(get_tp_size())
        self.device = torch.device(server_args.device if server_args.device == "cpu" else f"cuda:{torch.cuda.current_device()}")
        self.dtype = server_args.torch_dtype
        self.context_len = self.model_config.context_len(server_args.context_length)
        kernels.set_backend(server_args.kernel_backend)

        self.model = self._load_model(Path(model_dir))
        self.num_kv_slots = self._kv_slots_to_allocate()
        cfg = self.model_config
        kv_heads = cfg.kv_heads_per_rank(get_tp_size())
        self.kv_cache = KVCache(cfg.num_layers, self.num_kv_slots, kv_heads, cfg.head_dim, self.dtype, self.device)
        for i, layer in enumerate(self.model.model.layers):
            layer.self_attn.attn.k_cache = self.kv_cache.k_cache(i)
            layer.self_attn.attn.v_cache = self.kv_cache.v_cache(i)
        self.req_to_token_pool = ReqToTokenPool(server_args.max_running_requests, self.context_len, self.device)
        self.sampler = Sampler(cfg.vocab_size, self.device)
        self.request_states: dict[int, SamplingRequestState] = {}  # by req_pool_idx
        self.cuda_graphs = None
        if self.device.type == "cuda" and not server_args.disable_cuda_graph:
            self.cuda_graphs = DecodeCudaGraphs(self.model, self.req_to_token_pool.table, self.context_len,
                                                min(server_args.cuda_graph_max_bs, server_args.max_running_requests))

    # ------------------------------------------------------------------ setup
    def _load_model(self, model_dir: Path) -> torch.nn.Module:
        cls = model_class(self.model_config.architecture)
        old_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = cls(self.model_config)
        finally:
            torch.set_default_dtype(old_dtype)
        if self.args.load_format == "dummy":
            load_dummy(model, self.args.seed)
        else:
            load_safetensors(model, model_dir, show_progress=get_tp_rank() == 0)
        return model.eval()

    def _kv_slots_to_allocate(self) -> int:
        if self.args.max_total_tokens is not None:
            return self.args.max_total_tokens
        if self.device.type == "cpu":
            return CPU_DEFAULT_KV_TOKENS
        slots = self._kv_slots_that_fit()
        if get_tp_size() > 1:
            # Ranks may have different free memory; all must agree on the smallest pool.
            t = torch.tensor([slots], device=self.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
            slots = int(t.item())
        return slots

    def _kv_slots_that_fit(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        budget = int(total * self.args.mem_fraction_static) - used
        cfg = self.model_config
        slots = KVCache.num_slots_for_budget(budget, cfg.num_layers, cfg.kv_heads_per_rank(get_tp_size()),
                                             cfg.head_dim, self.dtype)
        if slots < self.context_len:
            raise RuntimeError(f"only {slots} KV slots fit in --mem-fraction-static {self.args.mem_fraction_static}; "
                               f"need at least the context length {self.context_len}")
        return slots

    # ------------------------------------------------------------------ forward
    def _register(self, req: WorkerRequest) -> None:
        p = req.params
        vocab = self.model_config.vocab_size
        counts = seen = None
        outputs = unpack_i32(req.output_ids)
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            counts = torch.bincount(torch.from_numpy(outputs.astype(np.int64)), minlength=vocab).to(self.device)
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            ids = np.concatenate([unpack_i32(req.penalty_prompt_ids), outputs]).astype(np.int64)
            seen[torch.from_numpy(ids).to(self.device)] = True
        self.request_states[req.req_pool_idx] = SamplingRequestState(
            params=p, eos_ids=self.model_config.eos_token_ids, num_outputs=len(outputs), output_counts=counts,
            seen_mask=seen)

    def _to_device(self, arrays: list[np.ndarray], dtype) -> list[torch.Tensor]:
        """Several small host arrays in one host-to-device copy (each copy costs a launch and a sync point)."""
        sizes = [len(a) for a in arrays]
        packed = torch.from_numpy(np.concatenate(arrays).astype(dtype, copy=False)).to(self.device, non_blocking=True)
        return list(packed.split(sizes))

    @torch.inference_mode()
    def compute_logits(self, batch: ForwardBatch, all_positions: bool = False) -> torch.Tensor:
        """Run the model on the batch; logits of each request's last token ([B, V]), or of every token."""
        for req in batch.new_requests:
            self._register(req)
        table = self.req_to_token_pool.table
        for w in batch.row_writes:
            self.req_to_token_pool.write(w.req_pool_idx, w.start, unpack_i32(w.slots).copy())

        rows, prefix_lens = unpack_i32(batch.req_pool_indices), unpack_i32(batch.prefix_lens)
        extend_lens = unpack_i32(batch.extend_lens)
        positions = batch_positions(prefix_lens, extend_lens)
        seq_lens = prefix_lens + extend_lens
        if seq_lens.max(initial=0) > self.context_len:
            raise ValueError(f"sequence of {seq_lens.max()} tokens exceeds the context length {self.context_len}")
        extend_start = (np.cumsum(extend_lens) - extend_lens).astype(np.int32)
        last_index = extend_start + extend_lens - 1
        flat_index = np.repeat(rows.astype(np.int64), extend_lens) * table.shape[1] + positions
        rows_t, prefix_t, extend_t, start_t, seq_lens_t, out_cache_loc = self._to_device(
            [rows, prefix_lens, extend_lens, extend_start, seq_lens, unpack_i32(batch.out_cache_loc)], np.int32)
        input_ids, positions_t, flat_index_t, last_index_t = self._to_device(
            [unpack_i32(batch.input_ids), positions, flat_index, last_index], np.int64)
        # The new tokens' slots go into req_to_token here, so the kernels read every position through one table.
        table.view(-1)[flat_index_t] = out_cache_loc

        # Decodes come last in a batch; find where that tail starts.
        not_decode = np.flatnonzero((extend_lens != 1) | (prefix_lens == 0))
        num_extend = int(not_decode[-1]) + 1 if len(not_decode) else 0
        if num_extend == 0 and not all_positions and self.cuda_graphs is not None and self.cuda_graphs.fits(len(rows)):
            return self.cuda_graphs.replay(input_ids, positions_t, rows_t, seq_lens_t, out_cache_loc)
        ctx = ForwardContext(
            num_extend_reqs=num_extend,
            num_extend_tokens=int(extend_lens[:num_extend].sum()),
            req_to_token=table,
            req_pool_indices=rows_t,
            prefix_lens=prefix_t,
            extend_lens=extend_t,
            extend_start_loc=start_t,
            seq_lens=seq_lens_t,
            out_cache_loc=out_cache_loc,
            max_extend_len=int(extend_lens[:num_extend].max(initial=0)),
            max_seq_len=int(seq_lens[num_extend:].max(initial=0)),
        )
        set_forward_context(ctx)
        try:
            hidden = self.model(input_ids, positions_t)
        finally:
            set_forward_context(None)
        if not all_positions:
            hidden = hidden[last_index_t]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> SampledTokens:
        logits = self.compute_logits(batch)
        mask = np.frombuffer(batch.sample_mask, dtype=np.uint8).astype(bool)
        rows = unpack_i32(batch.req_pool_indices)[mask]
        if not len(rows):
            return SampledTokens(step=batch.step, token_ids=b"")
        seq_lens = (unpack_i32(batch.prefix_lens) + unpack_i32(batch.extend_lens))[mask]
        logits = logits[torch.from_numpy(np.flatnonzero(mask)).to(self.device)] if not mask.all() else logits
        states = [self.request_states[int(r)] for r in rows]
        tokens, logprobs = self.sampler(logits, states, seq_lens.tolist())
        token_list = tokens.tolist()
        for state, token in zip(states, token_list):
            state.num_outputs += 1
            if state.output_counts is not None:
                state.output_counts[token] += 1
            if state.seen_mask is not None:
                state.seen_mask[token] = True
        return SampledTokens(step=batch.step, token_ids=np.asarray(token_list, dtype=np.int32).tobytes(),
                             logprobs=self._logprobs(logprobs, tokens, states))

    @staticmethod
    def _logprobs(logprobs, tokens, states) -> list[TokenLogprobs | None]:
        if logprobs is None:
            return []
        k_max = max(s.params.logprobs or 0 for s in states)
        chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        top_vals, top_ids = logprobs.topk(max(k_max, 1), dim=-1)
        top_vals, top_ids = top_vals.cpu().numpy(), top_ids.cpu().numpy().astype(np.int32)
        out = []
        for i, s in enumerate(states):
            k = s.params.logprobs
            if k is None:
                out.append(None)
                continue
            out.append(TokenLogprobs(logprob=chosen[i], top_ids=top_ids[i, :k].tobytes(),
                                     top_logprobs=top_vals[i, :k].astype(np.float32).tobytes()))
        return out
