"""The offline Engine against HF transformers: greedy generation token for token, and the demo model's answer."""

import pytest
import torch

from radixserve.engine import Engine
from radixserve.sampling import SamplingParams
from radixserve.testing.smollm2 import smollm2_dir
from radixserve.testing.tiny_models import tiny_model_dir

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)


def hf_greedy(model_dir, prompt_ids, max_new_tokens, ignore_eos=True):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            min_new_tokens=max_new_tokens if ignore_eos else 0,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_32_tokens_match_hf_generate(arch):
    model_dir = tiny_model_dir(arch)
    prompts = ["The quick brown fox", "Radix trees share prefixes", "1 2 3 4 5 6 7"]
    params = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)
    with Engine(str(model_dir), device="cpu", max_total_tokens=2048) as engine:  # scheduler + worker processes
        results = engine.generate(prompts, params)
    for prompt, result in zip(prompts, results):
        ids = engine.tokenizer.encode(prompt)
        assert result.token_ids == hf_greedy(model_dir, ids, 32), prompt
        assert result.finish_reason == "length" and result.prompt_tokens == len(ids)
        assert result.text == engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)


def test_spin_waiting_processes_serve_the_same_tokens():
    """--spin-wait-ms (on by default on a GPU, off on the CPU): the scheduler, worker and this caller poll their
    sockets after work instead of sleeping on them; the tokens are the same and nothing is missed."""
    model_dir = tiny_model_dir("llama")
    prompts = ["The quick brown fox", "Radix trees share prefixes"]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    with Engine(str(model_dir), device="cpu", max_total_tokens=2048, spin_wait_ms=20) as engine:
        assert engine.args.spin_wait_ms == 20
        results = [engine.generate(p, params) for p in prompts]  # one at a time: every wait starts from idle
        results += engine.generate(prompts, params)
    for prompt, result in zip(prompts * 2, results):
        assert result.token_ids == hf_greedy(model_dir, engine.tokenizer.encode(prompt), 12), prompt


def test_reading_back_before_long_steps_serves_the_same_tokens():
    """--read-back-wait-ms (on by default on a GPU): between two prefill or mixed steps the worker reports the first
    step's tokens before it launches the second. On the CPU every step is such a step, so with it on here each step
    is read back before the next one's forward. With chunked prefill (steps that sample nothing) and a penalised
    request beside plain ones, the tokens are those of the pipelined order; a step reported early and then lost
    leaves the scheduler waiting for it, and the test never ends."""
    model_dir = tiny_model_dir("llama")
    prompts = ["The quick brown fox " * 12, "Radix trees share prefixes " * 9, "1 2 3 4 5 6 7"]
    params = [
        SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True),
    ]
    outputs = {}
    for wait_ms in (0.0, 5.0):
        with Engine(
            str(model_dir), device="cpu", max_total_tokens=2048, chunked_prefill_size=16, read_back_wait_ms=wait_ms
        ) as engine:
            assert engine.args.read_back_wait_ms == wait_ms
            outputs[wait_ms] = [r.token_ids for r in engine.generate(prompts, params)]
    assert outputs[5.0] == outputs[0.0]
    assert outputs[0.0][0] == hf_greedy(model_dir, engine.tokenizer.encode(prompts[0]), 16)


@pytest.fixture(scope="module")
def smollm2_engine():
    with Engine(str(smollm2_dir()), device="cpu", max_total_tokens=4096) as engine:
        yield engine


def test_smollm2_chat_matches_hf_and_answers_paris(smollm2_engine):
    engine = smollm2_engine
    ids = engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    result = engine.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=32))
    assert "Paris" in result.text
    assert result.token_ids == hf_greedy(smollm2_dir(), ids, 32, ignore_eos=False)
    if result.finish_reason == "stop":
        assert result.token_ids[-1] in engine.model_config.eos_token_ids


def test_stop_strings_and_seeded_sampling(smollm2_engine):
    engine = smollm2_engine
    ids = engine.apply_chat_template([{"role": "user", "content": "Count from 1 to 20, separated by commas."}])
    stopped = engine.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=64, stop=["5"]))
    assert stopped.finish_reason == "stop" and stopped.matched_stop == "5"
    assert "5" not in stopped.text and stopped.text
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_new_tokens=16, seed=1234)
    a, b = engine.generate([ids, ids], [seeded, seeded])
    assert a.token_ids == b.token_ids, "same seed, same tokens"
    c = engine.generate(ids, SamplingParams(temperature=1.0, max_new_tokens=16, seed=99))
    assert c.token_ids != a.token_ids
    info = engine.server_info()
    assert info["kv_invariant_ok"] and info["num_running"] == 0


def test_logprobs_and_min_tokens(smollm2_engine):
    engine = smollm2_engine
    ids = engine.apply_chat_template([{"role": "user", "content": "Say hi."}])
    result = engine.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=8, min_new_tokens=8, logprobs=3))
    assert len(result.token_ids) == 8 and len(result.logprobs) == 8
    for token, lp in zip(result.token_ids, result.logprobs):
        import numpy as np

        top_ids = np.frombuffer(lp.top_ids, dtype=np.int32)
        assert len(top_ids) == 3 and top_ids[0] == token  # greedy picks the most likely token
        assert lp.logprob <= 0.0


def test_tensor_parallel_engine_matches_single_rank():
    """Engine with --tp-size 2 (two gloo worker processes) gives the single-rank greedy tokens."""
    model_dir = str(tiny_model_dir("qwen2"))
    prompts = ["Tensor parallel", "shards the heads"]
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    with Engine(model_dir, device="cpu", max_total_tokens=1024) as one:
        expected = [r.token_ids for r in one.generate(prompts, params)]
    with Engine(model_dir, device="cpu", max_total_tokens=1024, tp_size=2) as two:
        assert [r.token_ids for r in two.generate(prompts, params)] == expected
        assert two.server_info()["tp_size"] == 2


def test_bad_prompts_raise_before_anything_runs(smollm2_engine):
    with pytest.raises(ValueError, match="maximum context length"):
        smollm2_engine.generate("hi", SamplingParams(max_new_tokens=10**6))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        smollm2_engine.generate([1, 10**7], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="temperature"):
        smollm2_engine.generate("hi", SamplingParams(temperature=-1.0))
    assert smollm2_engine.generate("Hi", SamplingParams(max_new_tokens=2)).token_ids
