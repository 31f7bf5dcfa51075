"""CPU workers keep their per-step memory flat (radixserve/worker/cpu_logits.py): logits go into a buffer kept across
steps and are sampled in blocks of rows, with the same tokens as one sampler call over the whole batch."""

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from radixserve.config import ServerArgs
from radixserve.layers.sampler import Sampler, SamplingRequestState
from radixserve.protocol import ForwardBatch, WorkerRequest, pack_i32
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import tiny_model_dir
from radixserve.worker.cpu_logits import CpuLogits
from radixserve.worker.model_runner import ModelRunner

VOCAB = 49152  # the tiny models' (and SmolLM2's)


def mixed_states(n: int) -> list[SamplingRequestState]:
    """Rows whose tokens do not depend on the rest of the batch: greedy ones with bias and penalties, seeded ones
    with top-k / top-p / min-p, some asking for logprobs."""
    states = []
    for i in range(n):
        kind = i % 4
        counts = torch.bincount(torch.tensor([i, i, 7]), minlength=VOCAB) if kind == 1 else None
        params = [
            SamplingParams(temperature=0.0, logprobs=3 if i % 3 == 0 else None),
            SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3),
            SamplingParams(temperature=0.8, top_p=0.9, seed=1000 + i, logit_bias={5: 2.0}),
            SamplingParams(temperature=1.2, top_k=40, min_p=0.05, seed=2000 + i),
        ][kind]
        states.append(SamplingRequestState(params, eos_ids=[0], num_outputs=2, output_counts=counts, seen_mask=None))
    return states


def test_blocked_sampling_gives_the_tokens_of_one_call():
    logits = torch.randn(40, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    rows = np.array([0, 1, 2, 3, 5, 6, 9, 10, 11, 12, 13, 14, 20, 21, 22, 30, 31, 33, 34, 35, 36, 39])  # with gaps
    states = mixed_states(len(rows))
    positions = list(range(100, 100 + len(rows)))
    sampler = Sampler(VOCAB, torch.device("cpu"))
    whole_tokens, whole_logprobs = sampler(logits[torch.from_numpy(rows)].clone(), states, positions)
    blocked = CpuLogits(VOCAB, max_rows=40, block_mib=3, dtype=torch.float32)
    assert blocked.rows_per_block == 5
    tokens, logprobs = blocked.sample(sampler, logits.clone(), rows, states, positions)
    assert torch.equal(tokens, whole_tokens)
    assert torch.allclose(logprobs, whole_logprobs, atol=1e-6)


def runner_and_batch(block_mib: int, rows: int = 64):
    runner = ModelRunner(
        ServerArgs(
            device="cpu",
            dtype="float32",
            max_total_tokens=4096,
            max_running_requests=rows,
            cpu_logits_block_mib=block_mib,
        ),
        tiny_model_dir("llama"),
    )
    params = SamplingParams(temperature=0.7, top_p=0.9)
    prompts = [np.asarray([1 + i, 2 + i], dtype=np.int32) for i in range(rows)]
    batch = ForwardBatch(
        step=0,
        req_pool_indices=pack_i32(range(rows)),
        prefix_lens=pack_i32([0] * rows),
        extend_lens=pack_i32([2] * rows),
        input_ids=pack_i32(np.concatenate(prompts)),
        out_cache_loc=pack_i32(np.arange(1, 2 * rows + 1)),
        sample_mask=bytes([1] * rows),
        new_requests=[WorkerRequest(r, params) for r in range(rows)],
    )
    return runner, batch


def largest_allocation(block_mib: int) -> int:
    """Bytes of the largest allocation one op makes while a 64-row step computes its logits and samples."""
    runner, batch = runner_and_batch(block_mib)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        runner.finish_step(runner.sample(batch, runner.compute_logits(batch)))
    return max(event.self_cpu_memory_usage for event in prof.events())


def test_a_cpu_step_allocates_nothing_larger_than_a_block():
    """64 rows x 49,152 fp32 logits are 12 MiB per tensor (top-p's sort: 36 MiB). Blocked, no op allocates more
    than a 4 MiB block; the whole-batch path (--cpu-logits-block-mib 0) allocates the full logits several times a
    step."""
    assert largest_allocation(4) <= 4 << 20
    assert largest_allocation(0) >= 64 * VOCAB * 4
