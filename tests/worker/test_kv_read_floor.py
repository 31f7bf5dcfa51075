"""bench/kv_read_floor.py's kernel reads exactly the rows the shared-prefix kernels read: its per-program sums of K * V
over each prefix slice and each request's own tokens equal torch's, under TRITON_INTERPRET=1 in a child process
(triton reads that variable when it is imported). The floor it times on a GPU is only a floor if it reads those rows.
Likewise the contiguous read its ceiling times: each program sums its own run of the buffer."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.server
def test_read_only_floor_kernel_reads_the_kernels_rows_in_interpreter():
    from interpreter_child import run_interpreted  # tests/helpers (conftest.py)

    stdout = run_interpreted(os.path.join(ROOT, "bench", "kv_read_floor.py"))
    # prefix whole and in slices, and the suffixes, each matched: 2 prefixes (6 slices) and 7 requests; and the
    # contiguous read
    assert stdout.count(" ok\n") == 4 and "contiguous 3 programs" in stdout
    assert "prefix slices 3: 6 items" in stdout and "suffix slices 1: 7 items" in stdout
