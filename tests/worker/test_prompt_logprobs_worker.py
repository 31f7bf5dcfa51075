"""Prompt logprobs on the worker (SamplingParams.prompt_logprobs, behind /v1/completions echo): a prompt prefilled in
chunks, beside a request that asks for none, gets for every position 1.. the log-softmax HF transformers gives that
token after the ones before it, with the right top k, including the first token of each chunk (scored from the row
that ended the previous chunk)."""

import numpy as np
import torch

from radixserve.config import ServerArgs
from radixserve.protocol import ForwardBatch, WorkerRequest, pack_i32
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import tiny_model_dir
from radixserve.worker.model_runner import ModelRunner

TOP_K = 3
CHUNKS = [(0, 20), (20, 37), (37, 50)]  # the prompt's prefill chunks


def step_batch(step, entries, new_requests):
    """entries: (row, prefix_len, ids, slots, samples) per request of the batch."""
    return ForwardBatch(
        step=step,
        req_pool_indices=pack_i32([e[0] for e in entries]),
        prefix_lens=pack_i32([e[1] for e in entries]),
        extend_lens=pack_i32([len(e[2]) for e in entries]),
        input_ids=pack_i32(np.concatenate([e[2] for e in entries])),
        out_cache_loc=pack_i32(np.concatenate([e[3] for e in entries])),
        sample_mask=bytes([int(e[4]) for e in entries]),
        new_requests=new_requests,
    )


def test_chunked_prompt_logprobs_match_hf():
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir("llama")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner = ModelRunner(
        ServerArgs(device="cpu", dtype="float32", max_total_tokens=1024, max_running_requests=4), model_dir
    )
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 49152, CHUNKS[-1][1]).astype(np.int32)
    other = rng.integers(0, 49152, 9).astype(np.int32)
    slots = rng.permutation(np.arange(1, 1025))[: len(ids) + len(other)].astype(np.int32)
    wanted = SamplingParams(temperature=0.0, prompt_logprobs=TOP_K)
    found = {}
    for step, (lo, hi) in enumerate(CHUNKS):
        entries = [(2, lo, ids[lo:hi], slots[lo:hi], hi == len(ids))]
        new = [WorkerRequest(2, wanted)] if step == 0 else []
        if step == 1:  # a neighbour that wants no prompt logprobs, ahead of ours in the batch
            entries.insert(0, (1, 0, other, slots[len(ids) :], True))
            new.append(WorkerRequest(1, SamplingParams(temperature=0.0)))
        sampled = runner.forward(step_batch(step, entries, new))
        for part in sampled.prompt_logprobs:
            assert entries[part.index][0] == 2  # only the request that asked
            for j, entry in enumerate(part.logprobs):
                assert part.start + j not in found
                found[part.start + j] = entry
    assert sorted(found) == list(range(1, len(ids)))

    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([ids.tolist()])).logits[0].double(), dim=-1)
    for position, entry in found.items():
        expected = reference[position - 1]
        assert abs(entry.logprob - expected[ids[position]].item()) < 1e-4, position
        top_ids = np.frombuffer(entry.top_ids, dtype=np.int32)
        top_values = np.frombuffer(entry.top_logprobs, dtype=np.float32)
        assert len(top_ids) == TOP_K
        assert np.allclose(top_values, expected[torch.from_numpy(top_ids.astype(np.int64))].numpy(), atol=1e-4)
        assert np.allclose(top_values, expected.topk(TOP_K).values.numpy(), atol=1e-4)
