"""Programmatic dependent launch (kernels/triton_common.py) changes when the decode step's kernels start, never what
they compute: a step's logits are bitwise the same with it on and off, eagerly and replayed as a CUDA graph, at batch 1
and on W1's shared prefixes (where the suffix kernel runs beside the prefix kernel). On a GPU older than Hopper both
runs launch without it and the test still holds."""

import pytest
import torch


def _logits(model, ctx, ids, positions):
    """(eager logits, CUDA-graph logits) of one decode step."""
    from bench.gpu_timing import capture
    from radixserve.forward_context import set_forward_context

    set_forward_context(ctx)
    try:
        with torch.inference_mode():
            eager = model.compute_logits(model(ids, positions)).float()
            out = {}
            graph = capture(lambda: out.__setitem__("logits", model.compute_logits(model(ids, positions))))
            out["logits"].zero_()
            graph.replay()
            torch.cuda.synchronize()
            replayed = out["logits"].float().clone()
            del graph
    finally:
        set_forward_context(None)
    return eager, replayed


@pytest.mark.gpu
def test_decode_steps_compute_the_same_with_pdl_on_and_off():
    import kernels
    from bench import kernels_per_layer as kpl

    model, cfg = kpl.build_model("qwen3-0.6b", num_layers=2)
    previous = dict(kernels.OPTIONS)
    try:
        for batch in ("bs1", "W1"):
            requests, shared, own = kpl.BATCHES[batch]
            ctx, ids, positions = kpl.decode_step(model, cfg, requests, shared, own)
            runs = {}
            for pdl in (0, 1):  # the same group table (slices per prefix) for both: only the launches differ
                kernels.configure(pdl=pdl)
                runs[pdl] = _logits(model, ctx, ids, positions)
            for off, on in zip(runs[0], runs[1]):
                assert torch.isfinite(off).all()
                assert torch.equal(off, on), (batch, (off - on).abs().max().item())
    finally:
        kernels.configure(**previous)
