"""The suite's own rules (tests/conftest.py), seen from outside in a pytest run of its own: a test that starts a
process without the `server` marker fails the run and is named, one with the marker or without a process passes;
a skip outside the `gpu` marker fails the run too."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

REPO_ROOT = Path(__file__).resolve().parents[2]


def start_suite(tmp_path: Path, tests: str) -> subprocess.Popen:
    (tmp_path / "conftest.py").write_text((REPO_ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n    server: starts processes\n")
    (tmp_path / "test_rules.py").write_text(tests)
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finished(run: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = run.communicate(timeout=300)
    return subprocess.CompletedProcess(run.args, run.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The suites below, run at once by the first test that needs one: each run is mostly pytest's and torch's start
    on one core (~2.7 s), so two cores run them side by side. Each test reads its own."""
    suites = {"unmarked": UNMARKED, "skips": SKIPS, "marked": MARKED}  # below, each above its test
    started = {name: start_suite(tmp_path_factory.mktemp(name), tests) for name, tests in suites.items()}
    try:
        yield {name: finished(run) for name, run in started.items()}
    finally:
        for run in started.values():
            if run.poll() is None:
                run.kill()
                run.wait()


UNMARKED = """
import multiprocessing
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def child():
    return subprocess.run([sys.executable, "-c", "pass"]).returncode


def test_unmarked_run():
    subprocess.run([sys.executable, "-c", "pass"])


def test_unmarked_fixture(child):
    assert child == 0


def test_unmarked_multiprocessing():
    process = multiprocessing.get_context("spawn").Process(target=print)
    process.start()
    process.join()


@pytest.mark.server
def test_marked():
    subprocess.run([sys.executable, "-c", "pass"])


def test_no_process():
    pass
"""


def test_a_process_started_without_the_server_marker_fails_the_run(results):
    result = results["unmarked"]
    assert result.returncode == 1, result.stdout + result.stderr
    assert "5 passed" in result.stdout, result.stdout
    assert "3 test(s) started a process without the server marker" in result.stdout, result.stdout
    named = [line.split("::")[1].split(":")[0] for line in result.stdout.splitlines() if "test_rules.py::" in line]
    assert sorted(named) == ["test_unmarked_fixture", "test_unmarked_multiprocessing", "test_unmarked_run"], named


SKIPS = """
import pytest


@pytest.mark.gpu
def test_gpu():
    pytest.skip("no GPU")


def test_other():
    pytest.skip("a missing file")
"""


def test_a_skip_outside_the_gpu_marker_fails_the_run(results):
    result = results["skips"]
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 test(s) skipped without the gpu marker" in result.stdout, result.stdout
    assert "skipped GPU tests: 1" in result.stdout, result.stdout


MARKED = """
import subprocess
import sys

import pytest


@pytest.mark.server
def test_marked():
    subprocess.run([sys.executable, "-c", "pass"])
"""


def test_the_suite_passes_with_marked_processes_only(results):
    result = results["marked"]
    assert result.returncode == 0, result.stdout + result.stderr
