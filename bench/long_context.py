"""Contexts longer than the GPU holds (--enable-layerwise-offload): prefill time, decode ms/token against the PCIe
floor, a follow-up question's first token, peak GPU and host memory, for a model shape with dummy weights and a
YaRN-scaled context. One Engine serves both paths: prompts that fit its KV pool are the in-GPU prefill (a quadratic
fit over their lengths extrapolates it to the long document), the document itself goes through the host.

    python -m bench.long_context --config qwen3-8b --context 524288 --doc-tokens 520000 --out-tokens 32 \\
        --hicache-size 79 --max-total-tokens 140000 --out-dir bench/results/long-context-h100
    python -m bench.long_context --smoke --out-dir /tmp/long-context-smoke     # CPU, a tiny Qwen3, CI-sized
    python -m bench.long_context --plot bench/results/long-context-h100/long-context.json   # the PNG again

Figures (long-context.json, long-context.md, decode-vs-context.png):
- h2d_gb_s / d2h_gb_s: copies between pinned host memory and the GPU, 256 MiB at a time, measured first;
- kv_bytes_per_token: K and V of every layer; decode floor at context n = n * that / h2d_gb_s (every decode step
  reads the whole context from the host once);
- gpu_prefill_s at each length that fits the pool, and its quadratic fit; offload_prefill_s of the document (its
  first token's time) against the fit's value at the document's length;
- decode_ms_per_token at the document's length and at shorter contexts (prompts that reuse the document's first n
  tokens from the host tier, so they cost no prefill), against the floor;
- follow_up_first_token_s: the document + reply + a question, the document from the host tier: against the floor
  of reading the document once plus its own tokens' prefill (from the fit);
- peak_gpu_gb (nvidia-smi, whole device, above the idle baseline) beside its parts: weights, ring buffers, prefill
  workspace, the KV pool; gpu_ready_gb, the device memory in use once the engine is up, and the peak of each phase
  (peak_gpu_gb_by_phase): the document's phase against gpu_ready_gb is what a long request adds; peak_host_gb
  (MemTotal - MemAvailable above the baseline) beside the host pool.
Each phase writes the JSON as it ends, so a run cut by a time limit keeps what it measured; --budget-s shortens the
document (by the quadratic fit's prediction) when the whole run would not fit in it. The ratios, plot and table are
bench/long_context_report.py's."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench.long_context_report import add_ratios, markdown, plot

SMOKE = dict(
    config="tiny-qwen3",
    context=4096,
    doc_tokens=1400,
    out_tokens=6,
    question_tokens=24,
    hicache_size=0.01,
    max_total_tokens=300,
    gpu_prefill_points=[64, 128, 192, 256],
    decode_points=[400, 800],
    decode_tokens=4,
    chunk=256,
    ring_size=2,
)


def model_dir(config: str, context: int, out: Path) -> Path:
    """config.json of the shape with YaRN scaled to `context` (Qwen3's recipe: factor over 32768 original positions);
    the tiny Qwen3 for the smoke run."""
    from radixserve.testing.tiny_models import dummy_config_json, tiny_model_dir

    if config == "tiny-qwen3":
        return tiny_model_dir(
            "qwen3", rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
        )
    cfg = dummy_config_json(config)
    original = 32768
    cfg["rope_scaling"] = {
        "rope_type": "yarn",
        "factor": max(1.0, context / original),
        "original_max_position_embeddings": original,
    }
    cfg["max_position_embeddings"] = context
    path = out / "model"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def placeholder_tokenizer(vocab_size: int, out: Path) -> Path:
    """A word-level tokenizer over ids only (no network on the GPU machine): the benchmark sends token ids, and the
    engine needs a tokenizer to detokenize them."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = out / "tokenizer"
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


def copy_bandwidth(gib: float = 1.0, chunk_mib: int = 256) -> tuple[float, float]:
    """(host -> device, device -> host) GB/s between pinned memory and the GPU, in chunks like the ring's copies."""
    import torch

    n = int(gib * (1 << 30))
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    step = chunk_mib << 20
    result = []
    for direction in ("h2d", "d2h"):
        for repeat in range(3):  # the first one warms up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for lo in range(0, n, step):
                if direction == "h2d":
                    dev[lo : lo + step].copy_(host[lo : lo + step], non_blocking=True)
                else:
                    host[lo : lo + step].copy_(dev[lo : lo + step], non_blocking=True)
            end.record()
            end.synchronize()
        result.append(n / (start.elapsed_time(end) / 1e3) / 1e9)
    del host, dev
    torch.cuda.empty_cache()
    return result[0], result[1]


class MemoryPoller:
    """Peaks of device memory used (nvidia-smi, all processes) and host memory used (MemTotal - MemAvailable), over
    the whole run and per phase (enter(name) starts one), above the idle baseline."""

    def __init__(self, gpu: bool):
        self.gpu = gpu and shutil.which("nvidia-smi") is not None
        self.base_gpu, self.base_host = self._gpu(), self._host()
        self.peak_host = self.base_host
        self.phase, self.phase_peaks = "start", {}  # the whole run's GPU peak is the highest of these
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _gpu(self) -> float:
        if not self.gpu:
            return 0.0
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
        ).stdout
        return float(out.strip().splitlines()[0]) * (1 << 20) / 1e9

    @staticmethod
    def _host() -> float:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        kib = int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])
        return kib * 1024 / 1e9

    def _sample(self) -> float:
        gpu = self._gpu()
        self.peak_host = max(self.peak_host, self._host())
        self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0.0), gpu)
        return gpu

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self._sample()

    def enter(self, phase: str) -> float:
        """Start a phase; the device memory in use now, above the baseline."""
        used = self._sample()
        self.phase = phase
        return round(used - self.base_gpu, 2)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self._sample()  # the last phase, however short
        return {
            "peak_gpu_gb": round(max(self.phase_peaks.values(), default=self.base_gpu) - self.base_gpu, 2),
            "peak_gpu_gb_by_phase": {k: round(v - self.base_gpu, 2) for k, v in self.phase_peaks.items()},
            "peak_host_gb": round(self.peak_host - self.base_host, 2),
        }


