"""The API key is compared exactly, against one real server (`launch.py` subprocess, tiny model, the key in
$RADIXSERVE_API_KEY): the right key is let in, and every near miss is a 401 in OpenAI's error format: the key with
characters appended, a prefix of it, the key in other case, the key with whitespace around it, an empty bearer, the key
under another scheme or header. A key that comes out empty (a blank variable or flag) stops launch.py instead of
serving every route without one."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import httpx
import pytest

from http_checks import assert_error_response, assert_openai_error, raw_request
from radixserve.config import ServerArgs
from radixserve.runtime.launcher import resolve_api_key
from radixserve.testing.tiny_models import tiny_model_dir
from server_fixture import REPO_ROOT, LaunchedServer

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

KEY = "sk-Exact-0123456789abcdefXYZ"
BODY = {"prompt": "hi", "max_tokens": 1}

NEAR_MISSES = [
    ("appended", f"Bearer {KEY}x"),
    ("appended digit", f"Bearer {KEY}0"),
    ("appended word", f"Bearer {KEY} x"),
    ("prefix", f"Bearer {KEY[:-1]}"),
    ("short prefix", f"Bearer {KEY[:3]}"),
    ("upper case", f"Bearer {KEY.upper()}"),
    ("lower case", f"Bearer {KEY.lower()}"),
    ("swapped case", f"Bearer {KEY.swapcase()}"),
    ("one letter's case", f"Bearer {KEY[:-1]}{KEY[-1].lower()}"),
    ("space before", f"Bearer  {KEY}"),
    ("tab before", f"Bearer\t{KEY}"),
    ("space after", f"Bearer {KEY} "),
    ("tab after", f"Bearer {KEY}\t"),
    ("spaces around", f"Bearer  {KEY} "),
    ("no space", f"Bearer{KEY}"),
    ("empty bearer", "Bearer "),
    ("bare scheme", "Bearer"),
    ("key alone", KEY),
    ("other scheme", f"Token {KEY}"),
    ("empty", ""),
]


@pytest.fixture(scope="module")
def server():
    os.environ["RADIXSERVE_API_KEY"] = KEY  # inherited by launch.py only: Popen runs inside start()
    try:
        server = LaunchedServer(tiny_model_dir("llama")).start()
    finally:
        del os.environ["RADIXSERVE_API_KEY"]
    try:
        yield server
    finally:
        server.stop()


def request(port: int, method: str, path: str, authorization: str | None) -> tuple[int, dict, bytes]:
    """Over a plain socket, so that the header's bytes go exactly as written (whitespace included)."""
    body = b'{"prompt": "hi", "max_tokens": 1}' if method == "POST" else b""
    head = f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
    if authorization is not None:
        head += f"Authorization: {authorization}\r\n"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return raw_request(port, head.encode() + b"\r\n" + body)


ROUTES = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/server_info")]


@pytest.mark.parametrize("name,authorization", NEAR_MISSES, ids=[n for n, _ in NEAR_MISSES])
def test_near_miss_is_401(server, name, authorization):
    for method, path in ROUTES:
        status, headers, body = request(server.port, method, path, authorization)
        assert_openai_error(status, body, 401, "Invalid or missing API key")
        assert headers["www-authenticate"] == "Bearer"


def test_right_key_is_let_in_and_nothing_else(server):
    for method, path in ROUTES:
        status, _, body = request(server.port, method, path, f"Bearer {KEY}")
        assert status == 200, body
        status, _, body = request(server.port, method, path, None)
        assert_openai_error(status, body, 401, "Invalid or missing API key")
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/health").status_code == 200  # the one route without the key
        # The key anywhere but the Authorization header, and a wrong key before the right one, are refused.
        for response in (
            http.post("/v1/completions", json=BODY, headers={"x-api-key": KEY}),
            http.post("/v1/completions", json=BODY, headers={"api-key": KEY}),
            http.post("/v1/completions", params={"api_key": KEY}, json=BODY),
            http.post(
                "/v1/completions",
                json=BODY,
                headers=[("authorization", f"Bearer {KEY}x"), ("authorization", f"Bearer {KEY}")],
            ),
        ):
            assert_error_response(response, 401, "Invalid or missing API key")
        response = http.post("/v1/completions", json=BODY, headers={"authorization": f"Bearer {KEY}"})
        assert response.status_code == 200, response.text


def launch_status(*flags: str, env_key: str | None = None) -> tuple[int, str]:
    """launch.py's exit status and output, for flags that stop it before anything starts. Its port is taken, so that
    a launch that got past the API key stops there too, serving nothing."""
    env = {k: v for k, v in os.environ.items() if k != "RADIXSERVE_API_KEY"}
    if env_key is not None:
        env["RADIXSERVE_API_KEY"] = env_key
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = subprocess.run(
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
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize(
    "flags,env_key",
    [(["--api-key", ""], None), (["--api-key", " "], None), ([], ""), ([], " \n")],
    ids=["empty flag", "blank flag", "empty env", "blank env"],
)
def test_an_empty_key_stops_launch(flags, env_key):
    code, output = launch_status(*flags, env_key=env_key)
    assert code == 2 and "launch.py: error: the API key is empty" in output, (code, output)


def test_the_shortest_key_is_kept(monkeypatch):
    # The other side of the line: one character is a key (launch.py's own resolution, without starting a server).
    for flag, env_key in (("k", None), (None, " k\n")):
        monkeypatch.delenv("RADIXSERVE_API_KEY", raising=False)
        if env_key is not None:
            monkeypatch.setenv("RADIXSERVE_API_KEY", env_key)
        args = ServerArgs(device="cpu", api_key=flag)
        resolve_api_key(args)
        assert args.api_key == "k"
