"""radixserve as a Dynamo LLMEngine: tokens in, tokens out, through radixserve's own request path.

Dynamo's Worker (its Rust runtime) registers the model, serves the generate endpoint on the request plane, watches
for cancellation and calls abort(), and publishes the KV events this engine hands it. Everything else is
radixserve's: a request is validated by check_request (requests.py), queued as a TokenizedRequest to the scheduler,
and streamed back output by output; the scheduler decides every finish and frees an aborted request's KV at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path

from dynamo.common.backend import EngineConfig, LLMEngine, LlmRegistration, WorkerConfig
from dynamo.llm.exceptions import EngineShutdown, InvalidArgument

from radixserve.config import ServerArgs
from radixserve.model_config import ModelConfig
from radixserve.dynamo.controls import CONTROLS, control
from radixserve.dynamo.kv_publisher import KvEventRelay
from radixserve.dynamo.requests import chunk, prepare, usage
from radixserve.dynamo.scheduler_link import EngineFailure, SchedulerLink
from radixserve.protocol import TokenizedRequest, pack_i32
from radixserve.request_validation import InvalidRequest

logger = logging.getLogger(__name__)
DEFAULT_BLOCK_SIZE = 16
PROG = "python -m radixserve.dynamo"


def parse_args(argv: list[str] | None) -> ServerArgs:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="radixserve as an NVIDIA Dynamo backend (tokens in, tokens out; KV events from its radix tree)",
    )
    ServerArgs.add_cli_args(parser)
    try:
        args = ServerArgs.from_cli_args(parser.parse_args(argv))
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"{PROG}: error: {e}\n")
    if args.pin_prompts is not None:
        parser.exit(
            2,
            f"{PROG}: error: --pin-prompts needs the HTTP front end; pin token ids with "
            "POST /engine/control/pin_prefix on the worker's system port\n",
        )
    if args.port > 32767:  # Dynamo 1.6.1 reads DYN_SYSTEM_PORT as a signed 16-bit number
        parser.exit(2, f"{PROG}: error: --port must be at most 32767 (Dynamo's system server), got {args.port}\n")
    if args.kv_events_block_size is None:
        args.kv_events_block_size = DEFAULT_BLOCK_SIZE
    return args


def runtime_env(args: ServerArgs) -> dict[str, str]:
    """Where Dynamo's runtime binds and what it advertises: --host (loopback by default) for the request plane,
    the event plane's advertised address and the system server, which serves on --port."""
    return {
        "DYN_TCP_RPC_HOST": args.host,
        "DYN_EVENT_PLANE_HOST": args.host,
        "DYN_SYSTEM_HOST": args.host,
        "DYN_SYSTEM_PORT": str(args.port),
    }


