"""The layer fusions keep the CPU path bit for bit what it was.

kernels.qk_norm_rope_store and kernels.gate_up_silu replaced, in the model, the sequences norm -> RoPE -> store and
projection -> SiLU-and-mul. On the CPU their torch twins run: here they are compared with those sequences exactly
(torch.equal), op by op and through a whole model step, the old sequences written out as the layers ran them.
The Triton kernels are checked against the twins under TRITON_INTERPRET=1 (tests/worker/test_kernels_triton.py).
"""

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import reference


def _qkv(tokens, hq, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g).to(dtype)
    views = (
        qkv[:, : hq * d].view(tokens, hq, d),
        qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d),
        qkv[:, (hq + hkv) * d :].view(tokens, hkv, d),
    )
    return qkv, views, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm,rotary_dim", [(True, 64), (True, 32), (False, 64)])
def test_qk_twin_is_the_unfused_sequence(dtype, norm, rotary_dim):
    tokens, hq, hkv, d, slots = 7, 4, 2, 64, 40
    qkv, (q, k, v), g = _qkv(tokens, hq, hkv, d, dtype, seed=rotary_dim + norm)
    weights = (
        (torch.randn(d, generator=g).to(dtype) + 1, torch.randn(d, generator=g).to(dtype) + 1) if norm else (None, None)
    )
    cos_sin = torch.randn(100, rotary_dim, generator=g)
    positions = torch.randint(0, 100, (tokens,), generator=g)
    loc = torch.randperm(slots, generator=g)[:tokens].to(torch.int32)
    caches = [torch.randn(slots, hkv, d, generator=g).to(dtype) for _ in range(2)]

    # As the model ran it before the fusion: the norms return new tensors, RoPE rotates those, then the store.
    q_old, k_old = q.clone(), k.clone()
    if norm:
        q_old = reference.rmsnorm(q_old.reshape(-1, d), weights[0], 1e-6).view_as(q_old)
        k_old = reference.rmsnorm(k_old.reshape(-1, d), weights[1], 1e-6).view_as(k_old)
    reference.rope(q_old, k_old, positions, cos_sin)
    old_caches = [c.clone() for c in caches]
    reference.store_kv(k_old, v, *old_caches, loc)

    reference.qk_norm_rope_store(q, k, v, positions, cos_sin, *weights, 1e-6, *caches, loc)
    assert torch.equal(q, q_old) and torch.equal(k, k_old)
    assert torch.equal(caches[0], old_caches[0]) and torch.equal(caches[1], old_caches[1])
    assert not torch.equal(caches[0], old_caches[0].roll(1, 0))  # the check can tell caches apart


def test_gate_up_twin_is_projection_then_silu_and_mul():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 32, generator=g).to(torch.bfloat16), torch.randn(48, 32, generator=g).to(torch.bfloat16)
    assert torch.equal(reference.gate_up_silu(x, w), reference.silu_and_mul(F.linear(x, w)))
    assert torch.equal(kernels.gate_up_silu(x, w), reference.silu_and_mul(F.linear(x, w)))  # CPU dispatch


def _old_query(self, positions, hidden):
    """LlamaAttention.query before the fusion (commit 17d7381), verbatim in effect."""
    q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
    q = q.reshape(-1, self.num_heads, self.head_dim)
    k = k.reshape(-1, self.num_kv_heads, self.head_dim)
    v = v.reshape(-1, self.num_kv_heads, self.head_dim)
    if self.q_norm is not None:
        q = self.q_norm(q.reshape(-1, self.head_dim)).view_as(q)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view_as(k)
    self.rotary_emb(positions, q, k)
    self.attn.store(k, v)
    return q, k, v


def _old_mlp(self, x):
    return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_step_on_the_cpu_is_unchanged(arch, dtype, monkeypatch):
    from bench import kernels_per_layer as kpl
    from radixserve.model_config import ModelConfig
    from radixserve.forward_context import set_forward_context
    from radixserve.loader import load_dummy
    from radixserve.models import llama
    from radixserve.models.registry import model_class

    cfg = ModelConfig.from_dict(
        dict(
            architectures=[arch],
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=300,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            torch_dtype="float32",
        )
    )
    old_default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = model_class(arch)(cfg).eval()
    finally:
        torch.set_default_dtype(old_default)
    load_dummy(model, 3)

    def logits():
        # A grouped decode step (shared prefixes) over fresh KV caches: the same inputs for both runs.
        ctx, ids, positions = kpl.decode_step(model, cfg, 32, 40, 6, device="cpu")
        for layer in model.model.layers:
            layer.self_attn.attn.k_cache = layer.self_attn.attn.k_cache.to(dtype)
            layer.self_attn.attn.v_cache = layer.self_attn.attn.v_cache.to(dtype)
        set_forward_context(ctx)
        try:
            with torch.inference_mode():
                out = model.compute_logits(model(ids, positions))
            return out, [layer.self_attn.attn.k_cache for layer in model.model.layers]
        finally:
            set_forward_context(None)

    new, new_caches = logits()
    monkeypatch.setattr(llama.LlamaAttention, "query", _old_query)
    monkeypatch.setattr(llama.LlamaMLP, "forward", _old_mlp)
    old, old_caches = logits()
    assert torch.equal(new, old)
    assert all(torch.equal(a, b) for a, b in zip(new_caches, old_caches))


def test_step_inputs_twin_is_the_old_sequence():
    """kernels.step_input_ids replaced the decode graph's placeholder resolution and req_to_token write (and the eager
    steps' resolution); its twin does what those lines did."""
    g = torch.Generator().manual_seed(3)
    n, ring = 37, 11
    future = torch.randint(0, 1000, (ring,), generator=g)
    ids = torch.where(torch.rand(n, generator=g) < 0.5, -(torch.randint(0, ring, (n,), generator=g) + 1), 5)
    table = torch.randint(0, 99, (n + 2, 16), generator=g, dtype=torch.int32)
    rows = torch.randperm(n + 2, generator=g)[:n].to(torch.int32)
    positions = torch.randint(0, 16, (n,), generator=g)
    slots = torch.randint(100, 200, (n,), generator=g, dtype=torch.int32)

    # As the decode graph ran it before (cuda_graph._run).
    old_ids = torch.where(ids < 0, future[(-ids - 1).clamp(min=0)], ids)
    old_table = table.clone()
    old_table.view(-1)[rows.long() * old_table.stride(0) + positions] = slots

    new_table = table.clone()
    assert torch.equal(kernels.step_input_ids(ids, future, (new_table, rows, positions, slots)), old_ids)
    assert torch.equal(new_table, old_table) and not torch.equal(new_table, table)
    assert torch.equal(reference.step_input_ids(ids, future), old_ids) and (old_ids >= 0).all()
