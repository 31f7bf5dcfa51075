"""What the radixserve client raises: errors that carry the server's message (its OpenAI-style error body), and the
transport's failures as the client's own connection and timeout errors."""

from __future__ import annotations

import json
from typing import Any

import httpx


# ------------------------------------------------------------------------------------------------- errors


class RadixServeError(Exception):
    """An error answer of the server (status_code set) or a failure to reach it (status_code None)."""

    def __init__(
        self,
        status_code: int | None,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: Any = None,
        body: Any = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.body = body  # the parsed JSON (or text) of the error response

    def __str__(self) -> str:
        where = f"HTTP {self.status_code}" if self.status_code is not None else (self.type or "error")
        extra = f" (param: {self.param})" if self.param else ""
        return f"{where}: {self.message}{extra}"


class RadixServeConnectionError(RadixServeError):
    """Could not connect to the server, or the connection broke before the response was complete."""

    def __init__(self, message: str):
        super().__init__(None, message, type="connection_error")


class RadixServeTimeoutError(RadixServeError):
    """The server did not answer (or send the next part of a response) within the timeout."""

    def __init__(self, message: str):
        super().__init__(None, message, type="timeout")


def error_from_body(status_code: int | None, body: Any) -> RadixServeError:
    """The OpenAI error shape {"error": {"message", "type", "param", "code"}}, FastAPI's {"detail": ...}, or
    anything else (shown as it came)."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        code = err.get("code")
        if status_code is None and isinstance(code, int):
            status_code = code
        return RadixServeError(
            status_code, str(err.get("message") or err), err.get("type"), err.get("param"), code, body
        )
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return RadixServeError(status_code, body["error"], body.get("type"), body.get("param"), body.get("code"), body)
    if isinstance(body, dict) and "detail" in body:
        detail = body["detail"]
        return RadixServeError(status_code, detail if isinstance(detail, str) else json.dumps(detail), body=body)
    text = body if isinstance(body, str) else json.dumps(body)
    return RadixServeError(status_code, text or f"HTTP {status_code}", body=body)


def error_from_response(response: httpx.Response) -> RadixServeError:
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    return error_from_body(response.status_code, body)


def transport_error(exc: httpx.TransportError, url: str) -> RadixServeError:
    if isinstance(exc, httpx.TimeoutException):
        return RadixServeTimeoutError(f"timed out waiting for {url} ({type(exc).__name__}: {exc})")
    if isinstance(exc, httpx.ConnectError):
        return RadixServeConnectionError(f"could not connect to {url}: {exc} (is the server running?)")
    return RadixServeConnectionError(f"connection to {url} failed: {type(exc).__name__}: {exc}")
