"""Token sampling on the logits of each request's last position: penalties, temperature, top-k, top-p, min-p,
per-request seeds. Sampling uses the exponential race (argmax of p / Exp(1) noise), which draws from p exactly
and lets seeded rows take their noise from their own generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.sampling import SamplingParams


@dataclass
class SamplingRequestState:
    """What the sampler keeps per running request (on the worker)."""
    params: SamplingParams
    eos_ids: list[int]
    num_outputs: int
    output_counts: torch.Tensor | None  # [V] int32 counts of generated tokens, only when penalties are asked for
    seen_mask: torch.Tensor | None  # [V] bool prompt+output tokens, only for the repetition penalty


def _seed_noise(seed: int, position: int, vocab: int, device) -> torch.Tensor:
    # The noise of a seeded request depends only on (seed, position), so a retracted and recomputed request, or the
    # same request in another batch, draws the same tokens.
    gen = torch.Generator(device=device).manual_seed((seed * 1_000_003 + position) & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.empty(vocab, device=device).exponential_(generator=gen)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device

    def __call__(self, logits: torch.Tensor, states: list[SamplingRequestState], positions: list[int]):
        """logits [B, V] (any float dtype); positions: the position of the token being sampled, per row.
        Returns (token ids int64 [B], log-softmax of the raw logits or None)."""
        logits = logits.float()
        params = [s.params for s in states]
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        logits = self._apply_penalties(logits, states)
        if all(p.is_greedy for p in params):
            return logits.argmax(dim=-1), raw_logprobs

        dev = logits.device
        temps = torch.tensor([p.temperature if not p.is_greedy else 1.0 for p in params], device=dev)
        probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
        probs = self._apply_top_k_top_p_min_p(probs, params)
        noise = torch.empty_like(probs).exponential_()
        for i, p in enumerate(params):
            if p.seed is not None and not p.is_greedy:
                noise[i] = _seed_noise(p.seed, positions[i], probs.shape[1], dev)
        tokens = (probs / noise).argmax(dim=-1)
        greedy = torch.tensor([p.is_greedy for p in params], device=dev)
        return torch.where(greedy, logits.argmax(dim=-1), tokens), raw_logprobs

    def _apply_penalties(self, logits: torch.Tensor, states: list[SamplingRequestState]) -> torch.Tensor:
        for i, s in enumerate(states):
            p = s.params
            if s.num_outputs < p.min_new_tokens:
                # Too early to stop: EOS and stop tokens are not allowed yet.
                banned = ([] if p.ignore_eos else s.eos_ids) + list(p.stop_token_ids)
                if banned:
                    logits[i, banned] = float("-inf")
            if s.output_counts is not None:
                counts = s.output_counts.to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
            if s.seen_mask is not None and p.repetition_penalty != 1.0:
                row = logits[i]
                penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                logits[i] = torch.where(s.seen_mask, penalised, row)
        return logits

    @staticmethod
    def _apply_top_k_top_p_min_p(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        vocab = probs.shape[1]
        top_ks = [p.top_k if p.top_k > 0 else vocab for p in params]
        top_ps = [p.top_p for p in params]
        min_ps = [p.min_p for p in params]
        if any(k < vocab for k in top_ks) or any(tp < 1.0 for tp in top_ps):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            rank = torch.arange(vocab, device=probs.device).unsqueeze(0)
            cut = rank >= torch.tensor(top_ks, device=probs.device).unsqueeze(1)
            # Keep the smallest head whose mass reaches top_p: drop a token when the mass before it already does.
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            cut |= mass_before >= torch.tensor(top_ps, device=probs.device).unsqueeze(1)
            sorted_probs = sorted_probs.masked_fill(cut, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
        if any(mp > 0 for mp in min_ps):
            floor = torch.tensor(min_ps, device=probs.device).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs
