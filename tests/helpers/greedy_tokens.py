"""Greedy tokens of a batch of random prompts through an InProcessEngine: what the fusion tests compare with an
option on and off."""

import torch


def greedy_token_ids(engine, requests: int, tokens: int, seed: int = 0) -> list[list[int]]:
    """`requests` prompts of 3-39 random ids (seeded), `tokens` greedy tokens each (EOS ignored)."""
    from radixserve.sampling import SamplingParams

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (requests,), generator=g).tolist()
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)
    return [r.token_ids for r in engine.generate(prompts, [params] * len(prompts))]
