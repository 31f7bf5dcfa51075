"""The OpenAPI description served at /openapi.json: every route's request body (the models of openai_schema, which
the routes validate themselves from raw bytes) and its responses, errors included (OpenAI error JSON for every
status). The response models here only document what openai_responses builds; tests/http/test_schemathesis.py checks
real responses against them.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from tokenizer_service.request_fields import INT64_MAX, INT64_MIN, MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS

REF = "#/components/schemas/{model}"


# ---------------------------------------------------------------------------------------------- errors


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorDetail


# --------------------------------------------------------------------------------------------- OpenAI


class CachedTokens(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: CachedTokens


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: int | str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ResponseObject(BaseModel):
    """/v1/responses (routes_responses.py); output items and usage as responses_output.py writes them."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None
    previous_response_id: str | None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


# --------------------------------------------------------------------------------------------- native


class NativeMeta(BaseModel):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: dict[str, Any] | None
    e2e_latency: float | None


class GenerateResult(BaseModel):
    text: str
    output_ids: list[int]
    index: int
    meta_info: NativeMeta


class FlushCacheResponse(BaseModel):
    success: bool
    message: str


class ServerInfo(BaseModel):
    model: str
    model_dir: str
    context_len: int
    vocab_size: int
    num_requests_in_flight: int
    api_server_count: int
    api_server_index: int
    server_args: dict[str, Any]


class Health(BaseModel):
    status: Literal["ok"]


# ------------------------------------------------------------------------------------------ per route

# Before OpenAPI 3.2, the schema of an event stream describes one event: a chunk as JSON in `data`, or [DONE].
EVENT_STREAM = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "required": ["data"],
            "properties": {
                "data": {
                    "type": "string",
                    "description": "One chunk as JSON; the last event is [DONE]. An error "
                    'after the stream began is an {"error": ...} chunk.',
                }
            },
        }
    }
}


def _json(model: type[BaseModel] | dict) -> dict:
    schema = {"$ref": REF.format(model=model.__name__)} if isinstance(model, type) else model
    return {"application/json": {"schema": schema}}


def _ok(model, description: str, stream: bool = False) -> dict:
    content = _json(model)
    if stream:
        content.update(EVENT_STREAM)
    return {"description": description, "content": content}


OPENAI_RESPONSES = {
    "completion": {200: _ok(CompletionResponse, "The completion, or its chunks when stream is true", stream=True)},
    "chat": {200: _ok(ChatCompletionResponse, "The chat completion, or its chunks when stream is true", stream=True)},
    "models": {200: _ok(ModelList, "The served model")},
    "responses": {
        200: _ok(ResponseObject, "The response, or its events when stream is true", stream=True),
        404: {"description": "Unknown model, or previous_response_id not stored here", "content": _json(ErrorResponse)},
    },
    "response": {200: _ok(ResponseObject, "The stored response")},
    "response_deleted": {200: _ok(DeletedResponse, "The stored response was deleted")},
    "model": {200: _ok(ModelCard, "The served model, if that is its name")},
}

NATIVE_RESPONSES = {
    "generate": {
        200: _ok(
            {
                "anyOf": [
                    {"$ref": REF.format(model="GenerateResult")},
                    {"type": "array", "items": {"$ref": REF.format(model="GenerateResult")}},
                ]
            },
            "One result, or a list for a batch of prompts or n > 1; chunks when stream is true",
            stream=True,
        )
    },
    "flush_cache": {200: _ok(FlushCacheResponse, "The radix cache was emptied")},
    "server_info": {200: _ok(ServerInfo, "Scheduler state (KV slot accounting) and the server's arguments")},
    "health": {200: _ok(Health, "The scheduler and workers answer")},
    "metrics": {
        200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}
    },
}

ERROR_STATUSES = {
    400: "Invalid request",
    401: "Missing or wrong API key",
    403: "Host or Origin not allowed",
    404: "Unknown route or model",
    405: "Wrong method",
    413: "Body over --max-request-bytes",
    415: "Body not application/json",
    431: "Headers over --max-header-bytes",
    500: "Internal error",
    503: "Overloaded (with Retry-After) or the engine is not responding",
}

REQUEST_MODELS: list[type[BaseModel]] = []
RESPONSE_MODELS = [
    ErrorResponse,
    CompletionResponse,
    ChatCompletionResponse,
    ResponseObject,
    DeletedResponse,
    ModelList,
    ModelCard,
    GenerateResult,
    FlushCacheResponse,
    ServerInfo,
    Health,
]


