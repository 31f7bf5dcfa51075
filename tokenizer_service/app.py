"""The HTTP API: OpenAI routes (/v1/completions, /v1/chat/completions, /v1/models), native routes (/generate,
/flush_cache, /server_info), /health and /metrics.

Bodies are read as raw bytes and validated by the strict pydantic models of openai_schema (FastAPI's own body
parsing would coerce types and answer in its own error shape). Every error leaves as OpenAI error JSON.

A request's path: parse -> check the model name -> tokenize (chat template) -> resolve max_tokens against the
context -> SamplingParams -> RequestManager.submit -> stream SSE chunks or collect a response. While the client
waits, a task listens for its disconnect and aborts the request's sequences in the scheduler at once.

Default max_tokens when the client gives none: /v1/completions 16 (OpenAI's default), /v1/chat/completions the
rest of the context (as vLLM), /generate 128 (SGLang's default); an explicit null means the rest of the context.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

import msgspec
import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from radixserve.config import ModelConfig, ServerArgs
from radixserve.protocol import SchedulerLoad
from radixserve.sampling import SamplingParams
from tokenizer_service import openai_responses as R
from tokenizer_service.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from tokenizer_service.openai_schema import (ChatCompletionRequest, CompletionRequest, GenerateRequest, openai_error,
                                             openai_error_from_validation, to_sampling_fields)
from tokenizer_service.request_manager import (EngineOverloaded, EngineUnavailable, RequestGroup, RequestManager,
                                               SequenceOutput)

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
CONTROL_TIMEOUT_S = 5.0  # /server_info and /flush_cache wait this long for the scheduler
METRICS_REFRESH_TIMEOUT_S = 1.0
PUBLIC_PATHS = frozenset({"/health"})  # reachable without the API key (load balancers probe it)


@dataclass
class ServingContext:
    """What every route needs: the model's shape, the tokenizer and the request manager."""
    args: ServerArgs
    model_dir: str
    model_name: str
    model_config: ModelConfig
    context_len: int
    tokenizer: Any
    manager: RequestManager
    metrics: ServerMetrics
    started_at: int

    def __post_init__(self):
        tokenizer = self.tokenizer

        # Logprob token strings: each token's own text; a vocabulary is small enough to cache whole.
        @functools.lru_cache(maxsize=1 << 18)
        def token_text(token_id: int) -> str:
            return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

        self.token_text = token_text

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size


# ----------------------------------------------------------------------------------------------- errors


class RequestError(Exception):
    """An error answered to the client as OpenAI error JSON."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.headers = message, status, type, param, headers

    def response_body(self) -> dict:
        return openai_error(self.message, type=self.type, param=self.param, code=self.status)

    def response(self) -> Response:
        return JSONResponse(self.response_body(), status_code=self.status, headers=self.headers)


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_server_error",
               503: "service_unavailable_error"}


def error_for_status(message: str, status: int) -> RequestError:
    return RequestError(message, status=status, type=ERROR_TYPES.get(status, "invalid_request_error"))


class JSONResponse(Response):
    """msgspec encoding: fast, and NaN/inf become null instead of invalid JSON."""
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


# ------------------------------------------------------------------------------------------- middleware


async def _send_error(send, message: str, status: int, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = msgspec.json.encode(openai_error(message, type=ERROR_TYPES.get(status, "invalid_request_error"),
                                            code=status))
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class ApiKeyMiddleware:
    """--api-key: every route but /health wants 'Authorization: Bearer <key>'. Checked before the body is read."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = b"Bearer " + api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await _send_error(send, "Invalid or missing API key: send 'Authorization: Bearer <key>'", 401,
                                  [(b"www-authenticate", b"Bearer")])
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
        declared = dict(scope["headers"]).get(b"content-length")
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
        await _send_error(send, f"Request body too large: {size}; the limit is {self.max_bytes} bytes "
                                f"(--max-request-bytes)", 413, [(b"connection", b"close")])


