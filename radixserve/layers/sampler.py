"""Token sampling on the logits of each request's last position: logit bias, penalties, grammar masks, temperature,
top-k, top-p, min-p, per-request seeds. Every row draws from p exactly by inverting its cumulative sum at one uniform
number: from the device's generator, or for a seeded request one computed on the host from (seed, position) alone.
(Seeded rows once ran an exponential race with a generator and a vocabulary of noise each: six launches per row and
step, which made a batch of 256 seeded requests host-bound on an H100.)

Every change to a row's logits looks only at that row's own request, so a request gets the same tokens whatever else
shares its batch (a constrained neighbour included)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.grammar import RequestGrammar, allocate_bitmask, apply_bitmask, fill_bitmasks
from radixserve.sampling import SamplingParams


@dataclass
class SamplingRequestState:
    """What the sampler keeps per running request (on the worker)."""

    params: SamplingParams
    eos_ids: list[int]
    num_outputs: int
    output_counts: torch.Tensor | None  # [V] int32 counts of generated tokens, only when penalties are asked for
    seen_mask: torch.Tensor | None  # [V] bool prompt+output tokens, only for the repetition penalty
    grammar: RequestGrammar | None = None  # structured output: which tokens may come next
    # logit_bias as (ids, values) tensors on the sampler's device, made on first use
    logit_bias_tensors: tuple[torch.Tensor, torch.Tensor] | None = None
    # params.prompt_logprobs: (position, log-softmax row) of a prefill chunk's last position, which predicts the next
    # chunk's first token (radixserve/worker/prompt_logprobs.py)
    prompt_logprob_carry: tuple[int, torch.Tensor] | None = None

    def __post_init__(self):
        # Greedy with nothing that edits the logits (a grammar or min_tokens may still, checked per step).
        p = self.params
        self.plain_greedy = (
            p.is_greedy
            and not p.logit_bias
            and self.output_counts is None
            and self.seen_mask is None
            and self.grammar is None
        )

    def on_sampled(self, token: int) -> None:
        """Record a token sampled for this request, once it is on the host (by every rank, so that all ranks stay
        in step). The penalty state on the device was updated at sampling already (record_on_device)."""
        self.num_outputs += 1
        if self.grammar is not None:
            self.grammar.accept(token)

    def record_on_device(self, token: torch.Tensor) -> None:
        """The penalty state's update for the token just sampled (token: a 1-element view of the sampled tokens on
        the device): queued behind the sampling, no host value needed, so no wait for the device (indexing with a
        Python int from the host would copy it there and wait)."""
        if self.output_counts is not None:
            self.output_counts.index_add_(0, token, torch.ones_like(token, dtype=self.output_counts.dtype))
        if self.seen_mask is not None:
            self.seen_mask.index_fill_(0, token, True)


def _seeded_uniform(seed: int, position: int) -> float:
    # The draw of a seeded request depends only on (seed, position), so a retracted and recomputed request, or the
    # same request in another batch, draws the same tokens.
    return random.Random((seed * 1_000_003 + position) & 0x7FFF_FFFF_FFFF_FFFF).random()


def _inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of probs ([B, V], rows summing to ~1): the first whose cumulative probability passes the
    row's uniform draw (uniforms [B] in [0, 1)). A token of probability 0 (banned, masked by a grammar, cut by top-k)
    has an empty interval; float rounding at the very top could still land on one, so such a pick falls back to the
    row's most likely token."""
    cdf = probs.cumsum(dim=-1)
    target = uniforms.unsqueeze(1) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[1] - 1)
    allowed = probs.gather(1, tokens) > 0
    return torch.where(allowed, tokens, probs.argmax(dim=-1, keepdim=True)).squeeze(1)


