"""A W1-shaped audit of the Triton kernel variants a run launches (bench/kernel_variant_keys.py computes the keys
the GPU's JIT would compile each launch under, on the CPU).

    python -m bench.kernel_variants                  # small W1 shape, interpreted, through the multi-process Engine
    python -m bench.kernel_variants --shadow --h100 --shape 8 16 1024 128 128 \\
        --engine-args '{"chunked_prefill_size": 8192, "shared_prefix_min_tokens": 512, "max_running_requests": 1024,
                        "max_total_tokens": 65536}'     # W1 itself, the keys an H100 would compile (minutes)

The audit runs a W1-shaped chat workload (system prompts x questions, greedy, EOS ignored) as
bench/offline_throughput.py does: one whole warm-up run, then timed runs of the same prompts, and a run whose
requests arrive in waves (another batch makeup, as arrival timing gives the multi-process Engine), with
shared-prefix attention on and off, and prints every key first launched after the warm-up (exit status 1 if any).
Engine's worker is a child process, so the recorder is installed there by a sitecustomize module on PYTHONPATH (env
KERNEL_VARIANTS_LOG names the JSON-lines file each new key is appended to); --in-process runs InProcessEngine in this
process instead. The kernels' outputs never change a batch's makeup (EOS is ignored), so --shadow (launches
recorded, torch twins computing) gives the same keys as interpreting them, in a fraction of the time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile

from bench.kernel_variant_keys import KernelVariants, LOG_ENV, OPTIONS_ENV, REPO, child_env, read_log


# ------------------------------------------------------------------------------------------- the W1-shaped CPU audit


def audit_workload(groups=4, per_group=4, system_len=40, question_len=6, output_len=16):
    """W1's shape scaled to the tiny CPU model: system prompts x questions, each request its own question tokens."""
    from bench.offline_throughput import Workload

    return Workload("W1 audit", groups, per_group, system_len, question_len, output_len)


def _flush(engine) -> None:
    scheduler = getattr(engine, "scheduler", None)  # InProcessEngine
    assert scheduler.flush_cache() if scheduler is not None else engine.flush_cache()


_rids = itertools.count()


def generate_in_waves(engine, prompts, output_len: int, wave: int = 0, steps_between: int = 3) -> int:
    """Every prompt to the end (greedy, EOS ignored); wave > 0 queues them `wave` at a time, `steps_between` outputs
    apart, so that prefills and decodes mix in other proportions than when all arrive at once. Returns the tokens."""
    from radixserve.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=output_len, ignore_eos=True)
    queue = [(f"audit-{os.getpid()}-{next(_rids)}", p) for p in prompts]
    pending, tokens, polls = set(), 0, 0
    while queue or pending:
        if queue and (not wave or not pending or polls % steps_between == 0):
            for rid, ids in queue[: wave or len(queue)]:
                engine._submit(rid, list(ids), params)
                pending.add(rid)
            queue = queue[wave or len(queue) :]
        for out in engine._next_outputs():
            tokens += len(out.token_ids) // 4
            if out.finished:
                assert out.finish_reason == "length", (out.finish_reason, out.error)
                pending.discard(out.rid)
        polls += 1
    return tokens


RUNS = (("warm-up", 0), ("timed 1", 0), ("timed 2", 0), ("waves of 3", 3))
START = "start-up"  # the engine's construction (model runner, CUDA graphs): listed before the runs, never late


def audit(
    model_dir: str, shared_prefix: bool, in_process: bool, workload=None, runs=RUNS, recorder=None, **engine_args
) -> dict:
    """Runs the workload once per entry of runs (name, wave size: 0 = all at once), the cache flushed before each;
    returns per run (and for START) the keys it launched first, and the sm_90 compile seconds of each key (with
    recorder compile).
    recorder: KernelVariants options (shadow, h100, min_split_tokens, compile)."""
    from bench.offline_throughput import prompts_for

    w = workload or audit_workload()
    args = dict(
        device="cpu",
        kernel_backend="triton",
        max_total_tokens=8192,
        max_running_requests=64,
        shared_prefix_min_tokens=8,
    )
    args.update(engine_args, disable_shared_prefix_attention=not shared_prefix)
    prompts = prompts_for(w, 49152)
    recorder = recorder or {}
    found, seconds = {}, {}
    if in_process:
        from scheduler_service.in_process_engine import InProcessEngine

        with KernelVariants(**recorder) as variants:
            engine = InProcessEngine(model_dir, **args)
            engine.scheduler.check_invariant_every_step = True
            variants.phase("start-up")
            for name, wave in runs:
                _flush(engine)
                variants.phase(name)
                generate_in_waves(engine, prompts, w.output_len, wave)
            found = {START: variants.new_in("start"), **{name: variants.new_in(name) for name, _ in runs}}
        return found, variants.compile_seconds
    from radixserve.engine import Engine

    scratch = tempfile.mkdtemp(prefix="kernel-variants-")
    log = os.path.join(scratch, "keys.jsonl")
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", LOG_ENV, OPTIONS_ENV)}
    os.environ.update(child_env(log, scratch, **recorder))
    try:
        with Engine(model_dir, **args) as engine:
            found[START] = [e["key"] for e in read_log(log)]
            seconds.update({e["key"]: e["compile_seconds"] for e in read_log(log) if e["compile_seconds"] is not None})
            for name, wave in runs:
                _flush(engine)
                before = len(read_log(log))
                generate_in_waves(engine, prompts, w.output_len, wave)
                assert engine.server_info()["kv_invariant_ok"]
                entries = read_log(log)[before:]
                found[name] = [e["key"] for e in entries]
                seconds.update({e["key"]: e["compile_seconds"] for e in entries if e["compile_seconds"] is not None})
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        shutil.rmtree(scratch, ignore_errors=True)
    return found, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--in-process", action="store_true", help="InProcessEngine in this process (no workers)")
    parser.add_argument("--modes", default="on,off", help="shared-prefix attention: on, off or both (on,off)")
    parser.add_argument("--model", default="llama", help="tiny model architecture (radixserve.testing.tiny_models)")
    parser.add_argument(
        "--shape",
        type=int,
        nargs=5,
        metavar=("GROUPS", "PER_GROUP", "SYSTEM", "QUESTION", "OUT"),
        default=(4, 4, 40, 6, 16),
    )
    parser.add_argument(
        "--runs",
        default="0,0,0,3",
        help="one run per entry, the first the warm-up: how many "
        "requests each queues at a time (0: all at once; another number: another batch makeup)",
    )
    parser.add_argument(
        "--shadow",
        action="store_true",
        help="record launches without running them; the torch "
        "twins compute (fast enough for GPU-sized shapes such as --shape 8 16 1024 128 128)",
    )
    parser.add_argument(
        "--h100",
        action="store_true",
        help="block sizes and split counts as for bf16 on an H100; "
        "launches an H100 replays from CUDA graphs count as start-up's (captured then)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="with --shadow: compile every variant for sm_90 "
        "(Triton's own ptxas, no GPU) and print its seconds (runs without TRITON_INTERPRET)",
    )
    parser.add_argument(
        "--min-split-tokens",
        type=int,
        help="shortest split of the split policies (scaled down "
        "with a small workload, so that split counts change with the batch)",
    )
    parser.add_argument(
        "--engine-args",
        default="{}",
        help='JSON of extra Engine arguments, e.g. \'{"chunked_prefill_size": 8192, "shared_prefix_min_tokens": 512}\'',
    )
    parser.add_argument("--json-out")
    ns = parser.parse_args()
    if ns.compile and not ns.shadow:
        parser.error("--compile needs --shadow (compiled kernels cannot run on the CPU)")
    interpret = "" if ns.compile else "1"  # compiling needs real JITFunctions; shadow launches never run
    if os.environ.get("TRITON_INTERPRET", "") != interpret or os.environ.get("RADIXSERVE_KERNEL_BACKEND") != "triton":
        # Triton reads TRITON_INTERPRET when it is imported: start again with the environment set.
        env = dict(os.environ, TRITON_INTERPRET=interpret, RADIXSERVE_KERNEL_BACKEND="triton")
        if ns.compile:  # an empty cache: a variant found on disk would time as no compile at all
            env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kernel-variants-cache-")
        sys.exit(subprocess.call([sys.executable, "-m", "bench.kernel_variants", *sys.argv[1:]], cwd=REPO, env=env))
    from radixserve.testing.tiny_models import tiny_model_dir

    model_dir = str(tiny_model_dir(ns.model))
    recorder = dict(shadow=ns.shadow, h100=ns.h100, min_split_tokens=ns.min_split_tokens, compile=ns.compile)
    waves = [int(x) for x in ns.runs.split(",")]
    runs = [
        (f"{'warm-up' if i == 0 else f'run {i + 1}'} ({f'waves of {n}' if n else 'all at once'})", n)
        for i, n in enumerate(waves)
    ]
    results = {}
    for mode in [m.strip() for m in ns.modes.split(",")]:
        found, seconds = audit(
            model_dir,
            mode == "on",
            ns.in_process,
            audit_workload(*ns.shape),
            runs,
            recorder,
            **json.loads(ns.engine_args),
        )
        results[f"shared prefix {mode}"] = {"keys": found, "compile_seconds": seconds}
        print(
            f"\nshared prefix {mode} ({'InProcessEngine' if ns.in_process else 'Engine, worker process'}), "
            f"workload {list(ns.shape)}, {recorder}:",
            flush=True,
        )
        for name, keys in found.items():
            print(f"  {name}: {len(keys)} new variant keys")
            for key in keys:
                compile_time = f" ({seconds[key]:.2f} s to compile)" if key in seconds else ""
                print(f"    {'NEW ' if name not in (START, runs[0][0]) else ''}{key}{compile_time}")
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump(results, f, indent=2)
    late = sum(
        len(keys) for mode in results.values() for name, keys in mode["keys"].items() if name not in (START, runs[0][0])
    )
    print(f"\n{late} variant keys first launched after the warm-up run")
    sys.exit(1 if late else 0)


if __name__ == "__main__":
    main()
