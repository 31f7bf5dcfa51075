"""The tokenizer process: loads the tokenizer, connects to the scheduler, serves HTTP with uvicorn on uvloop until
SIGTERM / SIGINT. Its imports do not load torch (tests/http/test_http_security.py checks that): the process only parses,
tokenizes and streams. (Loading the tokenizer is another matter: transformers 5 imports torch from its own
configuration module wherever torch is installed.)

Shutdown order matters: on a signal, requests in flight are ended with a 503-style error first (their streams
close), then uvicorn stops listening and closes idle connections. Without that, uvicorn's graceful shutdown would
wait for streams whose engine is going away. We install our own signal handlers (uvicorn's re-raise the signal
after serving, which would kill the process instead of letting serve() return).

With --api-server-count N the launcher starts N of these, each with its index (radixserve/runtime/front_ends.py).
Each binds --port with SO_REUSEPORT (_bind says why); front end 0 alone pins --pin-prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Callable

import uvicorn
import uvloop

from radixserve.config import ServerArgs
from radixserve.model_config import ModelConfig
from radixserve.runtime.front_ends import METRICS_ENV
from radixserve.runtime.ipc import Endpoints
from radixserve.tokenizer_loading import load_tokenizer
from tokenizer_service.app import ServingContext, build_app
from tokenizer_service.http_protocol import protocol_class
from tokenizer_service.metrics import ServerMetrics
from tokenizer_service.request_manager import RequestManager
from tokenizer_service.responses_store import RESPONSES_DB
from tokenizer_service.routes_cache import pin_startup_prompts

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 3  # connections still open after this are closed by force


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # signals are handled by serve() below


def _bind(host: str, port: int, shared: bool = False) -> socket.socket:
    """shared (--api-server-count > 1): every front end binds the port with SO_REUSEPORT, and the kernel spreads
    new connections over the N listening sockets by a hash of each connection's addresses. One socket inherited from
    the launcher would be simpler to own, but a burst would not spread: the front end that wakes first accepts every
    connection queued (asyncio and uvloop accept in a loop), and a burst on one event loop is what N front ends are
    for. (launch.py's preflight finds the port free first; only processes of the same user can join the group.)"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def serve(
    args: ServerArgs,
    model_dir: str,
    endpoints: Endpoints,
    on_ready: Callable[[dict], None],
    api_server_index: str | None = None,
) -> None:
    """Build everything, listen on args.host:args.port, call on_ready({"url": ...}) once accepting connections, and
    return after SIGTERM / SIGINT. api_server_index: this front end's index (from the launcher; None: 0)."""
    index = int(api_server_index or 0)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_serve(args, model_dir, endpoints, on_ready, index))


async def _serve(
    args: ServerArgs, model_dir: str, endpoints: Endpoints, on_ready: Callable[[dict], None], index: int
) -> None:
    model_config = ModelConfig.from_dir(model_dir)
    tokenizer = load_tokenizer(args.tokenizer or model_dir)
    model_name = args.served_model_name or Path(model_dir).name
    # None only when started without the launcher (which resolves the default): one front end, as then.
    args.api_server_count = args.api_server_count or 1
    shared = args.api_server_count > 1
    metrics = ServerMetrics(model_name, index, os.environ[METRICS_ENV] if shared else None)
    manager = RequestManager(
        tokenizer,
        endpoints,
        metrics,
        max_in_flight=args.max_queued_requests,
        max_per_request=args.max_sequences_per_request,
        front_end=index,
    )
    ctx = ServingContext(
        args=args,
        model_dir=str(model_dir),
        model_name=model_name,
        model_config=model_config,
        context_len=model_config.context_len(args.context_length),
        tokenizer=tokenizer,
        manager=manager,
        metrics=metrics,
        started_at=int(time.time()),
        responses_db=os.path.join(endpoints.ipc_dir, RESPONSES_DB) if shared else ":memory:",
    )
    app = build_app(ctx)
    config = uvicorn.Config(
        app,
        http=protocol_class(args.max_header_bytes),
        lifespan="off",
        access_log=False,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=30,
    )
    server = _Server(config)
    sock = _bind(args.host, args.port, shared)

    def stop(signum: int) -> None:
        logger.info("received %s: shutting down", signal.Signals(signum).name)
        manager.begin_shutdown()
        server.should_exit = True

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop, signum)

    manager.start()
    if index == 0:  # --pin-prompts: pinned before the server listens and reports ready (once, by front end 0)
        await pin_startup_prompts(ctx)
    syncing = asyncio.create_task(metrics.sync_shared_loop()) if shared else None
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if serving.done():
                serving.result()  # startup failed: raise its error
                raise RuntimeError("uvicorn stopped before it started listening")
            await asyncio.sleep(0.01)
        host = f"[{args.host}]" if ":" in args.host else args.host
        url = f"http://{host}:{sock.getsockname()[1]}"
        logger.info("HTTP server listening on %s (model %s)", url, model_name)
        on_ready({"url": url})
        await serving
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        if syncing is not None:
            syncing.cancel()
        await manager.close()
        ctx.tokenization.close()
        sock.close()
