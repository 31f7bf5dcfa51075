"""bench/kv_read_floor.py's kernel reads exactly the rows the shared-prefix kernels read: its per-program sums of K * V
over each prefix slice and each request's own tokens equal torch's, under TRITON_INTERPRET=1 in a child process
(triton reads that variable when it is imported). The floor it times on a GPU is only a floor if it reads those rows.
Likewise the contiguous read its ceiling times: each program sums its own run of the buffer."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.server
def test_read_only_floor_kernel_reads_the_kernels_rows_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    child = subprocess.run(
        [sys.executable, "-m", "bench.kv_read_floor"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    print(child.stdout[-2000:], child.stderr[-2000:])
    assert child.returncode == 0, child.stdout[-2000:] + child.stderr[-2000:]
    # prefix whole and in slices, and the suffixes, each matched: 2 prefixes (6 slices) and 7 requests; and the
    # contiguous read
    assert child.stdout.count(" ok\n") == 4 and "contiguous 3 programs" in child.stdout
    assert "prefix slices 3: 6 items" in child.stdout and "suffix slices 1: 7 items" in child.stdout
