"""A test module's own checks run as a child process under TRITON_INTERPRET=1 (Triton reads the variable when it is
imported, so the suite's process keeps a normal triton): the module's file is the child's script."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_interpreted(script: str, *args: str, timeout: int = 300) -> str:
    """Runs `script` (a test module's path, whose __main__ runs its checks, or a bench script) with args and the Triton
    kernels interpreted on the CPU; returns its stdout once it exits 0, else fails with the tails of both streams."""
    env = dict(os.environ, TRITON_INTERPRET="1", RADIXSERVE_KERNEL_BACKEND="triton")
    helpers = os.path.join(ROOT, "tests", "helpers")  # importable by name, as conftest.py makes them in the suite
    env["PYTHONPATH"] = os.pathsep.join([ROOT, helpers, env.get("PYTHONPATH", "")])
    child = subprocess.run(
        [sys.executable, os.path.abspath(script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    print(child.stdout[-3000:], child.stderr[-3000:])
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    return child.stdout
