"""The torch reference kernels against naive per-request, per-token, per-head loops in float64.

The references define what the Triton kernels compute and run the whole CPU server, so they are
checked here against the plainest possible reading of each semantic: every new token, every head,
its visible keys gathered one position at a time through req_to_token.
"""

import math
import random

import pytest
import torch

import kernels
from kernels import reference

# ----------------------------------------------------------------------------------------------
# Naive implementations (float64, python loops)
# ----------------------------------------------------------------------------------------------


def naive_attention_row(q_row, keys, values, scale):
    """q_row [D]; keys/values [L, D] -> [D], all float64."""
    scores = (keys @ q_row) * scale
    weights = torch.exp(scores - scores.max())
    return (weights[:, None] * values).sum(0) / weights.sum()


def naive_extend(q, k_cache, v_cache, req_to_token, pools, prefixes, extends, starts, scale):
    t, hq, d = q.shape
    hkv = k_cache.shape[1]
    out = torch.empty(t, hq, d, dtype=torch.float64)
    for pool, prefix, ext, start in zip(pools, prefixes, extends, starts):
        for j in range(ext):
            visible = prefix + j + 1
            slots = [int(req_to_token[pool, p]) for p in range(visible)]
            for h in range(hq):
                kvh = h // (hq // hkv)
                keys = torch.stack([k_cache[s, kvh].double() for s in slots])
                values = torch.stack([v_cache[s, kvh].double() for s in slots])
                out[start + j, h] = naive_attention_row(q[start + j, h].double(), keys, values, scale)
    return out


def naive_decode(q, k_cache, v_cache, req_to_token, pools, seq_lens, scale):
    bsz, hq, d = q.shape
    hkv = k_cache.shape[1]
    out = torch.empty(bsz, hq, d, dtype=torch.float64)
    for i, (pool, seq_len) in enumerate(zip(pools, seq_lens)):
        slots = [int(req_to_token[pool, p]) for p in range(seq_len)]
        for h in range(hq):
            kvh = h // (hq // hkv)
            keys = torch.stack([k_cache[s, kvh].double() for s in slots])
            values = torch.stack([v_cache[s, kvh].double() for s in slots])
            out[i, h] = naive_attention_row(q[i, h].double(), keys, values, scale)
    return out


# ----------------------------------------------------------------------------------------------
# Random paged batches
# ----------------------------------------------------------------------------------------------


def random_batch(rng, gen, prefixes, extends, hq, hkv, d, dtype):
    """Caches with random contents everywhere, slots scattered, the table's unused tail filled with
    wrong-but-valid slots, and the new tokens' K/V already stored (as the model runner does)."""
    seq_lens = [p + e for p, e in zip(prefixes, extends)]
    num_slots = sum(seq_lens) + rng.randint(1, 40)
    num_rows = len(prefixes) + rng.randint(1, 4)
    width = max(seq_lens) + rng.randint(0, 9)
    k_cache = torch.randn(num_slots, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_slots, hkv, d, generator=gen).to(dtype)
    req_to_token = torch.randint(0, num_slots, (num_rows, width), generator=gen, dtype=torch.int32)
    pools = rng.sample(range(num_rows), len(prefixes))
    slots = torch.randperm(num_slots, generator=gen).to(torch.int32)
    total = sum(extends)
    q = torch.randn(total, hq, d, generator=gen).to(dtype)
    k = torch.randn(total, hkv, d, generator=gen).to(dtype)
    v = torch.randn(total, hkv, d, generator=gen).to(dtype)
    starts, cursor, token = [], 0, 0
    for pool, prefix, ext in zip(pools, prefixes, extends):
        req_to_token[pool, : prefix + ext] = slots[cursor : cursor + prefix + ext]
        cursor += prefix + ext
        new = req_to_token[pool, prefix : prefix + ext]
        reference.store_kv(k[token : token + ext], v[token : token + ext], k_cache, v_cache, new)
        starts.append(token)
        token += ext
    return dict(
        q=q,
        k=k,
        v=v,
        k_cache=k_cache,
        v_cache=v_cache,
        req_to_token=req_to_token,
        pools=pools,
        starts=starts,
        seq_lens=seq_lens,
    )


def ints(values):
    return torch.tensor(values, dtype=torch.int32)


def rel_err(out, ref):
    assert torch.isfinite(out).all(), "an output element was never written (NaN poison left)"
    return ((out.double() - ref).norm() / ref.norm()).item()


HEAD_SHAPES = [(2, 2, 16), (4, 2, 64), (8, 2, 16), (8, 1, 64)]  # GQA 1, 2, 4, 8; head_dim 16/64


