"""Where a lone request's first token goes, process by process: every process's hooked functions (listed in
bench/timeline_hooks/sitecustomize.py) write their entry and exit times, one clock for all; this lines each request
up on its submission and prints the median offset of every step of the chain, socket hops included.

    python -m bench.process_timeline --config qwen3-0.6b --tokenizer DIR [--device cuda] [--requests 20]
    python -m bench.process_timeline --model DIR --device cpu --requests 5        (a real model directory)

It runs Engine (the scheduler and worker processes as a server has them) in a child process with the hooks on
its PYTHONPATH, sending 1-token prompts (--prompt-len) with max_new_tokens=1, --gap-ms apart, after --warmup."""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROLES = {"Engine": "caller", "Scheduler": "scheduler", "SchedulerProcess": "scheduler", "ModelRunner": "worker"}


def requests_child(ns) -> None:
    """In the hooked child: the requests, and their first-token times on stdout as JSON."""
    import time

    import numpy as np

    from radixserve.engine import Engine
    from radixserve.sampling import SamplingParams

    model = ns.model
    if model is None:
        from radixserve.testing.tiny_models import dummy_config_dir

        model = str(dummy_config_dir(ns.config, ns.tokenizer))
    params = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    extra = {"load_format": "dummy"} if ns.model is None else {}
    rng = np.random.default_rng(0)
    with Engine(model, device=ns.device, **extra) as engine:
        seconds = []
        for i in range(ns.warmup + ns.requests):
            time.sleep(ns.gap_ms / 1e3)
            start = time.perf_counter()
            engine.generate(rng.integers(100, 1000, ns.prompt_len).tolist(), params)
            seconds.append(time.perf_counter() - start)
    print(json.dumps({"ttft_ms": [round(1e3 * s, 3) for s in seconds[ns.warmup :]]}))


def read_events(directory: Path) -> list[tuple[int, str, str, str]]:
    events = []
    for path in directory.glob("t*.txt"):
        pid = path.stem[1:]
        for line in path.read_text().splitlines():
            t, phase, name = line.split()
            events.append((int(t), pid, phase, name))
    return sorted(events)


def timeline(events, skip: int) -> list[tuple[float, str, str, str, int]]:
    """(median offset in us from Engine._submit, role, B/E, function, n) for every event of the requests after the
    first `skip`, each keyed by its process's role, name, phase and occurrence within its request."""
    roles = {}
    for _, pid, _, name in events:
        owner = name.split(".")[0]
        if owner in ROLES:
            roles.setdefault(pid, ROLES[owner])
    starts = [i for i, e in enumerate(events) if e[3] == "Engine._submit" and e[2] == "B"][skip:]
    offsets = collections.defaultdict(list)
    for i in starts:
        t0, seen = events[i][0], collections.Counter()
        for t, pid, phase, name in events[i:]:
            key = (roles.get(pid, pid), phase, name)
            seen[key] += 1
            offsets[(*key, seen[key])].append((t - t0) / 1e3)
            if name == "Engine._next_outputs" and phase == "E":
                break
    enough = len(starts) // 2
    rows = [(statistics.median(v), role, phase, name, len(v)) for (role, phase, name, _), v in offsets.items()]
    return sorted(row for row in rows if row[4] >= max(1, enough))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="qwen3-0.6b", help="a dummy shape (with --tokenizer)")
    parser.add_argument("--tokenizer")
    parser.add_argument("--model", help="a model directory instead of a dummy shape")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--gap-ms", type=float, default=10.0)
    parser.add_argument("--prompt-len", type=int, default=1)
    parser.add_argument("--out", help="where the processes write their events (default: a temporary folder)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child:
        return requests_child(ns)
    out = Path(ns.out or tempfile.mkdtemp(prefix="radixserve-timeline-"))
    env = dict(os.environ, RADIXSERVE_TIMELINE_DIR=str(out))
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "bench" / "timeline_hooks"), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    child = subprocess.run(
        [sys.executable, "-m", "bench.process_timeline", "--child", *sys.argv[1:]],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    ttft = json.loads(child.stdout.strip().splitlines()[-1])["ttft_ms"]
    print(f"first token, hooked: median {statistics.median(ttft):.2f} ms over {len(ttft)} requests ({out})")
    last = {}
    for offset, role, phase, name, n in timeline(read_events(out), ns.warmup):
        hop = ""
        if name == "Channel.recv" and phase == "E" and last.get("send") is not None and last["send"][1] != role:
            hop = f"   <- hop {offset - last['send'][0]:.0f} us from the {last['send'][1]}"
        if name == "Channel.send" and phase == "E":
            last["send"] = (offset, role)
        print(f"  +{offset:8.1f} us  {role:9s} {phase} {name}{hop}")


if __name__ == "__main__":
    main()
