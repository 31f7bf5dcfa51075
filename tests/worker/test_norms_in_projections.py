"""A decode layer's RMSNorms inside the projections (kernels.fuses_norms, models/llama.py): the same function as the
norms apart.

fold_norm_weights moves each layer's two norm weights into the QKV and gate/up weights; a decode-sized step then
adds the residual and sums its squares in the output and down projections' epilogues and scales the QKV and gate/up
rows by 1/rms. On the CPU the twins run that dataflow (kernels.linear_add, reference.scale_rows); in a child process
under TRITON_INTERPRET=1 the Triton kernels do, for a model step and through the scheduler (InProcessEngine). Both
are held to the unfolded model with its norms apart, in fp32; on a GPU, the engine's greedy tokens.
"""

import json
import sys

import pytest
from greedy_tokens import greedy_token_ids
import torch

import kernels

# per-head Q/K norms; none (and llama3 RoPE scaling); a QKV bias: radixserve.testing's tiny models
ARCHS = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def _model(arch, seed=3):
    from radixserve.loader import load_dummy
    from radixserve.model_config import ModelConfig
    from radixserve.models.registry import model_class
    from radixserve.testing.tiny_models import tiny_config

    cfg = ModelConfig.from_dict(tiny_config(ARCHS[arch], vocab_size=300).to_dict())
    model = model_class(arch)(cfg).eval()
    load_dummy(model, seed)
    return model, cfg


def _logits(model, cfg, requests=5):
    """Logits of one decode step of `requests` requests (6 tokens of context each) over fresh KV caches."""
    from bench import kernels_per_layer as kpl
    from radixserve.forward_context import set_forward_context

    ctx, ids, positions = kpl.decode_step(model, cfg, requests, 0, 6, device="cpu")
    for layer in model.model.layers:
        layer.self_attn.attn.k_cache = layer.self_attn.attn.k_cache.float()
        layer.self_attn.attn.v_cache = layer.self_attn.attn.v_cache.float()
    set_forward_context(ctx)
    try:
        with torch.inference_mode():
            return model.compute_logits(model(ids, positions))
    finally:
        set_forward_context(None)


def _piece_logits(model, cfg, requests=5):
    """_logits through the prefill graphs' pieces (LlamaModel.piece) with each layer's attention run between them."""
    from bench import kernels_per_layer as kpl
    from radixserve.forward_context import set_forward_context

    ctx, ids, positions = kpl.decode_step(model, cfg, requests, 0, 6, device="cpu")
    layers = model.model.layers
    for layer in layers:
        layer.self_attn.attn.k_cache = layer.self_attn.attn.k_cache.float()
        layer.self_attn.attn.v_cache = layer.self_attn.attn.v_cache.float()
    set_forward_context(ctx)
    try:
        with torch.inference_mode():
            x, residual = ids, None
            for i, layer in enumerate(layers):
                qkv, residual = model.model.piece(i, positions, x, residual)
                x = layer.self_attn.attn.attend(*qkv)
            return model.compute_logits(model.model.piece(len(layers), positions, x, residual)[0])
    finally:
        set_forward_context(None)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("arch", ARCHS)
def test_norms_in_the_projections_compute_the_unfolded_model(arch, monkeypatch):
    model, cfg = _model(arch)
    want = _logits(model, cfg)
    assert not any(layer.norms_folded for layer in model.model.layers)  # the CPU's kernels never fold

    adds = []
    real_linear_add = kernels.linear_add
    monkeypatch.setattr(kernels, "fuses_norms", lambda x, *weights: True)  # the GPU's decision, on the twins
    monkeypatch.setattr(kernels, "linear_add", lambda *a: adds.append(1) or real_linear_add(*a))
    model.fold_norm_weights()
    assert all(layer.norms_folded for layer in model.model.layers)
    assert all(torch.all(layer.input_layernorm.weight == 1) for layer in model.model.layers)
    fused = _logits(model, cfg)
    assert len(adds) == 2 * cfg.num_layers  # every output and down projection added its residual
    assert torch.equal(_piece_logits(model, cfg), fused)  # the prefill graphs' pieces hand the Normed on too
    monkeypatch.setattr(kernels, "fuses_norms", lambda x, *weights: False)
    apart = _logits(model, cfg)  # the folded weights with the norms apart: what larger batches run
    assert _rel(fused, want) < 1e-5 and _rel(apart, want) < 1e-5
    assert _rel(fused, want * 1.001) > 1e-4  # the check can tell