def _plain_upload(device: torch.device):
    return lambda array: torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, upload=None):
        """upload(np.ndarray) -> the array on the device, without waiting for the device: the worker passes its
        pinned staging (radixserve/worker/pinned_staging.py). torch.tensor(list, device=...) from pageable memory
        waits for every kernel queued before it, the forward included, so no per-row value goes that way."""
        self.vocab_size = vocab_size
        self.device = device
        self.upload = upload or _plain_upload(device)

    def __call__(
        self,
        logits: torch.Tensor,
        states: list[SamplingRequestState],
        positions: list[int],
        want_logprobs: bool | None = None,
    ):
        """logits [B, V] (any float dtype); positions: the position of the token being sampled, per row.
        Returns (token ids int64 [B], log-softmax of the raw logits or None). want_logprobs: whether to return the
        log-softmax (default: when a row asks for logprobs; a caller sampling a batch in parts asks for every part)."""
        params = [s.params for s in states]
        if want_logprobs is None:
            want_logprobs = any(p.logprobs is not None for p in params)
        if not want_logprobs and all(s.plain_greedy and s.num_outputs >= s.params.min_new_tokens for s in states):
            return logits.argmax(dim=-1), None  # (exact on the model's dtype: no float copy of [B, V] needed)
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        constrained = [i for i, s in enumerate(states) if s.grammar is not None and s.grammar.active]
        # min_tokens bans EOS with -inf, which can forbid every token the grammar allows (when only EOS may come): keep
        # those rows' raw logits to fall back on. Bias and penalties are finite and cannot do that.
        at_risk = [i for i in constrained if states[i].num_outputs < states[i].params.min_new_tokens]
        unbanned = logits[at_risk] if at_risk else None  # a copy (advanced indexing)
        self._apply_logit_bias(logits, states)
        logits = self._apply_penalties(logits, states)
        self._apply_grammars(logits, states, constrained, at_risk, unbanned)
        if all(p.is_greedy for p in params):
            return logits.argmax(dim=-1), raw_logprobs

        dev = logits.device
        temps = self.upload(np.array([p.temperature if not p.is_greedy else 1.0 for p in params], dtype=np.float32))
        probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
        probs = self._apply_top_k_top_p_min_p(probs, params, self.upload)
        uniforms = torch.rand(len(params), device=dev)
        seeded = [i for i, p in enumerate(params) if p.seed is not None and not p.is_greedy]
        if seeded:
            uniforms[self.upload(np.array(seeded, dtype=np.int64))] = self.upload(
                np.array([_seeded_uniform(params[i].seed, positions[i]) for i in seeded], dtype=np.float32)
            )
        tokens = _inverse_cdf_sample(probs, uniforms)
        greedy = self.upload(np.array([p.is_greedy for p in params], dtype=np.bool_))
        return torch.where(greedy, logits.argmax(dim=-1), tokens), raw_logprobs

    def _apply_logit_bias(self, logits: torch.Tensor, states: list[SamplingRequestState]) -> None:
        """Every biased row's bias in one scatter-add (a row's ids are distinct, so the sum is exact)."""
        rows = [i for i, s in enumerate(states) if s.params.logit_bias]
        if not rows:
            return
        row_index, ids, values = [], [], []
        for i in rows:
            s = states[i]
            if s.logit_bias_tensors is None:
                token_ids, biases = zip(*s.params.logit_bias.items())
                s.logit_bias_tensors = (
                    self.upload(np.array(token_ids, dtype=np.int64)),
                    self.upload(np.array(biases, dtype=np.float32)),
                )
            row_ids, row_values = s.logit_bias_tensors
            row_index.append(torch.full_like(row_ids, i))
            ids.append(row_ids)
            values.append(row_values)
        logits.index_put_((torch.cat(row_index), torch.cat(ids)), torch.cat(values).to(logits.dtype), accumulate=True)

    def _apply_grammars(
        self,
        logits: torch.Tensor,
        states: list[SamplingRequestState],
        rows: list[int],
        at_risk: list[int],
        unbanned: torch.Tensor | None,
    ) -> None:
        """Forbid, in the constrained rows only, every token the row's grammar does not allow next."""
        if not rows:
            return
        bitmask = allocate_bitmask(len(states), logits.shape[1])
        fill_bitmasks([states[i].grammar for i in rows], bitmask, rows)
        apply_bitmask(logits, bitmask, rows)
        if not at_risk:
            return
        # A row with nothing left to sample: the grammar wins over min_tokens, since a reply that breaks the grammar
        # is of no use. It samples from its raw logits, masked by the grammar alone (usually only EOS is left).
        dead = torch.isneginf(logits[at_risk].amax(dim=-1)).nonzero().flatten().tolist()
        if dead:
            dead_rows = [at_risk[j] for j in dead]
            fallback = unbanned[dead]
            apply_bitmask(fallback, bitmask[dead_rows], list(range(len(dead))))
            logits[dead_rows] = fallback

    def _apply_penalties(self, logits: torch.Tensor, states: list[SamplingRequestState]) -> torch.Tensor:
        """min_tokens bans, frequency/presence and repetition penalties: one batched op each over the rows that ask
        for it (the per-row state tensors are stacked), the same arithmetic as row by row."""
        ban_rows, ban_ids, count_rows, seen_rows = [], [], [], []
        for i, s in enumerate(states):
            p = s.params
            if s.num_outputs < p.min_new_tokens:
                # Too early to stop: EOS and stop tokens are not allowed yet.
                banned = ([] if p.ignore_eos else s.eos_ids) + list(p.stop_token_ids)
                ban_rows += [i] * len(banned)
                ban_ids += banned
            if s.output_counts is not None:
                count_rows.append(i)
            if s.seen_mask is not None and p.repetition_penalty != 1.0:
                seen_rows.append(i)
        up = self.upload
        if ban_rows:
            logits[up(np.array(ban_rows, dtype=np.int64)), up(np.array(ban_ids, dtype=np.int64))] = float("-inf")
        if count_rows:
            rows = up(np.array(count_rows, dtype=np.int64))
            counts = torch.stack([states[i].output_counts for i in count_rows]).to(logits.dtype)
            freq = up(np.array([states[i].params.frequency_penalty for i in count_rows], dtype=np.float32))
            presence = up(np.array([states[i].params.presence_penalty for i in count_rows], dtype=np.float32))
            logits[rows] -= freq.to(logits.dtype).unsqueeze(1) * counts + presence.to(logits.dtype).unsqueeze(1) * (
                counts > 0
            ).to(logits.dtype)
        if seen_rows:
            rows = up(np.array(seen_rows, dtype=np.int64))
            seen = torch.stack([states[i].seen_mask for i in seen_rows])
            penalty = up(np.array([states[i].params.repetition_penalty for i in seen_rows], dtype=np.float32))
            penalty = penalty.to(logits.dtype).unsqueeze(1)
            row = logits[rows]
            penalised = torch.where(row > 0, row / penalty, row * penalty)
            logits[rows] = torch.where(seen, penalised, row)
        return logits

    @staticmethod
    def _apply_top_k_top_p_min_p(probs: torch.Tensor, params: list[SamplingParams], upload) -> torch.Tensor:
        vocab = probs.shape[1]
        top_ks = [p.top_k if p.top_k > 0 else vocab for p in params]
        top_ps = [p.top_p for p in params]
        min_ps = [p.min_p for p in params]
        if any(k < vocab for k in top_ks) or any(tp < 1.0 for tp in top_ps):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            rank = torch.arange(vocab, device=probs.device).unsqueeze(0)
            cut = rank >= upload(np.array(top_ks, dtype=np.int64)).unsqueeze(1)
            # Keep the smallest head whose mass reaches top_p: drop a token when the mass before it already does.
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            cut |= mass_before >= upload(np.array(top_ps, dtype=np.float32)).unsqueeze(1)
            sorted_probs = sorted_probs.masked_fill(cut, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
        if any(mp > 0 for mp in min_ps):
            floor = upload(np.array(min_ps, dtype=np.float32)).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs
