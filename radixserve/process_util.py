"""What every child process of launch.py does first: parse its arguments, die with its parent, report ready or
failed to the launcher over a socket (msgspec only)."""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Callable

import zmq

from radixserve.config import ServerArgs
from radixserve.ipc import Channel, Endpoints
from radixserve.protocol import ProcessFailed, ProcessReady

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """No orphans: the kernel kills us when launch.py dies (Linux), and a watchdog covers other platforms."""
    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass

    def watch():
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name="parent-watchdog").start()


def child_argv(args: ServerArgs, model_dir: str, endpoints: Endpoints, **extra) -> list[str]:
    argv = ["--server-args-json", json.dumps(args.to_dict()), "--model-dir", str(model_dir),
            "--ipc-dir", endpoints.ipc_dir]
    for key, value in extra.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def setup_logging(name: str, level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s [{name}] %(levelname)s %(name)s: %(message)s")


def run_child(name: str, main: Callable, extra_args: tuple[str, ...] = ()) -> None:
    """Entry point of a child process: main(args, model_dir, endpoints, on_ready, **extra)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--server-args-json", required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--ipc-dir", required=True)
    for extra in extra_args:
        parser.add_argument(f"--{extra.replace('_', '-')}")
    ns = parser.parse_args()
    die_with_parent()
    args = ServerArgs(**json.loads(ns.server_args_json))
    extras = {e: getattr(ns, e) for e in extra_args}
    if "rank" in extras:
        name = f"{name}-{extras['rank']}"
    setup_logging(name, args.log_level)
    endpoints = Endpoints(ns.ipc_dir)
    ctx = zmq.Context()
    launcher = Channel(ctx, zmq.PUSH, endpoints.launcher, bind=False)
    try:
        main(args, ns.model_dir, endpoints, lambda info=None: launcher.send(ProcessReady(name, info or {})), **extras)
    except KeyboardInterrupt:
        pass
    except BaseException as e:  # noqa: BLE001 - whatever kills us is reported, then we exit non-zero
        if isinstance(e, SystemExit) and not e.code:
            return
        message = "".join(traceback.format_exception(e)).strip()
        logging.getLogger(name).error("fatal: %s", message)
        launcher.send(ProcessFailed(name, message))
        time.sleep(0.2)  # let the message leave before the socket dies with us
        os._exit(1)
