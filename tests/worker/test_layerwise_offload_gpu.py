"""Layer-wise KV offload and YaRN on a GPU: the side stream's copies against the compute stream (a missing wait
shows as wrong K/V once the compute stream is held back), the same greedy tokens with offload as on a pool that holds
everything (fp32, Triton kernels, CUDA graphs on the ordinary path), and the fused Q/K norm + RoPE + KV store kernel
reading a YaRN table. bench/gpu_round_long_context.sh runs these (with pytest, or by calling them when it is absent).
"""

import numpy as np
import torch

try:
    import pytest

    pytestmark = pytest.mark.gpu
    server = pytest.mark.server  # a test that starts processes (tests/conftest.py)
except ImportError:  # the GPU machine may lack pytest: the round's script calls the tests itself
    pytest = None
    server = lambda test: test  # noqa: E731

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}


def test_ring_copies_wait_for_each_other():
    """Ten layers through a ring of 2: each layer's buffer is filled from the host on the side stream while the
    compute stream is held back (torch.cuda._sleep), read by the 'layer', and new rows written and copied out. Every
    read must see its own layer's host data and every copy out must carry what its layer wrote."""
    from radixserve.worker.kv_cache import pinned_empty
    from radixserve.worker.layer_ring import LayerRing, host_runs

    dev = torch.device("cuda")
    layers, tokens, heads, dim = 10, 4096, 2, 64
    ring = LayerRing(2, tokens + 8, heads, dim, torch.float32, dev)
    host_k, host_v = (pinned_empty((layers, 2 * tokens, heads, dim), torch.float32) for _ in range(2))
    assert host_k.is_pinned()
    host_k.copy_(torch.randn(host_k.shape))
    host_v.copy_(torch.randn(host_v.shape))
    context = np.arange(0, tokens, dtype=np.int32)  # host slots of the context: one run
    new_slots = np.arange(tokens, tokens + 8, dtype=np.int32)
    sums = []
    for layer in range(layers):

        def fill(b, layer=layer):
            ring.load(b, 1, host_k[layer], host_v[layer], host_runs(context))

        b = ring.acquire(("job", layer), layer, fill)
        if layer + 1 < layers:
            ring.prefetch(
                ("job", layer + 1),
                layer + 1,
                lambda b, layer=layer + 1: ring.load(b, 1, host_k[layer], host_v[layer], host_runs(context)),
            )
        torch.cuda._sleep(2_000_000)  # the compute stream falls behind the copies
        sums.append(ring.k[b][1 : 1 + tokens].sum() + ring.v[b][1 : 1 + tokens].sum())
        ring.k[b][1 + tokens : 1 + tokens + 8] = float(layer)
        ring.v[b][1 + tokens : 1 + tokens + 8] = -float(layer)
        ring.save(b, [(1 + tokens, 8)], host_k[layer], host_v[layer], host_runs(new_slots))
    torch.cuda.synchronize()
    for layer in range(layers):
        want = host_k[layer, :tokens].sum() + host_v[layer, :tokens].sum()
        torch.testing.assert_close(sums[layer].cpu(), want, rtol=1e-4, atol=1e-2)
        assert (host_k[layer, tokens : tokens + 8] == layer).all() and (
            host_v[layer, tokens : tokens + 8] == -layer
        ).all()


@server
def test_offload_gives_the_tokens_of_a_pool_that_holds_it_on_cuda():
    from radixserve.engine import Engine
    from radixserve.sampling import SamplingParams
    from radixserve.testing.tiny_models import tiny_model_dir

    model = str(tiny_model_dir("qwen3", rope_scaling=YARN))
    rng = np.random.default_rng(11)
    longs = [rng.integers(100, 40000, 1024).tolist() for _ in range(2)]
    shorts = [rng.integers(100, 40000, 40).tolist() for _ in range(2)]
    question = rng.integers(100, 40000, 24).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", cuda_graph_max_bs=8, prefill_cuda_graph_max_tokens=256)
    with Engine(model, max_total_tokens=8192, **common) as engine:
        expected = [o.token_ids for o in engine.generate(longs + shorts, params)]
        follow_up = longs[0] + expected[0] + question
        follow_expected = engine.generate(follow_up, params).token_ids
    for config in (
        dict(layerwise_offload_chunk_size=128, layerwise_offload_ring_size=2),
        dict(layerwise_offload_chunk_size=1000, layerwise_offload_ring_size=3, layerwise_offload_units_per_step=0),
    ):
        with Engine(
            model, max_total_tokens=256, enable_layerwise_offload=True, hicache_size=0.05, **common, **config
        ) as engine:
            assert [o.token_ids for o in engine.generate(longs + shorts, params)] == expected, config
            again = engine.generate(follow_up, params)
            assert again.token_ids == follow_expected and again.cached_tokens == 1024 + 16 - 1, config
            info = engine.server_info()
            assert info["kv_invariant_ok"] and info["long_max_decode_batch"] == 2 and info["host_kv_owned"] == 0


