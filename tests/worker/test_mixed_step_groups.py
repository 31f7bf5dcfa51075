"""A step with prompt chunks keeps its decodes' shared-prefix groups only when they spare enough context reads
(forward_context.batch_decode_groups, --mixed-step-groups-min-saved-tokens): below the bound its decodes take the
plain kernel. Checked here: the count of context tokens a step's groups spare; the rule on eager steps (a mixed step
below the bound gets no groups, one at or past it keeps them, a step of decodes alone always keeps them); greedy
tokens through the scheduler with the rule at 0 (always group) and at its default equal the plain path's, with
grouped mixed steps seen on the one side and refused on the other; and the flag through a launched server."""

import asyncio

import numpy as np
import pytest
import torch

import radixserve.worker.model_runner as model_runner
from radixserve.config import ServerArgs
from radixserve.forward_context import batch_decode_groups, pack_decode_groups, saved_context_tokens
from radixserve.protocol import PrefixGroups, pack_i32
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import tiny_model_dir
from scheduler_service.in_process_engine import InProcessEngine

# Batch index 0 is a prompt chunk; decodes 1, 2 and 4 share group 0 (a 20-token prefix), decode 3 is group 1's only
# member (30 tokens), decode 5 is in none.
GROUPS = PrefixGroups(
    pack_i32([20, 30]), pack_i32([5, 6]), pack_i32([-1, 0, 0, 1, 0, -1]), pack_i32([0, 20, 20, 30, 20, 0])
)
ROWS = np.array([1, 2, 3, 4, 5, 6], dtype=np.int32)
SEQ_LENS = np.array([16, 25, 26, 40, 22, 9], dtype=np.int32)


def test_saved_context_tokens_count_each_prefix_once_a_group():
    # Group 0 is read once for three members (2 x 20 spared); group 1's lone member spares nothing.
    assert saved_context_tokens(GROUPS, 1) == 40
    decode_only = PrefixGroups(GROUPS.prefix_lens, GROUPS.prefix_rows, pack_i32([0, 0, 0, 0]), pack_i32([20] * 4))
    assert saved_context_tokens(decode_only, 0) == 60


def test_a_mixed_step_keeps_its_groups_only_at_or_past_the_bound():
    def groups(table, num_extend, bound, rows=ROWS, seq_lens=SEQ_LENS):
        return batch_decode_groups(table, num_extend, rows, seq_lens, pack_decode_groups, torch.from_numpy, bound)

    assert groups(GROUPS, 1, 41) is None  # below: the plain kernel
    kept = groups(GROUPS, 1, 40)
    assert kept is not None and kept.live_groups.tolist() == [2] and kept.req_group.tolist() == [0, 0, 1, 0, -1]
    assert groups(GROUPS, 1, 0) is not None
    assert groups(None, 1, 0) is None
    # A step of decodes alone keeps its groups whatever the bound: it is a CUDA graph's, or at least no prompt's.
    decode_only = PrefixGroups(GROUPS.prefix_lens, GROUPS.prefix_rows, pack_i32([0, 0, 1, 0, -1]), pack_i32([0] * 5))
    assert groups(decode_only, 0, 1 << 30, ROWS[1:], SEQ_LENS[1:]) is not None


def test_the_default_bound_is_the_flags():
    assert ServerArgs().mixed_step_groups_min_saved_tokens == 65536


VOCAB = 256
SIZES = dict(device="cpu", max_total_tokens=8192, max_running_requests=64, shared_prefix_min_tokens=8)


def chat_prompts(seed=1):
    """Two system prompts of 40 tokens with short questions after them: with 64-token prompt chunks the later
    prompts are prefilled in steps where the earlier ones already decode, together."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, VOCAB, 40).tolist() for _ in range(2)]
    return [systems[i % 2] + rng.integers(0, VOCAB, int(rng.integers(1, 8))).tolist() for i in range(10)]


def params(n):
    return [SamplingParams(temperature=0.0, max_new_tokens=6 + i % 5, ignore_eos=True) for i in range(n)]


@pytest.fixture(scope="module")
def plain_tokens():
    prompts = chat_prompts()
    engine = InProcessEngine(
        str(tiny_model_dir("llama")), disable_shared_prefix_attention=True, chunked_prefill_size=64, **SIZES
    )
    return [r.token_ids for r in engine.generate(prompts, params(len(prompts)))]


@pytest.mark.parametrize("bound", [0, None])
def test_scheduler_steps_give_the_plain_tokens_either_side_of_the_rule(monkeypatch, plain_tokens, bound):
    mixed = []  # per mixed step with groups: whether its decodes kept them

    def spy(groups, num_extend, *args):
        out = batch_decode_groups(groups, num_extend, *args)
        if num_extend and groups is not None:
            mixed.append(out is not None)
        return out

    monkeypatch.setattr(model_runner, "batch_decode_groups", spy)
    flags = {} if bound is None else {"mixed_step_groups_min_saved_tokens": bound}
    engine = InProcessEngine(str(tiny_model_dir("llama")), chunked_prefill_size=64, **SIZES, **flags)
    engine.scheduler.check_invariant_every_step = True
    prompts = chat_prompts()
    assert [r.token_ids for r in engine.generate(prompts, params(len(prompts)))] == plain_tokens
    assert engine.scheduler.stats.grouped_decodes > 0, "no group formed"
    assert mixed, "no mixed step had groups"
    # At 0 every mixed step keeps its groups; the default bound is past what 40-token prefixes can spare here.
    assert all(mixed) if bound == 0 else not any(mixed)


@pytest.mark.server
def test_a_server_grouping_every_mixed_step_gives_the_plain_tokens(plain_tokens):
    """--mixed-step-groups-min-saved-tokens 0 through launch.py: concurrent native requests, their output ids those
    of the plain path (the default bound is the other server tests')."""
    import httpx
    from server_fixture import launched_server  # tests/helpers (conftest.py)

    prompts = chat_prompts()
    bodies = [
        {"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": s.max_new_tokens, "ignore_eos": True}}
        for p, s in zip(prompts, params(len(prompts)))
    ]

    async def generate_all(url):
        async with httpx.AsyncClient(timeout=120) as client:
            replies = await asyncio.gather(*(client.post(f"{url}/generate", json=body) for body in bodies))
        return [r.json()["output_ids"] for r in replies]

    flags = ("--shared-prefix-min-tokens", "8", "--chunked-prefill-size", "64", "--mixed-step-groups-min-saved-tokens")
    with launched_server(tiny_model_dir("llama"), *flags, "0") as server:
        assert asyncio.run(generate_all(server.url)) == plain_tokens
        assert server.server_info()["grouped_decodes"] > 0, "the concurrent requests formed no group"
