"""Piecewise prefill CUDA graphs (radixserve/worker/prefill_cuda_graph.py): the forward cut at the attention kernels
computes what the whole forward does (CPU), the token buckets cover every step size, and on a GPU a runner that
replays the pieces gives the eager runner's hidden states and greedy tokens."""

import numpy as np
import pytest
import torch

from radixserve.config import ServerArgs
from radixserve.forward_context import set_forward_context
from radixserve.protocol import ForwardBatch, WorkerRequest, pack_i32
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import tiny_model_dir
from radixserve.worker.model_runner import ModelRunner
from radixserve.worker.prefill_cuda_graph import token_buckets

GREEDY = SamplingParams(temperature=0.0)


def mixed_batch(vocab: int, seed: int = 0, lengths=(37, 21)) -> ForwardBatch:
    """Prompt chunks of the given lengths, one request each, nothing cached."""
    rng = np.random.default_rng(seed)
    chunks = [rng.integers(0, vocab, n).astype(np.int32) for n in lengths]
    rows = list(range(1, len(lengths) + 1))
    return ForwardBatch(
        step=0,
        req_pool_indices=pack_i32(rows),
        prefix_lens=pack_i32([0] * len(rows)),
        extend_lens=pack_i32(lengths),
        input_ids=pack_i32(np.concatenate(chunks)),
        out_cache_loc=pack_i32(np.arange(1, sum(lengths) + 1, dtype=np.int32)),
        sample_mask=bytes([1] * len(rows)),
        new_requests=[WorkerRequest(r, GREEDY) for r in rows],
    )


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_pieces_in_turn_equal_the_forward(arch):
    runner = ModelRunner(
        ServerArgs(device="cpu", dtype="float32", max_total_tokens=512, max_running_requests=4), tiny_model_dir(arch)
    )
    inputs = runner.prepare(mixed_batch(runner.model_config.vocab_size))
    whole = runner.run_model(inputs).clone()
    model = runner.model.model
    set_forward_context(inputs.ctx)
    try:
        x, residual = inputs.input_ids, None
        for i, layer in enumerate(model.layers):
            (q, k, v, pending), residual = model.piece(i, inputs.positions, x, residual)
            x = layer.self_attn.attn.attend(q, k, v, pending, out=torch.empty(len(q) + 5, *q.shape[1:]))
        pieces, _ = model.piece(len(model.layers), inputs.positions, x, residual)
    finally:
        set_forward_context(None)
    assert torch.equal(pieces, whole)


def test_token_buckets_cover_every_size_with_bounded_padding():
    buckets = token_buckets(2048)
    assert buckets[0] == 16 and buckets[-1] == 2048 and buckets == sorted(set(buckets))
    for n in range(1, 2049):
        b = next(size for size in buckets if size >= n)
        assert b - n < max(16, n)  # at most the step again (small steps), else under a third more
        assert n <= 256 or (b - n) / n < 1 / 3
        assert n <= 1024 or (b - n) / n < 1 / 8
    assert token_buckets(100)[-1] == 100


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("lengths", [(37, 21), (45,)])  # pieces with attention between; a lone chunk's whole graph
def test_prefill_graphs_replay_what_the_eager_forward_computes(arch, lengths):
    args = dict(
        device="cuda", dtype="float32", max_total_tokens=2048, max_running_requests=4, prefill_cuda_graph_max_tokens=256
    )
    graphs = ModelRunner(ServerArgs(**args), tiny_model_dir(arch))
    eager = ModelRunner(ServerArgs(**args, disable_prefill_cuda_graph=True), tiny_model_dir(arch))
    assert graphs.prefill_graphs is not None and eager.prefill_graphs is None
    batch = mixed_batch(graphs.model_config.vocab_size, lengths=lengths)
    with torch.inference_mode():
        replayed = graphs.run_model(graphs.prepare(batch)).clone()
        expected = eager.run_model(eager.prepare(batch))
    assert replayed.shape == expected.shape
    assert torch.allclose(replayed, expected, rtol=1e-4, atol=1e-4), (replayed - expected).abs().max()
