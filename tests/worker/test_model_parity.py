"""The model runner computes what HF transformers computes (fp32, CPU), with the KV cache in scattered slots."""

import numpy as np
import pytest
import torch

from radixserve.config import ServerArgs
from radixserve.protocol import ForwardBatch, ReusedSlots, WorkerRequest, pack_i32
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import tiny_model_dir
from radixserve.worker.model_runner import ModelRunner

ARCHS = ["llama", "qwen2", "qwen3"]
NUM_SLOTS = 4096
GREEDY = SamplingParams(temperature=0.0)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module", params=ARCHS)
def setup(request):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir(request.param)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner = ModelRunner(
        ServerArgs(device="cpu", dtype="float32", max_total_tokens=NUM_SLOTS, max_running_requests=8), model_dir
    )
    return hf, runner


def hf_logits(hf, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


class SlotPool:
    """Hands out random, scattered slots so that nothing relies on contiguity."""

    def __init__(self, seed=0):
        self.free = list(np.random.default_rng(seed).permutation(np.arange(1, NUM_SLOTS + 1)))

    def take(self, n):
        out, self.free = self.free[:n], self.free[n:]
        return np.asarray(out, dtype=np.int32)


def batch(rows, prefix_lens, chunks, slots, new_rows=(), row_writes=(), step=0):
    return ForwardBatch(
        step=step,
        req_pool_indices=pack_i32(rows),
        prefix_lens=pack_i32(prefix_lens),
        extend_lens=pack_i32([len(c) for c in chunks]),
        input_ids=pack_i32(np.concatenate(chunks)),
        out_cache_loc=pack_i32(np.concatenate(slots)),
        sample_mask=bytes([1] * len(rows)),
        new_requests=[WorkerRequest(r, GREEDY) for r in new_rows],
        reused_slots=list(row_writes),
    )


def random_ids(n, seed, vocab=49152):
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


def test_full_prefill_matches_hf(setup):
    hf, runner = setup
    ids = random_ids(53, 1)
    out = runner.compute_logits(batch([1], [0], [ids], [SlotPool(1).take(53)], [1]), all_positions=True)
    assert rel_err(out, hf_logits(hf, ids.tolist())) < 1e-4


def test_extend_over_cached_prefix_in_scattered_slots(setup):
    hf, runner = setup
    ids = random_ids(70, 2)
    pool = SlotPool(2)
    prefix_slots = pool.take(41)
    # Request A computes the prefix in row 2; request B (row 3) reuses those slots through its page table.
    runner.compute_logits(batch([2], [0], [ids[:41]], [prefix_slots], [2]))
    out = runner.compute_logits(
        batch([3], [41], [ids[41:]], [pool.take(29)], [3], [ReusedSlots(3, 0, prefix_slots.tobytes())]),
        all_positions=True,
    )
    assert rel_err(out, hf_logits(hf, ids.tolist())[41:]) < 1e-4


def test_sixteen_decode_steps(setup):
    hf, runner = setup
    ids = random_ids(20, 3).tolist()
    pool = SlotPool(3)
    logits = runner.compute_logits(batch([4], [0], [np.asarray(ids)], [pool.take(20)], [4]))
    for step in range(16):
        token = int(logits[-1].argmax())
        ids.append(token)
        logits = runner.compute_logits(batch([4], [len(ids) - 1], [np.asarray([token])], [pool.take(1)]))
        assert rel_err(logits[0], hf_logits(hf, ids)[-1]) < 1e-4, f"decode step {step}"


def test_batch_of_four_equals_each_alone(setup):
    _, runner = setup
    lengths = [1, 17, 33, 8]
    prompts = [random_ids(n, 10 + i) for i, n in enumerate(lengths)]
    alone = []
    for i, ids in enumerate(prompts):
        # A copy: compute_logits's result is only valid until its next call (a kept buffer on the CPU, as CUDA
        # graphs' output on the GPU).
        alone.append(runner.compute_logits(batch([5], [0], [ids], [SlotPool(20 + i).take(len(ids))], [5]))[0].clone())
    pool = SlotPool(30)
    together = runner.compute_logits(
        batch([1, 2, 3, 4], [0] * 4, prompts, [pool.take(n) for n in lengths], [1, 2, 3, 4])
    )
    for i in range(4):
        assert rel_err(together[i], alone[i]) < 1e-5


@pytest.mark.parametrize("decode_last", [False, True])
def test_mixed_batch_of_extends_and_decodes(setup, decode_last):
    """Decodes (extend 1 over a prefix) and a fresh prompt in one forward equal HF on each sequence. With the decodes
    last (the scheduler's order) they run through the decode kernel, otherwise through the extend kernel."""
    hf, runner = setup
    pool = SlotPool(40)
    long_ids = [random_ids(30, 41), random_ids(18, 43)]
    for row, ids in zip((6, 8), long_ids):
        runner.compute_logits(batch([row], [0], [ids[:-1]], [pool.take(len(ids) - 1)], [row]))
    fresh = random_ids(12, 42)
    entries = [(6, 29, long_ids[0][29:]), (8, 17, long_ids[1][17:]), (7, 0, fresh)]
    if decode_last:
        entries = entries[2:] + entries[:2]
    rows, prefixes, chunks = zip(*entries)
    out = runner.compute_logits(
        batch(list(rows), list(prefixes), list(chunks), [pool.take(len(c)) for c in chunks], [7])
    )
    expected = {
        6: hf_logits(hf, long_ids[0].tolist())[-1],
        8: hf_logits(hf, long_ids[1].tolist())[-1],
        7: hf_logits(hf, fresh.tolist())[-1],
    }
    for i, row in enumerate(rows):
        assert rel_err(out[i], expected[row]) < 1e-4, row


def test_linear_rope_scaling_matches_hf():
    """The linear rope_scaling variant (positions divided by the factor), on a tiny Llama."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir("llama", rope_scaling={"rope_type": "linear", "factor": 4.0})
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner = ModelRunner(ServerArgs(device="cpu", max_total_tokens=NUM_SLOTS, max_running_requests=8), model_dir)
    assert runner.model_config.rope_scaling["rope_type"] == "linear"
    ids = random_ids(300, 7)  # long enough for the scaled positions to matter
    out = runner.compute_logits(batch([1], [0], [ids], [SlotPool(7).take(300)], [1]), all_positions=True)
    assert rel_err(out, hf_logits(hf, ids.tolist())) < 1e-4