def random_lengths(rng, bsz):
    prefixes = [rng.choice([0, rng.randint(1, 45)]) for _ in range(bsz)]
    extends = [rng.choice([1, rng.randint(1, 37)]) for _ in range(bsz)]
    # Always one fresh prefill of several tokens and one decode-shaped request (extend 1 over a prefix).
    prefixes[0], extends[0] = 0, max(extends[0], 5)
    prefixes[-1], extends[-1] = max(prefixes[-1], 3), 1
    return prefixes, extends


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("hq,hkv,d", HEAD_SHAPES)
def test_extend_attention_matches_naive(seed, hq, hkv, d):
    rng = random.Random(seed * 100 + hq * 10 + d)
    gen = torch.Generator().manual_seed(rng.randint(0, 1 << 30))
    prefixes, extends = random_lengths(rng, rng.randint(2, 5))
    b = random_batch(rng, gen, prefixes, extends, hq, hkv, d, torch.float32)
    scale = 1 / math.sqrt(d) * rng.uniform(0.5, 2.0)
    out = torch.full_like(b["q"], float("nan"))
    reference.extend_attention(
        b["q"],
        b["k"],
        b["v"],
        out,
        b["k_cache"],
        b["v_cache"],
        b["req_to_token"],
        ints(b["pools"]),
        ints(prefixes),
        ints(extends),
        ints(b["starts"]),
        scale,
        max(extends),
    )
    expect = naive_extend(
        b["q"], b["k_cache"], b["v_cache"], b["req_to_token"], b["pools"], prefixes, extends, b["starts"], scale
    )
    assert rel_err(out, expect) < 1e-5


def test_extend_attention_bf16_close_to_fp64():
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    prefixes, extends = [0, 29, 3], [17, 1, 40]
    b = random_batch(rng, gen, prefixes, extends, 8, 2, 64, torch.bfloat16)
    out = torch.full_like(b["q"], float("nan"))
    reference.extend_attention(
        b["q"],
        b["k"],
        b["v"],
        out,
        b["k_cache"],
        b["v_cache"],
        b["req_to_token"],
        ints(b["pools"]),
        ints(prefixes),
        ints(extends),
        ints(b["starts"]),
        0.125,
        40,
    )
    assert out.dtype == torch.bfloat16
    expect = naive_extend(
        b["q"], b["k_cache"], b["v_cache"], b["req_to_token"], b["pools"], prefixes, extends, b["starts"], 0.125
    )
    assert rel_err(out, expect) < 1e-2


