"""One rank's model: weights, the KV cache, the req_to_token table, and one forward + sample per ForwardBatch.

req_to_token has one writer, this runner: each step it derives every assignment from the batch (the new tokens'
slots at their positions, plus the batch's reused_slots) and writes them in one scatter before the forward, then
copies on the device the ranges that a burst of cache hits shares (ReqToTokenPool.batch_writes). The scheduler
decides slots but holds no table (ReqToTokenPool says why). The pools' sizes are kv_pool_size.py's, the sampled
tokens' logprobs sampled_logprobs.py's and prompt logprobs prompt_logprobs.py's; what a step carries between the
stages (StepInputs, SampledStep) is step_state.py's."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import numpy as np
import torch

import kernels
from radixserve.worker.kv_cache import KVCache, ReqToTokenPool
from radixserve.worker.kv_pool_size import device_kv_slots, host_kv_tier
from radixserve.worker.layerwise_offload import LayerwiseOffload
from radixserve.config import ServerArgs
from radixserve.model_config import ModelConfig
from radixserve.runtime.distributed import get_tp_rank, get_tp_size
from radixserve.forward_context import ForwardContext, batch_decode_groups, pack_decode_groups, set_forward_context
from radixserve.grammar import WorkerGrammars
from radixserve.layers.sampler import Sampler, SamplingRequestState
from radixserve.worker.cpu_logits import CpuLogits
from radixserve.loader import load_dummy, load_safetensors
from radixserve.models.registry import model_class
from radixserve.worker.cuda_graph import DecodeCudaGraphs
from radixserve.worker.prefill_cuda_graph import PrefillCudaGraphs
from radixserve.worker.pinned_staging import PinnedStaging
from radixserve.worker.step_state import SampledStep, StepInputs, batch_positions
from radixserve.worker.prompt_logprobs import prompt_logprobs, wants_prompt_logprobs
from radixserve.worker import sampled_logprobs
from radixserve.protocol import ForwardBatch, SampledTokens, WorkerRequest, future_token_ring_size, unpack_i32

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, server_args: ServerArgs, model_dir: str | Path):
        self.args = server_args
        self.model_config = ModelConfig.from_dir(model_dir)
        self.model_config.check_tp(get_tp_size())
        self.device = torch.device(
            server_args.device if server_args.device == "cpu" else f"cuda:{torch.cuda.current_device()}"
        )
        self.dtype = server_args.torch_dtype
        self.context_len = self.model_config.context_len(server_args.context_length)
        # The rope table covers every position served (a --context-length past the config's: YaRN's scaled context).
        self.model_config.max_position_embeddings = max(self.model_config.max_position_embeddings, self.context_len)
        kernels.set_backend(server_args.kernel_backend)
        fused = not server_args.disable_fused_layer_kernels
        kernels.configure(
            fused_qkv=fused,
            gate_up_silu_max_rows=server_args.gate_up_silu_max_rows if fused else 0,
            skinny_linear_max_rows=server_args.skinny_linear_max_rows,
            pdl=not server_args.disable_pdl,
            extend_key_splits=not server_args.disable_extend_key_split,
        )

        self.model = self._load_model(Path(model_dir))
        # Layer-wise offload's GPU buffers before the KV pool, which is sized from the memory left after them.
        self.offload = LayerwiseOffload(self) if server_args.enable_layerwise_offload else None
        cfg = self.model_config
        self.num_kv_slots = device_kv_slots(
            server_args, cfg, self.dtype, self.device, self.context_len, layerwise_offload=self.offload is not None
        )
        kv_heads = cfg.kv_heads_per_rank(get_tp_size())
        self.kv_cache = KVCache(cfg.num_layers, self.num_kv_slots, kv_heads, cfg.head_dim, self.dtype, self.device)
        for i, layer in enumerate(self.model.model.layers):
            layer.self_attn.attn.k_cache = self.kv_cache.k_cache(i)
            layer.self_attn.attn.v_cache = self.kv_cache.v_cache(i)
        # The host KV tier (--hicache-size): (0, None) without one.
        self.num_host_slots, self.host_kv_cache = host_kv_tier(server_args, self.kv_cache, self.offload is not None)
        self.req_to_token_pool = ReqToTokenPool(server_args.max_running_requests, self.context_len, self.device)
        self.staging = PinnedStaging(self.device, enabled=not server_args.disable_pinned_staging)
        self.sampler = Sampler(cfg.vocab_size, self.device, upload=self.staging.to_device)
        self.cpu_logits = None  # steady per-step memory on the CPU (radixserve/worker/cpu_logits.py)
        if self.device.type == "cpu" and server_args.cpu_logits_block_mib > 0 and get_tp_size() == 1:
            self.cpu_logits = CpuLogits(
                cfg.vocab_size, server_args.max_running_requests, server_args.cpu_logits_block_mib, self.dtype
            )
        self.request_states: dict[int, SamplingRequestState] = {}  # by req_pool_idx
        self.grammars = WorkerGrammars(
            server_args.grammar_backend,
            server_args.tokenizer or model_dir,
            cfg.vocab_size,
            cfg.eos_token_ids,
            unroll_bounded_strings=not server_args.disable_grammar_string_unrolling,
        )
        # Overlapped scheduling: sampled tokens stay here for the next batch, whose placeholder ids refer to them.
        self.future_tokens = torch.zeros(
            future_token_ring_size(server_args.max_running_requests), dtype=torch.int64, device=self.device
        )
        self._prompt_logprobs: dict[int, list] = {}  # by step: computed in compute_logits, sent by finish_step
        # A step's group table (forward_context.pack_decode_groups): slices per shared prefix, lone decodes' groups.
        tp = get_tp_size()
        slices = functools.partial(
            kernels.prefix_slices,
            num_q_heads=self.model_config.num_heads // tp,
            num_kv_heads=self.model_config.kv_heads_per_rank(tp),
            dtype=self.dtype,
            device=self.device,
        )
        lone = server_args.lone_decode_min_tokens
        self.pack_groups = functools.partial(pack_decode_groups, slices=slices, lone_min_tokens=lone)
        # Every extend kernel variant a step's makeup can select, compiled now rather than by the first step that
        # selects it (kernels.compile_extend_variants); metadata laid out as prepare()'s.
        attn = self.model.model.layers[0].self_attn.attn
        meta, _ = self.staging.to_device_packed([np.zeros(1), np.zeros(1), np.ones(1), np.zeros(1)], [])
        kernels.compile_extend_variants(
            attn.num_heads, self.dtype, attn.k_cache, attn.v_cache, self.req_to_token_pool.table, *meta
        )
        self.cuda_graphs = None
        if self.device.type == "cuda" and not server_args.disable_cuda_graph:
            self.cuda_graphs = DecodeCudaGraphs(
                self.model,
                self.req_to_token_pool.table,
                self.future_tokens,
                self.context_len,
                min(server_args.cuda_graph_max_bs, server_args.max_running_requests),
                grouped=not server_args.disable_shared_prefix_attention,
                staging=self.staging,
                pack_groups=self.pack_groups,
            )
        self.prefill_graphs = None
        if (
            self.device.type == "cuda"
            and not server_args.disable_cuda_graph
            and not server_args.disable_prefill_cuda_graph
            and server_args.prefill_cuda_graph_max_tokens > 0
        ):
            self.prefill_graphs = PrefillCudaGraphs(
                self.model, server_args.prefill_cuda_graph_max_tokens, self.req_to_token_pool.table
            )

    # ------------------------------------------------------------------ setup
    def _load_model(self, model_dir: Path) -> torch.nn.Module:
        old_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = model_class(self.model_config.architecture)(self.model_config)
        finally:
            torch.set_default_dtype(old_dtype)
        if self.args.load_format == "dummy":
            load_dummy(model, self.args.seed)
        else:
            load_safetensors(model, model_dir, show_progress=get_tp_rank() == 0)
        model.fold_norm_weights()  # where decode steps run the norms inside the projections (kernels.fuses_norms)
        return model.eval()

    # ------------------------------------------------------------------ forward
    def _register(self, req: WorkerRequest) -> None:
        p = req.params
        vocab = self.model_config.vocab_size
        counts = seen = None
        outputs = unpack_i32(req.output_ids)
        # Uploads through the staging buffers: a plain .to(device) from pageable memory waits for the device.
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            counts = self.staging.to_device(np.bincount(outputs, minlength=vocab).astype(np.int64))
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            ids = np.concatenate([unpack_i32(req.penalty_prompt_ids), outputs]).astype(np.int64)
            if len(ids):
                seen[self.staging.to_device(ids)] = True
        self.request_states[req.req_pool_idx] = SamplingRequestState(
            params=p,
            eos_ids=self.model_config.eos_token_ids,
            num_outputs=len(outputs),
            output_counts=counts,
            seen_mask=seen,
            grammar=self.grammars.matcher(p, outputs.tolist()),
        )

    def replays_decode_graph(self, batch: ForwardBatch) -> bool:
        """Whether the step is one decode graph's replay (a short host launch; other steps launch layer by layer).
        One new token is a decode whatever its context's length, a 1-token prompt's (context 0) included."""
        if self.cuda_graphs is None or batch.long is not None:
            return False
        extend_lens = unpack_i32(batch.extend_lens)
        return bool((extend_lens == 1).all()) and self.cuda_graphs.fits(len(extend_lens))

    def prepare(self, batch: ForwardBatch, all_positions: bool = False) -> StepInputs:
        """Unpack the batch once: host-tier copies queued, new requests registered, and then either the host arrays
        of a step that replays a decode graph (which writes req_to_token itself), or the step's index arrays on the
        device (one copy through pinned staging), req_to_token written, the attention layout built."""
        if batch.host_save_host_slots or batch.host_load_host_slots:
            self._copy_host_tier(batch)
        for req in batch.new_requests:
            self._register(req)
        rows, prefix_lens = unpack_i32(batch.req_pool_indices), unpack_i32(batch.prefix_lens)
        extend_lens = unpack_i32(batch.extend_lens)
        host_input_ids = unpack_i32(batch.input_ids)
        new_slots = unpack_i32(batch.out_cache_loc)
        seq_lens = prefix_lens + extend_lens
        # A batch of decodes alone replays a decode graph instead of launching the extend path's kernels one by one.
        if not all_positions and self.replays_decode_graph(batch):
            if batch.reused_slots:  # (the graph writes the new tokens' slots; ranges re-pointed at the tree here)
                writes = self.req_to_token_pool.batch_writes(
                    batch.reused_slots, rows[:0], prefix_lens[:0], extend_lens[:0], new_slots[:0]
                )
                (slots_t,), (index_t, copy_rows_t) = self.staging.to_device_packed(
                    [writes.slots], [writes.index, writes.copy_rows]
                )
                self.req_to_token_pool.write(index_t, slots_t, copy_rows_t, writes.copies)
            return StepInputs(
                batch,
                rows,
                prefix_lens,
                extend_lens,
                None,
                host_input_ids,
                prefix_lens,
                None,
                None,
                decode_graph=True,
                seq_lens=seq_lens,
                new_slots=new_slots,
            )

        not_decode = np.flatnonzero(extend_lens != 1)  # decodes come last in a batch: where that tail starts
        num_extend = int(not_decode[-1]) + 1 if len(not_decode) else 0
        positions = batch_positions(prefix_lens, extend_lens)
        extend_start = (np.cumsum(extend_lens) - extend_lens).astype(np.int32)
        last_index = extend_start + extend_lens - 1
        writes = self.req_to_token_pool.batch_writes(batch.reused_slots, rows, prefix_lens, extend_lens, new_slots)
        (
            (rows_t, prefix_t, extend_t, start_t, seq_lens_t, table_slots_t),
            (input_ids, positions_t, last_index_t, table_index_t, copy_rows_t),
        ) = self.staging.to_device_packed(
            [rows, prefix_lens, extend_lens, extend_start, seq_lens, writes.slots],
            [host_input_ids, positions, last_index, writes.index, writes.copy_rows],
        )
        if (host_input_ids < 0).any():
            # Placeholders (-(index + 1)) of tokens the previous step sampled: resolved here, with no host sync.
            input_ids = kernels.step_input_ids(input_ids, self.future_tokens)
        # Every position the kernels read goes through one table, written here (or in a decode graph) only.
        self.req_to_token_pool.write(table_index_t, table_slots_t, copy_rows_t, writes.copies)
        ctx = ForwardContext(
            num_extend_reqs=num_extend,
            num_extend_tokens=int(extend_lens[:num_extend].sum()),
            req_to_token=self.req_to_token_pool.table,
            req_pool_indices=rows_t,
            prefix_lens=prefix_t,
            extend_lens=extend_t,
            extend_start_loc=start_t,
            seq_lens=seq_lens_t,
            out_cache_loc=table_slots_t[: len(new_slots)],
            max_extend_len=int(extend_lens[:num_extend].max(initial=0)),
            max_seq_len=int(seq_lens[num_extend:].max(initial=0)),
            decode_groups=batch_decode_groups(
                batch.prefix_groups,
                num_extend,
                rows,
                seq_lens,
                self.pack_groups,
                self.staging.to_device,
                self.args.mixed_step_groups_min_saved_tokens,
            ),
        )
        return StepInputs(
            batch, rows, prefix_lens, extend_lens, extend_start, input_ids, positions_t, last_index_t, ctx
        )

    def run_model(self, inputs: StepInputs) -> torch.Tensor:
        """The forward of a step that is not a decode graph's: hidden states of every new token, from a piecewise
        prefill CUDA graph when the step's token count has one, else eager."""
        if self.prefill_graphs is not None and self.prefill_graphs.fits(len(inputs.input_ids)):
            return self.prefill_graphs.run(inputs.input_ids, inputs.positions, inputs.ctx)
        set_forward_context(inputs.ctx)
        try:
            return self.model(inputs.input_ids, inputs.positions)
        finally:
            set_forward_context(None)

    @torch.inference_mode()
    def compute_logits(self, batch: ForwardBatch, all_positions: bool = False) -> torch.Tensor:
        """Run the model on the batch; logits of each request's last token ([B, V]), or of every token. The result
        is valid until the next call: a CUDA graph's output or the CPU's kept logits buffer may hold it."""
        if batch.long is not None:  # a step of a request longer than the KV pool (layerwise_offload.py)
            return self.offload.compute_logits(batch)
        inputs = self.prepare(batch, all_positions)
        if inputs.decode_graph:  # the whole step, req_to_token writes and LM head included, in one replay
            return self.cuda_graphs.replay(
                inputs.input_ids, inputs.positions, inputs.rows, inputs.seq_lens, inputs.new_slots, batch.prefix_groups
            )
        return self.logits(inputs, self.run_model(inputs), all_positions)

    def logits(self, inputs: StepInputs, hidden: torch.Tensor, all_positions: bool = False) -> torch.Tensor:
        """The LM head over each request's last new token (or every token), prompt logprobs on the way."""
        if all_positions:
            return self.model.compute_logits(hidden)
        self._compute_prompt_logprobs(
            inputs.batch,
            hidden,
            inputs.rows,
            inputs.prefix_lens,
            inputs.extend_lens,
            inputs.extend_start,
            inputs.ctx.num_extend_reqs,
        )
        hidden = hidden[inputs.last_index]
        if self.cpu_logits is not None:
            return self.cpu_logits.compute(self.model.lm_head, hidden)
        return self.model.compute_logits(hidden)

    def _compute_prompt_logprobs(self, batch, hidden, rows, prefix_lens, extend_lens, extend_start, num_extend):
        states = [self.request_states.get(int(r)) for r in rows[:num_extend]]
        if not any(s is not None and wants_prompt_logprobs(s) for s in states):
            return
        sample_mask = np.frombuffer(batch.sample_mask, dtype=np.uint8)
        found = prompt_logprobs(
            self.model, hidden, unpack_i32(batch.input_ids), states, prefix_lens, extend_lens, extend_start, sample_mask
        )
        if found:
            self._prompt_logprobs[batch.step] = found

    def _copy_host_tier(self, batch: ForwardBatch) -> None:
        """The batch's host-tier copies, before its forward and on the same stream: saves, then loads (why this order
        is safe: radixserve/cache/host_tier.py). Each rank copies its own KV heads."""
        if self.offload is not None:
            self.offload.before_host_tier_copies()
        if batch.host_save_host_slots:
            self.host_kv_cache.save(unpack_i32(batch.host_save_device_slots), unpack_i32(batch.host_save_host_slots))
        if batch.host_load_host_slots:
            self.host_kv_cache.load(unpack_i32(batch.host_load_host_slots), unpack_i32(batch.host_load_device_slots))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> SampledTokens:
        return self.finish_step(self.sample(batch, self.compute_logits(batch)))

    @torch.inference_mode()
    def sample(self, batch: ForwardBatch, logits: torch.Tensor) -> "SampledStep":
        """Sample the batch's tokens; they stay on the device (and in the future-token ring for the next batch's
        placeholders), and a copy to pinned host memory is queued at once, behind the sampling and ahead of anything
        launched later, so that finish_step waits for this step alone (step_pipeline.py says why)."""
        mask = np.frombuffer(batch.sample_mask, dtype=np.uint8).astype(bool)
        rows = unpack_i32(batch.req_pool_indices)[mask]
        prompt_logprobs = self._prompt_logprobs.pop(batch.step, [])
        if not len(rows):
            return SampledStep(batch.step, None, None, [], prompt_logprobs=prompt_logprobs)
        seq_lens = (unpack_i32(batch.prefix_lens) + unpack_i32(batch.extend_lens))[mask]
        # The states themselves, not their rows: the next batch may already have given a row to a new request.
        states = [self.request_states[int(r)] for r in rows]
        if self.cpu_logits is not None:
            tokens, logprobs = self.cpu_logits.sample(
                self.sampler, logits, np.flatnonzero(mask), states, seq_lens.tolist()
            )
        else:
            logits = logits[self.staging.to_device(np.flatnonzero(mask))] if not mask.all() else logits
            tokens, logprobs = self.sampler(logits, states, seq_lens.tolist())
        if batch.future_token_base >= 0:  # the ring's slots base, base + 1, ... (wrapping at its end)
            base, size = batch.future_token_base, len(self.future_tokens)
            head = min(len(rows), size - base)
            self.future_tokens[base : base + head].copy_(tokens[:head])
            if head < len(rows):
                self.future_tokens[: len(rows) - head].copy_(tokens[head:])
        for i, state in enumerate(states):
            if state.output_counts is not None or state.seen_mask is not None:
                state.record_on_device(tokens[i : i + 1])
        chosen_logprobs = sampled_logprobs.pick(logprobs, tokens, states)
        host_tokens = tokens.to("cpu", non_blocking=True)  # into pinned memory on a GPU; itself on the CPU
        if chosen_logprobs is not None:
            chosen_logprobs = tuple(t.to("cpu", non_blocking=True) for t in chosen_logprobs)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return SampledStep(batch.step, host_tokens, chosen_logprobs, states, done, prompt_logprobs)

    @torch.inference_mode()
    def finish_step(self, step: "SampledStep") -> SampledTokens:
        """The sampled tokens on the host (waits for their copy only), into each request's sampling state, as a
        message."""
        if step.tokens is None:
            return SampledTokens(step=step.step, token_ids=b"", prompt_logprobs=step.prompt_logprobs)
        if step.done is not None:
            step.done.synchronize()
        token_array = step.tokens.numpy()
        for state, token in zip(step.states, token_array.tolist()):
            state.on_sampled(token)
        return SampledTokens(
            step=step.step,
            token_ids=token_array.astype(np.int32).tobytes(),
            logprobs=sampled_logprobs.entries(step.logprobs, step.states),
            prompt_logprobs=step.prompt_logprobs,
        )
