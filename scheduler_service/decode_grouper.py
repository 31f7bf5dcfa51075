"""The shared-prefix groups of each step's decodes (prefix_groups.py says what a group is and chooses them), kept
from step to step and brought up to date by what changed.

The search is cut into independent problems. A group's node is at least min_tokens deep, so the first node that deep
on a request's path (its anchor) decides which requests it can ever share with: those through the same anchor (a
path through a node below the anchor runs through the anchor). Each anchor's requests are one _Subtree, solved alone
by the rule (_Subtree.solve): nodes one member passes through can host no group and that member may as well end
above them, so each path is cut after its last node that two members pass through; when every cut path ends at the
same node the subtree is one group there, otherwise choose_prefix_groups searches it. Without the cuts the search
was ~10x slower for 256 requests.

From step to step (DecodeGrouper.groups):
- the same decodes with the same locked nodes: last step's groups. A node split since by another insert leaves each
  member's path at the same tokens, and the answer the same: the new upper node has the members of the node it was
  cut from and, shallower, never hosts a group where that node could.
- requests joined or left (an admission or a finish: most steps at a steady arrival rate): only their subtrees
  change. A changed subtree is one group of all its members at its top (the deepest node they all pass through)
  when what they share below the top is too little to pay for a group of its own (_Subtree.one_group proves it);
  that is the usual case, a system prompt with each request's own tokens below it and a few short branches
  between them. Otherwise the rule solves it again. The other subtrees keep their answers, renumbered: a member is
  an index into decodes, and a request that left shifts the ones after it.
- a split since the kept paths were read (TreeNode.splits; the grouper has only nodes, no tree): every kept path is
  read again, and each subtree with one that changed is taken apart and built again from the new paths.
A grouper with nothing kept (a new one) solves every subtree by the rule: the search from scratch, which the answers
kept and updated must always equal (tests/scheduler/test_decode_grouper_incremental.py).
"""

from __future__ import annotations

import bisect
from itertools import compress, filterfalse, repeat
from operator import attrgetter, is_not
from typing import Sequence

from radixserve.cache.tree_node import TreeNode
from scheduler_service.prefix_groups import PrefixGroup, choose_prefix_groups, node_path

_last_node = attrgetter("last_node")
_ONE_GROUP = "one group"  # a subtree's answer: all its members, one group at its top
_NOT_KEPT = object()  # the node a request the grouper does not know was placed with


