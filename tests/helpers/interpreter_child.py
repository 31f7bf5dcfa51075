"""A test module's own checks run as a child process under TRITON_INTERPRET=1 (Triton reads the variable when it is
imported, so the suite's process keeps a normal triton): the module's file is the child's script."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start(script: str, args) -> subprocess.Popen:
    env = dict(os.environ, TRITON_INTERPRET="1", RADIXSERVE_KERNEL_BACKEND="triton")
    helpers = os.path.join(ROOT, "tests", "helpers")  # importable by name, as conftest.py makes them in the suite
    env["PYTHONPATH"] = os.pathsep.join([ROOT, helpers, env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, os.path.abspath(script), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_interpreted_together(script: str, arg_lists, timeout: int = 300) -> list[str]:
    """run_interpreted for each list of args, the children side by side (an interpreted check is one busy core, and
    pytest only waits): their stdouts in order, once every one has exited 0, else fails with the tails of the first
    that did not."""
    children = [_start(script, args) for args in arg_lists]
    outputs = []
    try:
        for child in children:
            out, err = child.communicate(timeout=timeout)
            print(out[-3000:], err[-3000:])
            assert child.returncode == 0, out[-3000:] + err[-3000:]
            outputs.append(out)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    return outputs


def run_interpreted(script: str, *args: str, timeout: int = 300) -> str:
    """Runs `script` (a test module's path, whose __main__ runs its checks, or a bench script) with args and the Triton
    kernels interpreted on the CPU; returns its stdout once it exits 0, else fails with the tails of both streams."""
    return run_interpreted_together(script, [args], timeout)[0]


def printed_json(stdout: str, label: str):
    """The value a child printed as `label: <JSON>` on a line of its own (the first such line)."""
    line = next(line for line in stdout.splitlines() if line.startswith(f"{label}: "))
    return json.loads(line[len(label) + 2 :])
