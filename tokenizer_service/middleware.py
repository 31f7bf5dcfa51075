"""ASGI middleware that stops a request before any route sees it: the Host check (DNS rebinding), CORS, the API
key, JSON-only POST bodies from allowed origins, and the body size limit. Each answers in OpenAI error JSON.

Why the browser checks: a server on 127.0.0.1 is reachable from every web page its user opens. A page can POST
`text/plain` across origins without a CORS preflight, and with DNS rebinding (evil.example resolving to
127.0.0.1) it can even read responses, Host: evil.example being the only trace. So without an API key, Host must
name this server; every POST body must be application/json (which a cross-origin page cannot send without a
preflight, and CORS is off unless --allowed-origins); and a state-changing request that carries an Origin header
must come from an allowed origin.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from radixserve.config import ServerArgs
from tokenizer_service.errors import JSONResponse, error_for_status, send_error
from tokenizer_service.routes_dashboard import PAGE_PATH, SCRIPT_PATH

# Reachable without the API key: load balancers probe /health; the dashboard's page and script hold nothing secret
# (the stats they fetch need the key).
PUBLIC_PATHS = frozenset({"/health", PAGE_PATH, SCRIPT_PATH})
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _split_list(value: str | None) -> list[str]:
    return [item.strip() for item in (value or "").split(",") if item.strip()]


def host_name(host_header: str) -> str:
    """'[::1]:30000' -> '::1', 'Example.com:80' -> 'example.com'."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class HostCheckMiddleware:
    """Without --api-key: 403 unless the Host header names the bound address, localhost or --allowed-hosts."""

    def __init__(self, app, allowed: set[str]):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and "*" not in self.allowed:
            raw = _header(scope, b"host")
            if raw is not None and host_name(raw.decode("latin-1")) not in self.allowed:
                await send_error(
                    send,
                    f"Host {raw.decode('latin-1')!r} is not served here: without --api-key only "
                    f"the bound address and localhost are accepted (add names with "
                    f"--allowed-hosts)",
                    403,
                )
                return
        await self.app(scope, receive, send)


class ApiKeyMiddleware:
    """--api-key: every route but /health wants 'Authorization: Bearer <key>'. Checked before the body is read."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = b"Bearer " + api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            given = _header(scope, b"authorization") or b""
            if not hmac.compare_digest(given, self.expected):
                await send_error(
                    send,
                    "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                    401,
                    [(b"www-authenticate", b"Bearer")],
                )
                return
        await self.app(scope, receive, send)


class JsonPostMiddleware:
    """415 for a request body that is not application/json; 403 for a state-changing request whose Origin header
    names a page that --allowed-origins does not list. A bodiless POST without Content-Type (/flush_cache from curl)
    is fine."""

    def __init__(self, app, allowed_origins: list[str]):
        self.app, self.allowed_origins = app, set(allowed_origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in SAFE_METHODS:
            await self.app(scope, receive, send)
            return
        origin = _header(scope, b"origin")
        if (
            origin is not None
            and "*" not in self.allowed_origins
            and origin.decode("latin-1") not in self.allowed_origins
        ):
            await send_error(
                send,
                f"Origin {origin.decode('latin-1')!r} may not call this API (allow it with --allowed-origins)",
                403,
            )
            return
        content_type = _header(scope, b"content-type")
        length = _header(scope, b"content-length")
        has_body = _header(scope, b"transfer-encoding") is not None or (length is not None and length != b"0")
        if content_type is not None or has_body:
            media_type = (content_type or b"").split(b";", 1)[0].strip().lower()
            if media_type != b"application/json":
                shown = content_type.decode("latin-1") if content_type is not None else "none"
                await send_error(
                    send, f"Request body must be JSON: send 'Content-Type: application/json' (got {shown})", 415
                )
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """--max-request-bytes: 413 for a declared Content-Length over the limit, and for a body (chunked or lying about
    its length) that turns out bigger while it is read. The body is read here in full and replayed to the app, so
    the routes never hold more than the limit."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(send, f"{int(declared)} bytes")
            return
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # gone before the body arrived: nothing to answer
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                await self._too_large(send, f"more than {self.max_bytes} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: waits for http.disconnect

        await self.app(scope, replay, send)

    async def _too_large(self, send, size: str) -> None:
        await send_error(
            send,
            f"Request body too large: {size}; the limit is {self.max_bytes} bytes (--max-request-bytes)",
            413,
            [(b"connection", b"close")],
        )


class JsonCORSMiddleware(CORSMiddleware):
    """Starlette's CORS, with a refused preflight answered in OpenAI error JSON rather than plain text."""

    def preflight_response(self, request_headers):
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        error = error_for_status(
            f"{response.body.decode()}: this origin, method or header is not allowed (--allowed-origins)",
            response.status_code,
        )
        cors_headers = {k: v for k, v in response.headers.items() if k.lower().startswith("access-control-")}
        return JSONResponse(error.response_body(), status_code=error.status, headers=cors_headers)


def add_middleware(app: FastAPI, args: ServerArgs) -> None:
    """Starlette runs the middleware added last first: Host check, CORS (preflights answered before the API key is
    asked for), API key (before the body is read), JSON-only POSTs, body limit, then the routes."""
    origins = _split_list(args.allowed_origins)
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_request_bytes)
    app.add_middleware(JsonPostMiddleware, allowed_origins=origins)
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)
    if origins:
        app.add_middleware(
            JsonCORSMiddleware,
            allow_origins=origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
            max_age=600,
        )
    if not args.api_key:
        hosts = {args.host.strip("[]").lower(), *LOOPBACK_HOSTS, *(h.lower() for h in _split_list(args.allowed_hosts))}
        app.add_middleware(HostCheckMiddleware, allowed=hosts)