# ------------------------------------------------------------------------------------------ disconnects


@asynccontextmanager
async def abort_on_disconnect(receive, group: RequestGroup):
    """While the body of the `with` runs, a client disconnect aborts the group's sequences at once (the scheduler
    frees their KV within a step), whether or not the handler is sending anything at that moment."""

    async def watch():
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not group.finished:
                    logger.info("client disconnected: aborting %s", group.request_id)
                group.abort()
                return

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        group.abort()  # handler failed or was cancelled: never leave sequences behind (no-op when finished)


class EventStreamResponse(Response):
    """Server-sent events from an async iterator of already-encoded events, aborting the request group when the
    client goes away."""

    def __init__(self, events: AsyncIterator[bytes], group: RequestGroup):
        super().__init__(status_code=200, media_type="text/event-stream")
        self.events, self.group = events, group

    async def __call__(self, scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no")]})
        async with abort_on_disconnect(receive, self.group):
            try:
                async for event in self.events:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
            finally:
                await self.events.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def sse(payload: Any) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def merge_outputs(batch: list[SequenceOutput]) -> list[SequenceOutput]:
    """Outputs of one wake-up merged per choice (text and tokens concatenated), in order of first appearance."""
    merged: dict[int, SequenceOutput] = {}
    for out in batch:
        into = merged.get(out.index)
        if into is None:
            merged[out.index] = SequenceOutput(out.index, out.text, list(out.token_ids), list(out.logprobs),
                                               out.finished, out.finish_reason, out.matched_stop, out.error,
                                               out.error_status)
            continue
        into.text += out.text
        into.token_ids += out.token_ids
        into.logprobs += out.logprobs
        if out.finished:
            into.finished, into.finish_reason, into.matched_stop = True, out.finish_reason, out.matched_stop
            into.error, into.error_status = out.error, out.error_status
    return list(merged.values())


def first_error(outputs) -> RequestError | None:
    for out in outputs:
        if out.error is not None:
            return error_for_status(out.error, out.error_status)
    return None


# --------------------------------------------------------------------------------------- request preparation


async def parse_body(request: Request, model):
    body = await request.body()
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        error = openai_error_from_validation(e)["error"]
        raise RequestError(error["message"], param=error["param"]) from None


def check_model(ctx: ServingContext, model: str | None) -> None:
    if model is not None and model != ctx.model_name:
        raise RequestError(f"The model `{model}` does not exist.", status=404, type="not_found_error",
                           param="model")


def check_prompt_ids(ctx: ServingContext, ids: list[int], param: str) -> list[int]:
    if not ids:
        raise RequestError(f"{param} must not be empty (it tokenizes to no tokens)", param=param)
    vocab = ctx.vocab_size
    try:
        array = np.asarray(ids, dtype=np.int64)
        outside = np.flatnonzero((array < 0) | (array >= vocab)).tolist()
    except OverflowError:  # an id beyond int64 (JSON integers are unbounded)
        outside = [i for i, token in enumerate(ids) if not 0 <= token < vocab]
    if outside:
        raise RequestError(f"{param} contains token id {ids[outside[0]]}, outside the vocabulary [0, {vocab})",
                           param=param)
    return ids


def encode_prompts(ctx: ServingContext, prompt: str | list, param: str) -> list[list[int]]:
    """The OpenAI prompt shapes (str, list[str], list[int], list[list[int]]) as token-id lists."""
    if isinstance(prompt, str):
        prompts = [ctx.tokenizer.encode(prompt)]
    elif all(isinstance(p, str) for p in prompt):
        prompts = [ctx.tokenizer.encode(p) for p in prompt]
    elif all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = [list(p) for p in prompt]
    return [check_prompt_ids(ctx, ids, param) for ids in prompts]


# Arguments of apply_chat_template that chat_template_kwargs must not override.
RESERVED_TEMPLATE_ARGS = frozenset({"conversation", "tokenize", "return_dict", "add_generation_prompt",
                                    "return_tensors", "padding", "truncation", "max_length", "tools", "documents"})


def encode_chat(ctx: ServingContext, req: ChatCompletionRequest) -> list[int]:
    if not getattr(ctx.tokenizer, "chat_template", None):
        raise RequestError("This model has no chat template; use /v1/completions", param="messages")
    extra = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in RESERVED_TEMPLATE_ARGS}
    try:
        ids = ctx.tokenizer.apply_chat_template(req.template_messages(), add_generation_prompt=req.add_generation_prompt,
                                                tokenize=True, return_dict=False, **extra)
    except Exception as e:  # noqa: BLE001 - jinja raises whatever the template says ("roles must alternate")
        raise RequestError(f"Could not apply the chat template: {e}", param="messages") from None
    return check_prompt_ids(ctx, list(ids), "messages")


