"""Batches for the shared-prefix (grouped) decode attention benches and tests: groups of requests sharing a prefix in
the KV cache, every slot scattered, tables laid out as kernels.decode_attention_grouped takes them.

A batch is G groups (a prefix of P_g tokens shared by the group's members, each member with its own tokens after it)
plus ungrouped requests, in shuffled batch order, with unused table entries pointing at real but wrong slots.
"""

import inspect

import torch

BYTES_PER_ELEMENT = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}


def make_grouped_batch(groups, ungrouped, hq, hkv, d, dtype, device, generator, prefix_row="member", pad_groups=0):
    """groups: [(prefix_len, [own_len of each member])]; ungrouped: [seq_len]. own_len >= 1 (the new token).

    prefix_row "member": a group's prefix is read through its first member's row; "other": through a
    table row outside the batch that holds the same prefix slots (as a radix-tree node would).
    Returns the keyword arguments of decode_attention_grouped (without o and sm_scale) plus q.
    """
    g = generator
    reqs = [(gi, p, own) for gi, (p, owns) in enumerate(groups) for own in owns] + [(-1, 0, n) for n in ungrouped]
    reqs = [reqs[i] for i in torch.randperm(len(reqs), generator=g).tolist()]
    bsz = len(reqs)
    seq_lens = [p + own for _, p, own in reqs]
    num_slots = sum(p for p, _ in groups) + sum(own for _, _, own in reqs) + 64
    num_rows = bsz + len(groups) + 3
    table = torch.randint(0, num_slots, (num_rows, max(seq_lens) + 7), generator=g, dtype=torch.int32)
    rows = torch.randperm(num_rows, generator=g)[: bsz + len(groups)].tolist()
    slots = torch.randperm(num_slots, generator=g).to(torch.int32)
    cursor = 0

    def take(n):
        nonlocal cursor
        cursor += n
        return slots[cursor - n : cursor]

    prefix_slots = [take(p) for p, _ in groups]
    for gi, p in enumerate(prefix_slots):
        table[rows[bsz + gi], : len(p)] = p
    members = [[] for _ in groups]
    for b, (gi, p, own) in enumerate(reqs):
        if gi >= 0:
            table[rows[b], :p] = prefix_slots[gi]
            members[gi].append(b)
        table[rows[b], p : p + own] = take(own)
    prefix_rows = [rows[m[0]] if prefix_row == "member" else rows[bsz + gi] for gi, m in enumerate(members)]
    starts = [0]
    for m in members:
        starts.append(starts[-1] + len(m))
    starts += [starts[-1]] * pad_groups  # empty groups, as a CUDA-graph-padded table has

    dev_gen = torch.Generator(device=device)
    dev_gen.manual_seed(int(torch.randint(0, 2**62, (1,), generator=g)))

    def randn(*shape):
        return torch.randn(*shape, generator=dev_gen, device=device).to(dtype)

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return dict(
        q=randn(bsz, hq, d),
        k_cache=randn(num_slots, hkv, d),
        v_cache=randn(num_slots, hkv, d),
        req_to_token=table.to(device),
        req_pool_indices=ints(rows[:bsz]),
        seq_lens=ints(seq_lens),
        group_prefix_lens=ints([p for p, _ in groups] + [0] * pad_groups),
        group_prefix_rows=ints(prefix_rows + [0] * pad_groups),
        group_member_start=ints(starts),
        group_members=ints([b for m in members for b in m]),
        req_group=ints([gi for gi, _, _ in reqs]),
        req_suffix_start=ints([p for _, p, _ in reqs]),
        max_seq_len=max(seq_lens),
        max_prefix_len=max([p for p, _ in groups] + [1]),
        max_group_size=max([len(m) for m in members] + [1]),
    )


def plain_args(b):
    return (b["req_to_token"], b["req_pool_indices"], b["seq_lens"], b["q"].shape[-1] ** -0.5, b["max_seq_len"])


def run_plain(impl, b, o):
    impl.decode_attention(b["q"], b["k_cache"], b["v_cache"], o, *plain_args(b))


def run_grouped(impl, b, o, **splits):
    if "prefix_splits" in inspect.signature(impl.decode_attention_grouped).parameters:
        splits = {**b.get("slicing", {}), **splits}  # the split kernels take the step's slicing from the table
    impl.decode_attention_grouped(
        b["q"],
        b["k_cache"],
        b["v_cache"],
        o,
        b["req_to_token"],
        b["req_pool_indices"],
        b["seq_lens"],
        b["group_prefix_lens"],
        b["group_prefix_rows"],
        b["group_member_start"],
        b["group_members"],
        b["req_group"],
        b["req_suffix_start"],
        b["q"].shape[-1] ** -0.5,
        b["max_seq_len"],
        b["max_prefix_len"],
        b["max_group_size"],
        **splits,
    )


