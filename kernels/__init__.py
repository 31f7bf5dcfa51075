"""Kernels of radixserve: Triton on the GPU, a plain-torch twin of each for the CPU and for ablations.

This module is the one dispatch point. The backend is "auto" (Triton for CUDA tensors, the torch
reference otherwise), "triton" (always Triton: on CPU tensors that needs TRITON_INTERPRET=1, which is
how CI tests the kernels) or "reference" (the torch twins even on the GPU). The environment variable
RADIXSERVE_KERNEL_BACKEND sets the default; set_backend() changes it at run time.

Triton is imported on first use only: a CPU server never pays for it, and TRITON_INTERPRET is read
when triton is imported, so importing this package early must not freeze that choice.

OPTIONS are the switches of the GPU path's optimisations, for ablations (configure(), or RADIXSERVE_KERNEL_OPTIONS as
"name=value,..."): fused_qkv (Q/K norms, RoPE and the KV store as one kernel: kernels/triton_qkv.py) and
gate_up_silu_max_rows (the MLP's gate/up projection with SiLU-and-mul fused, up to this many rows; 0: never:
kernels/triton_mlp.py) and skinny_linear_max_rows (the other projections by one weight-streaming kernel up to this many
rows, instead of cuBLAS; 0: never: kernels/triton_skinny_linear.py) and pdl (programmatic dependent launch on Hopper and
later: a kernel starts beside the one before it and waits for it only where it reads its output;
kernels/triton_common.py) and pdl_prefetch (under pdl, the plain decode kernel asks L2 for its first K/V block before it
waits: triton_attention.prefetches_kv) and extend_key_splits (an extend whose grid is too small for the device, a lone
cache hit's, splits its keys over programs and merges them: kernels/triton_attention.py extend_num_splits) and
norms_in_projections (at decode-sized batches each layer's two RMSNorms run inside the projections after them, the
residual add and the sums of squares in the epilogue of the ones before: fuses_norms, models/llama.py) and
qkv_in_decode_max_rows (a decode step of up to this many requests does its Q/K norms, RoPE and KV store inside the plain
decode kernel, not a kernel of their own: decode_attention's pending; 0: never) and prefix_live_items (the shared-prefix
kernel's programs walk the live groups' work items only; off: one program per item of the padded table:
shared_prefix_attention.decode_attention_grouped) and attention_launch_replay (the layers after the first of an eager
step's piecewise-graph attention replay its launches: kernels/launch_replay.py) and fused_step_inputs (a step's input
ids resolved from the overlapped loop's placeholders, and a decode graph's new slots written into req_to_token, by one
kernel instead of ten small torch ones: kernels/triton_step_inputs.py). The torch twins compute the same whatever the
options.
"""

import os
import sys
import types
from typing import NamedTuple

import torch.nn.functional as F

from kernels import reference

BACKENDS = ("auto", "triton", "reference")

_backend = "auto"
_triton_modules = None
_fused_ops = None


def set_backend(name):
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; expected one of {BACKENDS}")
    _backend = name


def get_backend():
    return _backend


set_backend(os.environ.get("RADIXSERVE_KERNEL_BACKEND", "auto"))

OPTIONS = {
    "fused_qkv": True,
    "gate_up_silu_max_rows": 16,
    "skinny_linear_max_rows": 16,
    "pdl": True,
    "pdl_prefetch": True,
    "extend_key_splits": True,
    "norms_in_projections": True,
    # 16: on an H100 the decode step measured faster with it up to 16 requests (Qwen3-0.6B 1.020 -> 0.993 ms at batch 1,
    # 1.827 -> 1.680 at 16; Qwen3-8B within noise) and slower at 64 (0.6B 3.988 -> 4.049, 8B 10.076 -> 10.163):
    # bench/results/decode-step-h100-session19.md.
    "qkv_in_decode_max_rows": 16,
    "prefix_live_items": True,
    "attention_launch_replay": True,
    "fused_step_inputs": True,
}


def configure(**options):
    """Sets OPTIONS (unknown names are an error); returns the previous values of those given."""
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise ValueError(f"unknown kernel options {sorted(unknown)}; expected some of {sorted(OPTIONS)}")
    previous = {name: OPTIONS[name] for name in options}
    OPTIONS.update({name: type(OPTIONS[name])(value) for name, value in options.items()})
    return previous


def _options_from_env(text):
    pairs = [item.split("=", 1) for item in text.split(",") if item.strip()]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"RADIXSERVE_KERNEL_OPTIONS={text!r}: expected name=value,...")
    configure(**{name.strip(): int(value) for name, value in pairs})


_options_from_env(os.environ.get("RADIXSERVE_KERNEL_OPTIONS", ""))


