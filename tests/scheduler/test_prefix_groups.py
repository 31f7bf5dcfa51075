"""Prefix groups of a decode batch, chosen over a real radix tree.

Requests are admitted the way the scheduler does it: insert the prompt, match it, lock last_node, and
read the path back with node_path. Properties: groups never mix requests that do not share their
prefix (tokens and KV slots), every request is in at most one group, and the choice saves as many
tokens as the best of every possible assignment (brute force on small batches).
"""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import reference
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.slot_allocator import TokenSlotAllocator
from scheduler_service.prefix_groups import PrefixGroup, choose_prefix_groups, group_tables, node_path


def _admit(prompts, num_slots=4096):
    """Insert each prompt (its KV computed), then match and lock it as a running request would."""
    tree = RadixCache(TokenSlotAllocator(num_slots))
    for prompt in prompts:
        slots = tree.allocator.alloc(len(prompt))
        tree.insert(prompt, slots)
    matches = []
    for prompt in prompts:
        match = tree.match_prefix(prompt)
        tree.inc_lock_ref(match.last_node)
        matches.append(match)
    return tree, matches


def _saved(groups):
    return sum((len(g.members) - 1) * g.prefix_len for g in groups)


def _brute_force_saved(paths, min_tokens):
    """Every assignment of each request to nothing or one node of its path (depth >= min_tokens)."""
    options = []
    for path in paths:
        depths = np.cumsum([len(n) for n in path]).tolist()
        options.append([None] + [(node, d) for node, d in zip(path, depths) if d >= max(1, min_tokens)])
    best = 0
    for choice in itertools.product(*options):
        counts, depth = {}, {}
        for pick in choice:
            if pick is not None:
                counts[pick[0]] = counts.get(pick[0], 0) + 1
                depth[pick[0]] = pick[1]
        best = max(best, sum((c - 1) * depth[n] for n, c in counts.items()))
    return best


def _check_groups(groups, prompts, matches, min_tokens):
    seen = set()
    for group in groups:
        assert len(group.members) >= 2 and group.prefix_len >= max(1, min_tokens)
        assert not seen & set(group.members), "a request is in two groups"
        seen |= set(group.members)
        first = group.members[0]
        for m in group.members:
            assert len(matches[m].slots) >= group.prefix_len
            assert np.array_equal(prompts[m][: group.prefix_len], prompts[first][: group.prefix_len])
            assert np.array_equal(matches[m].slots[: group.prefix_len], matches[first].slots[: group.prefix_len])


def test_exact_not_greedy_deepest_first():
    # a and b meet at depth 100, c leaves their path at 99: one group of three at 99 saves 198 tokens;
    # grouping a and b at 100 first (greedy by depth) would save 100.
    base = list(range(1, 100))
    prompts = [np.array(base + [500, 7, 8]), np.array(base + [500, 9]), np.array(base + [600, 3])]
    _, matches = _admit(prompts)
    groups = choose_prefix_groups([node_path(m.last_node) for m in matches], min_tokens=16)
    assert [(g.prefix_len, g.members) for g in groups] == [(99, (0, 1, 2))]


def test_system_prompts_make_one_group_each():
    rng = np.random.default_rng(0)
    systems = [rng.integers(1000, 2000, size=300) for _ in range(3)]
    prompts, owner = [], []
    for i in range(12):
        s = i % 3
        prompts.append(np.concatenate([systems[s], [3000 + i], rng.integers(1, 999, size=int(rng.integers(1, 20)))]))
        owner.append(s)
    order = rng.permutation(12)
    prompts = [prompts[i] for i in order]
    owner = [owner[i] for i in order]
    _, matches = _admit(prompts)
    paths = [node_path(m.last_node) for m in matches]
    groups = choose_prefix_groups(paths, min_tokens=64)
    assert sorted((g.prefix_len, tuple(owner[m] for m in g.members)) for g in groups) == [
        (300, (s,) * 4) for s in range(3)
    ]
    assert choose_prefix_groups(paths, min_tokens=301) == []  # below the threshold: nothing shared


def test_no_tree_no_groups():
    tree = RadixCache(TokenSlotAllocator(64), disable=True)
    paths = [node_path(tree.match_prefix([1, 2, 3]).last_node) for _ in range(3)]
    assert paths == [[], [], []]
    assert choose_prefix_groups(paths, min_tokens=1) == []


def test_group_locks_hold_the_shared_node():
    # Members lock their own last_node; that alone protects the shared node from eviction.
    prompts = [np.array([1] * 40 + [2, 3]), np.array([1] * 40 + [4])]
    tree, matches = _admit(prompts)
    (group,) = choose_prefix_groups([node_path(m.last_node) for m in matches], min_tokens=8)
    shared = node_path(matches[0].last_node)[0]
    assert group.prefix_len == len(shared) == 40 and shared.lock_ref == 2
    assert tree.evict(10**6) == 0
    tree.dec_lock_ref(matches[0].last_node)
    assert shared.lock_ref == 1 and tree.evict(10**6) == 2  # only the released request's own leaf


