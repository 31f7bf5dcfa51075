"""Batch-1 latency through the offline Engine: decode speed (and its share of the bandwidth floor), and the time to
the first token of a 1-token prompt, of a cache hit (cached system prompt + new tokens) and of a cold prompt.
Real model shapes with dummy weights; every figure is the median of --repeats runs after a warm-up on the same
shapes (Triton compiles each kernel variant on first use).

    python -m bench.latency --config qwen3-0.6b --tokenizer DIR [--tp-size 2] [--engine-arg disable_cuda_graph=true]

Decode time per token = (time for N tokens - time for 1 token) / (N - 1), the same prompt, greedy, EOS ignored.
The floor is the bytes of weights one rank reads per token over the measured device-to-device copy bandwidth."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from radixserve.engine import Engine
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import dummy_config_dir

from bench.run_record import check_repeats, command_line


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy bandwidth, counting bytes read and written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 10
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / seconds / 1e9


def weight_bytes(model_dir: str, tp_size: int, dtype_bytes: int = 2) -> float:
    """Bytes of weights one rank reads per decode step (the embedding table is gathered, not read whole)."""
    from radixserve.model_config import ModelConfig
    from radixserve.models.registry import model_class

    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    total = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    if cfg.tie_word_embeddings:
        total += cfg.vocab_size * cfg.hidden_size  # the LM head reads the tied table
    return total * dtype_bytes / tp_size


def timed(engine: Engine, prompt: list[int], max_new_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.generate(prompt, params)
    return time.perf_counter() - start


def measure(engine: Engine, decode_tokens: int, prefix_len: int, new_len: int, repeats: int) -> tuple[list, ...]:
    """Seconds of each repeat: 1 and decode_tokens greedy tokens of one 16-token prompt, and the first token of a
    1-token prompt, of a cache hit (prefix_len cached + new_len new) and of a cold prompt (prefix_len + new_len)."""
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    fresh = lambda n: rng.integers(100, vocab - 100, n).tolist()  # noqa: E731 - a fresh random prompt
    decode_prompt = fresh(16)
    system = fresh(prefix_len)
    for _ in range(2):  # warm-up on every shape measured below
        timed(engine, decode_prompt, decode_tokens)
        timed(engine, decode_prompt, 1)
        timed(engine, fresh(1), 1)
        timed(engine, system + fresh(new_len), 1)
        timed(engine, fresh(prefix_len + new_len), 1)
    one = [timed(engine, decode_prompt, 1) for _ in range(repeats)]
    many = [timed(engine, decode_prompt, decode_tokens) for _ in range(repeats)]
    ttft_one_token = [timed(engine, fresh(1), 1) for _ in range(repeats)]
    ttft_hit = [timed(engine, system + fresh(new_len), 1) for _ in range(repeats)]
    ttft_cold = [timed(engine, fresh(prefix_len + new_len), 1) for _ in range(repeats)]
    assert engine.server_info()["kv_invariant_ok"]
    return one, many, ttft_one_token, ttft_hit, ttft_cold


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="qwen3-0.6b")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--prefix-len", type=int, default=1024, help="cached system prompt of the cache-hit case")
    parser.add_argument("--new-len", type=int, default=128, help="new tokens after it (and the cold prompt's extra)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Engine/ServerArgs field (value parsed as JSON when it can be)",
    )
    parser.add_argument("--json-out")
    ns = parser.parse_args()
    extra = {}
    for item in ns.engine_arg:
        key, _, value = item.partition("=")
        try:
            extra[key] = json.loads(value)
        except json.JSONDecodeError:
            extra[key] = value

    check_repeats(ns.repeats)
    model_dir = str(dummy_config_dir(ns.config, ns.tokenizer))
    gpu = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth_gbs()
    floor_ms = weight_bytes(model_dir, ns.tp_size) / (bandwidth * 1e9) * 1e3
    with Engine(model_dir, load_format="dummy", device="cuda", tp_size=ns.tp_size, **extra) as engine:
        one, many, ttft_one_token, ttft_hit, ttft_cold = measure(
            engine, ns.decode_tokens, ns.prefix_len, ns.new_len, ns.repeats
        )

    ms = lambda xs: round(statistics.median(xs) * 1e3, 2)  # noqa: E731
    spread = lambda xs: [round(min(xs) * 1e3, 2), round(max(xs) * 1e3, 2)]  # noqa: E731
    per_token = [(m - statistics.median(one)) / (ns.decode_tokens - 1) for m in many]
    decode_ms = statistics.median(per_token) * 1e3
    row = {
        "gpu": gpu,
        "date": time.strftime("%Y-%m-%d"),
        "config": ns.config,
        "tp_size": ns.tp_size,
        "engine_args": extra,
        "decode_ms_per_token": round(decode_ms, 3),
        "decode_tok_per_s": round(1e3 / decode_ms, 1),
        "decode_ms_spread": [round(min(per_token) * 1e3, 3), round(max(per_token) * 1e3, 3)],
        "floor_ms_per_token": round(floor_ms, 3),
        "share_of_floor": round(floor_ms / decode_ms, 3),
        "copy_bandwidth_gbs": round(bandwidth),
        "ttft_1_token_ms": ms(ttft_one_token),
        "ttft_1_token_spread": spread(ttft_one_token),
        f"ttft_cache_hit_ms ({ns.prefix_len} cached + {ns.new_len} new)": ms(ttft_hit),
        "ttft_cache_hit_spread": spread(ttft_hit),
        f"ttft_cold_ms ({ns.prefix_len + ns.new_len} tokens)": ms(ttft_cold),
        "ttft_cold_spread": spread(ttft_cold),
        "repeats": ns.repeats,
        "command": command_line(),
    }
    print(json.dumps(row, indent=1))
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
