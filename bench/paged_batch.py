"""Paged batches for the kernel checks and benches (bench/check_kernels_gpu.py, bench/kernel_bench.py): requests
whose prefixes sit at scattered slots of a KV cache larger than needed, with a req_to_token table whose unused part
holds plausible-but-wrong slots, and the relative error the checks compare against their tolerances. torch is passed
in, not imported: the check imports it only after it has set TRITON_INTERPRET."""


def make_paged_batch(
    torch,
    prefix_lens,
    extend_lens,
    num_q_heads,
    num_kv_heads,
    head_dim,
    dtype,
    device,
    generator=None,
    table_width=None,
    spare_slots=64,
):
    """A batch of requests whose prefixes already sit in a KV cache at scattered slots.

    Returns a dict with q/k/v of the new tokens, the caches (new tokens stored too, as the model runner
    does before attention), the table and the per-request int32 vectors of the extend/decode APIs.
    """
    g = generator
    bsz = len(prefix_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    total_new = sum(extend_lens)
    num_slots = sum(seq_lens) + spare_slots
    width = table_width or max(seq_lens) + 7
    num_rows = bsz + 3

    # Draw the big tensors on their device (a 1 GiB cache drawn on the host takes seconds), from a
    # device generator seeded by the caller's so that a run is reproducible.
    dev_gen = torch.Generator(device=device)
    dev_gen.manual_seed(int(torch.randint(0, 2**62, (1,), generator=g)))

    def randn(*shape):
        return torch.randn(*shape, generator=dev_gen, device=device).to(dtype)

    k_cache = randn(num_slots, num_kv_heads, head_dim)
    v_cache = randn(num_slots, num_kv_heads, head_dim)
    # Unused table entries point at real but wrong slots: a kernel that reads past a length gets
    # plausible garbage and a wrong answer rather than a crash that hides which case broke.
    req_to_token = torch.randint(0, num_slots, (num_rows, width), generator=g, dtype=torch.int32)
    pool_rows = torch.randperm(num_rows, generator=g)[:bsz].to(torch.int32)
    slots = torch.randperm(num_slots, generator=g).to(torch.int32)
    cursor = 0
    new_slots = []
    for i in range(bsz):
        n = seq_lens[i]
        req_to_token[pool_rows[i], :n] = slots[cursor : cursor + n]
        new_slots.append(slots[cursor + prefix_lens[i] : cursor + n])
        cursor += n
    q = randn(total_new, num_q_heads, head_dim)
    k = randn(total_new, num_kv_heads, head_dim)
    v = randn(total_new, num_kv_heads, head_dim)
    out_cache_loc = torch.cat(new_slots) if new_slots else torch.zeros(0, dtype=torch.int32)
    k_cache[out_cache_loc.long().to(device)] = k
    v_cache[out_cache_loc.long().to(device)] = v
    starts = [0]
    for e in extend_lens[:-1]:
        starts.append(starts[-1] + e)

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return dict(
        q=q,
        k=k,
        v=v,
        k_cache=k_cache,
        v_cache=v_cache,
        req_to_token=req_to_token.to(device),
        req_pool_indices=pool_rows.to(device),
        prefix_lens=ints(prefix_lens),
        extend_lens=ints(extend_lens),
        extend_start_loc=ints(starts),
        seq_lens=ints(seq_lens),
        out_cache_loc=out_cache_loc.to(device),
        max_extend_len=max(extend_lens),
        max_seq_len=max(seq_lens),
    )


def rel_err(torch, out, ref):
    out = out.double()
    ref = ref.double()
    if not torch.isfinite(out).all():
        return float("inf")  # NaN poison left somewhere: an output element was never written
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