def test_extend_equals_full_prefill_split_anywhere():
    """A prompt extended in two chunks (the second over the cached first) equals one full prefill."""
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, n, cut = 4, 2, 16, 23, 9
    b = random_batch(rng, gen, [0], [n], hq, hkv, d, torch.float32)
    args = (b["k_cache"], b["v_cache"], b["req_to_token"], ints(b["pools"]))
    full = torch.full_like(b["q"], float("nan"))
    reference.extend_attention(b["q"], b["k"], b["v"], full, *args, ints([0]), ints([n]), ints([0]), 0.3, n)
    second = torch.full_like(b["q"][cut:], float("nan"))
    reference.extend_attention(
        b["q"][cut:], b["k"][cut:], b["v"][cut:], second, *args, ints([cut]), ints([n - cut]), ints([0]), 0.3, n - cut
    )
    torch.testing.assert_close(second, full[cut:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("hq,hkv,d", HEAD_SHAPES)
def test_decode_attention_matches_naive(seed, hq, hkv, d):
    rng = random.Random(seed * 31 + hq + d)
    gen = torch.Generator().manual_seed(rng.randint(0, 1 << 30))
    bsz = rng.randint(1, 6)
    seq_lens = [rng.choice([1, rng.randint(1, 70)]) for _ in range(bsz)]
    b = random_batch(rng, gen, [s - 1 for s in seq_lens], [1] * bsz, hq, hkv, d, torch.float32)
    out = torch.full_like(b["q"], float("nan"))
    scale = 1 / math.sqrt(d)
    reference.decode_attention(
        b["q"],
        b["k_cache"],
        b["v_cache"],
        out,
        b["req_to_token"],
        ints(b["pools"]),
        ints(seq_lens),
        scale,
        max(seq_lens),
    )
    expect = naive_decode(b["q"], b["k_cache"], b["v_cache"], b["req_to_token"], b["pools"], seq_lens, scale)
    assert rel_err(out, expect) < 1e-5


def test_decode_equals_extend_of_one_token():
    """A decode step and an extend of length 1 over the same prefix compute the same thing."""
    rng = random.Random(11)
    gen = torch.Generator().manual_seed(11)
    seq_lens = [1, 40, 13, 64]
    b = random_batch(rng, gen, [s - 1 for s in seq_lens], [1] * 4, 8, 2, 16, torch.float32)
    common = (b["req_to_token"], ints(b["pools"]))
    dec = torch.full_like(b["q"], float("nan"))
    reference.decode_attention(b["q"], b["k_cache"], b["v_cache"], dec, *common, ints(seq_lens), 0.25, 64)
    ext = torch.full_like(b["q"], float("nan"))
    reference.extend_attention(
        b["q"],
        b["k"],
        b["v"],
        ext,
        b["k_cache"],
        b["v_cache"],
        *common,
        ints([s - 1 for s in seq_lens]),
        ints([1] * 4),
        ints(b["starts"]),
        0.25,
        1,
    )
    torch.testing.assert_close(dec, ext, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_store_kv_writes_exactly_the_given_slots(index_dtype):
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn(50, 2, 16, generator=gen)
    v_cache = torch.randn(50, 2, 16, generator=gen)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    fused = torch.randn(9, 6, 16, generator=gen)
    k, v = fused[:, 2:4], fused[:, 4:]  # strided views, as sliced from a qkv projection
    loc = torch.randperm(50, generator=gen)[:9].to(index_dtype)
    reference.store_kv(k, v, k_cache, v_cache, loc)
    for i in range(9):
        assert torch.equal(k_cache[loc[i]], k[i]) and torch.equal(v_cache[loc[i]], v[i])
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[loc.long()] = False
    assert torch.equal(k_cache[untouched], before_k[untouched])
    assert torch.equal(v_cache[untouched], before_v[untouched])


def naive_rmsnorm(x, weight, eps):
    out = torch.empty(x.shape, dtype=torch.float64)
    for r in range(x.shape[0]):
        row = x[r].double()
        out[r] = row / math.sqrt(float((row * row).sum()) / row.numel() + eps) * weight.double()
    return out


@pytest.mark.parametrize("hidden", [1, 37, 64])
def test_rmsnorm_matches_naive(hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=gen)
    w = torch.randn(hidden, generator=gen)
    res = torch.randn(5, hidden, generator=gen)
    assert rel_err(reference.rmsnorm(x, w, 1e-6), naive_rmsnorm(x, w, 1e-6)) < 1e-6
    out, h = reference.rmsnorm(x, w, 1e-5, residual=res)
    torch.testing.assert_close(h, x + res)
    assert rel_err(out, naive_rmsnorm(x + res, w, 1e-5)) < 1e-6


def test_rmsnorm_keeps_dtype():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 32, generator=gen).to(torch.bfloat16)
    w = torch.randn(32, generator=gen)
    out, h = reference.rmsnorm(x, w, 1e-6, residual=x)
    assert out.dtype == torch.bfloat16 and h.dtype == torch.bfloat16
    assert rel_err(out, naive_rmsnorm(h, w, 1e-6)) < 1e-2


@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_rope_matches_naive_on_strided_views(rotary_dim):
    gen = torch.Generator().manual_seed(rotary_dim)
    t, hq, hkv, d, max_pos = 6, 4, 2, 16, 50
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen)
    original = qkv.clone()
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    cos_sin = torch.randn(max_pos, rotary_dim, generator=gen)
    positions = torch.randint(0, max_pos, (t,), generator=gen)
    reference.rope(q, k, positions, cos_sin)

    half = rotary_dim // 2
    expect = original.double().clone()
    for i in range(t):
        cos = cos_sin[positions[i], :half].double()
        sin = cos_sin[positions[i], half:].double()
        for base, heads in ((0, hq), (hq * d, hkv)):
            for h in range(heads):
                row = original[i, base + h * d : base + (h + 1) * d].double()
                for j in range(half):
                    x1, x2 = row[j], row[half + j]
                    expect[i, base + h * d + j] = x1 * cos[j] - x2 * sin[j]
                    expect[i, base + h * d + half + j] = x2 * cos[j] + x1 * sin[j]
    assert rel_err(qkv, expect) < 1e-6  # also proves v and the dims past rotary_dim are untouched


def test_silu_and_mul_matches_naive():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2 * 13, generator=gen)
    xd = x.double()
    expect = xd[:, :13] / (1 + torch.exp(-xd[:, :13])) * xd[:, 13:]
    assert rel_err(reference.silu_and_mul(x), expect) < 1e-6


def test_dispatch_uses_reference_on_cpu_and_validates_names():
    assert kernels.get_backend() in kernels.BACKENDS
    previous = kernels.get_backend()
    try:
        kernels.set_backend("auto")
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(3, 2 * 8, generator=gen)
        assert torch.equal(kernels.silu_and_mul(x), reference.silu_and_mul(x))
        with pytest.raises(ValueError):
            kernels.set_backend("cuda")
    finally:
        kernels.set_backend(previous)
