"""The messages of the processes' supervision, beside the serving path's (radixserve/protocol.py): every child to
launch.py (ready, failed, heartbeats; radixserve/runtime/launcher.py), and between the launchers of a multi-node
server (radixserve/runtime/node_link.py). msgspec msgpack, as every socket's messages."""

from __future__ import annotations

import msgspec


# ---------------------------------------------------------------- every child -> launch.py


class ProcessReady(msgspec.Struct, tag=True):
    name: str  # "scheduler", "worker-0", "tokenizer"
    info: dict[str, int | float | str | bool | None] = {}


class ProcessFailed(msgspec.Struct, tag=True):
    name: str
    message: str


class Heartbeat(msgspec.Struct, tag=True):
    """Sent by every child's heartbeat thread about once a second: a silent child is frozen (stopped, or stuck
    where not even a thread runs), and a busy one whose progress count stands still is hung (--watchdog-timeout)."""

    name: str
    progress: int  # units of work finished so far (worker: forward batches, scheduler: steps)
    busy: bool  # working on a unit right now
    warm: bool  # finished at least one unit: the first one (CUDA graph capture, Triton compile) is not timed


ChildToLauncher = ProcessReady | ProcessFailed | Heartbeat


# ---------------------------------------------------------------- between the launchers of a multi-node server
# (radixserve/runtime/node_link.py; over CURVE-authenticated tcp)


class NodeBeat(msgspec.Struct, tag=True):
    """Sent by every node's launcher twice a second: it is alive, and whether all its processes are ready."""

    node_rank: int
    ready: bool


class NodeFailed(msgspec.Struct, tag=True):
    """Node k > 0 to node 0: one of its processes died or hung; node 0 stops the server with this reason."""

    node_rank: int
    reason: str


class NodeStop(msgspec.Struct, tag=True):
    """Node 0 to every other node: the server is stopping (failed: because something broke; exit non-zero)."""

    reason: str
    failed: bool


NodeToNode = NodeBeat | NodeFailed | NodeStop
