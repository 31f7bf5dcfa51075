"""Repetition, frequency and presence penalties end to end: the Engine (scheduler and worker processes) against a
reference that applies each penalty by its definition on Hugging Face logits, token by token.

Definitions (those of OpenAI, vLLM and SGLang): frequency and presence penalties count GENERATED tokens only,
logit -= frequency * count + presence * (count > 0); the repetition penalty (CTRL, as in HF) covers prompt and
generated tokens, a positive logit divided by it and a negative one multiplied. A penalty that counted the prompt
too, stopped counting after the first step, or forgot the tokens of earlier steps gives other tokens than the
reference here: greedy decoding of the tiny model repeats tokens, so the penalties change its path.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.engine import Engine
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import tiny_model_dir

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

MAX_NEW = 24
PROMPTS = ["Once upon a time there was a cat", "The radix tree"]  # greedy repeats tokens on both
PENALTIES = [
    dict(frequency_penalty=1.5),
    dict(presence_penalty=2.0),
    dict(repetition_penalty=2.0),
    dict(frequency_penalty=-1.0),  # negative: repetition is encouraged
    dict(frequency_penalty=0.7, presence_penalty=0.5, repetition_penalty=1.3),
]


@pytest.fixture(scope="module")
def model_dir():
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_greedy(
    model, prompt_ids: list[int], frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0
) -> list[int]:
    seen = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    seen[torch.tensor(prompt_ids)] = True
    counts = torch.zeros(model.config.vocab_size, dtype=torch.float64)
    generated: list[int] = []
    past, step_input = None, torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(MAX_NEW):
            out = model(step_input, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].double()
            logits -= frequency_penalty * counts + presence_penalty * (counts > 0).double()
            if repetition_penalty != 1.0:
                penalised = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
                logits = torch.where(seen, penalised, logits)
            token = int(logits.argmax())
            generated.append(token)
            counts[token] += 1
            seen[token] = True
            step_input = torch.tensor([[token]])
    return generated


@pytest.fixture(scope="module")
def engine_results(model_dir):
    """Every prompt under every penalty (and none), all in one continuous batch: rows with different penalties
    share steps, so per-row state mix-ups show as well."""
    cases = [(prompt, penalty) for prompt in PROMPTS for penalty in [{}] + PENALTIES]
    with Engine(model_dir, device="cpu", max_total_tokens=2048) as engine:
        params = [
            SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True, **penalty) for _, penalty in cases
        ]
        results = engine.generate([prompt for prompt, _ in cases], params)
        prompt_ids = {prompt: engine.tokenizer.encode(prompt) for prompt in PROMPTS}
        info = engine.server_info()
    assert info["kv_invariant_ok"] and info["num_running"] == 0 and info["num_waiting"] == 0
    assert info["kv_free"] + info["kv_evictable"] == info["kv_total"]
    return {
        (prompt, tuple(sorted(penalty.items()))): r.token_ids for (prompt, penalty), r in zip(cases, results)
    }, prompt_ids


def test_unpenalised_greedy_repeats_tokens(hf_model, engine_results):
    # The premise: without penalties the outputs repeat generated tokens, so penalties on them have work to do.
    results, prompt_ids = engine_results
    for prompt in PROMPTS:
        tokens = results[(prompt, ())]
        assert tokens == reference_greedy(hf_model, prompt_ids[prompt])
        assert len(set(tokens)) < len(tokens), f"{prompt!r}: no repeated token in {tokens}"


@pytest.mark.parametrize("penalty", PENALTIES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_penalised_greedy_matches_the_definition(hf_model, engine_results, penalty):
    results, prompt_ids = engine_results
    changed = 0
    for prompt in PROMPTS:
        tokens = results[(prompt, tuple(sorted(penalty.items())))]
        assert tokens == reference_greedy(hf_model, prompt_ids[prompt], **penalty), prompt
        changed += tokens != results[(prompt, ())]
    assert changed, "the penalty changed no output: the test would not see a broken penalty"