class _Subtree:
    """The decodes whose paths pass through one anchor, and their groups."""

    __slots__ = ("members", "paths", "visits", "top", "top_depth", "shared_tokens", "answer")

    def __init__(self):
        self.members: list = []  # requests, in batch order
        self.paths: dict = {}  # request -> node_path of its last_node
        self.visits: dict = {}  # node -> members whose paths pass through it (>= 1)
        self.top = None  # the deepest node every member passes through
        self.top_depth = 0  # its depth in tokens
        self.shared_tokens = 0  # sum over nodes two or more members pass through of members x tokens
        # _ONE_GROUP, the groups the rule found (members as positions in self.members), or None: to be solved.
        self.answer: str | list[PrefixGroup] | None = None

    def add(self, req, path: list, index: dict) -> None:
        """A member joins (index: request -> position in this step's decodes)."""
        bisect.insort(self.members, req, key=index.__getitem__)
        self.paths[req] = path
        for node in path:
            visits = self.visits.get(node, 0)
            self.visits[node] = visits + 1
            self.shared_tokens += len(node) * (2 if visits == 1 else visits > 1)
        if len(self.members) == 1:
            self.top, self.top_depth = path[-1], sum(map(len, path))
        elif self.top not in path:  # the top moves up to where the new path leaves it
            k = len(path) - 1
            while self.visits[path[k]] < len(self.members):
                k -= 1
            self.top, self.top_depth = path[k], sum(map(len, path[: k + 1]))

    def remove(self, req) -> None:
        self.members.remove(req)
        for node in self.paths.pop(req):
            visits = self.visits.pop(node)
            if visits > 1:
                self.visits[node] = visits - 1
            self.shared_tokens -= len(node) * (2 if visits == 2 else visits > 2)
        if self.members:  # the top moves down while every member left goes on through one node
            path = self.paths[self.members[0]]
            k = path.index(self.top)
            while k + 1 < len(path) and self.visits[path[k + 1]] == len(self.members):
                k += 1
                self.top_depth += len(path[k])
            self.top = path[k]

    def one_group(self) -> bool:
        """Whether the best choice is, with no search, one group of all n members at the top.

        Proof. Write d for the top's depth (>= min_tokens: the top is at or below the anchor) and c_m for the depth
        at which member m's path leaves the nodes two members pass through (c_m >= d). The test is W < d, where
        W = sum over m of (c_m - d) = shared_tokens - n x d. A choice of groups saves the sum over its groups g of
        (|g| - 1) x d_g, d_g the depth of g's node. A node above the top has d_g < d; the top, d; a node below it has
        d_g <= c_m for each of g's members, so (|g| - 1) x (d_g - d) <= the sum over them of (c_m - d), and over all
        groups below the top, at most W < d. So k groups holding m members save at most (m - k) x d, plus less than
        d if a group is below the top. Without one below, that is at most (n - 1) x d, reached only by one group of
        all n at the top. With one, it is less than (m - k + 1) x d <= (n - 1) x d: either k >= 2, or the one group
        is below the top and leaves a member out (no node below the top has them all). One group of all n at the
        top is the one best choice, and the exact search returns it."""
        n = len(self.members)
        return n >= 2 and self.shared_tokens < (n + 1) * self.top_depth

    def renumber(self, index: dict) -> list[int]:
        """The members' positions in this step's decodes, ascending. A batch whose requests changed order re-sorts
        them, and an answer of the rule, which depends on that order, is solved again."""
        at = list(map(index.__getitem__, self.members))
        if at != sorted(at):
            self.members.sort(key=index.__getitem__)
            if self.answer is not _ONE_GROUP:
                self.answer = None
            at.sort()
        return at

    def solve(self, min_tokens: int) -> None:
        """The rule: the answer from the members' paths alone (two or more members)."""
        cut_paths = []
        for req in self.members:
            path = self.paths[req]
            cut = len(path)
            while cut and self.visits[path[cut - 1]] < 2:
                cut -= 1
            cut_paths.append(path[:cut])
        last = cut_paths[0][-1]
        if all(path[-1] is last for path in cut_paths):  # one system prompt, nothing deeper
            self.answer = [PrefixGroup(sum(map(len, cut_paths[0])), tuple(range(len(cut_paths))))]
        else:
            self.answer = choose_prefix_groups(cut_paths, min_tokens)


