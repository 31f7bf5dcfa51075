"""Every error of the HTTP front end leaves as OpenAI error JSON: {"error": {"message", "type", "param", "code"}},
whether a route raised it, FastAPI refused the request (unknown route, wrong method), a middleware stopped it before
the app, or something failed unexpectedly (500; the traceback goes to the log, not to the client)."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from radixserve.request_validation import InvalidRequest
from tokenizer_service.request_errors import openai_error

logger = logging.getLogger(__name__)

# OpenAI's `type` for each status; the client libraries map the status itself to an exception class.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    431: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error")


class RequestError(Exception):
    """An error answered to the client as OpenAI error JSON."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.headers = message, status, type, param, headers

    def response_body(self) -> dict:
        return openai_error(self.message, type=self.type, param=self.param, code=self.status)

    def response(self) -> Response:
        return JSONResponse(self.response_body(), status_code=self.status, headers=self.headers)


def error_for_status(message: str, status: int, param: str | None = None) -> RequestError:
    return RequestError(message, status=status, type=error_type(status), param=param)


class JSONResponse(Response):
    """msgspec encoding: fast, and NaN/inf become null instead of invalid JSON."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


def error_json(message: str, status: int) -> bytes:
    return msgspec.json.encode(openai_error(message, type=error_type(status), code=status))


async def send_error(send, message: str, status: int, headers: list[tuple[bytes, bytes]] = ()) -> None:
    """An error answered from ASGI middleware, before (or instead of) the app."""
    body = error_json(message, status)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return exc.response()

    @app.exception_handler(InvalidRequest)
    async def _invalid_request(request: Request, exc: InvalidRequest):
        return RequestError(exc.message, param=exc.param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_for_status(str(exc.detail), exc.status_code).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return RequestError(str(exc)).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return error_for_status(f"Internal server error: {type(exc).__name__}: {exc}", 500).response()
