"""The HTTP API, assembled: OpenAI routes (routes_openai.py), native and operational routes (routes_native.py),
errors as OpenAI error JSON (errors.py), the middleware in front of them (middleware.py) and the OpenAPI
description at /openapi.json (openapi_docs.py). The path of one request through them is in serving.py.
"""

from __future__ import annotations

from fastapi import FastAPI

from tokenizer_service.errors import install_error_handlers
from tokenizer_service.routes_cache import add_cache_routes
from tokenizer_service.routes_dashboard import add_dashboard_routes
from tokenizer_service.middleware import add_middleware
from tokenizer_service.openapi_docs import install_openapi
from tokenizer_service.routes_native import add_native_routes
from tokenizer_service.routes_openai import add_openai_routes
from tokenizer_service.routes_responses import add_responses_routes
from tokenizer_service.routes_router import add_router_routes
from tokenizer_service.routes_tokenize import add_tokenize_routes
from tokenizer_service.serving import ServingContext

__all__ = ["ServingContext", "build_app"]


def build_app(ctx: ServingContext) -> FastAPI:
    app = FastAPI(title="radixserve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.ctx = ctx
    install_error_handlers(app)
    add_openai_routes(app, ctx)
    add_responses_routes(app, ctx)  # /v1/responses, with stored responses
    add_native_routes(app, ctx)
    add_tokenize_routes(app, ctx)  # /v1/tokenize, /v1/detokenize
    add_router_routes(app, ctx)  # what sglang-router reads from a server behind it
    add_dashboard_routes(app, ctx)  # /dashboard and the /v1/cache/stats it polls
    add_cache_routes(app, ctx)  # pinned prefixes: /v1/cache/pin, /v1/cache/pins
    install_openapi(app, ctx.vocab_size, ctx.context_len)
    add_middleware(app, ctx.args)
    return app
