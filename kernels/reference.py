"""Plain-torch twins of the Triton kernels.

They define what each kernel computes (the Triton versions are tested against them) and they are the
kernels the whole engine runs on the CPU. Attention math is done in fp32 whatever the storage dtype.
Lengths are read back to the host (`.tolist()`), which is free on the CPU and acceptable for the
"reference" ablation backend on the GPU.
"""

import sys

import torch
import torch.nn.functional as F


def store_kv(k, v, k_cache, v_cache, out_cache_loc):
    loc = out_cache_loc.long()
    k_cache[loc] = k.to(k_cache.dtype)
    v_cache[loc] = v.to(v_cache.dtype)


def step_input_ids(input_ids, future_tokens, table_write=None):
    ids = torch.where(input_ids < 0, future_tokens[(-input_ids - 1).clamp(min=0)], input_ids)
    if table_write is not None:
        table, rows, positions, slots = table_write
        table[rows.long(), positions.long()] = slots.to(table.dtype)
    return ids


def _attend(q, k, v, sm_scale, prefix_len):
    """One request: q [M, Hq, D] over k/v [L, Hkv, D], where query row j sees keys 0..prefix_len+j.

    Returns fp32 [M, Hq, D]. Query heads are folded onto their KV head ([Hkv, group*M, D]) so GQA
    needs no copy of K/V; the causal mask is repeated per query head of a group instead.
    """
    m, hq, d = q.shape
    seq_len, hkv, _ = k.shape
    group = hq // hkv
    qf = q.float().reshape(m, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * m, d)
    kf = k.float().permute(1, 0, 2)  # [Hkv, L, D]
    vf = v.float().permute(1, 0, 2)
    mask = None
    if m > 1:  # a single query row sees every key: no mask needed (a decode inside a mixed batch)
        rows = torch.arange(m, device=q.device)[:, None] + prefix_len
        cols = torch.arange(seq_len, device=q.device)[None, :]
        mask = (cols <= rows).repeat(group, 1)  # [group*M, L]
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=sm_scale)
    return out.reshape(hkv, group, m, d).permute(2, 0, 1, 3).reshape(m, hq, d)


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
    pools = req_pool_indices.tolist()
    prefixes = prefix_lens.tolist()
    extends = extend_lens.tolist()
    starts = extend_start_loc.tolist()
    for pool, prefix, ext, start in zip(pools, prefixes, extends, starts):
        if ext == 0:
            continue
        rows = slice(start, start + ext)
        # The new tokens come from k/v directly (identical to what store_kv put in the cache); only the
        # prefix goes through the token table.
        slots = req_to_token[pool, :prefix].long()
        keys = torch.cat([k_cache[slots].to(k.dtype), k[rows]])
        values = torch.cat([v_cache[slots].to(v.dtype), v[rows]])
        o[rows] = _attend(q[rows], keys, values, sm_scale, prefix).to(o.dtype)


def compile_extend_variants(*args):
    """Nothing to compile: the twin of kernels/triton_attention.compile_extend_variants."""


def decode_attention(
    q, k_cache, v_cache, o, req_to_token, req_pool_indices, seq_lens, sm_scale, max_seq_len, pending=None
):
    """Batched: every request's context is gathered into a [B, max_len] padded block, masked past its length.
    pending (kernels.PendingQKV): the new tokens' Q/K norms, RoPE and K/V store, done first (qk_norm_rope_store).

    One fp32 matmul pair for the whole batch keeps the CPU server's decode step cheap; memory is
    B * max_len * Hkv * D floats, small for the models that run on the CPU.
    """
    if pending is not None:
        qk_norm_rope_store(*pending.store_args(q, k_cache, v_cache))
    bsz, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    lens = seq_lens.long()
    max_len = int(lens.max().item()) if bsz else 0
    if max_len == 0:
        return
    positions = torch.arange(max_len, device=q.device)
    valid = positions[None, :] < lens[:, None]  # [B, L]
    # Rows of req_to_token past a request's length may hold stale or garbage slots: never dereference them.
    slots = req_to_token[req_pool_indices.long(), :max_len].long()
    slots = torch.where(valid, slots, torch.zeros_like(slots))
    keys = k_cache[slots].float().permute(0, 2, 1, 3)  # [B, Hkv, L, D]
    values = v_cache[slots].float().permute(0, 2, 1, 3)
    qf = q.float().reshape(bsz, hkv, group, d)
    scores = torch.matmul(qf, keys.transpose(-1, -2)) * sm_scale  # [B, Hkv, group, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, values)  # [B, Hkv, group, D]
    o.copy_(out.reshape(bsz, hq, d).to(o.dtype))


def rmsnorm(x, weight, eps, residual=None):
    if residual is not None:
        h = x + residual
        return rmsnorm(h, weight, eps), h
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv_rms * weight.float()).to(x.dtype)


def rope(q, k, positions, cos_sin_cache):
    rotary_dim = cos_sin_cache.shape[-1]
    half = rotary_dim // 2
    cos_sin = cos_sin_cache[positions.long()].float()  # [T, rotary_dim]
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]
    for x in (q, k):
        # Slicing keeps the caller's view: q and k may be strided windows into a fused qkv output.
        x1 = x[..., :half].float()
        x2 = x[..., half:rotary_dim].float()
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x[..., :rotary_dim] = rotated.to(x.dtype)


def silu_and_mul(x):
    inter = x.shape[-1] // 2
    return (F.silu(x[..., :inter].float()) * x[..., inter:].float()).to(x.dtype)


