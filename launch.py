"""Start radixserve: one worker process per tensor-parallel rank, the scheduler, and the HTTP tokenizer process;
wait until each reports ready, print the URL, and supervise. If any child dies the others are stopped, the reason
is printed and we exit non-zero; SIGINT/SIGTERM stop everything within a few seconds."""

from __future__ import annotations

import argparse
import signal
import sys

from radixserve.config import ServerArgs
from radixserve.launcher import Launcher


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="radixserve: an LLM server with a radix prefix cache")
    ServerArgs.add_cli_args(parser)
    try:
        args = ServerArgs.from_cli_args(parser.parse_args(argv))
        launcher = Launcher(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        parser.error(str(e))  # exits 2 with the message, no traceback

    def request_stop(signum, frame):
        launcher.stop_requested = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    exit_code = 0
    try:
        launcher.start()
        dead = launcher.wait_until_ready()
        if dead is None and not launcher.stop_requested:
            print(f"radixserve: serving {launcher.model_dir} at http://{args.host}:{args.port} "
                  f"(device {args.device}, tp {args.tp_size})", flush=True)
            dead = launcher.supervise()
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
