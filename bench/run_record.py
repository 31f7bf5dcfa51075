"""What every benchmark result carries, and how repeated measurements are summarised.

A figure without the command that produced it, the date and the GPU cannot be checked or compared, and a figure
from one run cannot tell a change from noise. So every script writes `run_record()` beside its figures (the command
is rebuilt from sys.argv: it is the one that ran, not one typed by hand) and reports throughput as the median of
`--repeats` (>= 3) timed runs with their spread.
"""

from __future__ import annotations

import datetime
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIN_REPEATS = 3


def command_line() -> str:
    """The command this process was started with, as it would be typed in the repository root."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and spec.name:  # python -m bench.xxx
        program = ["python", "-m", spec.name.removesuffix(".__main__")]
    else:
        program = ["python", sys.argv[0]]
    return shlex.join(program + sys.argv[1:])


def gpu_name() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu (no CUDA device)"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if len(names) == 1:
        return names[0]
    return f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)


def _git_commit() -> str:
    if os.environ.get("RADIXSERVE_GIT_COMMIT"):  # a tree without .git (a `git archive` sent to a GPU machine)
        return os.environ["RADIXSERVE_GIT_COMMIT"]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (commit or "unknown") + ("+uncommitted changes" if dirty else "")


def host_cpu() -> str:
    """The host CPU's model name (/proc/cpuinfo), or the platform's word for it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def host_python_ms() -> float:
    """Milliseconds of a fixed piece of pure Python (dict, list and attribute work, as a scheduler step or a request
    handler does), the best of 5: on the GPU machines the host-bound figures (first tokens, small models' workloads)
    moved up to ~30% between machines with the same code, and this says how fast the host at hand runs Python."""
    import time

    class Item:
        __slots__ = ("key", "value")

        def __init__(self, key, value):
            self.key, self.value = key, value

    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        table: dict = {}
        for i in range(20000):
            item = Item(i % 977, [i, i + 1])
            table[item.key] = table.get(item.key, 0) + len(item.value)
        sorted(table.items())
        best = min(best, time.perf_counter() - start)
    return round(best * 1e3, 2)


def run_record() -> dict:
    """When, where and how: to be stored with every result."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu_name(),
        "command": command_line(),
        "git_commit": _git_commit(),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": sys.version.split()[0],
        "host_cpu": host_cpu(),
        "host_python_ms": host_python_ms(),
    }


def summarize(values: list[float]) -> dict:
    """Median of repeated measurements, with their spread: (max - min) / median, in percent."""
    if not values:
        raise ValueError("no measurements")
    median = statistics.median(values)
    spread = 100.0 * (max(values) - min(values)) / median if median else 0.0
    return {
        "median": round(median, 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "spread_pct": round(spread, 1),
        "runs": [round(v, 3) for v in values],
    }


def summarize_rows(rows: list[dict]) -> dict:
    """Per key of the rows (one row per run): the summary of its numeric values; other values must agree."""
    out = {}
    for key in rows[0]:
        values = [row[key] for row in rows]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = summarize([float(v) for v in values])
        else:
            out[key] = values[0] if all(v == values[0] for v in values) else values
    return out


def check_repeats(repeats: int) -> None:
    if repeats < MIN_REPEATS:
        raise SystemExit(f"--repeats must be at least {MIN_REPEATS}: one run cannot tell a change from noise")


if __name__ == "__main__":  # python -m bench.run_record: what a result made here and now would carry
    import json

    print(json.dumps(run_record(), indent=2))