class DecodeGrouper:
    """The groups of a batch's decodes, step after step (the module's docstring says how)."""

    def __init__(self, min_tokens: int):
        self.min_tokens = min_tokens
        self._decodes: list = []  # last step's decodes
        self._nodes: list = []  # their last_nodes
        self._groups: list[PrefixGroup] = []  # their groups
        self._node_of: dict = {}  # each of those requests -> the last_node it was placed with
        self._anchor_of: dict = {}  # and -> its anchor, None for a request that can join no group
        self._subtrees: dict = {}  # anchor -> _Subtree of those decodes
        self._shared: dict = {}  # the subtrees of two or more (the only ones with groups)
        self._splits = TreeNode.splits  # when the kept paths were read
        self.searches = 0  # how often the groups were worked out again, from scratch or not (tests and benchmarks)
        self.full_searches = 0  # of which from scratch

    def groups(self, decodes: Sequence) -> list[PrefixGroup]:
        """Groups among decodes (requests, hashed by identity, with last_node and tree_len, the length of their
        path); members are indices into decodes. The same list object while nothing changed."""
        decodes = list(decodes)
        nodes = list(map(_last_node, decodes))
        if nodes == self._nodes and decodes == self._decodes:
            return self._groups
        self.searches += 1
        from_scratch = not self._node_of
        self.full_searches += from_scratch
        index = dict(zip(decodes, range(len(decodes))))
        leaving, joining = self._changes(decodes, nodes, index)
        changed = {}  # anchor -> its subtree, for those a request left or joined
        for req in leaving:
            self._leave(req, changed)
        for req in joining:
            self._join(req, nodes[index[req]], index, changed)
        for anchor, subtree in changed.items():
            subtree.answer = _ONE_GROUP if not from_scratch and subtree.one_group() else None
            if len(subtree.members) >= 2:
                self._shared[anchor] = subtree
            else:
                self._shared.pop(anchor, None)
        self._decodes, self._nodes = decodes, nodes
        self._groups = self._collect(index)
        return self._groups

    def _changes(self, decodes: list, nodes: list, index: dict) -> tuple[set, list]:
        """The requests to take out of the kept state and those to place in it: new ones; ones placed with another
        node than they hold now (out, then in again); ones gone; after a split, every member of a subtree where a
        kept path changed (out, then in again with its new path). A few passes over the batch in C, then work in
        proportion to these."""
        placed_with = map(self._node_of.get, decodes, repeat(_NOT_KEPT))
        joining = list(compress(decodes, map(is_not, placed_with, nodes)))
        leaving = set(filter(self._node_of.__contains__, joining))
        if len(self._node_of) - len(leaving) > len(decodes) - len(joining):  # not every request kept is here
            leaving.update(filterfalse(index.__contains__, self._decodes))
        taken_apart = self._split_apart()
        joining += [req for req in taken_apart if req in index and req not in leaving]
        return leaving | taken_apart, joining

    def _split_apart(self) -> set:
        """After a split: the members of every subtree through which a kept path now runs otherwise."""
        if TreeNode.splits == self._splits:
            return set()
        self._splits = TreeNode.splits
        reqs = set()
        for subtree in self._subtrees.values():
            if any(node_path(path[-1]) != path for path in subtree.paths.values()):
                reqs.update(subtree.members)
        return reqs

    def _leave(self, req, changed: dict) -> None:
        del self._node_of[req]
        anchor = self._anchor_of.pop(req)
        if anchor is not None:
            subtree = changed[anchor] = self._subtrees[anchor]
            subtree.remove(req)
            if not subtree.members:  # (one taken apart after a split is built anew, from nothing)
                del self._subtrees[anchor]

    def _join(self, req, last_node, index: dict, changed: dict) -> None:
        """Place a request: its path and its anchor, the first node of the path at least min_tokens deep (none: no
        lock, or a prefix too short for any group)."""
        path, anchor = None, None
        if last_node is not None and req.tree_len >= self.min_tokens:
            path, depth = node_path(last_node), 0
            for node in path:
                depth += len(node)
                if depth >= self.min_tokens:
                    anchor = node
                    break
        self._node_of[req], self._anchor_of[req] = last_node, anchor
        if anchor is not None:
            if anchor not in self._subtrees:
                self._subtrees[anchor] = _Subtree()
            changed[anchor] = self._subtrees[anchor]
            changed[anchor].add(req, path, index)

    def _collect(self, index: dict) -> list[PrefixGroup]:
        """Every subtree's groups, in this step's numbering, by first member."""
        groups = []
        for subtree in self._shared.values():
            at = subtree.renumber(index)
            if subtree.answer is None:
                subtree.solve(self.min_tokens)
            if subtree.answer is _ONE_GROUP:
                groups.append(PrefixGroup(subtree.top_depth, tuple(at)))
            else:
                groups += [PrefixGroup(g.prefix_len, tuple(map(at.__getitem__, g.members))) for g in subtree.answer]
        groups.sort(key=_first_member)
        return groups


def _first_member(group: PrefixGroup) -> int:
    return group.members[0]
