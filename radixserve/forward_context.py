"""The batch layout of the forward in flight, set by the model runner and read by the attention layers, so that
model forward signatures stay (input_ids, positions)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.protocol import PrefixGroups, unpack_i32


@dataclass
class DecodeGroups:
    """kernels.decode_attention_grouped's group tables for the decode part of the batch (request indices count
    from the first decode). Eight int32 views of one flat tensor, so that a step moves them in one copy."""

    prefix_lens: torch.Tensor  # [G]
    prefix_rows: torch.Tensor  # [G]
    member_start: torch.Tensor  # [G + 1]
    members: torch.Tensor  # [D]: the first member_start[G] are used
    req_group: torch.Tensor  # [D]
    req_suffix_start: torch.Tensor  # [D]
    live_groups: torch.Tensor  # [1]: how many groups are real (the first ones); the rest pads a CUDA graph's table
    prefix_splits: torch.Tensor  # [1]: slices per prefix this step, chosen by the host from the real groups
    max_prefix_len: int  # bounds every prefix_lens[g] (a constant under CUDA graphs)
    max_group_size: int  # bounds every group's size (likewise)
    max_prefix_splits: int  # bounds prefix_splits (likewise: the kernels' grid)

    @staticmethod
    def flat_size(num_groups: int, num_decodes: int) -> int:
        return 3 * num_groups + 1 + 3 * num_decodes + 2

    @classmethod
    def view(
        cls,
        flat: torch.Tensor,
        num_groups: int,
        num_decodes: int,
        max_prefix_len: int,
        max_group_size: int,
        max_prefix_splits: int,
    ) -> "DecodeGroups":
        g, d = num_groups, num_decodes
        parts = flat[: cls.flat_size(g, d)].split([g, g, g + 1, d, d, d, 1, 1])
        return cls(
            *parts, max_prefix_len=max_prefix_len, max_group_size=max_group_size, max_prefix_splits=max_prefix_splits
        )


def pack_decode_groups(
    groups: PrefixGroups,
    num_extend: int,
    num_groups: int | None = None,
    num_decodes: int | None = None,
    slices: Callable[[int, int, int], int] | None = None,
    *,
    decodes: tuple[np.ndarray, np.ndarray] | None = None,
    lone_min_tokens: int = 0,
) -> tuple[np.ndarray, int, int]:
    """The flat int32 layout DecodeGroups.view reads, from the batch's PrefixGroups; the decode part starts at batch
    index num_extend. num_groups / num_decodes pad it to a captured graph's shape: padding groups are empty, after the
    live ones whose count the table carries (the prefix kernel visits those only), and padding requests are in no
    group. slices(groups, largest group, longest prefix) gives the step's slices per prefix from the real groups (the
    model's kernels.prefix_slices; default 1). decodes, the decodes' req_to_token rows and sequence lengths, and
    lone_min_tokens > 0 make lone decodes groups of their own (lone_decode_groups). Returns (flat, max prefix
    length, largest group)."""
    prefix_lens, prefix_rows = unpack_i32(groups.prefix_lens), unpack_i32(groups.prefix_rows)
    req_group = unpack_i32(groups.req_group)[num_extend:]
    suffix_start = unpack_i32(groups.req_suffix_start)[num_extend:]
    if lone_min_tokens > 0 and decodes is not None and len(prefix_lens):
        room = (num_groups or len(req_group)) - len(prefix_lens)
        prefix_lens, prefix_rows, req_group, suffix_start = lone_decode_groups(
            prefix_lens, prefix_rows, req_group, suffix_start, *decodes, lone_min_tokens, room
        )
    g, d = len(prefix_lens), len(req_group)
    gp, dp = num_groups or g, num_decodes or d
    if gp < g or dp < d:
        raise ValueError(f"{g} groups over {d} decodes do not fit a table of {gp} groups over {dp} decodes")
    grouped = np.flatnonzero(req_group >= 0)
    members = grouped[np.argsort(req_group[grouped], kind="stable")]  # by group, batch order inside one
    sizes = np.bincount(req_group[grouped], minlength=g)
    flat = np.zeros(DecodeGroups.flat_size(gp, dp), dtype=np.int32)
    lens, rows, start, member_list, req_groups, suffixes = np.split(flat, np.cumsum([gp, gp, gp + 1, dp, dp])[:5])
    lens[:g], rows[:g] = prefix_lens, prefix_rows
    start[1 : g + 1] = np.cumsum(sizes)
    start[g + 1 :] = len(members)
    member_list[: len(members)] = members
    req_groups[:] = -1
    req_groups[:d], suffixes[:d] = req_group, suffix_start
    max_prefix_len, max_group_size = int(prefix_lens.max(initial=0)), int(sizes.max(initial=0))
    flat[-2] = g
    flat[-1] = slices(g, max_group_size, max_prefix_len) if slices is not None and g else 1
    return flat, max_prefix_len, max_group_size


def batch_decode_groups(
    groups: PrefixGroups | None,
    num_extend: int,
    rows: np.ndarray,
    seq_lens: np.ndarray,
    pack: Callable,
    to_device: Callable[[np.ndarray], torch.Tensor],
    mixed_min_saved_tokens: int = 0,
) -> DecodeGroups | None:
    """An eager step's DecodeGroups (None without groups: the plain kernel): its table packed by pack
    (pack_decode_groups with the model's slices and lone-decode rule) from the batch's groups, rows and sequence
    lengths, in one copy (to_device). The table's group count is its own: the batch's groups and any lone decodes made
    groups of one.

    A step with prompt chunks (num_extend > 0) keeps its groups only when they spare reading mixed_min_saved_tokens
    context tokens or more (saved_context_tokens). Why: such a step runs attention eagerly between its prefill graph
    pieces, and at serving loads it is bound by the host's launches, where the grouped path's table and kernels cost
    more than the prefix reads they spare (bench/results/mixed-step-groups-h200.md)."""
    if groups is None or (num_extend and saved_context_tokens(groups, num_extend) < mixed_min_saved_tokens):
        return None
    decodes = (rows[num_extend:], seq_lens[num_extend:])
    flat, max_prefix_len, max_group_size = pack(groups, num_extend, decodes=decodes)
    return DecodeGroups.view(
        to_device(flat), int(flat[-2]), len(decodes[0]), max_prefix_len, max_group_size, max_prefix_splits=int(flat[-1])
    )


def saved_context_tokens(groups: PrefixGroups, num_extend: int) -> int:
    """Context tokens the decodes' groups spare reading: each group's prefix read once instead of once a member."""
    prefix_lens = unpack_i32(groups.prefix_lens).astype(np.int64)
    req_group = unpack_i32(groups.req_group)[num_extend:]
    members = np.bincount(req_group[req_group >= 0], minlength=len(prefix_lens))
    return int((prefix_lens * np.maximum(members - 1, 0)).sum())


def lone_decode_groups(prefix_lens, prefix_rows, req_group, suffix_start, rows, seq_lens, min_tokens: int, room: int):
    """The group tables with each decode in no group whose context before its new token is min_tokens or longer
    made a group of its own, its prefix that context (up to room of them, the longest first).

    Why: in a grouped step a decode in no group reads its whole context in the suffix kernel, whose programs are
    sized for members' own tokens (one warp, 16-token blocks) and whose grid gives each request 1-2 of them per KV
    head at serving batch sizes: a lone request of 2,000 tokens walks ~100 blocks in turn while the step's other
    programs are done after a few. As a group of one its context is read by the prefix kernel, sliced over the SMs
    like any shared prefix, and the suffix kernel reads the new token alone."""
    lone = np.flatnonzero((req_group < 0) & (seq_lens - 1 >= min_tokens))
    if len(lone) > room:
        lone = np.sort(lone[np.argsort(-seq_lens[lone], kind="stable")[: max(room, 0)]])
    if not len(lone):
        return prefix_lens, prefix_rows, req_group, suffix_start
    contexts = (seq_lens[lone] - 1).astype(np.int32)
    req_group, suffix_start = req_group.copy(), suffix_start.copy()
    req_group[lone] = len(prefix_lens) + np.arange(len(lone), dtype=np.int32)
    suffix_start[lone] = contexts
    prefix_lens = np.concatenate([prefix_lens, contexts])
    prefix_rows = np.concatenate([prefix_rows, np.asarray(rows, dtype=np.int32)[lone]])
    return prefix_lens, prefix_rows, req_group, suffix_start


@dataclass
class ForwardContext:
    """Requests [0, num_extend_reqs) compute prompt chunks (the extend kernel); the rest are decodes, one token over
    a cached context each, which the split-KV decode kernel does several times faster than the extend kernel. The
    scheduler puts decodes last, so one split point suffices."""

    num_extend_reqs: int
    num_extend_tokens: int
    req_to_token: torch.Tensor  # int32 [rows, context_len]
    req_pool_indices: torch.Tensor  # int32 [B]
    prefix_lens: torch.Tensor  # int32 [B]: tokens already in the KV cache before this step
    extend_lens: torch.Tensor  # int32 [B]: new tokens this step
    extend_start_loc: torch.Tensor  # int32 [B]: row of each request's first new token in the flat batch
    seq_lens: torch.Tensor  # int32 [B]: prefix + extend
    out_cache_loc: torch.Tensor  # int32 [T]: KV slot of each new token
    max_extend_len: int  # over the extend requests
    max_seq_len: int  # over the decode requests
    # Decodes that share a prefix read it once for the group (kernels.decode_attention_grouped); None: none do.
    decode_groups: DecodeGroups | None = None

    @property
    def plain_decode(self) -> bool:
        """Every token a request's decode (a prefill graph's capture has tokens but no requests), none grouped."""
        return (
            self.num_extend_tokens == 0
            and self.seq_lens.shape[0] == self.out_cache_loc.shape[0] > 0
            and self.decode_groups is None
        )


_current: ForwardContext | None = None


def set_forward_context(ctx: ForwardContext | None) -> None:
    global _current
    _current = ctx


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention called outside a model-runner forward")
    return _current
