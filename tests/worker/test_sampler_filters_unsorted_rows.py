"""The sampler's filters on logits that are NOT sorted, with different parameters on every row of one batch, checked
against a reference written from the definitions (no sorting, one row at a time).

tests/worker/test_sampler.py uses one descending distribution and one parameter set per batch: a filter that cuts by
vocabulary index instead of by rank, scatters the kept probabilities back to the wrong ids, or applies row 0's
parameters to every row passes there and fails here.
"""

import torch

from radixserve.layers.sampler import Sampler, SamplingRequestState
from radixserve.sampling import SamplingParams

VOCAB = 12
# Distinct probabilities in a shuffled order: rank and vocabulary index disagree everywhere.
PROBS = torch.tensor([0.03, 0.20, 0.005, 0.11, 0.26, 0.015, 0.07, 0.14, 0.04, 0.02, 0.09, 0.01])
PROBS = PROBS / PROBS.sum()
LOGITS = PROBS.log()
# A second, differently shuffled distribution, so rows differ in their logits too.
LOGITS_B = LOGITS[torch.tensor([7, 3, 11, 0, 9, 4, 1, 10, 6, 2, 8, 5])]

# Every row of the mixed batch gets its own parameters, logits rows alternate A/B.
ROW_PARAMS = [
    dict(temperature=1.0),
    dict(temperature=1.0, top_k=3),
    dict(temperature=0.7, top_p=0.5),
    dict(temperature=1.3, min_p=0.3),
    dict(temperature=0.0),  # greedy among sampled rows
    dict(temperature=2.0, top_k=5, top_p=0.8),
    dict(temperature=0.5, top_k=4, min_p=0.2),
    dict(temperature=1.0, top_p=0.3),
    dict(temperature=1.0, top_k=1),  # greedy by top_k
]


def reference_distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a row must be drawn from, by definition, token by token without sorting:
    softmax(logits / T); keep a token if fewer than top_k tokens are more likely, if the mass of the tokens more
    likely than it is below top_p, and if it is at least min_p times the most likely token; renormalise."""
    if p.temperature == 0.0 or p.top_k == 1:
        out = torch.zeros(VOCAB, dtype=torch.float64)
        out[int(logits.argmax())] = 1.0
        return out
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    for i in range(VOCAB):
        more_likely = probs > probs[i]
        ok = p.top_k <= 0 or int(more_likely.sum()) < p.top_k
        ok = ok and float(probs[more_likely].sum()) < p.top_p
        ok = ok and float(probs[i]) >= p.min_p * float(probs.max())
        keep[i] = ok
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum()


def state(params: SamplingParams) -> SamplingRequestState:
    return SamplingRequestState(params, eos_ids=[], num_outputs=0, output_counts=None, seen_mask=None)


def test_reference_is_not_trivial():
    # The premise: the cases cut the distribution in different places, and the logits are far from sorted.
    supports = {
        tuple(reference_distribution(LOGITS, SamplingParams(**kw)).nonzero().flatten().tolist()) for kw in ROW_PARAMS
    }
    assert len(supports) >= 6
    assert not torch.equal(LOGITS.argsort(descending=True), torch.arange(VOCAB))


def test_mixed_batch_of_unsorted_rows_matches_the_reference():
    per_row, repeats = len(ROW_PARAMS), 3000
    params = [SamplingParams(**kw) for kw in ROW_PARAMS]
    logits = torch.stack([LOGITS if r % 2 == 0 else LOGITS_B for r in range(per_row)])
    # One batch holding every parameter set `repeats` times, rows interleaved.
    batch_logits = logits.repeat(repeats, 1)
    states = [state(params[i % per_row]) for i in range(per_row * repeats)]
    sampler = Sampler(VOCAB, torch.device("cpu"))
    torch.manual_seed(0)
    tokens, _ = sampler(batch_logits.clone(), states, list(range(len(states))))
    tokens = tokens.view(repeats, per_row)
    for r, p in enumerate(params):
        expected = reference_distribution(logits[r], p)
        counts = torch.bincount(tokens[:, r], minlength=VOCAB).double()
        outside = [int(t) for t in counts.nonzero().flatten() if expected[t] == 0]
        assert not outside, f"row {r} ({ROW_PARAMS[r]}) drew tokens {outside}, outside the reference support"
        freq = counts / repeats
        # 5 standard deviations of a binomial frequency: a wrong kept set or wrong temperature moves some token's
        # frequency by far more, chance by 5 sigma almost never.
        sigma = torch.sqrt(expected * (1 - expected) / repeats)
        worst = float(((freq - expected).abs() - 5 * sigma - 1e-3).max())
        assert worst <= 0, (
            f"row {r} ({ROW_PARAMS[r]}): frequencies {freq.numpy().round(3)} vs reference {expected.numpy().round(3)}"
        )


def test_seeded_rows_ignore_their_neighbours_parameters():
    # A seeded row draws the same token whatever other rows share its batch (their parameters, their logits).
    sampler = Sampler(VOCAB, torch.device("cpu"))
    seeded = SamplingParams(temperature=0.9, top_k=6, top_p=0.9, seed=7)
    alone = [int(sampler(LOGITS.unsqueeze(0).clone(), [state(seeded)], [pos])[0]) for pos in range(30)]
    mixed = []
    for pos in range(30):
        batch = torch.stack([LOGITS_B, LOGITS, LOGITS_B])
        rows = [state(SamplingParams(temperature=2.0, top_k=2)), state(seeded), state(SamplingParams(min_p=0.5))]
        mixed.append(int(sampler(batch, rows, [3, pos, 9])[0][1]))
    assert alone == mixed
    support = reference_distribution(LOGITS, seeded).nonzero().flatten().tolist()
    assert set(alone) <= set(support) and len(set(alone)) > 1


def test_top_p_boundary_is_by_rank_not_by_index():
    # top_p 0.5 on LOGITS at T=1: by rank the kept head is ids 4 (0.26), 1 (0.20), 7 (0.14); cutting the cumulative
    # mass along vocabulary order would keep ids 0, 1, 2, 3, 4 instead.
    p = SamplingParams(temperature=1.0, top_p=0.5)
    support = reference_distribution(LOGITS, p).nonzero().flatten().tolist()
    assert support == [1, 4, 7]
    sampler = Sampler(VOCAB, torch.device("cpu"))
    torch.manual_seed(1)
    tokens, _ = sampler(LOGITS.repeat(2000, 1), [state(p)] * 2000, [0] * 2000)
    assert set(tokens.tolist()) == {1, 4, 7}