def qk_norm_rope_store(
    q, k, v, positions, cos_sin_cache, q_weight, k_weight, eps, k_cache, v_cache, out_cache_loc, ops=None
):
    """The unfused sequence itself, in place: per-head RMSNorm of q and k (when given weights), RoPE, the K/V store.
    The same ops in the same order as the layers ran them before the fusion: on the CPU the result is bit for bit
    what it was (the norms' outputs are copied back into q/k instead of replacing them, a copy of equal dtype).
    ops: where rmsnorm, rope and store_kv come from (this module's twins by default; kernels' dispatch for the GPU's
    unfused path)."""
    ops = ops or sys.modules[__name__]
    if q_weight is not None:
        d = q.shape[-1]
        q.copy_(ops.rmsnorm(q.reshape(-1, d), q_weight, eps).view(q.shape))
        k.copy_(ops.rmsnorm(k.reshape(-1, d), k_weight, eps).view(k.shape))
    ops.rope(q, k, positions, cos_sin_cache)
    ops.store_kv(k, v, k_cache, v_cache, out_cache_loc)


def gate_up_silu(x, weight, squares=None, eps=0.0):
    """silu(x @ gate^T) * (x @ up^T) for weight = [gate; up] stacked by rows: the merged projection, then SiLU-and-mul,
    exactly as the unfused MLP computed them (after scale_rows, given squares)."""
    return silu_and_mul(F.linear(x if squares is None else scale_rows(x, squares, eps), weight))


def scale_rows(x, squares, eps):
    """rmsnorm(x) with a weight of 1, from its rows' sums of squares split by column block (squares [rows, blocks],
    fp32, as linear_add gives them back): the norm a projection whose weight holds the norm's runs on its input."""
    inv_rms = torch.rsqrt(squares.sum(-1, keepdim=True) / x.shape[-1] + eps)
    return (x.float() * inv_rms.view(*x.shape[:-1], 1)).to(x.dtype)


def linear_add(x, weight, residual):
    """(residual + x @ weight^T, its row sums of squares [rows, 1] in fp32): rounded as F.linear and `+` round."""
    h = F.linear(x, weight) + residual
    return h, h.float().pow(2).sum(-1).reshape(-1, 1)


def _attend_with_lse(q, keys, values, valid, sm_scale):
    """q [B, Hkv, R, D] over keys/values [B, Hkv, L, D] where valid [B, L]: fp32 (out, natural-log lse).

    Rows with no valid key get out 0 and lse -inf, so they weigh nothing in a merge.
    """
    scores = torch.matmul(q, keys.transpose(-1, -2)) * sm_scale  # [B, Hkv, R, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, R]
    probs = torch.exp(scores - lse.clamp_min(torch.finfo(torch.float32).min)[..., None])
    return torch.matmul(probs, values), lse


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
    num_prefix_splits=None,
    prefix_splits=None,
    live_groups=None,
):
    """decode_attention, with each group's shared prefix gathered and attended once for all its members (the split
    kernels' slicing and live-group arguments change nothing here: the groups past the live ones are empty).

    Same three steps as kernels/shared_prefix_attention.py: every group's members (x their GQA heads)
    attend its prefix together, every request attends its own positions [suffix_start, seq_len), and
    the two softmaxes are merged by their log-sum-exps.
    """
    bsz, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    if bsz == 0:
        return
    qf = q.float().reshape(bsz, hkv, group, d)

    # Own positions of every request, padded to the longest suffix as in decode_attention.
    starts = req_suffix_start.long()
    own = seq_lens.long() - starts
    width = int(own.max().item())
    offsets = torch.arange(width, device=q.device)
    valid = offsets[None, :] < own[:, None]
    positions = torch.where(valid, starts[:, None] + offsets[None, :], torch.zeros_like(offsets)[None, :])
    slots = req_to_token[req_pool_indices.long()[:, None], positions].long()
    slots = torch.where(valid, slots, torch.zeros_like(slots))
    keys = k_cache[slots].float().permute(0, 2, 1, 3)  # [B, Hkv, L, D]
    values = v_cache[slots].float().permute(0, 2, 1, 3)
    suffix_out, suffix_lse = _attend_with_lse(qf, keys, values, valid, sm_scale)

    # Each group's prefix: one gather of its K/V, one matmul for all members' query rows.
    prefix_out = torch.zeros_like(suffix_out)
    prefix_lse = torch.full_like(suffix_lse, float("-inf"))
    bounds = group_member_start.tolist()
    for g, (prefix_len, row) in enumerate(zip(group_prefix_lens.tolist(), group_prefix_rows.tolist())):
        members = group_members[bounds[g] : bounds[g + 1]].long()
        if prefix_len == 0 or members.numel() == 0:
            continue
        pslots = req_to_token[row, :prefix_len].long()
        pkeys = k_cache[pslots].float().permute(1, 0, 2)[None]  # [1, Hkv, P, D]
        pvalues = v_cache[pslots].float().permute(1, 0, 2)[None]
        rows = qf[members].permute(1, 0, 2, 3).reshape(1, hkv, members.numel() * group, d)
        out, lse = _attend_with_lse(
            rows, pkeys, pvalues, torch.ones(1, prefix_len, dtype=torch.bool, device=q.device), sm_scale
        )
        prefix_out[members] = out.reshape(hkv, members.numel(), group, d).permute(1, 0, 2, 3)
        prefix_lse[members] = lse.reshape(hkv, members.numel(), group).permute(1, 0, 2)

    top = torch.maximum(suffix_lse, prefix_lse)
    w_suffix = torch.exp(suffix_lse - top)[..., None]
    w_prefix = torch.exp(prefix_lse - top)[..., None]
    out = (suffix_out * w_suffix + prefix_out * w_prefix) / (w_suffix + w_prefix)
    o.copy_(out.reshape(bsz, hq, d).to(o.dtype))