class RadixserveEngine(LLMEngine):
    def __init__(self, args: ServerArgs, link: SchedulerLink):
        self.args = args
        self.link = link
        link.on_kv_events, link.on_failure = self._on_kv_events, self._on_failure
        self.model_dir = link.launcher.model_dir
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.context_len = self.model_config.context_len(args.context_length)
        self.served_name = args.served_model_name or Path(self.model_dir).name
        block_size = args.kv_events_block_size
        self.kv_relay = KvEventRelay(block_size, args.dp_size) if block_size else None
        self.kv_pool_tokens: int | None = None
        self.worker_id: int | None = None
        self.failed = False

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple["RadixserveEngine", WorkerConfig]:
        args = parse_args(argv)
        try:
            # Checks the flags and the model directory (preflight) before anything starts, as launch.py does.
            engine = cls(args, SchedulerLink(args))
        except (ValueError, FileNotFoundError, RuntimeError) as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)  # one line, no traceback
            raise SystemExit(2) from None
        os.environ.update(runtime_env(args))
        env = os.environ.get
        config = WorkerConfig(
            namespace=args.dynamo_namespace,
            component=args.dynamo_component,
            endpoint="generate",
            model_name=engine.model_dir,
            served_model_name=engine.served_name,
            discovery_backend=args.discovery_backend or env("DYN_DISCOVERY_BACKEND", "etcd"),
            request_plane=args.request_plane or env("DYN_REQUEST_PLANE", "tcp"),
            event_plane=args.event_plane or env("DYN_EVENT_PLANE"),
            response_plane=env("DYN_RESPONSE_PLANE", "tcp"),
            enable_kv_routing=engine.kv_relay is not None,
        )
        return engine, config

    async def start(self, worker_id: int) -> EngineConfig:
        self.worker_id = worker_id  # the instance id a request's nvext.backend_instance_id names
        await self.link.start()
        self.kv_pool_tokens = (await self.link.server_info()).get("kv_pool_tokens")
        block_size = self.args.kv_events_block_size or None
        blocks = self.kv_pool_tokens // block_size if block_size and self.kv_pool_tokens else None
        logger.info(
            "radixserve engine ready: %s (tp %d, dp %d, KV pool %s tokens, KV event blocks of %s)",
            self.model_dir,
            self.args.tp_size,
            self.args.dp_size,
            self.kv_pool_tokens,
            block_size,
        )
        return EngineConfig(
            model=self.model_dir,
            served_model_name=self.served_name,
            llm=LlmRegistration(
                context_length=self.context_len,
                kv_cache_block_size=block_size,
                total_kv_blocks=blocks,
                max_num_seqs=self.args.max_running_requests,
                data_parallel_size=self.args.dp_size,
            ),
        )

    async def kv_event_sources(self) -> list:
        return self.kv_relay.sources() if self.kv_relay is not None else []

    async def generate(self, request, context):
        try:
            job = prepare(
                request,
                self.model_config.vocab_size,
                self.context_len,
                self.kv_pool_tokens,
                self.args.require_cache_salt,
            )
        except InvalidRequest as e:
            raise InvalidArgument(e.message) from None
        rid, link = context.id(), self.link  # the link, even if cleanup() drops it meanwhile
        if link is None:
            raise EngineShutdown("the radixserve engine is shutting down")
        if rid in link.streams:
            raise InvalidArgument(f"request id {rid} is already in flight on this worker")
        dp_rank = job.dp_rank if self.args.dp_size > 1 else None
        queue = link.submit(
            TokenizedRequest(
                rid, pack_i32(job.prompt_ids), job.params, time.time(), cache_salt=job.cache_salt, dp_rank=dp_rank
            )
        )
        finished, cached_tokens = False, None
        try:
            while not finished:
                out = await queue.get()
                if out is None:  # aborted (abort() came first)
                    return
                if isinstance(out, EngineFailure):
                    raise EngineShutdown(out.reason)
                if out.finish_reason == "error":
                    # Refused before generating anything (it can never fit): the request's fault, else ours.
                    error = out.error or "the scheduler failed this request"
                    raise (InvalidArgument if out.completion_tokens == 0 else EngineShutdown)(error)
                if out.finish_reason == "abort":  # not ours to ask for: the engine dropped it
                    raise EngineShutdown(out.error or "the engine aborted this request")
                if cached_tokens is None and (out.token_ids or out.finished):
                    cached_tokens = out.cached_tokens
                piece = chunk(out, job.params)
                if out.finished:
                    finished = True
                    piece["finish_reason"] = out.finish_reason  # stop | length
                    piece["completion_usage"] = usage(out, cached_tokens or 0)
                yield piece
        finally:
            # Ended early (client gone, cancelled, failed): the scheduler drops it and frees its KV now.
            link.finish(rid, abort=not finished)

    async def abort(self, context) -> None:
        if self.link is not None:
            self.link.finish(context.id(), abort=True)

    def supported_controls(self) -> set[str]:
        return set(CONTROLS)

    async def engine_control(self, name: str, body: dict) -> dict:
        if self.link is None:
            return {"status": 503, "message": "the radixserve engine is shutting down"}
        answer = await control(self.link, name, body)
        if name == "server_info":
            answer["dynamo_worker_id"] = self.worker_id
        return answer

    def _on_kv_events(self, message) -> None:
        if self.kv_relay is not None:
            self.kv_relay.publish(message)

    def _on_failure(self, reason: str) -> None:
        """The engine is gone: leave discovery and stop (Dynamo's Worker shuts down on SIGTERM, calling cleanup)."""
        self.failed = True
        os.kill(os.getpid(), signal.SIGTERM)

    async def cleanup(self) -> None:
        link, self.link = self.link, None
        if link is not None:
            link.stop()
        if self.kv_relay is not None:
            self.kv_relay.close()
