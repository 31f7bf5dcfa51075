"""DecodeGrouper, the scheduler's per-step grouping: it cuts the search down (nodes one request passes through,
subtrees below shallow nodes, single-node groups) and caches it while the decodes stay the same. The cuts must
not change the answer: it saves exactly what the exact search over the whole paths saves."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.slot_allocator import TokenSlotAllocator
from radixserve.sampling import SamplingParams
from scheduler_service.decode_grouper import DecodeGrouper
from scheduler_service.prefix_groups import choose_prefix_groups, node_path
from scheduler_service.request import Req


def running_requests(prompts):
    """Requests as the scheduler leaves them once decoding: prompt inserted, matched, last_node locked."""
    tree = RadixCache(TokenSlotAllocator(8192))
    for prompt in prompts:
        tree.insert(prompt, tree.allocator.alloc(len(prompt)))
    reqs = []
    for i, prompt in enumerate(prompts):
        match = tree.match_prefix(prompt)
        tree.inc_lock_ref(match.last_node)
        req = Req(f"r{i}", prompt, SamplingParams(max_new_tokens=4))
        req.last_node, req.tree_len = match.last_node, len(match.slots)
        reqs.append(req)
    return tree, reqs


def saved(groups):
    return sum((len(g.members) - 1) * g.prefix_len for g in groups)


_prompt_sets = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 12), st.lists(st.integers(1, 3), min_size=1, max_size=6)),
    min_size=1,
    max_size=8,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_prompt_sets, st.integers(1, 20))
def test_cut_search_saves_what_the_whole_search_saves(specs, min_tokens):
    systems = [np.arange(1, 13) * (s + 1) for s in range(4)]
    prompts = [np.concatenate([systems[s][:cut], tail]).astype(np.int32) for s, cut, tail in specs]
    _, reqs = running_requests(prompts)
    groups = DecodeGrouper(min_tokens).groups(reqs)
    assert saved(groups) == saved(choose_prefix_groups([node_path(r.last_node) for r in reqs], min_tokens))
    seen = set()
    for g in groups:
        assert len(g.members) >= 2 and g.prefix_len >= min_tokens and not seen & set(g.members)
        seen |= set(g.members)
        first = prompts[g.members[0]][: g.prefix_len]
        assert all(np.array_equal(prompts[m][: g.prefix_len], first) for m in g.members)
        assert all(reqs[m].tree_len >= g.prefix_len for m in g.members)


def test_search_runs_again_only_when_the_decodes_change():
    rng = np.random.default_rng(0)
    systems = [rng.integers(100, 900, 64) for _ in range(3)]
    prompts = [np.concatenate([systems[i % 3], rng.integers(100, 900, 5)]).astype(np.int32) for i in range(12)]
    tree, reqs = running_requests(prompts)
    grouper = DecodeGrouper(32)
    first = grouper.groups(reqs)
    assert sorted(len(g.members) for g in first) == [4, 4, 4] and {g.prefix_len for g in first} == {64}
    assert grouper.groups(list(reqs)) is first and grouper.searches == 1
    # A later insert splits a system prompt's node: same tokens, same groups (the paths gain a node).
    tree.insert(np.concatenate([systems[0][:40], [7, 7, 7]]).astype(np.int32), tree.allocator.alloc(43))
    assert grouper.groups(reqs) is first
    assert [(g.prefix_len, g.members) for g in DecodeGrouper(32).groups(reqs)] == [
        (g.prefix_len, g.members) for g in first
    ]
    fewer = grouper.groups(reqs[1:])
    assert grouper.searches == 2 and sorted(len(g.members) for g in fewer) == [3, 4, 4]
