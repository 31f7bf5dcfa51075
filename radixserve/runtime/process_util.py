"""What every child process of launch.py does first: read its configuration (a 0600 file, never argv), die with
its parent, report ready or failed to the launcher over a socket (msgspec only), then send it heartbeats."""

from __future__ import annotations

import argparse
import ctypes
import gc
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
from radixserve.runtime.front_ends import front_end_name
from radixserve.runtime.heartbeat import heartbeat_interval, start_heartbeat
from radixserve.runtime.ipc import Channel, Endpoints
from radixserve.runtime.supervision_messages import ProcessFailed, ProcessReady

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


CONFIG_FILE_NAME = "child_config.json"


def write_child_config(args: ServerArgs, model_dir: str, endpoints: Endpoints, dp_rank: int | None = None) -> str:
    """The children's configuration as a 0600 file in the private IPC directory, never on a command line: argv is
    world-readable (ps, /proc/*/cmdline), and the server arguments may hold the API key. dp_rank: the file of one
    data-parallel replica's processes (their endpoints are the replica's, their names start with dp<i>-)."""
    path = os.path.join(endpoints.ipc_dir, CONFIG_FILE_NAME)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(
            {
                "server_args": args.to_dict(),
                "model_dir": str(model_dir),
                "ipc_dir": endpoints.ipc_dir,
                "dp_rank": dp_rank,
            },
            f,
        )
    return path


def child_argv(config_file: str, **extra) -> list[str]:
    argv = ["--config-file", config_file]
    for key, value in extra.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def _read_configuration(ns: argparse.Namespace) -> tuple[ServerArgs, str, str, int | None]:
    if ns.config_file is not None:
        with open(ns.config_file) as f:
            config = json.load(f)
        return (ServerArgs(**config["server_args"]), config["model_dir"], config["ipc_dir"], config.get("dp_rank"))
    # The same on the command line, for starting one service by hand (tests); launch.py never passes these.
    if None in (ns.server_args_json, ns.model_dir, ns.ipc_dir):
        raise SystemExit("give --config-file, or all of --server-args-json, --model-dir and --ipc-dir")
    return ServerArgs(**json.loads(ns.server_args_json)), ns.model_dir, ns.ipc_dir, None


def setup_logging(name: str, level: str) -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr, format=f"%(asctime)s [{name}] %(levelname)s %(name)s: %(message)s"
    )


def run_child(name: str, main: Callable, extra_args: tuple[str, ...] = ()) -> None:
    """Entry point of a child process: main(args, model_dir, endpoints, on_ready, **extra)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config-file")
    parser.add_argument("--server-args-json")
    parser.add_argument("--model-dir")
    parser.add_argument("--ipc-dir")
    for extra in extra_args:
        parser.add_argument(f"--{extra.replace('_', '-')}")
    ns = parser.parse_args()
    die_with_parent()
    args, model_dir, ipc_dir, dp_rank = _read_configuration(ns)
    extras = {e: getattr(ns, e) for e in extra_args}
    if "rank" in extras:
        name = f"{name}-{extras['rank']}"
    if extras.get("api_server_index") is not None:  # one of --api-server-count front ends
        name = front_end_name(int(extras["api_server_index"]), args.api_server_count)
    if dp_rank is not None:
        name = f"dp{dp_rank}-{name}"
    setup_logging(name, args.log_level)
    endpoints = Endpoints(ipc_dir)
    ctx = zmq.Context()
    launcher = Channel(ctx, zmq.PUSH, endpoints.launcher, bind=False)

    def on_ready(info=None) -> None:
        # Everything built at start-up (model, tokenizer, graphs, the app) lives as long as the process: moved out of
        # the collector's generations, a full collection no longer walks it (70-160 ms pauses mid-serving before).
        gc.collect()
        gc.freeze()
        launcher.send(ProcessReady(name, info or {}))
        if args.watchdog_timeout:  # resolved to a number by the launcher; 0 turns the watchdog off
            start_heartbeat(ctx, name, endpoints.launcher, heartbeat_interval(args.watchdog_timeout))

    try:
        main(args, model_dir, endpoints, on_ready, **extras)
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


def process_tree_argv(root: int) -> dict[int, list[str]]:
    """root and every process below it, each with its argv, read from /proc (Linux). A process that exits while we
    read is left out. Tests and bench/soak.py use it to find the server's children and what each one runs."""
    from pathlib import Path

    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        try:
            tree[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        frontier += [child for child, parent in parents.items() if parent == pid]
    return tree
