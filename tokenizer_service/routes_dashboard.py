"""The live cache dashboard: GET /dashboard (a static page, tokenizer_service/static/) and GET /v1/cache/stats, the
JSON it polls.

The page and its script hold nothing secret, so they load without the API key (middleware.PUBLIC_PATHS); the stats
do need it, like every other route: they show the first words of cached prompts. The page reads the key from its
URL fragment (/dashboard#key=...), which the browser never sends to a server, and sends it as a Bearer header.

The front end remembers the counters of recent answers (StatsHistory), so that a dashboard opened now draws the
last minutes at once rather than starting from an empty chart, and several open dashboards draw the same history.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import deque
from functools import lru_cache
from importlib import resources

from fastapi import FastAPI
from starlette.responses import Response

from radixserve.protocol import unpack_i32
from tokenizer_service.errors import JSONResponse, error_for_status
from tokenizer_service.serving import ServingContext

STATS_TIMEOUT_S = 5.0
HISTORY_SAMPLES = 600  # 10 minutes of a dashboard polling every second or more slowly
MIN_SAMPLE_INTERVAL_S = 1.0  # answers closer together than this (several dashboards open) add no sample
HISTORY_FIELDS = ("time", "prompt_tokens_cached", "prompt_tokens_computed", "cache_hit_rate", "decode_tokens")
STATIC = resources.files("tokenizer_service") / "static"
PAGE_PATH, SCRIPT_PATH = "/dashboard", "/dashboard/dashboard.js"
# The page runs only its own script and talks only to this server; cached prompt text is put into the page as text
# nodes (never as HTML), and this policy stops anything injected from running anyway.
PAGE_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; connect-src 'self'; img-src 'self'; "
    "style-src 'self' 'unsafe-inline'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


class StatsHistory:
    """The last HISTORY_SAMPLES answers' counters, at least MIN_SAMPLE_INTERVAL_S apart, each a list in the order
    of HISTORY_FIELDS."""

    def __init__(self):
        self.samples: deque[list] = deque(maxlen=HISTORY_SAMPLES)

    def add(self, stats: dict) -> list[list]:
        if not self.samples or stats["time"] - self.samples[-1][0] >= MIN_SAMPLE_INTERVAL_S:
            self.samples.append([stats[field] for field in HISTORY_FIELDS])
        return list(self.samples)


@lru_cache(maxsize=None)
def _static(name: str) -> bytes:
    return (STATIC / name).read_bytes()


def add_dashboard_routes(app: FastAPI, ctx: ServingContext) -> None:
    history = StatsHistory()

    @app.get(PAGE_PATH, include_in_schema=False)
    async def dashboard():
        return Response(_static("dashboard.html"), media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    @app.get(SCRIPT_PATH, include_in_schema=False)
    async def dashboard_script():
        return Response(_static("dashboard.js"), media_type="text/javascript; charset=utf-8", headers=PAGE_HEADERS)

    @app.get("/v1/cache/stats", include_in_schema=False)
    async def cache_stats():
        try:
            reply = await ctx.manager.cache_stats(STATS_TIMEOUT_S)
        except (TimeoutError, asyncio.TimeoutError):
            raise error_for_status("The scheduler did not answer", 503) from None
        stats = stats_json(ctx, reply.numbers, reply.largest_prefixes)
        stats["history"] = {"fields": HISTORY_FIELDS, "samples": history.add(stats)}
        return JSONResponse(stats)


def stats_json(ctx: ServingContext, numbers: dict, prefixes) -> dict:
    """The scheduler's numbers as they came (scheduler_service/cache_stats.py), the front end's own, and each large
    prefix with its first words decoded."""
    return {
        "time": time.time(),
        "model": ctx.model_name,
        **numbers,
        "num_requests_in_flight": ctx.manager.num_in_flight,
        "largest_prefixes": [
            {
                "num_tokens": p.num_tokens,
                "hits": p.hits,
                "last_use": p.last_use,
                "pinned": p.pinned,
                "tenant": _tenant(p.namespace),
                "text": _first_words(ctx, p.first_tokens),
            }
            for p in prefixes
        ],
    }


def _first_words(ctx: ServingContext, first_tokens: bytes) -> str:
    ids = unpack_i32(first_tokens).tolist()
    # Special tokens stay: a chat template's markers show where the system prompt starts.
    return ctx.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _tenant(namespace: str | None) -> str | None:
    """A cache_salt is what keeps one tenant from probing another's cache, so the page shows a digest of it."""
    return None if namespace is None else hashlib.sha256(namespace.encode()).hexdigest()[:8]
