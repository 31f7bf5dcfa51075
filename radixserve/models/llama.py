"""Llama decoder (also the base of Qwen2 and Qwen3, which differ only in QKV bias and per-head Q/K norms)."""

from __future__ import annotations

import torch
from torch import nn

import kernels
from radixserve.model_config import ModelConfig
from radixserve.runtime.distributed import get_tp_size
from radixserve.layers.activation import gate_up_silu
from radixserve.layers.attention import Attention
from radixserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from radixserve.layers.norm import Normed, RMSNorm
from radixserve.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, qkv_bias: bool, o_bias: bool, qk_norm: bool):
        super().__init__()
        tp = get_tp_size()
        self.head_dim = config.head_dim
        self.num_heads = config.num_heads // tp
        self.num_kv_heads = config.kv_heads_per_rank(tp)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_heads, config.num_kv_heads, bias=qkv_bias
        )
        self.o_proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size, bias=o_bias)
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None

    def query(self, positions: torch.Tensor, hidden: torch.Tensor) -> tuple:
        """Q/K/V of the new tokens ([T, H, D] each, views of one projection output): Q/K normalised per head (Qwen3)
        and rotated in place, K/V stored into their KV slots, by one kernel (kernels.qk_norm_rope_store), and None;
        or, in a plain decode step, as projected and what is pending on them (Attention.store_rotated)."""
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q_norm, k_norm = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)
        eps = self.q_norm.eps if self.q_norm is not None else 0.0
        pending = self.attn.store_rotated(positions, q, k, v, self.rotary_emb.cos_sin_cache, q_norm, k_norm, eps)
        return q, k, v, pending

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return self.o_proj(o.reshape(-1, self.q_size))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(self.attn.attend(*self.query(positions, hidden)))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported activation {config.hidden_act!r} (only silu)")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The merged projection with SiLU-and-mul in its epilogue (one kernel at decode-sized batches).
        return self.down_proj(gate_up_silu(x, self.gate_up_proj.weight))


class LlamaDecoderLayer(nn.Module):
    norms_folded = False  # both norms' weights moved into the projections after them (fold_norm_weights)

    def __init__(self, config: ModelConfig, qkv_bias: bool, o_bias: bool, qk_norm: bool):
        super().__init__()
        self.self_attn = LlamaAttention(config, qkv_bias, o_bias, qk_norm)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    # A layer is two halves around the attention kernels, so that a piecewise CUDA graph can capture everything
    # between one layer's attention and the next (radixserve/worker/prefill_cuda_graph.py) while attention, whose
    # launch depends on the batch's shape, runs eagerly.
    def before_attention(self, positions, hidden, residual):
        """Norm (with the residual add), Q/K/V, K/V stored: (query()'s (Q, K, V, pending), the residual stream)."""
        # The residual stream is carried separately so each norm can fuse the residual add.
        if isinstance(hidden, Normed):  # the layer before added the residual: the norm runs in the QKV kernel
            return self.self_attn.query(positions, hidden), residual
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        return self.self_attn.query(positions, hidden), residual

    def after_attention(self, o, residual, fuse_norms=True):
        """Output projection, norm (with the residual add) and MLP: (hidden, the residual stream). At decode-sized
        steps (kernels.fuses_norms) each norm runs inside the projection after it, its residual add and sums of
        squares in the epilogue of the projection before: hidden is then Normed (the next layer's QKV, or the final
        norm, takes it) and the layer launches two kernels fewer."""
        o = o.reshape(-1, self.self_attn.q_size)
        if not (fuse_norms and self.norms_folded and kernels.fuses_norms(o)):
            hidden, residual = self.post_attention_layernorm(self.self_attn.output(o), residual)
            return self.mlp(hidden), residual
        residual, squares = self.self_attn.o_proj.add_to(o, residual)
        x = gate_up_silu(Normed(residual, squares, self.post_attention_layernorm.eps), self.mlp.gate_up_proj.weight)
        residual, squares = self.mlp.down_proj.add_to(x, residual)
        return Normed(residual, squares, self.input_layernorm.eps), residual  # every layer's norms share one eps

    def forward(self, positions, hidden, residual):
        qkv, residual = self.before_attention(positions, hidden, residual)
        return self.after_attention(self.self_attn.attn.attend(*qkv), residual)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, qkv_bias: bool, o_bias: bool, qk_norm: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, qkv_bias, o_bias, qk_norm) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return self.final_norm(hidden, residual)

    def final_norm(self, hidden, residual):
        """The last norm, over hidden + residual (hidden Normed: the residual is already added, kernels.linear_add)."""
        return self.norm(hidden.x) if isinstance(hidden, Normed) else self.norm(hidden, residual)[0]

    # The same forward cut at the attention kernels: piece(0) runs up to layer 0's attention, piece(i) from layer
    # i-1's attention output to layer i's, piece(num_layers) from the last attention output to the final norm.
    # forward() == the pieces in turn with each layer's attention in between (tests/worker/test_prefill_cuda_graph.py).
    def piece(self, i: int, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None):
        """Piece i: x is the input ids (i == 0) or layer i-1's attention output; returns (query() of layer i,
        residual), or (hidden, None) after the final norm for i == num_layers."""
        if i == 0:
            return self.layers[0].before_attention(positions, self.embed_tokens(x), None)
        hidden, residual = self.layers[i - 1].after_attention(x, residual)
        if i == len(self.layers):
            return self.final_norm(hidden, residual), None
        return self.layers[i].before_attention(positions, hidden, residual)


class LlamaForCausalLM(nn.Module):
    # Checkpoint names merged into one of our parameters: name -> (our module, shard id for its weight_loader).
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qkv_bias = False
    qk_norm = False

    def __init__(self, config: ModelConfig):
        super().__init__()
        qkv_bias = self.qkv_bias or config.attention_bias
        self.model = LlamaModel(config, qkv_bias, config.attention_bias, self.qk_norm)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def fold_norm_weights(self) -> None:
        """Moves each decoder layer's two RMSNorm weights into the projections after them (W[:, k] *= weight[k]; the
        norms keep weights of 1), so that decode-sized steps can run the norms inside those projections' kernels
        (kernels.fuses_norms). Only where that can run: its option on, the device's kernels, every projection in the
        skinny kernel, one rank (only there does an output projection's epilogue see whole rows), no output bias."""
        layers = self.model.layers
        weights = [p.weight for x in layers for p in (x.self_attn.qkv_proj, x.self_attn.o_proj, x.mlp.down_proj)]
        biased = any(x.self_attn.o_proj.bias is not None for x in layers)
        if biased or get_tp_size() != 1 or not kernels.fuses_norms(weights[0][:1], *weights):
            return
        for layer in layers:
            for norm, proj in (
                (layer.input_layernorm, layer.self_attn.qkv_proj),
                (layer.post_attention_layernorm, layer.mlp.gate_up_proj),
            ):
                proj.weight.mul_(norm.weight)
                norm.weight.fill_(1.0)
            layer.norms_folded = True