def shape_bytes(cfg, dtype_bytes: int, ring_size: int, buffer_tokens: int, pool_tokens: int) -> dict:
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    layer = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h + 3 * h * i + 2 * h + 2 * d
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    kv_token_layer = 2 * cfg.num_kv_heads * d * dtype_bytes
    return {
        "weights_gb": (cfg.num_layers * layer + embed + h) * dtype_bytes / 1e9,
        "ring_gb": ring_size * (buffer_tokens + 1) * kv_token_layer / 1e9,
        "workspace_gb": 2 * buffer_tokens * h * dtype_bytes / 1e9,
        "kv_pool_gb": pool_tokens * kv_token_layer * cfg.num_layers / 1e9,
        "kv_bytes_per_token": kv_token_layer * cfg.num_layers,
    }


def timed(engine, prompt, n_out):
    from radixserve.sampling import SamplingParams

    t0 = time.perf_counter()
    out = engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=n_out, ignore_eos=True))
    total = time.perf_counter() - t0
    if out.error:
        raise RuntimeError(out.error)
    decode_ms = (total - out.first_token_s) / (n_out - 1) * 1e3 if n_out > 1 else None
    return out, out.first_token_s, decode_ms


def run(ns, out_dir: Path) -> dict:
    import torch

    from radixserve.model_config import ModelConfig
    from radixserve.engine import Engine

    cuda = ns.device == "cuda"
    started = time.perf_counter()
    mdir = model_dir(ns.config, ns.context, out_dir)
    cfg = ModelConfig.from_dir(mdir)
    tokenizer = ns.tokenizer or (None if ns.config == "tiny-qwen3" else placeholder_tokenizer(cfg.vocab_size, out_dir))
    res = {
        "config": ns.config,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "context": ns.context,
        "doc_tokens": ns.doc_tokens,
        "out_tokens": ns.out_tokens,
        "ring_size": ns.ring_size,
        "chunk": ns.chunk,
        "rope_scaling": cfg.rope_scaling,
    }
    path = out_dir / "long-context.json"

    def save():
        path.write_text(json.dumps(res, indent=1) + "\n")

    if cuda:
        res["h2d_gb_s"], res["d2h_gb_s"] = (round(x, 2) for x in copy_bandwidth())
    dtype_bytes = 2 if cuda else 4
    res.update(
        {
            k: round(v, 3) if k.endswith("_gb") else v
            for k, v in shape_bytes(cfg, dtype_bytes, ns.ring_size, ns.context, ns.max_total_tokens).items()
        }
    )
    save()
    poller = MemoryPoller(cuda)
    rng = np.random.default_rng(0)
    vocab = min(cfg.vocab_size, 150000)
    t0 = time.perf_counter()
    engine = Engine(
        str(mdir),
        tokenizer=str(tokenizer) if tokenizer else None,
        device=ns.device,
        load_format="dummy" if ns.config != "tiny-qwen3" else "auto",
        context_length=ns.context,
        max_total_tokens=ns.max_total_tokens,
        enable_layerwise_offload=True,
        hicache_size=ns.hicache_size,
        layerwise_offload_ring_size=ns.ring_size,
        layerwise_offload_chunk_size=ns.chunk,
        chunked_prefill_size=ns.chunk,
        max_running_requests=8,
        cuda_graph_max_bs=8,
        disable_prefill_cuda_graph=True,
    )  # (chunks of 8192 tokens run eagerly anyway; saves start-up)
    res["engine_start_s"] = round(time.perf_counter() - t0, 1)
    # What the engine holds once up (weights, KV pool, ring, workspace, and the CUDA context, graphs and library
    # workspaces that no tensor size names): the phases' peaks are read against it.
    res["gpu_ready_gb"] = poller.enter("in-GPU prefill")
    try:
        # Warm-up (Triton compiles every kernel variant on its first use): the in-GPU path; the offload path too on
        # the CPU (on a GPU its smallest request is a prompt the size of the pool: its compiles stay in the document's
        # prefill, seconds out of minutes).
        timed(engine, rng.integers(0, vocab, 512).tolist(), 2)
        if not cuda:
            timed(engine, rng.integers(0, vocab, ns.max_total_tokens + 64).tolist(), 2)
        points = {}
        for n in ns.gpu_prefill_points:
            # An empty cache first: the pool's evictions would copy the earlier prompts to the host tier inside the
            # timed prefill.
            engine.flush_cache()
            points[n] = min(timed(engine, rng.integers(0, vocab, n).tolist(), 1)[1] for _ in range(1 if cuda else 2))
            res["gpu_prefill_s"] = {str(k): round(v, 4) for k, v in points.items()}
            save()
        fit = np.polyfit(list(points), list(points.values()), 2)
        res["gpu_prefill_fit"] = [float(c) for c in fit]
        doc_tokens = ns.doc_tokens
        if ns.budget_s:  # shorten the document so that the rest of the run fits the budget
            left = ns.budget_s - (time.perf_counter() - started) - 30
            read_s = res["kv_bytes_per_token"] / ((res.get("h2d_gb_s") or 20.0) * 1e9)  # a decode reads it all
            decodes = ns.out_tokens + len(ns.decode_points) * ns.decode_tokens + 4
            while (
                doc_tokens > 2 * ns.max_total_tokens
                and 1.2 * np.polyval(fit, doc_tokens) + 1.2 * decodes * doc_tokens * read_s > left
            ):
                doc_tokens = int(doc_tokens * 0.9)
            res["doc_tokens"] = doc_tokens
        doc = rng.integers(0, vocab, doc_tokens).tolist()
        poller.enter("document")
        out, prefill_s, decode_ms = timed(engine, doc, ns.out_tokens)
        res.update(
            offload_prefill_s=round(prefill_s, 3),
            decode_ms_per_token=round(decode_ms, 3),
            gpu_prefill_fit_at_doc_s=round(float(np.polyval(fit, doc_tokens)), 3),
        )
        res["decode_points"] = {str(doc_tokens): round(decode_ms, 3)}
        save()
        question = rng.integers(0, vocab, ns.question_tokens).tolist()
        poller.enter("follow-up")
        follow, ttft, _ = timed(engine, doc + out.token_ids + question, 2)
        res.update(
            follow_up_first_token_s=round(ttft, 3),
            follow_up_cached_tokens=follow.cached_tokens,
            follow_up_own_tokens=len(doc) + len(out.token_ids) + len(question) - follow.cached_tokens,
        )
        save()
        poller.enter("decode points")
        for n in ns.decode_points:
            if n < doc_tokens:
                _, _, ms = timed(engine, doc[:n] + question[:1], ns.decode_tokens)
                res["decode_points"][str(n)] = round(ms, 3)
                save()
        info = engine.server_info()
        res.update(
            {
                k: info[k]
                for k in (
                    "long_jobs",
                    "long_steps",
                    "long_max_decode_batch",
                    "kv_invariant_ok",
                    "hicache_capacity_tokens",
                    "kv_pool_tokens",
                )
            }
        )
    finally:
        engine.shutdown()
        res.update(poller.stop())
        res["wall_s"] = round(time.perf_counter() - started, 1)
        add_ratios(res)
        save()
    return res


