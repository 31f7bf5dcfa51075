"""The routes sglang-router reads from the servers behind it (its "worker contract"), in SGLang's names and
shapes: /model_info and /get_model_info (what model this is), /get_server_info (the server's settings and state,
flat, with dp_size for --dp-aware routing), /get_load (one entry per data-parallel replica, for power_of_two). /health,
/server_info, /flush_cache and /metrics are the native routes (routes_native.py)."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI

from tokenizer_service.errors import JSONResponse, error_for_status
from tokenizer_service.serving import ServingContext

CONTROL_TIMEOUT_S = 5.0


def model_fields(ctx: ServingContext) -> dict:
    return {
        "model_path": ctx.model_dir,
        "tokenizer_path": ctx.args.tokenizer or ctx.model_dir,
        "served_model_name": ctx.model_name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": ctx.model_config.architecture,
        "architectures": [ctx.model_config.architecture],
    }


def router_server_fields(ctx: ServingContext, info: dict) -> dict:
    """What the router reads from /server_info and /get_server_info, beside the scheduler's own numbers."""
    return {
        "model_path": ctx.model_dir,
        "tokenizer_path": ctx.args.tokenizer or ctx.model_dir,
        "served_model_name": ctx.model_name,
        "dp_size": ctx.args.dp_size,
        "tp_size": ctx.args.tp_size,
        "max_total_tokens": info.get("kv_total"),
        "context_length": ctx.context_len,
        "max_running_requests": ctx.args.max_running_requests,
    }


def replica_loads(info: dict, dp_size: int) -> list[dict]:
    """/get_load: per replica, requests held (running + waiting), waiting, KV tokens in use by requests."""

    def one(prefix: str, dp_rank: int) -> dict:
        running, waiting = int(info.get(f"{prefix}num_running", 0)), int(info.get(f"{prefix}num_waiting", 0))
        tokens = int(info.get(f"{prefix}kv_owned", 0)) + int(info.get(f"{prefix}kv_protected", 0))
        return {"dp_rank": dp_rank, "num_reqs": running + waiting, "num_waiting_reqs": waiting, "num_tokens": tokens}

    if dp_size == 1:
        return [one("", 0)]
    return [one(f"dp{i}_", i) for i in range(dp_size)]


def add_router_routes(app: FastAPI, ctx: ServingContext) -> None:

    async def scheduler_info() -> dict:
        try:
            return await ctx.manager.server_info(CONTROL_TIMEOUT_S)
        except (TimeoutError, asyncio.TimeoutError):
            raise error_for_status("The scheduler did not answer", 503) from None

    @app.get("/model_info", include_in_schema=False)
    @app.get("/get_model_info", include_in_schema=False)
    async def model_info():
        return JSONResponse(model_fields(ctx))

    @app.get("/get_server_info", include_in_schema=False)
    async def get_server_info():
        info = await scheduler_info()
        args = ctx.args.to_dict()
        if args.get("api_key"):
            args["api_key"] = "<redacted>"
        return JSONResponse(
            {**args, **info, **router_server_fields(ctx, info), "num_requests_in_flight": ctx.manager.num_in_flight}
        )

    @app.get("/get_load", include_in_schema=False)
    async def get_load():
        return JSONResponse(replica_loads(await scheduler_info(), ctx.args.dp_size))
