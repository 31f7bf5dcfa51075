"""Where the processes of data-parallel replica i live (--dp-size > 1): each replica's scheduler and workers use the
usual endpoints, in a private subdirectory of the server's IPC directory; the DP controller (scheduler_service/
dp_controller.py) takes the server directory's scheduler endpoints, so the front end is the same as with one."""

from __future__ import annotations

import os

from radixserve.runtime.ipc import Endpoints


def replica_endpoints(server: Endpoints, dp_rank: int) -> Endpoints:
    path = os.path.join(server.ipc_dir, f"dp{dp_rank}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return Endpoints(path)


def replica_gpus(args, dp_rank: int, visible: list[str]) -> list[str]:
    """GPU ids of replica dp_rank's ranks: in order from --base-gpu-id, tp_size per replica."""
    start = args.base_gpu_id + dp_rank * args.tp_size
    return visible[start : start + args.tp_size]
