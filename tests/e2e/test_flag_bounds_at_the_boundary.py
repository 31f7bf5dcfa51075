"""Every bounded server flag at exactly its bound and one past it, parsed the way launch.py parses them (its
argparse options from ServerArgs, then ServerArgs' checks): at the bound the flag is kept, one past it is refused
with a message that names the flag. launch.py itself turns that refusal into one line and exit status 2."""

from __future__ import annotations

import argparse
import math
import socket
import subprocess
import sys

import pytest

from radixserve.config import ServerArgs
from radixserve.runtime.launcher import Launcher
from radixserve.runtime.preflight import LaunchError
from radixserve.testing.tiny_models import tiny_model_dir
from server_fixture import REPO_ROOT

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

TINY = math.nextafter(0.0, 1.0)  # the smallest positive float

# (flag, value at the bound, value one past it, words of the refusal)
BOUNDS = [
    ("--tp-size", "1", "0", "--tp-size must be >= 1"),
    ("--dp-size", "1", "0", "--dp-size must be >= 1"),
    ("--mem-fraction-static", repr(TINY), "0", "--mem-fraction-static must be in (0, 1)"),
    ("--mem-fraction-static", repr(math.nextafter(1.0, 0.0)), "1", "--mem-fraction-static must be in (0, 1)"),
    ("--hicache-size", "0", repr(-TINY), "--hicache-size must be >= 0"),
    ("--max-running-requests", "1", "0", "--max-running-requests must be >= 1"),
    ("--max-total-tokens", "2", "1", "--max-total-tokens must be >= 2"),
    ("--chunked-prefill-size", "1", "0", "--chunked-prefill-size must be positive or -1"),
    ("--chunked-prefill-size", "-1", "0", "--chunked-prefill-size must be positive or -1"),
    ("--max-pinned-tokens", "0", "-1", "--max-pinned-tokens must be >= 0"),
    ("--cpu-logits-block-mib", "0", "-1", "--cpu-logits-block-mib must be >= 0"),
    ("--shared-prefix-min-tokens", "1", "0", "--shared-prefix-min-tokens must be >= 1"),
    ("--lone-decode-min-tokens", "0", "-1", "--lone-decode-min-tokens must be >= 0"),
    ("--mixed-step-groups-min-saved-tokens", "0", "-1", "--mixed-step-groups-min-saved-tokens must be >= 0"),
    ("--max-sequences-per-request", "1", "0", "--max-sequences-per-request must be >= 1"),
    ("--tokenizer-workers", "1", "0", "--tokenizer-workers must be >= 1"),
    ("--chat-segment-cache-mib", "0", "-1", "--chat-segment-cache-mib must be >= 0"),
    ("--responses-store-size", "0", "-1", "--responses-store-size must be >= 0"),
    ("--responses-store-ttl", repr(TINY), "0", "--responses-store-ttl > 0"),
    ("--max-header-bytes", "1024", "1023", "--max-header-bytes must be >= 1024"),
    ("--spin-wait-ms", "0", repr(-TINY), "--spin-wait-ms must be >= 0"),
    ("--api-server-count", "1", "0", "--api-server-count must be >= 1"),
    ("--port", "1", "0", "--port out of range"),
    ("--port", "65535", "65536", "--port out of range"),
]


def parse(flag: str, value: str) -> ServerArgs:
    """launch.py's parsing (launch.main) of one flag, on the CPU."""
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(["--device", "cpu", f"{flag}={value}"]))


@pytest.mark.parametrize("flag,at_bound,past,words", BOUNDS, ids=[f"{b[0]} {b[1]}" for b in BOUNDS])
def test_flag_at_its_bound_and_one_past(flag, at_bound, past, words):
    args = parse(flag, at_bound)
    assert getattr(args, flag[2:].replace("-", "_")) == type(getattr(args, flag[2:].replace("-", "_")))(at_bound)
    with pytest.raises(ValueError) as refused:
        parse(flag, past)
    assert words in str(refused.value), refused.value


def launch(*flags: str) -> subprocess.CompletedProcess:
    """launch.py on a taken port: a launch that got past the flags stops there, serving nothing."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        return subprocess.run(
            [
                sys.executable,
                "launch.py",
                "--model",
                str(tiny_model_dir("llama")),
                "--device",
                "cpu",
                "--port",
                str(taken.getsockname()[1]),
                *flags,
            ],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )


def test_launch_refuses_one_past_in_one_line():
    for flags, words in (
        (["--max-header-bytes=1023"], "--max-header-bytes must be >= 1024, got 1023"),
        ([f"--watchdog-timeout={-TINY!r}"], "--watchdog-timeout must be >= 0"),
    ):
        done = launch(*flags)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done
        assert lines[0].startswith("launch.py: error: ") and words in lines[0], lines


def test_several_front_ends_are_launch_pys_alone():
    # Engine and the Dynamo worker stand where front end 0 stands: there is no second one to start.
    args = ServerArgs(model=str(tiny_model_dir("llama")), device="cpu", api_server_count=2)
    with pytest.raises(LaunchError, match="--api-server-count is launch.py's"):
        Launcher(args, serve_http=False)
