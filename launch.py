"""Start radixserve: one worker process per tensor-parallel rank, the scheduler, and the HTTP tokenizer process;
wait until each reports ready, print the URL, and supervise. If any child dies the others are stopped, the reason
is printed and we exit non-zero, and so it is when one hangs (--watchdog-timeout); SIGINT/SIGTERM stop everything
within a few seconds. With --nnodes > 1 the same command runs on every node: node 0 as above with its share of the
ranks, the others only their workers (radixserve/runtime/node_link.py); a node's failure ends them all."""

from __future__ import annotations

import argparse
import signal
import sys

from radixserve.config import ServerArgs
from radixserve.runtime.launcher import Launcher
from radixserve.runtime.node_link import ranks_on_node


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="radixserve: an LLM server with a radix prefix cache")
    ServerArgs.add_cli_args(parser)
    try:
        args = ServerArgs.from_cli_args(parser.parse_args(argv))
        key_on_command_line = args.api_key is not None
        # Checks every operator mistake it can (GPU, ports, model directory, TP sizes) before any child starts.
        launcher = Launcher(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")  # one line, no usage dump, no traceback
    if key_on_command_line:
        print(
            "radixserve: warning: --api-key is visible to every local user (ps); pass the key in "
            "$RADIXSERVE_API_KEY or --api-key-file instead",
            file=sys.stderr,
        )

    def request_stop(signum, frame):
        launcher.stop_requested = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    exit_code = 0
    try:
        launcher.start()
        dead = launcher.wait_until_ready()
        if dead is None and not launcher.stop_requested:
            if args.node_rank == 0:
                print(
                    f"radixserve: serving {launcher.model_dir} at http://{args.host}:{args.port} "
                    f"(device {args.device}, tp {args.tp_size}, dp {args.dp_size}, nodes {args.nnodes})",
                    flush=True,
                )
            else:
                print(
                    f"radixserve: node {args.node_rank} of {args.nnodes} ready: tensor-parallel ranks "
                    f"{list(ranks_on_node(args))} for node 0 at {args.dist_init_addr}",
                    flush=True,
                )
            dead = launcher.supervise()
        if dead is None and launcher.links is not None and launcher.links.stopped_by_head:
            print(f"radixserve: node 0 ended the server: {launcher.links.stopped_by_head}", flush=True)
        if dead is not None:
            print(f"radixserve: {launcher.describe_death(dead)}\nradixserve: stopping the server", file=sys.stderr)
            exit_code = 1
    finally:
        launcher.stop()
    if exit_code == 0:
        print("radixserve: stopped", flush=True)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
