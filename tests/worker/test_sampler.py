"""The sampler draws from the distribution the parameters describe: greedy, temperature, top-k, top-p, min-p,
penalties, min_tokens, and per-request seeds."""

import torch

from radixserve.layers.sampler import Sampler, SamplingRequestState
from radixserve.sampling import SamplingParams

VOCAB = 8
# Probabilities 0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005
PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005])
LOGITS = PROBS.log()


def state(**kw) -> SamplingRequestState:
    return SamplingRequestState(SamplingParams(**kw), eos_ids=[7], num_outputs=0, output_counts=None, seen_mask=None)


def draw(n=4000, **kw) -> torch.Tensor:
    """Empirical distribution of n draws (one batch of n identical rows)."""
    sampler = Sampler(VOCAB, torch.device("cpu"))
    states = [state(**kw) for _ in range(n)]
    tokens, _ = sampler(LOGITS.repeat(n, 1), states, list(range(n)))
    return torch.bincount(tokens, minlength=VOCAB).float() / n


def test_greedy_is_argmax():
    sampler = Sampler(VOCAB, torch.device("cpu"))
    logits = torch.randn(5, VOCAB)
    tokens, _ = sampler(logits, [state(temperature=0.0) for _ in range(5)], [0] * 5)
    assert torch.equal(tokens, logits.argmax(-1))


def test_temperature_one_follows_the_distribution():
    freq = draw()
    assert (freq - PROBS).abs().max() < 0.03


def test_low_temperature_sharpens():
    assert draw(temperature=0.2)[0] > 0.85  # 0.4^5 / sum(p^5) = 0.906


def test_top_k_keeps_only_k_tokens():
    freq = draw(top_k=2)
    assert freq[2:].sum() == 0
    assert abs(freq[0] - 0.4 / 0.65) < 0.03


def test_top_p_keeps_the_nucleus():
    freq = draw(top_p=0.7)  # 0.4 + 0.25 = 0.65 < 0.7, so the third token (0.15) completes the nucleus
    assert freq[3:].sum() == 0 and freq[2] > 0
    assert abs(freq[2] - 0.15 / 0.8) < 0.03


def test_min_p_drops_unlikely_tokens():
    freq = draw(min_p=0.3)  # keeps p >= 0.12: the first three tokens
    assert freq[3:].sum() == 0 and (freq[:3] > 0).all()


def test_seeded_rows_repeat_and_differ_by_seed():
    sampler = Sampler(VOCAB, torch.device("cpu"))
    logits = torch.zeros(6, VOCAB)
    states = [state(seed=s) for s in (1, 1, 2, 2, 3, 3)]
    first, _ = sampler(logits, states, [5] * 6)
    second, _ = sampler(logits, states, [5] * 6)
    assert torch.equal(first, second)
    assert first[0] == first[1] and first[2] == first[3]
    seq = [int(sampler(logits[:1], [state(seed=1)], [p])[0]) for p in range(40)]
    assert len(set(seq)) > 3, "the noise must change with the position"


def test_min_tokens_bans_eos_and_stop_tokens():
    sampler = Sampler(VOCAB, torch.device("cpu"))
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 10.0  # EOS strongly preferred
    logits[0, 6] = 9.0  # then a stop token
    s = state(temperature=0.0, min_new_tokens=2, stop_token_ids=[6])
    tokens, _ = sampler(logits.clone(), [s], [0])
    assert tokens.item() not in (6, 7)
    s.num_outputs = 2
    tokens, _ = sampler(logits.clone(), [s], [0])
    assert tokens.item() == 7


def test_penalties_push_away_repeated_tokens():
    sampler = Sampler(VOCAB, torch.device("cpu"))
    logits = LOGITS.clone().unsqueeze(0)
    counts = torch.zeros(VOCAB, dtype=torch.int32)
    counts[0] = 3
    s = SamplingRequestState(SamplingParams(temperature=0.0, frequency_penalty=1.0), [7], 3, counts, None)
    assert sampler(logits.clone(), [s], [0])[0].item() == 1
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    seen[0] = True
    s = SamplingRequestState(SamplingParams(temperature=0.0, repetition_penalty=2.0), [7], 0, None, seen)
    # log(0.4) * 2 = -1.83 < log(0.25) = -1.39: token 1 wins.
    assert sampler(logits.clone(), [s], [0])[0].item() == 1


def test_logprobs_are_of_the_raw_distribution():
    sampler = Sampler(VOCAB, torch.device("cpu"))
    _, logprobs = sampler(LOGITS.unsqueeze(0), [state(temperature=0.5, logprobs=2)], [0])
    assert torch.allclose(logprobs[0].exp(), PROBS / PROBS.sum(), atol=1e-6)


def test_inverse_cdf_draws_match_the_distribution_and_never_a_zero_probability_token():
    from radixserve.layers.sampler import _inverse_cdf_sample

    torch.manual_seed(0)
    p = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    draws = _inverse_cdf_sample(p.repeat(40_000, 1), torch.rand(40_000))
    freq = torch.bincount(draws, minlength=6).float() / len(draws)
    assert freq[[0, 2, 5]].sum() == 0
    assert torch.allclose(freq, p, atol=0.01), freq
    # A draw at the very top of the cumulative sum lands past the last allowed token: the row's best token instead.
    assert _inverse_cdf_sample(torch.tensor([[0.25, 0.75, 0.0]]), torch.ones(1)).item() == 1


def test_seeded_rows_draw_from_the_distribution_whatever_their_batch():
    """A seeded row's draw comes from (seed, position) alone: over many seeds it follows p, and each row gets the
    same token alone as among unseeded neighbours."""
    sampler = Sampler(VOCAB, torch.device("cpu"))
    logits = LOGITS.unsqueeze(0).repeat(4_000, 1)
    states = [state(seed=s) for s in range(4_000)]
    tokens, _ = sampler(logits.clone(), states, [3] * 4_000)
    freq = torch.bincount(tokens, minlength=VOCAB).float() / len(tokens)
    assert torch.allclose(freq, PROBS / PROBS.sum(), atol=0.03), freq
    mixed = [state(seed=None) if i % 2 else states[i] for i in range(40)]
    among_others, _ = sampler(logits[:40].clone(), mixed, [3] * 40)
    assert torch.equal(among_others[::2], tokens[:40:2])
