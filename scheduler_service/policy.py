"""Order of the waiting queue: longest cached prefix first (LPM) while the queue is short, plain FCFS when it is
long (matching every waiting prompt each step would cost more than it saves), and aged requests always first so
a cache miss cannot be starved by a stream of cache hits.

Fairness between requests: that order is then dealt round-robin over request groups (the sequences of one HTTP
request, whose rids are f"{request_id}-{index}"): each group's first sequence in the order, then each group's
second, and so on, groups taken in the order their first sequence appears. A request with 1,000 prompts therefore
gets one admission slot per round like any other request instead of holding everyone behind it; within a group,
and between single-sequence requests, the LPM / FCFS / aging order above is unchanged.

Priorities (--enable-priority-scheduling): the requests' `priority` field orders the queue first, higher values
first (SGLang's convention); the order above only breaks ties, and request groups take turns only among requests of
equal priority. The aging bound still holds: a request waiting more than --max-wait-steps steps (or retracted) goes
before every fresher one whatever the priorities, so a stream of high-priority work delays a low-priority request
by that many steps at most, never forever."""

from __future__ import annotations

from collections import deque

from radixserve.cache.radix_cache import RadixCache
from radixserve.config import ServerArgs
from scheduler_service.request import Req

LPM_MAX_QUEUE = 128


def order_waiting_queue(
    waiting: deque[Req], tree: RadixCache, args: ServerArgs, step: int, matches: dict | None = None
) -> list[Req]:
    """The waiting queue in admission order. matches: filled with id(req) -> (its MatchResult, the tree's
    evicted_tokens when it was taken) for each request that LPM matched, so that admission can reuse the match while
    nothing has been evicted since (a split keeps the node a match ends at: radixserve/cache/tree_node.split_node)."""
    ordered = _policy_order(waiting, tree, args, step, matches)
    if not args.enable_priority_scheduling:
        return interleave_request_groups(ordered)
    return [req for level in _priority_levels(ordered, args, step) for req in interleave_request_groups(level)]


def _is_aged(req: Req, args: ServerArgs, step: int) -> bool:
    return step - req.arrival_step > args.max_wait_steps or req.retractions > 0


def _priority_levels(ordered: list[Req], args: ServerArgs, step: int) -> list[list[Req]]:
    """`ordered` split by admission rank: aged requests first (in `ordered`'s order), then one list per priority,
    highest first, each in `ordered`'s order."""
    levels: dict[tuple, list[Req]] = {}
    for req in ordered:
        key = (0, 0) if _is_aged(req, args, step) else (1, -req.priority)
        levels.setdefault(key, []).append(req)
    return [levels[key] for key in sorted(levels)]


def request_group(rid: str) -> str:
    """The request a sequence belongs to: its rid without the final -<index> (a rid without one is its own)."""
    group, dash, _ = rid.rpartition("-")
    return group if dash else rid


def interleave_request_groups(ordered: list[Req]) -> list[Req]:
    """Round-robin over request groups, keeping `ordered`'s order within each group and among groups' heads."""
    turn_in_group: dict[str, int] = {}
    group_rank: dict[str, int] = {}
    keys = []
    for position, req in enumerate(ordered):
        group = request_group(req.rid)
        turn = turn_in_group.get(group, 0)
        turn_in_group[group] = turn + 1
        rank = group_rank.setdefault(group, len(group_rank))
        keys.append((turn, rank, position))
    if len(group_rank) <= 1:
        return ordered  # one request (or none): nothing to share
    return [ordered[position] for _, _, position in sorted(keys)]


def _policy_order(
    waiting: deque[Req], tree: RadixCache, args: ServerArgs, step: int, matches: dict | None
) -> list[Req]:
    if args.schedule_policy == "fcfs" or len(waiting) > LPM_MAX_QUEUE or tree.disable:
        return list(waiting)
    aged = [r for r in waiting if _is_aged(r, args, step)]
    if len(aged) == len(waiting):
        return aged
    aged_ids = {id(r) for r in aged}
    fresh = [r for r in waiting if id(r) not in aged_ids]
    matches = {} if matches is None else matches
    for r in fresh:
        matches[id(r)] = (
            tree.match_prefix(r.fill_ids()[:-1], namespace=r.cache_salt, record_hit=False),
            tree.evicted_tokens,
        )
    # sorted() is stable, so requests with equally long cached prefixes keep their arrival order.
    fresh.sort(key=lambda r: -len(matches[id(r)][0].slots))
    return aged + fresh