def test_real_weights_give_the_same_tokens_with_offload_on_cuda():
    """The demo model (SmolLM2-135M, fp32) on the GPU: a chat prompt over 2.5x the pool, its 30 layers one at a time
    through the host, gives the greedy tokens of a pool that holds it (in process, as its CPU twin in
    test_layerwise_offload.py)."""
    from radixserve.sampling import SamplingParams
    from radixserve.testing import smollm2_dir
    from scheduler_service.in_process_engine import InProcessEngine

    model = str(smollm2_dir())
    text = " ".join(
        f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} stones." for i in range(20)
    )
    messages = [{"role": "user", "content": text + "\nWhich box holds the most stones?"}]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", cuda_graph_max_bs=4, prefill_cuda_graph_max_tokens=256)
    whole = InProcessEngine(model, max_total_tokens=1024, **common)
    prompt = whole.apply_chat_template(messages)
    expected = whole.generate(prompt, params).token_ids
    pool = 112
    assert len(prompt) > 2.5 * pool
    for chunk, ring in ((100, 2), (64, 3)):
        offload = InProcessEngine(
            model,
            max_total_tokens=pool,
            enable_layerwise_offload=True,
            hicache_size=0.05,
            layerwise_offload_chunk_size=chunk,
            layerwise_offload_ring_size=ring,
            **common,
        )
        offload.scheduler.check_invariant_every_step = True
        out = offload.generate(prompt, params)
        assert out.token_ids == expected and out.error is None, (chunk, ring)
        assert offload.scheduler.long.jobs >= 1 + 11
        offload.scheduler.check_invariant(walk_tree=True)


def test_yarn_through_the_fused_kernel_matches_hf_on_cuda():
    from transformers import AutoModelForCausalLM

    from radixserve.config import ServerArgs
    from radixserve.protocol import ForwardBatch, WorkerRequest, pack_i32
    from radixserve.sampling import SamplingParams
    from radixserve.testing.tiny_models import tiny_model_dir
    from radixserve.worker.model_runner import ModelRunner

    model = tiny_model_dir("qwen3", rope_scaling=YARN)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).cuda().eval()
    runner = ModelRunner(
        ServerArgs(
            device="cuda", dtype="float32", max_total_tokens=2048, max_running_requests=4, disable_cuda_graph=True
        ),
        model,
    )
    ids = np.random.default_rng(3).integers(0, 49152, 1500).astype(np.int32)
    batch = ForwardBatch(
        step=0,
        req_pool_indices=pack_i32([1]),
        prefix_lens=pack_i32([0]),
        extend_lens=pack_i32([len(ids)]),
        input_ids=ids.tobytes(),
        out_cache_loc=pack_i32(np.arange(1, len(ids) + 1)),
        sample_mask=b"\x01",
        new_requests=[WorkerRequest(1, SamplingParams(temperature=0.0))],
    )
    ours = runner.compute_logits(batch, all_positions=True)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids.tolist()], device="cuda")).logits[0]
    err = ((ours.double() - theirs.double()).norm() / theirs.double().norm()).item()
    assert err < 1e-4, err


if __name__ == "__main__":  # without pytest: python tests/worker/test_layerwise_offload_gpu.py
    import sys
    import traceback

    failed = 0
    for name, test in list(globals().items()):
        if name.startswith("test_") and callable(test):
            try:
                test()
                print(f"PASSED {name}")
            except Exception:  # noqa: BLE001 - report every test
                failed += 1
                print(f"FAILED {name}\n{traceback.format_exc()}")
    print(f"{sum(n.startswith('test_') for n in globals()) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
