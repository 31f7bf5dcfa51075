"""Helpers for the HTTP hardening tests: raw socket requests (for what httpx refuses to send), the OpenAI error
shape, and a check that every process of a launched server is still alive."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import httpx


def assert_openai_error(status: int, body: bytes | str, expected_status: int | None = None, *words: str) -> dict:
    if expected_status is not None:
        assert status == expected_status, (status, body)
    assert 400 <= status < 500, (status, body)
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, error
    for word in words:
        assert word in error["message"], (word, error["message"])
    return error


def assert_error_response(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.headers["content-type"].startswith("application/json"), response.headers
    return assert_openai_error(response.status_code, response.content, status, *words)


def raw_request(port: int, data: bytes, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """Send bytes as they are; read the one response (the server closes the connection after an error)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed while we were still sending: read what it said
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
            response = b"".join(chunks)
            head, sep, body = response.partition(b"\r\n\r\n")
            if sep and b"content-length:" in head.lower():
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                if len(body) >= length:
                    break
    response = b"".join(chunks)
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 "), response[:200]
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def process_tree(pid: int) -> list[int]:
    out = [pid]
    for child in _children(pid):
        out += process_tree(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def assert_processes_alive(root_pid: int, expected: list[int]) -> None:
    """Every process the server had at the start (launch.py and its children) is still there and not a zombie."""
    now = process_tree(root_pid)
    for pid in expected:
        assert pid in now and _alive(pid), f"server process {pid} died (processes now: {now})"