def rel_err(out, ref):
    if not torch.isfinite(out).all():
        return float("inf")  # NaN poison left: some output element was never written
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def kv_bytes(b, grouped):
    """The KV bytes a step must read: every request's whole context, or each prefix once plus own tokens."""
    per_token = 2 * b["k_cache"].shape[1] * b["k_cache"].shape[2] * BYTES_PER_ELEMENT[b["k_cache"].dtype]
    if not grouped:
        return int(b["seq_lens"].sum()) * per_token
    return prefix_bytes(b) + own_bytes(b)


def prefix_bytes(b):
    """Each group's shared prefix KV, once."""
    per_token = 2 * b["k_cache"].shape[1] * b["k_cache"].shape[2] * BYTES_PER_ELEMENT[b["k_cache"].dtype]
    return int(b["group_prefix_lens"].sum()) * per_token


def own_bytes(b):
    """Every request's own (unshared) tokens' KV."""
    per_token = 2 * b["k_cache"].shape[1] * b["k_cache"].shape[2] * BYTES_PER_ELEMENT[b["k_cache"].dtype]
    return int((b["seq_lens"] - b["req_suffix_start"]).sum()) * per_token


def step_slices(b):
    """The slices per prefix that the split kernels cut this batch's real groups into (the host's choice for a step)."""
    from kernels import shared_prefix_attention

    return shared_prefix_attention.prefix_slices(
        b["group_prefix_lens"].shape[0],
        b["max_group_size"],
        b["max_prefix_len"],
        b["q"].shape[1],
        b["k_cache"].shape[1],
        b["q"].dtype,
        b["q"].device,
    )


def graph_padded(b, context_len, num_groups):
    """The batch as a decode CUDA graph sees it (radixserve/worker/cuda_graph.py): the group table padded to
    num_groups empty groups, the bounds fixed at the context length and the batch size, and the split kernels'
    slices per prefix chosen from the real groups (as forward_context.pack_decode_groups does) under the graph's
    bound."""
    from kernels import shared_prefix_attention

    slices = step_slices(b)
    slicing = dict(
        num_prefix_splits=shared_prefix_attention.prefix_slices_bound(context_len),
        prefix_splits=torch.tensor([slices], dtype=torch.int32, device=b["q"].device),
        live_groups=torch.tensor([b["group_prefix_lens"].shape[0]], dtype=torch.int32, device=b["q"].device),
    )
    pad = num_groups - b["group_prefix_lens"].shape[0]
    assert pad >= 0
    device = b["q"].device
    zeros = torch.zeros(pad, dtype=torch.int32, device=device)
    start = b["group_member_start"]
    return dict(
        b,
        group_prefix_lens=torch.cat([b["group_prefix_lens"], zeros]),
        group_prefix_rows=torch.cat([b["group_prefix_rows"], zeros]),
        group_member_start=torch.cat([start, start[-1:].expand(pad)]),
        max_seq_len=context_len,
        max_prefix_len=context_len,
        max_group_size=b["q"].shape[0],
        slicing=slicing,
    )


def prefix_groups_message(b):
    """The batch's groups as the scheduler sends them to the workers (protocol.PrefixGroups)."""
    from radixserve.protocol import PrefixGroups, pack_i32

    names = ("group_prefix_lens", "group_prefix_rows", "req_group", "req_suffix_start")
    return PrefixGroups(*(pack_i32(b[name].tolist()) for name in names))


def with_lone_groups(b, min_tokens):
    """The batch with each request in no group whose context before its new token is min_tokens or longer made a
    group of one: its tables packed by the worker's own code (forward_context.pack_decode_groups with lone decodes,
    --lone-decode-min-tokens)."""
    from radixserve.forward_context import DecodeGroups, pack_decode_groups

    decodes = (b["req_pool_indices"].cpu().numpy(), b["seq_lens"].cpu().numpy())
    flat, max_prefix_len, max_group_size = pack_decode_groups(
        prefix_groups_message(b), 0, decodes=decodes, lone_min_tokens=min_tokens
    )
    t = DecodeGroups.view(torch.from_numpy(flat).to(b["q"].device), int(flat[-2]), len(decodes[0]), 1, 1, 1)
    return dict(
        b,
        group_prefix_lens=t.prefix_lens,
        group_prefix_rows=t.prefix_rows,
        group_member_start=t.member_start,
        group_members=t.members,
        req_group=t.req_group,
        req_suffix_start=t.req_suffix_start,
        max_prefix_len=max(1, max_prefix_len),
        max_group_size=max(1, max_group_size),
    )


def layer_copies(b, layers, generator_seed=0):
    """`layers` batches sharing the tables but each with its own KV cache and queries, as a model's layers have:
    timing them in turn reads more than L2 holds, as a decode step does."""
    out = [b]
    gen = torch.Generator(device=b["q"].device)
    gen.manual_seed(generator_seed)
    for _ in range(layers - 1):
        copy = dict(b)
        for name in ("q", "k_cache", "v_cache"):
            copy[name] = torch.randn(b[name].shape, generator=gen, device=b[name].device).to(b[name].dtype)
        out.append(copy)
    return out