def _triton():
    global _triton_modules
    if _triton_modules is None:
        from kernels import triton_attention, triton_elementwise, triton_step_inputs

        _triton_modules = (triton_attention, triton_elementwise, triton_step_inputs)
    return _triton_modules


def _use_reference(tensor):
    return _backend == "reference" or (_backend == "auto" and not tensor.is_cuda)


def _attention_impl(tensor):
    if _use_reference(tensor):
        return reference
    return _triton()[0]


def _elementwise_impl(tensor):
    if _use_reference(tensor):
        return reference
    return _triton()[1]


def store_kv(k, v, k_cache, v_cache, out_cache_loc):
    """k_cache[out_cache_loc[i]] = k[i] (and v). k, v: [N, Hkv, D]; caches: [num_slots, Hkv, D]."""
    _attention_impl(k).store_kv(k, v, k_cache, v_cache, out_cache_loc)


def step_input_ids(input_ids, future_tokens, table_write=None):
    """A new tensor: input_ids (int64 [N]) with each placeholder -(i + 1), a token of the step in flight (the overlapped
    scheduler's), replaced by future_tokens[i]. table_write (req_to_token, req_pool_indices, positions, out_cache_loc;
    [N] each): also req_to_token[req_pool_indices[j], positions[j]] = out_cache_loc[j], a decode step's new slots. One
    kernel on the GPU (OPTIONS["fused_step_inputs"]), else its torch twin."""
    impl = _step_inputs_impl(input_ids) if OPTIONS["fused_step_inputs"] else reference
    return impl.step_input_ids(input_ids, future_tokens, table_write)


def _step_inputs_impl(tensor):
    """The module of step_input_ids' kernel, or the twin's (a seam for bench/kernel_variant_keys.py)."""
    return reference if _use_reference(tensor) else _triton()[2]


def extend_attention(
    q,
    k,
    v,
    o,
    k_cache,
    v_cache,
    req_to_token,
    req_pool_indices,
    prefix_lens,
    extend_lens,
    extend_start_loc,
    sm_scale,
    max_extend_len,
):
    """Prefill/extend for a batch of requests; writes o [T, Hq, D] in place.

    New token j of request i sees its prefix positions [0, prefix_lens[i]) through
    req_to_token[req_pool_indices[i]] and new tokens 0..j. q/k/v/o rows of request i are
    extend_start_loc[i] : extend_start_loc[i] + extend_lens[i]. GQA: query head h uses KV head
    h // (Hq // Hkv). max_extend_len (a python int) sizes the grid without a device sync.
    The new tokens' K/V must already be in the caches (store_kv first): the Triton kernel reads the
    new tokens before a query block through req_to_token, and only its diagonal block from k/v.
    Decode requests (extend 1) cost far more here than in decode_attention; split them out when the
    host knows which they are.
    """
    _attention_impl(q).extend_attention(
        q,
        k,
        v,
        o,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        extend_start_loc,
        sm_scale,
        max_extend_len,
    )


def compile_extend_variants(
    num_heads, dtype, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start_loc
):
    """Compiles, now, every extend-kernel variant that a step's makeup can select (the torch twin has none): see
    kernels/triton_attention.compile_extend_variants."""
    _attention_impl(k_cache).compile_extend_variants(
        num_heads, dtype, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start_loc
    )


class PendingQKV(NamedTuple):
    """What qk_norm_rope_store would do to a decode step's new tokens (its arguments but q and the caches), left to
    decode_attention: k/v [B, Hkv, D] and q as the QKV projection wrote them."""

    k: object
    v: object
    positions: object
    cos_sin_cache: object
    q_weight: object
    k_weight: object
    eps: float
    out_cache_loc: object

    def store_args(self, q, k_cache, v_cache) -> tuple:
        """The arguments of qk_norm_rope_store (or a twin's) that does it now."""
        k, v, positions, cos_sin, q_weight, k_weight, eps, loc = self
        return q, k, v, positions, cos_sin, q_weight, k_weight, eps, k_cache, v_cache, loc


def decode_attention(
    q, k_cache, v_cache, o, req_to_token, req_pool_indices, seq_lens, sm_scale, max_seq_len, pending=None
):
    """One query token per request over positions 0..seq_lens[i]-1 (its own K/V already stored, or stored here from
    pending: PendingQKV); o in place.

    max_seq_len (a python int, >= every seq_len) fixes the number of KV splits; under CUDA graphs pass a
    constant (e.g. the context length) so that the captured grid stays valid.
    """
    in_kernel = OPTIONS["fused_qkv"] and q.shape[0] <= OPTIONS["qkv_in_decode_max_rows"]
    if pending is not None and not in_kernel:
        qk_norm_rope_store(*pending.store_args(q, k_cache, v_cache))  # its own kernel(s) first, as in other steps
        pending = None
    args = (q, k_cache, v_cache, o, req_to_token, req_pool_indices, seq_lens, sm_scale, max_seq_len)
    _attention_impl(q).decode_attention(*args, pending=pending)