def test_fold_needs_the_devices_kernels():
    model, _ = _model("Qwen3ForCausalLM")
    weights = [layer.self_attn.qkv_proj.weight.clone() for layer in model.model.layers]
    model.fold_norm_weights()  # CPU tensors, reference kernels: nothing moves
    assert all(torch.equal(w, layer.self_attn.qkv_proj.weight) for w, layer in zip(weights, model.model.layers))


def _engine_greedy(norms_in_projections, device, requests, tokens, **flags):
    """Greedy tokens of a tiny Qwen3 whose projections all take the skinny kernel (widths in whole 128-wide steps),
    PDL off so that they launch without it (kernels.fuses_norms), fp32, through InProcessEngine; its model folded
    exactly when the norms run in the projections."""
    from radixserve.testing.tiny_models import tiny_model_dir
    from scheduler_service.in_process_engine import InProcessEngine

    model_dir = str(tiny_model_dir("qwen3", hidden_size=128, intermediate_size=256, head_dim=32))
    previous = kernels.configure(norms_in_projections=norms_in_projections)
    try:
        engine = InProcessEngine(
            model_dir,
            device=device,
            dtype="float32",
            disable_pdl=True,
            max_total_tokens=4096,
            max_running_requests=16,
            **flags,
        )
        assert engine.runner.model.model.layers[0].norms_folded == norms_in_projections
        return greedy_token_ids(engine, requests, tokens)
    finally:
        kernels.configure(**previous)


@pytest.mark.gpu
def test_gpu_greedy_outputs_are_the_same_with_the_norms_in_the_projections():
    # Through the decode CUDA graphs and the prefill graphs' pieces too, on the GPU's own kernels.
    graphs = dict(cuda_graph_max_bs=16, prefill_cuda_graph_max_tokens=512)
    assert _engine_greedy(True, "cuda", 12, 16, **graphs) == _engine_greedy(False, "cuda", 12, 16, **graphs)


def interpreter_check(mode: str) -> None:
    """In a child with TRITON_INTERPRET=1: greedy tokens through the scheduler (InProcessEngine: admission, chunked
    prefill, decode batches) with the norms in the projections (mode "on") or apart ("off"), printed for the test to
    compare, the two modes being two children side by side. Each child also checks half the architectures' decode
    step with the norms in the projections on the Triton kernels against the unfolded model's on the torch twins, for
    a batch within and past a skinny tile."""
    for arch in list(ARCHS)[mode == "off" :: 2]:
        for requests in (3, 16):
            kernels.set_backend("reference")
            model, cfg = _model(arch)
            want = _logits(model, cfg, requests)
            kernels.set_backend("triton")
            model.fold_norm_weights()
            assert all(layer.norms_folded for layer in model.model.layers), arch
            got = _logits(model, cfg, requests)
            err = _rel(got, want)
            print(f"{arch} {requests} requests: norms in the projections vs apart, rel err {err:.2e}", flush=True)
            assert err < 1e-4, (arch, requests, err)
    tokens = _engine_greedy(mode == "on", "cpu", 4, 4, kernel_backend="triton")
    print(f"engine greedy tokens: {json.dumps(tokens)}", flush=True)


@pytest.mark.server
def test_norms_in_the_projections_in_interpreter():
    from interpreter_child import printed_json, run_interpreted_together  # tests/helpers; not in the child itself

    on, off = run_interpreted_together(__file__, [["on"], ["off"]])
    assert (on + off).count(" requests: norms in the projections") == 2 * len(ARCHS)
    tokens = printed_json(on, "engine greedy tokens")
    assert len(tokens) == 4 and all(len(t) == 4 for t in tokens), tokens
    assert tokens == printed_json(off, "engine greedy tokens")


if __name__ == "__main__":
    interpreter_check(sys.argv[1])
