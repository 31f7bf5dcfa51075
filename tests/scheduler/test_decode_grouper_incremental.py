"""DecodeGrouper kept from step to step (scheduler_service/decode_grouper.py) answers exactly what a new one, which
searches from scratch, answers for the same decodes: the same groups, members, prefix_len and order, at every step
of random churn over a real radix tree. The churn: requests admitted (under several system prompts, on deeper
shared branches, or on prompts too short for any group) and finished, inserts that split nodes on running paths,
requests whose locked node moves deeper, retraction and readmission, a reordered batch, eviction, steps with no
change."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.slot_allocator import TokenSlotAllocator
from radixserve.sampling import SamplingParams
from scheduler_service.decode_grouper import DecodeGrouper
from scheduler_service.prefix_groups import choose_prefix_groups, node_path
from scheduler_service.request import Req

SYSTEMS = [np.arange(1, 13) * 10 + s for s in range(3)]  # three 12-token system prompts, no token in common


class Batch:
    """Running requests over one tree, changed the way the scheduler changes them."""

    def __init__(self):
        self.tree = RadixCache(TokenSlotAllocator(1 << 16))
        self.running: list[Req] = []
        self.made = 0

    def _cache(self, tokens) -> None:
        tokens = np.asarray(tokens, dtype=np.int32)
        self.tree.insert(tokens, self.tree.allocator.alloc(len(tokens)))

    def admit(self, system: int, cut: int, tail: list[int], at: int, req: Req | None = None) -> None:
        prompt = np.concatenate([SYSTEMS[system][:cut], tail]).astype(np.int32)
        self._cache(prompt)  # its prompt computed and inserted (it may split a node another request runs through)
        match = self.tree.match_prefix(prompt)
        self.tree.inc_lock_ref(match.last_node)
        if req is None:
            req = Req(f"r{self.made}", prompt, SamplingParams(max_new_tokens=4))
            self.made += 1
        req.last_node, req.tree_len = match.last_node, len(match.slots)
        self.running.insert(at % (len(self.running) + 1), req)

    def finish(self, at: int, output: list[int]) -> Req:
        req = self.running.pop(at % len(self.running))
        if output:  # its output into the tree below its prefix, as Endings does
            tokens = np.asarray(output, dtype=np.int32)
            self.tree.insert_below(req.last_node, tokens, self.tree.allocator.alloc(len(tokens)))
        self.tree.dec_lock_ref(req.last_node)
        req.last_node, req.tree_len = None, 0
        return req

    def extend(self, at: int, tokens: list[int]) -> None:
        """A running request's lock moves down to a node it now ends at (results.ResultProcessor._cache_chunk)."""
        req = self.running[at % len(self.running)]
        tokens = np.asarray(tokens, dtype=np.int32)
        match = self.tree.insert_below(req.last_node, tokens, self.tree.allocator.alloc(len(tokens)))
        self.tree.inc_lock_ref(match.last_node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node, req.tree_len = match.last_node, req.tree_len + len(tokens)


_tails = st.lists(st.integers(1, 3), min_size=0, max_size=6)  # a small alphabet: branches shared two or more deep
_steps = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(0, 2), st.integers(0, 12), _tails, st.integers(0, 99)),
        st.tuples(st.just("finish"), st.integers(0, 99), _tails),
        st.tuples(st.just("split"), st.integers(0, 2), st.integers(1, 12), _tails),
        st.tuples(st.just("extend"), st.integers(0, 99), st.lists(st.integers(1, 3), min_size=1, max_size=3)),
        st.tuples(st.just("readmit"), st.integers(0, 99), st.integers(0, 2), st.integers(0, 12), _tails),
        st.tuples(st.just("reorder"), st.randoms(use_true_random=False)),
        st.tuples(st.just("evict"), st.integers(1, 40)),
        st.tuples(st.just("same")),
    ),
    min_size=1,
    max_size=40,
)


def _apply(batch: Batch, step: tuple) -> None:
    kind, *args = step
    if kind == "admit":
        batch.admit(*args)
    elif kind == "finish" and batch.running:
        batch.finish(*args)
    elif kind == "split":  # another prompt, diverging inside a node (no request of its own)
        system, cut, tail = args
        batch._cache(np.concatenate([SYSTEMS[system][:cut], [7], tail]))
    elif kind == "extend" and batch.running:
        batch.extend(*args)
    elif kind == "readmit" and batch.running:  # retracted, then admitted again: same request, another node
        at, system, cut, tail = args
        batch.admit(system, cut, tail, at, batch.finish(at, []))
    elif kind == "reorder":
        args[0].shuffle(batch.running)
    elif kind == "evict":
        batch.tree.evict(args[0])


def _saved(groups) -> int:
    return sum((len(g.members) - 1) * g.prefix_len for g in groups)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(0, 2), st.integers(0, 12), _tails), min_size=0, max_size=10),
    _steps,
    st.integers(0, 14),
)
def test_kept_groups_equal_a_search_from_scratch_at_every_step(first, steps, min_tokens):
    batch = Batch()
    for system, cut, tail in first:
        batch.admit(system, cut, tail, len(batch.running))
    kept = DecodeGrouper(min_tokens)
    for step in [("same",), *steps]:
        _apply(batch, step)
        decodes = list(batch.running)
        groups = kept.groups(decodes)
        fresh = DecodeGrouper(min_tokens).groups(decodes)
        assert [(g.prefix_len, g.members) for g in groups] == [(g.prefix_len, g.members) for g in fresh], step
        # and the search from scratch is the best choice over the whole paths
        assert _saved(fresh) == _saved(choose_prefix_groups([node_path(r.last_node) for r in decodes], min_tokens))
    batch.tree.check_invariants()


def test_a_steady_batch_is_never_searched_from_scratch_again():
    """Requests coming and going under system prompts, no split: one search from scratch, then updates alone."""
    rng = np.random.default_rng(0)
    batch = Batch()
    for i in range(12):
        batch.admit(i % 3, 12, [100 + i], len(batch.running))
    grouper = DecodeGrouper(8)
    grouper.groups(list(batch.running))
    for i in range(12, 60):
        batch.finish(int(rng.integers(0, len(batch.running))), [])
        batch.admit(i % 3, 12, [100 + i], len(batch.running))  # its own first token: it splits no node
        groups = grouper.groups(list(batch.running))
        assert groups == DecodeGrouper(8).groups(list(batch.running))
        assert groups and {g.prefix_len for g in groups} == {12}
    assert grouper.full_searches == 1 and grouper.searches == 49


@settings(max_examples=1500, deadline=None)
@given(st.integers(1, 12), st.lists(st.lists(st.integers(1, 2), max_size=14), min_size=2, max_size=7))
def test_one_group_without_a_search_only_where_the_search_finds_it(depth, tails):
    """The bound of _Subtree.one_group at its edge: one system prompt `depth` tokens long, branches below it shared
    by a few requests, a few tokens deep (the search picks them over one group when they are deep enough)."""
    batch = Batch()
    for tail in tails:
        batch.admit(0, depth, tail, len(batch.running))
    kept = DecodeGrouper(1)
    kept.groups(batch.running[:1])
    assert kept.groups(list(batch.running)) == DecodeGrouper(1).groups(list(batch.running))