def documented(request_model: type[BaseModel] | None, responses: dict) -> dict:
    """Keyword arguments of a route decorator that document its body and responses."""
    errors = {
        status: {"description": text, **{"content": _json(ErrorResponse)}} for status, text in ERROR_STATUSES.items()
    }
    extra: dict = {}
    if request_model is not None:
        REQUEST_MODELS.append(request_model)
        extra["requestBody"] = {"required": True, "content": _json(request_model)}
    return {"responses": {**errors, **responses}, "openapi_extra": extra}


def _numeric_members(schema: dict) -> list[dict]:
    members = schema.get("anyOf", [schema])
    return [m for m in members if m.get("type") in ("integer", "number")]


def _token_id_items(schema: dict) -> list[dict]:
    """The integer items of the token-id shapes of a field (list[int], list[list[int]])."""
    found = []
    for member in schema.get("anyOf", [schema]):
        items = member.get("items", {})
        if items.get("type") == "integer":
            found.append(items)
        elif items.get("type") == "array":
            found += _token_id_items(items)
    return found


def _non_empty(schema: dict) -> None:
    """Prompts are never empty: no empty string, list, or list inside a list."""
    for member in schema.get("anyOf", [schema]):
        if member.get("type") == "string":
            member["minLength"] = 1
        elif member.get("type") == "array":
            member["minItems"] = 1
            if member.get("items", {}).get("type") in ("string", "array"):
                _non_empty(member["items"])


def document_bounds(schemas: dict, vocab_size: int, context_len: int) -> None:
    """The ranges the field validators of openai_schema enforce, written into the JSON schemas (pydantic cannot see
    inside a validator), so that clients and generated tests know them. Context length and vocabulary are this
    server's."""
    int64 = {"minimum": INT64_MIN, "maximum": INT64_MAX}
    bounds = {
        "temperature": {"minimum": 0},
        "top_p": {"exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"minimum": -1},
        "min_p": {"minimum": 0, "maximum": 1},
        "n": {"minimum": 1, "maximum": MAX_N},
        "seed": int64,
        "presence_penalty": {"minimum": -2, "maximum": 2},
        "frequency_penalty": {"minimum": -2, "maximum": 2},
        "repetition_penalty": {"exclusiveMinimum": 0, "maximum": 2},
        "logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
        "top_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
        "top_logprobs_num": {"minimum": 0, "maximum": MAX_LOGPROBS},
        "min_tokens": {"minimum": 0},
        "min_new_tokens": {"minimum": 0},
    }
    for name in ("max_tokens", "max_completion_tokens", "max_new_tokens", "max_output_tokens"):
        bounds[name] = {"minimum": 1, "maximum": context_len}
    for model in schemas.values():
        for name, prop in model.get("properties", {}).items():
            for member in _numeric_members(prop) if name in bounds else []:
                member.update(bounds[name])
            if name in ("prompt", "input_ids", "stop_token_ids"):
                for items in _token_id_items(prop):
                    items.update({"minimum": 0, "maximum": vocab_size - 1})
            if name in ("prompt", "text", "input_ids", "messages", "input"):
                _non_empty(prop)
            if name == "stop":
                for member in prop.get("anyOf", []):
                    if member.get("type") == "array":
                        member["maxItems"] = MAX_STOP_STRINGS
    generate = schemas.get("GenerateRequest")
    if generate is not None:  # exactly one of the two inputs
        generate["oneOf"] = [{"required": ["text"]}, {"required": ["input_ids"]}]


def install_openapi(app: FastAPI, vocab_size: int, context_len: int) -> None:
    """FastAPI documents the routes; the schemas they point to are added to components here (pydantic writes them,
    with the strict types the routes enforce)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                routes=app.routes,
                description="OpenAI-compatible and native (SGLang-style) routes of radixserve",
            )
            _, requests = models_json_schema(
                [(m, "validation") for m in dict.fromkeys(REQUEST_MODELS)], ref_template=REF
            )
            _, responses = models_json_schema([(m, "serialization") for m in RESPONSE_MODELS], ref_template=REF)
            document_bounds(requests.get("$defs", {}), vocab_size, context_len)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(responses.get("$defs", {}))
            components.update(requests.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
