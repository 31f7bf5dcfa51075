"""The figures of bench/long_context.py's run, from its results dict: the ratios to the PCIe floor and the in-GPU
prefill fit (add_ratios), the decode-vs-context plot, and the markdown table."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def add_ratios(res: dict) -> None:
    """The ratios the issue asks for, where their inputs were measured."""
    bw = res.get("h2d_gb_s")
    per_token = res["kv_bytes_per_token"]
    if bw and "decode_ms_per_token" in res:
        res["decode_floor_ms"] = round(res["doc_tokens"] * per_token / (bw * 1e9) * 1e3, 3)
        res["decode_vs_floor"] = round(res["decode_ms_per_token"] / res["decode_floor_ms"], 3)
    if "offload_prefill_s" in res:
        res["prefill_vs_gpu_fit"] = round(res["offload_prefill_s"] / res["gpu_prefill_fit_at_doc_s"], 3)
    if bw and "follow_up_first_token_s" in res:
        own = float(np.polyval(res["gpu_prefill_fit"], res["follow_up_own_tokens"]))
        floor = res["follow_up_cached_tokens"] * per_token / (bw * 1e9) + max(own, 0.0)
        res["follow_up_floor_s"] = round(floor, 3)
        res["follow_up_vs_floor"] = round(res["follow_up_first_token_s"] / floor, 3)
        res["follow_up_vs_doc_prefill"] = round(res["follow_up_first_token_s"] / res["offload_prefill_s"], 4)
    if "peak_gpu_gb" in res and res.get("weights_gb"):
        res["gpu_bound_gb"] = round(res["weights_gb"] + res["ring_gb"] + res["workspace_gb"] + res["kv_pool_gb"], 2)
        if res.get("gpu_ready_gb"):
            # The CUDA context, CUDA graphs' pool, cuBLAS / Triton workspaces and the allocator's rounding: held from
            # start-up on, whatever the context length.
            res["gpu_runtime_gb"] = round(res["gpu_ready_gb"] - res["gpu_bound_gb"], 2)
        doc_peak = res.get("peak_gpu_gb_by_phase", {}).get("document")
        if doc_peak is not None and res.get("gpu_ready_gb"):
            res["doc_peak_over_ready_gb"] = round(doc_peak - res["gpu_ready_gb"], 2)


def plot(res: dict, png: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (python -m bench.long_context --plot JSON makes it later)")
        return False
    points = sorted((int(k), v) for k, v in res.get("decode_points", {}).items())
    if not points:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs = [p[0] for p in points]
    ax.plot(xs, [p[1] for p in points], "o-", label="decode, layer-wise offload")
    if res.get("h2d_gb_s"):
        grid = np.linspace(0, max(xs) * 1.05, 50)
        ax.plot(
            grid,
            grid * res["kv_bytes_per_token"] / (res["h2d_gb_s"] * 1e9) * 1e3,
            "--",
            label=f"PCIe floor (KV bytes / {res['h2d_gb_s']} GB/s host-to-device)",
        )
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms per output token")
    ax.set_title(f"{res['config']} ({res['device']}), ring of {res['ring_size']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return True


def markdown(res: dict) -> str:
    keys = [
        "device",
        "config",
        "context",
        "doc_tokens",
        "out_tokens",
        "h2d_gb_s",
        "d2h_gb_s",
        "kv_bytes_per_token",
        "offload_prefill_s",
        "gpu_prefill_fit_at_doc_s",
        "prefill_vs_gpu_fit",
        "decode_ms_per_token",
        "decode_floor_ms",
        "decode_vs_floor",
        "follow_up_first_token_s",
        "follow_up_floor_s",
        "follow_up_vs_floor",
        "follow_up_vs_doc_prefill",
        "follow_up_cached_tokens",
        "peak_gpu_gb",
        "peak_gpu_gb_by_phase",
        "gpu_ready_gb",
        "gpu_bound_gb",
        "gpu_runtime_gb",
        "doc_peak_over_ready_gb",
        "weights_gb",
        "ring_gb",
        "workspace_gb",
        "kv_pool_gb",
        "peak_host_gb",
        "hicache_capacity_tokens",
        "gpu_prefill_s",
        "decode_points",
        "kv_invariant_ok",
        "wall_s",
    ]
    rows = [f"| {k} | {res[k]} |" for k in keys if k in res]
    return "# Layer-wise KV offload\n\n| figure | value |\n| --- | --- |\n" + "\n".join(rows) + "\n"