def _shared_prefix_impl(tensor):
    """Where decode_attention_grouped goes: the twin (which ignores the split kernels' slicing arguments) or the split
    kernels of kernels/shared_prefix_attention.py."""
    if _use_reference(tensor):
        return reference
    from kernels import shared_prefix_attention

    return shared_prefix_attention


def decode_attention_grouped(
    q,
    k_cache,
    v_cache,
    o,
    req_to_token,
    req_pool_indices,
    seq_lens,
    group_prefix_lens,
    group_prefix_rows,
    group_member_start,
    group_members,
    req_group,
    req_suffix_start,
    sm_scale,
    max_seq_len,
    max_prefix_len,
    max_group_size,
    prefix_splits=None,
    max_prefix_splits=None,
    live_groups=None,
):
    """decode_attention that reads each group's shared prefix K/V once for all its members; o in place.

    Group g's members, group_members[group_member_start[g]:group_member_start[g + 1]] (batch indices),
    share context positions [0, group_prefix_lens[g]), read through req_to_token[group_prefix_rows[g]].
    req_group [B] is each request's group (-1: none) and req_suffix_start [B] where its own positions
    begin (its group's prefix length, or 0; below seq_len). Ungrouped requests get plain decode
    attention, and a batch with no group takes decode_attention itself. The host ints bound the
    suffixes (max_seq_len), prefixes and group sizes and fix the grids (constants under CUDA graphs;
    pad the group table with empty groups). All index tensors int32. prefix_splits (int32 [1], on the device) is the
    step's count of slices per prefix, at most max_prefix_splits (a host int: the grid's), and live_groups (int32
    [1]) how many of the table's groups are real: both the group table's (forward_context.pack_decode_groups). See
    kernels/shared_prefix_attention.py.
    """
    args = (q, k_cache, v_cache, o, req_to_token, req_pool_indices, seq_lens, group_prefix_lens, group_prefix_rows)
    args += (group_member_start, group_members, req_group, req_suffix_start, sm_scale, max_seq_len, max_prefix_len)
    _shared_prefix_impl(q).decode_attention_grouped(
        *args,
        max_group_size,
        num_prefix_splits=max_prefix_splits,
        prefix_splits=prefix_splits,
        live_groups=live_groups,
    )


def prefix_slices(num_groups, max_group_size, max_prefix_len, num_q_heads, num_kv_heads, dtype, device):
    """Slices per shared prefix that decode_attention_grouped's split kernels cut a step of these real bounds into."""
    from kernels import shared_prefix_attention

    return shared_prefix_attention.prefix_slices(
        num_groups, max_group_size, max_prefix_len, num_q_heads, num_kv_heads, dtype, device
    )


def prefix_slices_bound(max_prefix_len):
    """The most slices prefix_slices can give under this prefix bound (a CUDA graph's grid)."""
    from kernels import shared_prefix_attention

    return shared_prefix_attention.prefix_slices_bound(max_prefix_len)


def rmsnorm(x, weight, eps, residual=None):
    """x * rsqrt(mean(x^2) + eps) * weight in fp32; with residual returns (norm(x + residual), x + residual)."""
    return _elementwise_impl(x).rmsnorm(x, weight, eps, residual)


def rope(q, k, positions, cos_sin_cache):
    """Neox-style rotary embedding applied in place to q [T, Hq, D] and k [T, Hkv, D] (strided views allowed).

    cos_sin_cache: fp32 [max_pos, rotary_dim], cos in the first half, sin in the second.
    """
    _elementwise_impl(q).rope(q, k, positions, cos_sin_cache)


def silu_and_mul(x):
    """[..., 2I] -> silu(x[..., :I]) * x[..., I:]."""
    return _elementwise_impl(x).silu_and_mul(x)


def _fused_impl(tensor):
    """The module of the Triton kernels that fuse a layer's small ops (a seam for bench/kernel_variant_keys.py)."""
    global _fused_ops
    if _use_reference(tensor):
        return reference
    if _fused_ops is None:
        from kernels import triton_common, triton_mlp, triton_qkv, triton_skinny_linear

        _fused_ops = types.SimpleNamespace(
            qk_norm_rope_store=triton_qkv.qk_norm_rope_store,
            gate_up_silu=triton_mlp.gate_up_silu,
            skinny_linear=triton_skinny_linear.skinny_linear,
            skinny_supports=triton_skinny_linear.supports,
            launches_with_pdl=triton_common.linear_uses_pdl,
        )
    return _fused_ops