def _terminated(*_) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one (timeout forwards its own) must not cut the cleanup
    sys.exit(143)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny Qwen3 with YaRN, seconds")
    p.add_argument("--plot", help="only draw the PNG of an earlier run's JSON (next to it)")
    p.add_argument("--config", default="qwen3-8b")
    p.add_argument("--device", default=None)
    p.add_argument("--tokenizer", help="tokenizer dir (default: a placeholder over the ids)")
    p.add_argument("--context", type=int, default=524288)
    p.add_argument("--doc-tokens", type=int, default=520000)
    p.add_argument("--out-tokens", type=int, default=32)
    p.add_argument("--question-tokens", type=int, default=128)
    p.add_argument("--hicache-size", type=float, default=79.0, help="GB of host KV pool")
    p.add_argument("--max-total-tokens", type=int, default=140000, help="the GPU KV pool (in-GPU prefill points)")
    p.add_argument(
        "--gpu-prefill-points", type=lambda s: [int(x) for x in s.split(",")], default=[16384, 32768, 65536, 131072]
    )
    p.add_argument(
        "--decode-points",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[160000, 262144, 393216],
        help="shorter contexts decoded through the host (longer than the pool)",
    )
    p.add_argument("--decode-tokens", type=int, default=6, help="output tokens at each shorter decode point")
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--ring-size", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=0, help="shorten the document to fit this many seconds")
    p.add_argument("--out-dir", default="bench/results/long-context")
    ns = p.parse_args()
    if ns.plot:
        res = json.loads(Path(ns.plot).read_text())
        plot(res, Path(ns.plot).with_name("decode-vs-context.png"))
        return
    # A time limit's SIGTERM unwinds like an exception: the engine's processes stop and the JSON keeps what ran.
    signal.signal(signal.SIGTERM, _terminated)
    if ns.smoke:
        for k, v in SMOKE.items():
            setattr(ns, k, v)
        ns.device = ns.device or "cpu"
    import torch

    ns.device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out_dir = Path(ns.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    res = run(ns, out_dir)
    plot(res, out_dir / "decode-vs-context.png")
    (out_dir / "long-context.md").write_text(markdown(res))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
