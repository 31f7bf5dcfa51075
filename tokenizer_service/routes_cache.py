"""Pinned prefixes over HTTP: POST /v1/cache/pin, GET /v1/cache/pins, DELETE /v1/cache/pin/{id}, and the prompts of
--pin-prompts pinned at start-up. The scheduler does the work (scheduler_service/cache_control.py): it computes a
prefix that is not cached yet, pins it in the radix tree so that no eviction takes it, and answers 409 when the pins
would hold more than --max-pinned-tokens. /flush_cache keeps pins unless asked with ?drop_pins=true (routes_native.py).

A pin body names its tokens one of three ways: `messages` (rendered by the server's chat template without the
generation prompt, so that it is the exact token prefix of a chat request that starts with the same messages),
`prompt` (text, or token ids) or `input_ids`. `cache_salt` pins in that tenant's namespace: only requests with the
same salt hit it. These routes stay out of /openapi.json, like the other operator routes (routes_router.py).

With --dp-size > 1 every pin is made on every replica, under one id (scheduler_service/dp_pins.py); `pinned_tokens`
is then the most any one replica holds, the number --max-pinned-tokens bounds.
"""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from pydantic import ValidationError, field_validator, model_validator

from radixserve.protocol import PinEntry, PinsReply
from radixserve.request_validation import InvalidRequest, check_prompt_ids
from tokenizer_service.errors import JSONResponse, RequestError, error_for_status
from tokenizer_service.openai_schema import ChatCompletionRequest, ChatMessage, openai_error_from_validation
from tokenizer_service.request_fields import _check_cache_salt, _check_prompt, _StrictModel
from tokenizer_service.serving import ServingContext, check_cache_salt, parse_body

logger = logging.getLogger(__name__)

PIN_TIMEOUT_S = 300.0  # a pin may wait for its prefix's prefill (a long prompt on a busy server)
STARTUP_PIN_TIMEOUT_S = 1800.0  # --pin-prompts waits for the engine to load its weights first
LIST_TIMEOUT_S = 5.0
MAX_TTL_SECONDS = 365 * 24 * 3600.0


