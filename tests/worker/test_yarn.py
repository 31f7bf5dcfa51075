"""YaRN rope scaling (rope_type "yarn", as Qwen3's long-context configuration sets it) computes what HF transformers
computes: the cos/sin table bit for bit (attention factor included, which HF applies to cos and sin), the logits
of every position, and greedy tokens through the engine, on tiny Qwen3 models in fp32 on the CPU."""

import numpy as np
import pytest
import torch

from radixserve.config import ServerArgs
from radixserve.layers.rotary import rope_table
from radixserve.protocol import ForwardBatch, WorkerRequest, pack_i32
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import tiny_model_dir
from radixserve.worker.model_runner import ModelRunner

# original_max_position_embeddings 64 puts the prompts below far past the original context, so interpolation, the
# ramp and the attention factor all change the logits; the second variant takes the factor from mscale (DeepSeek's
# form), the third gives it outright.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0}
VARIANTS = [
    YARN,
    {**YARN, "factor": 8.0, "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16.0},
    {**YARN, "attention_factor": 1.3, "truncate": False},
]


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("scaling", VARIANTS, ids=["qwen3", "mscale", "attention_factor"])
def test_table_and_logits_match_hf(scaling):
    model_dir = tiny_model_dir("qwen3", rope_scaling=scaling)
    hf = hf_model(model_dir)
    rotary = hf.model.rotary_emb
    assert rotary.rope_type == "yarn" and rotary.attention_scaling != 1.0
    positions = torch.arange(300)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    runner = ModelRunner(
        ServerArgs(device="cpu", dtype="float32", max_total_tokens=1024, max_running_requests=4), model_dir
    )
    table = runner.model.model.layers[0].self_attn.rotary_emb.cos_sin_cache
    half = table.shape[1] // 2
    torch.testing.assert_close(table[:300, :half], cos[0, :, :half], rtol=0, atol=0)
    torch.testing.assert_close(table[:300, half:], sin[0, :, :half], rtol=0, atol=0)
    # Every layer reads one shared table.
    assert all(layer.self_attn.rotary_emb.cos_sin_cache is table for layer in runner.model.model.layers)

    ids = np.random.default_rng(3).integers(0, 49152, 300).astype(np.int32)
    batch = ForwardBatch(
        step=0,
        req_pool_indices=pack_i32([1]),
        prefix_lens=pack_i32([0]),
        extend_lens=pack_i32([300]),
        input_ids=ids.tobytes(),
        out_cache_loc=pack_i32(np.arange(1, 301)),
        sample_mask=b"\x01",
        new_requests=[WorkerRequest(1, SamplingParams(temperature=0.0))],
    )
    ours = runner.compute_logits(batch, all_positions=True)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids.tolist()])).logits[0]
    err = ((ours.double() - theirs.double()).norm() / theirs.double().norm()).item()
    assert err < 1e-5, err


def test_greedy_tokens_match_hf_generate():
    """Through the engine (scheduler + model runner, chunked prefill, decode steps): the same greedy tokens as HF's
    generate, with the context far past the original 64 positions."""
    from scheduler_service.in_process_engine import InProcessEngine

    model_dir = tiny_model_dir("qwen3", rope_scaling=YARN)
    hf = hf_model(model_dir)
    prompt = np.random.default_rng(5).integers(0, 49152, 200).tolist()
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24, pad_token_id=0
        )[0, 200:].tolist()
    engine = InProcessEngine(str(model_dir), device="cpu", max_total_tokens=1024, chunked_prefill_size=64)
    out = engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True))
    assert out.token_ids == expected


def test_unknown_rope_type_is_refused():
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'dynamic'"):
        rope_table(16, 8, 10000.0, {"rope_type": "dynamic", "factor": 2.0})