def qk_norm_rope_store(q, k, v, positions, cos_sin_cache, q_weight, k_weight, eps, k_cache, v_cache, out_cache_loc):
    """In place: each head of q [T, Hq, D] and k [T, Hkv, D] RMS-normalised with q_weight / k_weight (None: no norm,
    as in Llama), rotated as rope() does, then k and v stored into their KV slots as store_kv() does. q/k/v may be
    strided views of a fused QKV output. One kernel on the GPU (OPTIONS["fused_qkv"]), else the four it replaces."""
    args = (q, k, v, positions, cos_sin_cache, q_weight, k_weight, eps, k_cache, v_cache, out_cache_loc)
    if _use_reference(q) or OPTIONS["fused_qkv"]:
        return _fused_impl(q).qk_norm_rope_store(*args)
    reference.qk_norm_rope_store(*args, ops=sys.modules[__name__])  # the four kernels it replaces


def gate_up_silu(x, weight, squares=None, eps=0.0):
    """silu(x @ weight[:I]^T) * (x @ weight[I:]^T) for the merged gate/up weight [2I, H]: the MLP's first half. One
    kernel on the GPU up to OPTIONS["gate_up_silu_max_rows"] rows, else cuBLAS and silu_and_mul. squares (with eps):
    x is first RMS-normalised without a weight, as linear() takes it."""
    if _use_reference(x) or x.numel() <= OPTIONS["gate_up_silu_max_rows"] * x.shape[-1]:
        return _fused_impl(x).gate_up_silu(x, weight, squares=squares, eps=eps)
    return silu_and_mul(F.linear(x if squares is None else reference.scale_rows(x, squares, eps), weight))


def _skinny(x, weight) -> bool:
    """Whether a projection of x takes the weight-streaming kernel (OPTIONS["skinny_linear_max_rows"], at most 16)."""
    return (
        not _use_reference(x)
        and x.numel() <= min(16, OPTIONS["skinny_linear_max_rows"]) * x.shape[-1]
        and _fused_impl(x).skinny_supports(weight)
    )


def linear(x, weight, bias=None, squares=None, eps=0.0):
    """x @ weight^T (+ bias) for a projection of the model: one weight-streaming kernel on the GPU up to
    OPTIONS["skinny_linear_max_rows"] rows (at most 16) where the weight's shape allows, else cuBLAS. squares (with
    eps): x is the residual stream, first RMS-normalised without a weight (the norm's weight is folded into this
    one), from the row sums of squares that linear_add gave back; the skinny kernel scales its output rows instead."""
    if not _skinny(x, weight):
        return F.linear(x if squares is None else reference.scale_rows(x, squares, eps), weight, bias)
    y = _fused_impl(x).skinny_linear(x, weight, squares=squares, eps=eps)
    return y if bias is None else y + bias


def linear_add(x, weight, residual):
    """(residual + x @ weight^T, that sum's row sums of squares [rows, blocks] in fp32, by column block): an output
    projection with the residual add and the next RMSNorm's statistic in its epilogue (the skinny kernel where
    linear() takes it, else its twin), so that the norm itself runs inside the next projection (fuses_norms)."""
    if not _skinny(x, weight):
        return reference.linear_add(x, weight, residual)
    return _fused_impl(x).skinny_linear(x, weight, residual=residual)


def fuses_norms(x, *weights) -> bool:
    """Whether a step of x's rows runs its layers' RMSNorms inside the projections (OPTIONS["norms_in_projections"]):
    on the GPU, up to as many rows as both the skinny and the gate/up kernels take, where the skinny kernel takes
    each of these projection weights and none launches with PDL (models/llama.py)."""
    rows = x.numel() // x.shape[-1]
    limit = min(16, OPTIONS["skinny_linear_max_rows"], OPTIONS["gate_up_silu_max_rows"])
    if not OPTIONS["norms_in_projections"] or _use_reference(x) or not 0 < rows <= limit:
        return False
    # Between projections that launch with PDL (weights up to 16 MB) a norm kernel's launch hides under theirs, and
    # the epilogues cost more than it: H100, batch 1, Qwen3-0.6B 1.12-1.17 -> 1.18 ms a step; Qwen3-8B (no PDL on
    # its projections) 6.33-6.36 -> 6.12-6.14 ms (bench/results/norms-in-projections-h100.md).
    ops = _fused_impl(x)
    return all(ops.skinny_supports(w) and not ops.launches_with_pdl(w) for w in weights)
