"""A decode step's Q/K norms, RoPE and K/V store done by the plain decode kernel itself (kernels.PendingQKV,
OPTIONS["qkv_in_decode_max_rows"]) against their own kernel first: which steps leave them pending, and the same greedy
tokens through the scheduler under TRITON_INTERPRET=1 (in CI) and on the GPU (gpu-marked). The kernel against its twin
is bench/kernel_check_cases.py's decode_prepared cases (tests/worker/test_kernels_triton.py runs them)."""

import json
import sys

import pytest
from greedy_tokens import greedy_token_ids
import torch

import kernels
from radixserve.forward_context import ForwardContext, set_forward_context
from radixserve.layers.attention import Attention


def _context(extend_tokens: int, requests: int, tokens: int) -> ForwardContext:
    ints = lambda n: torch.zeros(n, dtype=torch.int32)  # noqa: E731
    return ForwardContext(
        num_extend_reqs=1 if extend_tokens else 0,
        num_extend_tokens=extend_tokens,
        req_to_token=torch.zeros(4, 64, dtype=torch.int32),
        req_pool_indices=ints(requests),
        prefix_lens=ints(requests),
        extend_lens=ints(requests),
        extend_start_loc=ints(requests),
        seq_lens=ints(requests),
        out_cache_loc=torch.arange(tokens, dtype=torch.int32),
        max_extend_len=extend_tokens,
        max_seq_len=64,
    )


@pytest.mark.parametrize(
    "extend_tokens,requests,tokens,pending",
    [
        (0, 3, 3, True),  # a decode step: every token a request's
        (5, 2, 6, False),  # a mixed step: the extend kernel reads the new K/V from the cache
        (0, 0, 8, False),  # a prefill graph's capture: tokens but no requests, the store goes into the piece
    ],
)
def test_only_plain_decode_steps_leave_it_pending(extend_tokens, requests, tokens, pending):
    attn = Attention(4, 2, 16, 0.25)
    attn.k_cache, attn.v_cache = torch.zeros(16, 2, 16), torch.zeros(16, 2, 16)
    q, k, v = torch.randn(tokens, 4, 16), torch.randn(tokens, 2, 16), torch.randn(tokens, 2, 16)
    cos_sin = torch.randn(64, 16)
    set_forward_context(_context(extend_tokens, requests, tokens))
    try:
        left = attn.store_rotated(torch.zeros(tokens, dtype=torch.int64), q, k, v, cos_sin, None, None, 1e-6)
    finally:
        set_forward_context(None)
    assert (left is not None) == pending
    assert bool(attn.k_cache.abs().sum() == 0) == pending  # stored now exactly when nothing is left pending


@pytest.mark.parametrize("batch,in_kernel", [(2, True), (3, False)])
def test_decode_steps_past_the_row_limit_run_the_qkv_kernel_first(monkeypatch, batch, in_kernel):
    # qkv_in_decode_max_rows: up to that many requests the pending prep goes to the decode kernel (here the CPU twin,
    # which does it itself); past it kernels.decode_attention runs qk_norm_rope_store before handing the step on.
    first = []
    store = kernels.qk_norm_rope_store
    monkeypatch.setattr(kernels, "qk_norm_rope_store", lambda *args: first.append(True) or store(*args))
    q, k, v = torch.randn(batch, 4, 16), torch.randn(batch, 2, 16), torch.randn(batch, 2, 16)
    k_cache, v_cache = torch.zeros(16, 2, 16), torch.zeros(16, 2, 16)
    pending = kernels.PendingQKV(
        k,
        v,
        torch.zeros(batch, dtype=torch.int64),
        torch.randn(64, 16),
        None,
        None,
        1e-6,
        torch.arange(batch, dtype=torch.int32),
    )
    table = torch.arange(batch, dtype=torch.int32)[:, None]  # each request's one token: its new slot
    lens = torch.ones(batch, dtype=torch.int32)
    previous = kernels.configure(qkv_in_decode_max_rows=2)
    try:
        kernels.decode_attention(
            q, k_cache, v_cache, torch.empty_like(q), table, torch.arange(batch), lens, 0.25, 8, pending
        )
    finally:
        kernels.configure(**previous)
    assert bool(first) != in_kernel
    assert k_cache[:batch].abs().sum() > 0  # stored either way


def _engine_greedy(qkv_in_decode, device, arch, requests, tokens, **flags):
    from radixserve.testing.tiny_models import tiny_model_dir
    from scheduler_service.in_process_engine import InProcessEngine

    previous = kernels.configure(qkv_in_decode_max_rows=1 << 20 if qkv_in_decode else 0)  # on: every batch
    try:
        engine = InProcessEngine(
            str(tiny_model_dir(arch)), device=device, dtype="float32", max_total_tokens=4096, **flags
        )
        return greedy_token_ids(engine, requests, tokens)
    finally:
        kernels.configure(**previous)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_gpu_greedy_outputs_are_the_same_with_the_qkv_prep_in_the_decode_kernel(arch):
    # Decode CUDA graphs and eager decode batches past them (12 requests, graphs up to 8), prefill graphs too.
    graphs = dict(cuda_graph_max_bs=8, prefill_cuda_graph_max_tokens=512, max_running_requests=16)
    assert _engine_greedy(True, "cuda", arch, 12, 16, **graphs) == _engine_greedy(False, "cuda", arch, 12, 16, **graphs)


def interpreter_check(mode: str) -> None:
    """In a child with TRITON_INTERPRET=1: greedy tokens with the Q/K/V prep in the decode kernel (mode "on") or in
    its own kernel ("off"), printed for the test to compare (the two modes run as two children side by side)."""
    for arch in ("qwen3", "llama"):  # Q/K norms and none; llama3 RoPE scaling
        tokens = _engine_greedy(mode == "on", "cpu", arch, 3, 4, kernel_backend="triton", max_running_requests=4)
        print(f"{arch} greedy tokens: {json.dumps(tokens)}", flush=True)


@pytest.mark.server
def test_greedy_outputs_are_the_same_with_the_qkv_prep_in_the_decode_kernel_in_interpreter():
    from interpreter_child import printed_json, run_interpreted_together  # tests/helpers; not in the child itself

    on, off = run_interpreted_together(__file__, [["on"], ["off"]])
    for arch in ("qwen3", "llama"):
        tokens = printed_json(on, f"{arch} greedy tokens")
        assert len(tokens) == 3 and all(len(t) == 4 for t in tokens), tokens
        assert tokens == printed_json(off, f"{arch} greedy tokens"), arch


if __name__ == "__main__":
    interpreter_check(sys.argv[1])
