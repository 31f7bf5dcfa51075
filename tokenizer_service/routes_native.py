"""Native routes (SGLang's names and shapes): /generate, /flush_cache, /server_info; and the operational ones:
/health, /metrics. /generate's default max_new_tokens is SGLang's 128."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import FastAPI, Request
from starlette.responses import Response

from radixserve.protocol import SchedulerLoad
from tokenizer_service import openai_responses as R
from tokenizer_service.errors import JSONResponse, RequestError, error_for_status
from tokenizer_service.metrics import CONTENT_TYPE_LATEST
from tokenizer_service.openai_schema import GenerateRequest, to_sampling_fields
from tokenizer_service.openapi_docs import NATIVE_RESPONSES, documented
from tokenizer_service.routes_cache import drop_pins_param
from tokenizer_service.routes_router import router_server_fields
from tokenizer_service.serving import ServingContext, build_prompts, collect, parse_body, submit
from tokenizer_service.streaming import EventStreamResponse, generate_events

CONTROL_TIMEOUT_S = 5.0  # /server_info and /flush_cache wait this long for the scheduler
METRICS_REFRESH_TIMEOUT_S = 1.0


def add_native_routes(app: FastAPI, ctx: ServingContext) -> None:

    @app.post("/generate", **documented(GenerateRequest, NATIVE_RESPONSES["generate"]))
    async def generate(request: Request):
        arrival = time.monotonic()
        req = await parse_body(request, GenerateRequest)
        fields = to_sampling_fields(req)
        n = fields.pop("n")
        await ctx.grammar_check.check(fields)  # a grammar that does not compile is a 400 (structured_outputs.py)
        param = "text" if req.text is not None else "input_ids"
        prompt = req.text if req.text is not None else req.input_ids
        prompts = await ctx.tokenization.encode_prompts(prompt, param)
        batched = isinstance(prompt, list) and (param == "text" or isinstance(prompt[0], list))
        request_id = uuid.uuid4().hex
        group = submit(
            ctx,
            request_id,
            build_prompts(ctx, fields, prompts, param),
            n,
            arrival,
            cache_salt=req.cache_salt,
            priority=req.priority,
        )
        if req.stream:
            return EventStreamResponse(generate_events(group, request_id, arrival, req.return_logprob), group)
        results = await collect(request, group)
        latency = time.monotonic() - arrival
        by_index = {s.index: s for s in group.sequences}
        out = [
            R.native_result(
                request_id,
                r.index,
                r.text,
                r.token_ids,
                r.finish_reason,
                r.matched_stop,
                len(by_index[r.index].prompt_ids),
                by_index[r.index].cached_tokens,
                r.logprobs if req.return_logprob else None,
                latency,
            )
            for r in results
        ]
        return JSONResponse(out if batched or n > 1 else out[0])

    @app.post("/flush_cache", **documented(None, NATIVE_RESPONSES["flush_cache"]))
    async def flush_cache(request: Request):
        keep_pins = not drop_pins_param(request)  # ?drop_pins=true: pinned prefixes go too (routes_cache.py)
        try:
            result = await ctx.manager.flush_cache(CONTROL_TIMEOUT_S, keep_pins=keep_pins)
        except (TimeoutError, asyncio.TimeoutError):
            raise error_for_status("The scheduler did not answer", 503) from None
        if not result.success:
            raise RequestError(f"Cache not flushed: {result.message}")
        return JSONResponse({"success": True, "message": "Cache flushed"})

    @app.get("/server_info", **documented(None, NATIVE_RESPONSES["server_info"]))
    async def server_info():
        try:
            info = await ctx.manager.server_info(CONTROL_TIMEOUT_S)
        except (TimeoutError, asyncio.TimeoutError):
            raise error_for_status("The scheduler did not answer", 503) from None
        args = ctx.args.to_dict()
        if args.get("api_key"):
            args["api_key"] = "<redacted>"
        return JSONResponse(
            {
                **info,
                **router_server_fields(ctx, info),
                "model": ctx.model_name,
                "model_dir": ctx.model_dir,
                "context_len": ctx.context_len,
                "vocab_size": ctx.vocab_size,
                "num_requests_in_flight": ctx.manager.num_in_flight,  # this front end's
                # --api-server-count: which of the HTTP processes answered (each binds the port; the kernel picks)
                "api_server_count": ctx.args.api_server_count,
                "api_server_index": ctx.manager.front_end,
                "server_args": args,
            }
        )

    @app.get("/health", **documented(None, NATIVE_RESPONSES["health"]))
    async def health():
        if await ctx.manager.is_healthy():
            return JSONResponse({"status": "ok"})
        raise error_for_status("The engine is not responding", 503)

    @app.get("/metrics", **documented(None, NATIVE_RESPONSES["metrics"]))
    async def metrics():
        # Gauges from BatchOutputs lag while idle (no outputs, no updates); ask the scheduler for fresh numbers.
        try:
            info = await ctx.manager.server_info(METRICS_REFRESH_TIMEOUT_S)
            if "kv_total" in info:
                ctx.metrics.update_load(
                    SchedulerLoad(
                        int(info["num_running"]),
                        int(info["num_waiting"]),
                        int(info.get("kv_protected", 0)) + int(info.get("kv_owned", 0)),
                        int(info.get("kv_evictable", 0)),
                        int(info["kv_total"]),
                    )
                )
                ctx.metrics.update_replicas(info)  # --dp-size > 1: per-replica gauges
                # hit rate, pins, host tier, evictions (scheduler_service/cache_stats.py)
                ctx.metrics.update_cache(info)
        except (TimeoutError, asyncio.TimeoutError):
            pass  # serve what the last BatchOutput said
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)