class PinRequest(_StrictModel):
    """The body of POST /v1/cache/pin and one line of --pin-prompts: exactly one of messages, prompt, input_ids."""

    messages: list[ChatMessage] | None = None
    prompt: str | list[int] | None = None
    input_ids: list[int] | None = None
    ttl_seconds: float | None = None  # None: until unpinned
    cache_salt: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if value is None:
            return value
        several = isinstance(value, list) and value and isinstance(value[0], (str, list))
        if several or not isinstance(value, (str, list)):
            raise ValueError("prompt must be one string or one list of token ids (pin one prefix per request)")
        return _check_prompt("prompt", value)

    @field_validator("input_ids", mode="before")
    @classmethod
    def _input_ids(cls, value: Any) -> Any:
        if value is None:
            return value
        if not isinstance(value, list) or (value and isinstance(value[0], list)):
            raise ValueError("input_ids must be one list of token ids (pin one prefix per request)")
        return _check_prompt("input_ids", value, allow_text=False)

    @field_validator("messages")
    @classmethod
    def _messages(cls, value: list[ChatMessage] | None) -> list[ChatMessage] | None:
        if value is not None and not value:
            raise ValueError("messages must not be empty")
        return value

    @field_validator("ttl_seconds")
    @classmethod
    def _ttl_seconds(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and 0 < value <= MAX_TTL_SECONDS):
            raise ValueError(f"ttl_seconds must be a number in (0, {MAX_TTL_SECONDS:.0f}], got {value}")
        return value

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _cache_salt(cls, value: Any) -> Any:
        return _check_cache_salt(value)

    @model_validator(mode="after")
    def _exactly_one_input(self):
        given = [name for name in ("messages", "prompt", "input_ids") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("exactly one of messages, prompt and input_ids must be given")
        return self


async def pin_token_ids(ctx: ServingContext, body: PinRequest) -> list[int]:
    """The tokens a pin body names, checked against the vocabulary."""
    if body.messages is not None:
        # The salt too: the tokenizer's piece cache keeps tenants apart by it, as the radix cache does.
        chat = ChatCompletionRequest(messages=body.messages, add_generation_prompt=False, cache_salt=body.cache_salt)
        ids, param = await ctx.tokenization.encode_chat(chat), "messages"
    elif body.input_ids is not None:
        ids, param = body.input_ids, "input_ids"
    else:
        ids, param = (await ctx.tokenization.encode_prompts(body.prompt, "prompt"))[0], "prompt"
    return check_prompt_ids(ids, ctx.vocab_size, param)


def pin_json(pin: PinEntry) -> dict:
    body = {
        "id": pin.id,
        "object": "cache.pin",
        "num_tokens": pin.num_tokens,
        "cache_salt": pin.cache_salt,
        "created_at": pin.created_at,
        "expires_at": pin.expires_at,
    }
    if pin.replicas:  # --dp-size > 1: which replicas hold it (all of them, unless its TTL is running out)
        body["replicas"] = pin.replicas
    return body


def _raise_unless_ok(reply: PinsReply) -> None:
    if reply.status != 200:
        raise error_for_status(reply.message, reply.status)


async def _ask(call, timeout_s: float):
    try:
        return await call
    except (TimeoutError, asyncio.TimeoutError):
        raise error_for_status(f"The scheduler did not answer within {timeout_s:.0f} s", 503) from None


async def pin(ctx: ServingContext, body: PinRequest, timeout_s: float = PIN_TIMEOUT_S) -> dict:
    """Pin what the body names; the pin as JSON (RequestError with the scheduler's status when refused)."""
    check_cache_salt(ctx, body.cache_salt)
    ids = await pin_token_ids(ctx, body)
    reply = await _ask(ctx.manager.pin_prefix(ids, body.cache_salt, body.ttl_seconds, timeout_s), timeout_s)
    _raise_unless_ok(reply)
    return {**pin_json(reply.pins[0]), "pinned_tokens": reply.pinned_tokens}


def add_cache_routes(app: FastAPI, ctx: ServingContext) -> None:

    @app.post("/v1/cache/pin", include_in_schema=False)
    async def pin_prefix(request: Request):
        return JSONResponse(await pin(ctx, await parse_body(request, PinRequest)))

    @app.get("/v1/cache/pins", include_in_schema=False)
    async def list_pins():
        reply = await _ask(ctx.manager.list_pins(LIST_TIMEOUT_S), LIST_TIMEOUT_S)
        _raise_unless_ok(reply)
        return JSONResponse(
            {"object": "list", "data": [pin_json(p) for p in reply.pins], "pinned_tokens": reply.pinned_tokens}
        )

    @app.delete("/v1/cache/pin/{pin_id}", include_in_schema=False)
    async def unpin_prefix(pin_id: str):
        reply = await _ask(ctx.manager.unpin_prefix(pin_id, LIST_TIMEOUT_S), LIST_TIMEOUT_S)
        _raise_unless_ok(reply)
        return JSONResponse(
            {"id": pin_id, "object": "cache.pin", "deleted": True, "pinned_tokens": reply.pinned_tokens}
        )


def drop_pins_param(request: Request) -> bool:
    """/flush_cache?drop_pins=true: also drop the pinned prefixes (they survive a flush by default)."""
    value = request.query_params.get("drop_pins", "false").lower()
    if value not in ("true", "false", "1", "0"):
        raise RequestError(f"drop_pins must be true or false, got {value!r}", param="drop_pins")
    return value in ("true", "1")


async def pin_startup_prompts(ctx: ServingContext) -> None:
    """--pin-prompts FILE: pin every line's prompt before the server reports ready. A bad line, or a pin the
    scheduler refuses, stops the start with the file's line number in the error."""
    path = ctx.args.pin_prompts
    if not path:
        return
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"--pin-prompts {path} line {number}"
        try:
            body = PinRequest.model_validate_json(line)
            result = await pin(ctx, body, STARTUP_PIN_TIMEOUT_S)
        except ValidationError as e:
            raise ValueError(f"{where}: {openai_error_from_validation(e)['error']['message']}") from None
        except RequestError as e:
            raise ValueError(f"{where}: {e.message}") from None
        except InvalidRequest as e:  # a token id outside the vocabulary, an empty prompt
            raise ValueError(f"{where}: {e.message}") from None
        logger.info("%s: pinned %d tokens as %s", where, result["num_tokens"], result["id"])