def resolve_max_tokens(ctx: ServingContext, requested: int | None, prompt_len: int) -> int:
    n = ctx.context_len
    if requested is None:
        if prompt_len >= n:
            raise RequestError(f"This model's maximum context length is {n} tokens. However, your request has "
                               f"{prompt_len} input tokens. Please reduce the length of the input messages.")
        return n - prompt_len
    if prompt_len + requested > n:
        raise RequestError(f"This model's maximum context length is {n} tokens. However, you requested "
                           f"{prompt_len + requested} tokens ({prompt_len} in the messages, {requested} in the "
                           f"completion). Please reduce the length of the messages or completion.")
    return requested


def build_prompts(ctx: ServingContext, fields: dict, prompts: list[list[int]]) -> list[tuple[list[int], SamplingParams]]:
    out = []
    for ids in prompts:
        params = SamplingParams(**{**fields, "max_new_tokens": resolve_max_tokens(ctx, fields["max_new_tokens"],
                                                                                   len(ids))})
        try:
            params.validate(ctx.vocab_size)
        except ValueError as e:
            raise RequestError(str(e)) from None
        out.append((ids, params))
    return out


def submit(ctx: ServingContext, request_id: str, prompts, n: int, arrival: float) -> RequestGroup:
    try:
        return ctx.manager.submit(request_id, prompts, n, arrival)
    except EngineOverloaded as e:
        raise RequestError(str(e), status=503, type="service_unavailable_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except EngineUnavailable as e:
        raise error_for_status(str(e), 503) from None


async def collect(request: Request, group: RequestGroup):
    async with abort_on_disconnect(request.receive, group):
        results = await group.collect()
    error = first_error(results)
    if error is not None:
        raise error
    return results


# ------------------------------------------------------------------------------------------- streams


async def merged_outputs(group: RequestGroup) -> AsyncIterator[SequenceOutput]:
    """The group's outputs as they arrive; what queued up meanwhile comes merged, one output per sequence."""
    async for batch in group.stream():
        for out in merge_outputs(batch):
            yield out


def error_event(out: SequenceOutput) -> bytes:
    """An error in the middle of a stream: the OpenAI error object as an event, then the end of the stream."""
    return sse(error_for_status(out.error, out.error_status).response_body()) + SSE_DONE


async def completion_events(ctx: ServingContext, group: RequestGroup, request_id: str, created: int,
                            want_logprobs: bool, include_usage: bool) -> AsyncIterator[bytes]:
    text_offsets: dict[int, int] = {}
    async for out in merged_outputs(group):
        if out.error is not None:
            yield error_event(out)
            return
        if out.finish_reason == "abort" or not (out.text or out.finished or (want_logprobs and out.token_ids)):
            continue
        logprobs = None
        if want_logprobs:
            offset = text_offsets.get(out.index, 0)
            logprobs = R.completion_logprobs(out.token_ids, out.logprobs, ctx.token_text, offset)
            text_offsets[out.index] = offset + sum(len(t) for t in logprobs["tokens"])
        yield sse(R.completion_chunk(request_id, created, ctx.model_name, out.index, out.text,
                                     out.finish_reason, logprobs, include_usage,
                                     out.matched_stop if out.finished else None))
    if include_usage:
        yield sse(R.completion_usage_chunk(request_id, created, ctx.model_name, group.usage()))
    yield SSE_DONE


async def chat_events(ctx: ServingContext, group: RequestGroup, request_id: str, created: int,
                      want_logprobs: bool, include_usage: bool) -> AsyncIterator[bytes]:
    # The role comes first, before any token, as OpenAI and vLLM send it.
    for seq in group.sequences:
        yield sse(R.chat_chunk(request_id, created, ctx.model_name, seq.index, {"role": "assistant", "content": ""},
                               None, None, include_usage))
    async for out in merged_outputs(group):
        if out.error is not None:
            yield error_event(out)
            return
        if out.finish_reason == "abort" or not (out.text or out.finished or (want_logprobs and out.token_ids)):
            continue
        logprobs = R.chat_logprobs(out.token_ids, out.logprobs, ctx.token_text) if want_logprobs else None
        delta = {"content": out.text} if out.text or not out.finished else {}
        yield sse(R.chat_chunk(request_id, created, ctx.model_name, out.index, delta, out.finish_reason,
                               logprobs, include_usage, out.matched_stop if out.finished else None))
    if include_usage:
        yield sse(R.chat_usage_chunk(request_id, created, ctx.model_name, group.usage()))
    yield SSE_DONE


async def generate_events(ctx: ServingContext, group: RequestGroup, request_id: str, arrival: float,
                          want_logprobs: bool) -> AsyncIterator[bytes]:
    """SGLang's /generate stream: every chunk carries the cumulative text and output_ids of its choice."""
    by_index = {s.index: s for s in group.sequences}
    text = {i: "" for i in by_index}
    ids = {i: [] for i in by_index}
    logprobs = {i: [] for i in by_index}
    async for out in merged_outputs(group):
        if out.error is not None:
            yield error_event(out)
            return
        if out.finish_reason == "abort":
            continue
        i = out.index
        text[i] += out.text
        ids[i] += out.token_ids
        logprobs[i] += out.logprobs
        if not (out.text or out.finished or out.token_ids):
            continue
        seq = by_index[i]
        yield sse(R.native_result(request_id, i, text[i], ids[i], out.finish_reason, out.matched_stop,
                                  len(seq.prompt_ids), seq.cached_tokens,
                                  logprobs[i] if want_logprobs else None,
                                  time.monotonic() - arrival if out.finished else None))
    yield SSE_DONE


# ----------------------------------------------------------------------------------------------- app


def build_app(ctx: ServingContext) -> FastAPI:
    app = FastAPI(title="radixserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return exc.response()

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

    # ------------------------------------------------------------------ OpenAI
    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.monotonic()
        req = await parse_body(request, CompletionRequest)
        check_model(ctx, req.model)
        fields = to_sampling_fields(req)
        n = fields.pop("n")
        prompts = build_prompts(ctx, fields, encode_prompts(ctx, req.prompt, "prompt"))
        request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        group = submit(ctx, request_id, prompts, n, arrival)
        want_logprobs = req.logprobs is not None
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStreamResponse(
                completion_events(ctx, group, request_id, created, want_logprobs, include_usage), group)
        results = await collect(request, group)
        return JSONResponse(R.completion_response(request_id, created, ctx.model_name, results, group.usage(),
                                                  ctx.token_text, want_logprobs))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.monotonic()
        req = await parse_body(request, ChatCompletionRequest)
        check_model(ctx, req.model)
        fields = to_sampling_fields(req)
        n = fields.pop("n")
        prompts = build_prompts(ctx, fields, [encode_chat(ctx, req)])
        request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        group = submit(ctx, request_id, prompts, n, arrival)
        want_logprobs = req.logprobs
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStreamResponse(chat_events(ctx, group, request_id, created, want_logprobs, include_usage),
                                       group)
        results = await collect(request, group)
        return JSONResponse(R.chat_response(request_id, created, ctx.model_name, results, group.usage(),
                                            ctx.token_text, want_logprobs))

    def model_card() -> dict:
        return {"id": ctx.model_name, "object": "model", "created": ctx.started_at, "owned_by": "radixserve",
                "root": ctx.model_dir, "max_model_len": ctx.context_len}

    @app.get("/v1/models")
    async def models():
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        check_model(ctx, model)
        return JSONResponse(model_card())

    # ------------------------------------------------------------------ native
    @app.post("/generate")
    async def generate(request: Request):
        arrival = time.monotonic()
        req = await parse_body(request, GenerateRequest)
        fields = to_sampling_fields(req)
        n = fields.pop("n")
        if req.text is not None:
            prompts = encode_prompts(ctx, req.text, "text")
            batched = isinstance(req.text, list)
        else:
            prompts = encode_prompts(ctx, req.input_ids, "input_ids")
            batched = isinstance(req.input_ids[0], list)
        request_id = uuid.uuid4().hex
        group = submit(ctx, request_id, build_prompts(ctx, fields, prompts), n, arrival)
        if req.stream:
            return EventStreamResponse(generate_events(ctx, group, request_id, arrival, req.return_logprob), group)
        results = await collect(request, group)
        latency = time.monotonic() - arrival
        by_index = {s.index: s for s in group.sequences}
        out = [R.native_result(request_id, r.index, r.text, r.token_ids, r.finish_reason, r.matched_stop,
                               len(by_index[r.index].prompt_ids), by_index[r.index].cached_tokens,
                               r.logprobs if req.return_logprob else None, latency) for r in results]
        return JSONResponse(out if batched or n > 1 else out[0])

    @app.post("/flush_cache")
    async def flush_cache():
        try:
            result = await ctx.manager.flush_cache(CONTROL_TIMEOUT_S)
        except (TimeoutError, asyncio.TimeoutError):
            raise error_for_status("The scheduler did not answer", 503) from None
        if not result.success:
            raise RequestError(f"Cache not flushed: {result.message}")
        return JSONResponse({"success": True, "message": "Cache flushed"})

    @app.get("/server_info")
    async def server_info():
        try:
            info = await ctx.manager.server_info(CONTROL_TIMEOUT_S)
        except (TimeoutError, asyncio.TimeoutError):
            raise error_for_status("The scheduler did not answer", 503) from None
        args = ctx.args.to_dict()
        if args.get("api_key"):
            args["api_key"] = "<redacted>"
        return JSONResponse({**info, "model": ctx.model_name, "model_dir": ctx.model_dir,
                             "context_len": ctx.context_len, "vocab_size": ctx.vocab_size,
                             "num_requests_in_flight": ctx.manager.num_in_flight, "server_args": args})

    # ------------------------------------------------------------------ operations
    @app.get("/health")
    async def health():
        if await ctx.manager.is_healthy():
            return JSONResponse({"status": "ok"})
        raise error_for_status("The engine is not responding", 503)

    @app.get("/metrics")
    async def metrics():
        # Gauges from BatchOutputs lag while idle (no outputs, no updates); ask the scheduler for fresh numbers.
        try:
            info = await ctx.manager.server_info(METRICS_REFRESH_TIMEOUT_S)
            if "kv_total" in info:
                ctx.metrics.update_load(SchedulerLoad(
                    int(info["num_running"]), int(info["num_waiting"]),
                    int(info.get("kv_protected", 0)) + int(info.get("kv_owned", 0)), int(info.get("kv_evictable", 0)),
                    int(info["kv_total"])))
        except (TimeoutError, asyncio.TimeoutError):
            pass  # serve what the last BatchOutput said
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # Outermost last: the API key is checked before the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=ctx.args.max_request_bytes)
    if ctx.args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=ctx.args.api_key)
    return app
