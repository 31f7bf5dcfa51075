"""Benchmark results say when, where and how they were made, and throughput needs repeated runs
(bench/run_record.py): the command is the one that ran, taken from sys.argv, never typed by hand."""

import datetime
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.run_record import summarize, summarize_rows

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_module(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def test_record_quotes_the_command_that_ran():
    proc = run_module("bench.run_record", "--tokenizer", "a dir", "--repeats", "3")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert record["command"] == "python -m bench.run_record --tokenizer 'a dir' --repeats 3"
    assert datetime.datetime.fromisoformat(record["date"]).tzinfo is not None
    assert record["gpu"] and record["git_commit"] and record["torch"]
    assert record["host_cpu"] and record["host_python_ms"] > 0  # how fast this host runs Python, for host-bound figures


def test_throughput_refuses_fewer_than_three_runs():
    proc = run_module("bench.offline_throughput", "--tokenizer", "unused", "--repeats", "1")
    assert proc.returncode != 0 and "--repeats must be at least 3" in proc.stderr


def test_summary_is_median_and_spread():
    assert summarize([10.0, 12.0, 11.0]) == {
        "median": 11.0,
        "min": 10.0,
        "max": 12.0,
        "spread_pct": 18.2,
        "runs": [10.0, 12.0, 11.0],
    }
    rows = summarize_rows(
        [{"seconds": 4.0, "mode": "radix"}, {"seconds": 5.0, "mode": "radix"}, {"seconds": 3.0, "mode": "radix"}]
    )
    assert rows["seconds"]["median"] == 4.0 and rows["mode"] == "radix"


def test_burst_timeline_lines_up_every_request(tmp_path):
    """bench/burst_timeline.py on the demo model (CPU, 8 requests): every request is seen starting, reaching the
    app, being built and submitted in the processes' hooks, and its first chunk comes back."""
    from radixserve.testing import smollm2_dir

    out = tmp_path / "timeline.json"
    proc = run_module(
        "bench.burst_timeline",
        *("--model", str(smollm2_dir()), "--device", "cpu", "--requests", "8", "--groups", "2"),
        *("--system-tokens", "120", "--max-tokens", "3", "--client-procs", "2", "--bursts", "1"),
        *("--span-ms", "5000", "--bin-ms", "100", "--json-out", str(out)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (burst,) = json.loads(out.read_text())["bursts"]
    totals = {key: sum(row[key] for row in burst["table"]) for key in burst["table"][0] if key != "ms"}
    assert totals["started"] == totals["arrived"] == totals["built"] == totals["submitted"] == 8, totals
    assert totals["first chunk"] == 8 and totals["steps"] >= 1 and totals["output batches"] >= 1, totals
    # One front end on the CPU device: it took every request.
    ((requests, last_submitted_ms, _),) = burst["summary"]["front ends (requests, last submitted ms, output ms)"]
    assert requests == 8 and last_submitted_ms > 0, burst["summary"]
    assert burst["summary"]["client GC longest pause ms"] >= 0, burst["summary"]