def test_tables_drive_the_grouped_kernel_to_the_plain_result():
    # The scheduler's view (tree slots + own slots in req_to_token rows) through group_tables into the kernel twin.
    rng = np.random.default_rng(1)
    system = rng.integers(1, 500, size=50)
    prompts = [np.concatenate([system, [600 + i], rng.integers(1, 500, size=5)]) for i in range(5)]
    prompts.append(rng.integers(1, 500, size=9))  # shares nothing
    tree, matches = _admit(prompts, num_slots=512)
    groups = choose_prefix_groups([node_path(m.last_node) for m in matches], min_tokens=16)
    assert [len(g.members) for g in groups] == [5]
    rows = [7, 2, 9, 0, 4, 11]
    table = torch.from_numpy(rng.integers(0, 512, size=(12, 80)).astype(np.int32))  # garbage beyond each length
    seq_lens = []
    for i, m in enumerate(matches):
        own = tree.allocator.alloc(3)  # two output tokens and the one being decoded
        slots = np.concatenate([m.slots, own])
        table[rows[i], : len(slots)] = torch.from_numpy(slots)
        seq_lens.append(len(slots))
    t = group_tables(groups, rows)
    assert t.group_member_start.tolist() == [0, 5] and t.req_group.tolist() == [0] * 5 + [-1]
    assert t.req_suffix_start.tolist() == [50] * 5 + [0]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(6, 4, 32, generator=gen)
    k_cache, v_cache = torch.randn(2, 513, 2, 32, generator=gen)
    ints = {name: torch.from_numpy(np.asarray(v)) for name, v in t._asdict().items()}
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    pools = torch.tensor(rows, dtype=torch.int32)
    out, expect = torch.empty_like(q), torch.empty_like(q)
    reference.decode_attention_grouped(
        q,
        k_cache,
        v_cache,
        out,
        table,
        pools,
        lens,
        sm_scale=0.2,
        max_seq_len=max(seq_lens),
        max_prefix_len=50,
        max_group_size=5,
        **ints,
    )
    reference.decode_attention(q, k_cache, v_cache, expect, table, pools, lens, 0.2, max(seq_lens))
    torch.testing.assert_close(out, expect, rtol=0, atol=1e-5)


_prompt_sets = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 12), st.lists(st.integers(1, 3), min_size=1, max_size=6)),
    min_size=1,
    max_size=6,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_prompt_sets, st.integers(0, 20))
def test_groups_share_their_prefix_and_are_optimal(specs, min_tokens):
    # Prompts = one of 4 "system prompts" cut to a random length + a short random tail: trees with nested,
    # partial and identical prefixes. A tiny alphabet makes accidental shared tails common too.
    systems = [np.arange(1, 13) * (s + 1) for s in range(4)]
    prompts = [np.concatenate([systems[s][:cut], tail]).astype(np.int32) for s, cut, tail in specs]
    _, matches = _admit(prompts)
    paths = [node_path(m.last_node) for m in matches]
    groups = choose_prefix_groups(paths, min_tokens)
    _check_groups(groups, prompts, matches, min_tokens)
    assert _saved(groups) == _brute_force_saved(paths, min_tokens)
    t = group_tables(groups, list(range(len(prompts))))
    for g, group in enumerate(groups):
        members = t.group_members[t.group_member_start[g] : t.group_member_start[g + 1]].tolist()
        assert members == list(group.members) and all(t.req_group[m] == g for m in members)
    assert (t.req_group >= 0).sum() == sum(len(g.members) for g in groups)


def test_a_large_batch_groups_by_its_system_prompts():
    """256 running requests over 16 system prompts: 16 groups of 16. (Its time per step is a benchmark's figure:
    `python -m bench.scheduler_bench` prints it.)"""
    rng = np.random.default_rng(2)
    systems = [rng.integers(1000, 2000, size=200) for _ in range(16)]
    prompts = [np.concatenate([systems[i % 16], [5000 + i], rng.integers(1, 999, size=30)]) for i in range(256)]
    _, matches = _admit(prompts, num_slots=20000)
    groups = choose_prefix_groups([node_path(m.last_node) for m in matches], min_tokens=64)
    assert len(groups) == 16 and all(len(g.members) == 16 for g in groups)
    assert sorted(m for g in groups for m in g.members) == list(range(256))


def test_group_tables_of_a_small_batch():
    """Every table of group_tables, written out, and the request in two groups it refuses."""
    groups = [PrefixGroup(7, (0, 3)), PrefixGroup(5, (1, 2, 5))]
    t = group_tables(groups, [40, 41, 42, 43, 44, 45])
    expected = {
        "group_prefix_lens": [7, 5],
        "group_prefix_rows": [40, 41],
        "group_member_start": [0, 2, 5],
        "group_members": [0, 3, 1, 2, 5],
        "req_group": [0, 1, 1, 0, -1, 1],
        "req_suffix_start": [7, 5, 5, 7, 0, 5],
    }
    assert {name: getattr(t, name).tolist() for name in expected} == expected
    assert all(array.dtype == np.int32 for array in t)
    assert [array.tolist() for array in group_tables([], [40, 41])] == [[], [], [0], [], [-1, -1], [0, 0]]
    with pytest.raises(ValueError, match="two groups"):
        group_tables([PrefixGroup(7, (0, 3)), PrefixGroup(5, (3, 4))], [40, 41, 42, 43, 44])
