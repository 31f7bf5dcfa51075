"""The sampler changes logits for a whole batch at once (logit bias, min_tokens bans, frequency/presence and
repetition penalties); each row must still get exactly what its own parameters ask for, as if it were alone."""

import torch

from radixserve.layers.sampler import Sampler, SamplingRequestState
from radixserve.sampling import SamplingParams

VOCAB = 32


def make_state(params: SamplingParams, outputs: list[int], prompt: list[int]) -> SamplingRequestState:
    counts = seen = None
    if params.presence_penalty or params.frequency_penalty:
        counts = torch.bincount(torch.tensor(outputs, dtype=torch.int64), minlength=VOCAB)
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(VOCAB, dtype=torch.bool)
        seen[torch.tensor(prompt + outputs, dtype=torch.int64)] = True
    return SamplingRequestState(params, eos_ids=[3], num_outputs=len(outputs), output_counts=counts, seen_mask=seen)


def row_by_row(logits: torch.Tensor, state: SamplingRequestState) -> torch.Tensor:
    """One row's logits after its own bias, bans and penalties, written out directly."""
    row, p = logits.clone(), state.params
    for token, value in p.logit_bias.items():
        row[token] += value
    if state.num_outputs < p.min_new_tokens:
        row[([] if p.ignore_eos else state.eos_ids) + list(p.stop_token_ids)] = float("-inf")
    if state.output_counts is not None:
        counts = state.output_counts.float()
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    if state.seen_mask is not None:
        row = torch.where(
            state.seen_mask, torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty), row
        )
    return row


def test_batched_logit_changes_match_each_row_alone():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, VOCAB, generator=gen) * 3
    cases = [
        (SamplingParams(temperature=0.0), [5, 5, 6]),
        (SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=-0.4), [5, 5, 6, 9]),
        (SamplingParams(temperature=0.0, repetition_penalty=1.6), [1, 2]),
        (SamplingParams(temperature=0.0, min_new_tokens=4, stop_token_ids=[7, 8]), [4]),
        (
            SamplingParams(
                temperature=0.0, logit_bias={2: 5.0, 30: -2.5}, frequency_penalty=1.5, repetition_penalty=0.5
            ),
            [2, 2, 30],
        ),
        (SamplingParams(temperature=0.0, min_new_tokens=9, ignore_eos=True, logit_bias={11: 1.0}), [11]),
    ]
    states = [make_state(p, outputs, prompt=[0, 1, 2]) for p, outputs in cases]
    expected = torch.stack([row_by_row(logits[i], s) for i, s in enumerate(states)])
    changed = logits.clone()
    sampler = Sampler(VOCAB, torch.device("cpu"))
    sampler._apply_logit_bias(changed, states)
    changed = sampler._apply_penalties(changed, states)
    assert torch.equal(changed, expected)
    tokens, _ = Sampler(VOCAB, torch.device("cpu"))(logits.clone(), states, [10] * 6)
    assert torch.equal(tokens, expected.argmax(-1))
