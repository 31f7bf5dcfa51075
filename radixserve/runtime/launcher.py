"""Starts and supervises the engine's processes: one worker per tensor-parallel rank, the scheduler, and (for the
HTTP server) the tokenizer process. Used by launch.py and by the offline Engine. Children report ready or failed
over a socket; any child's death is noticed and reported with its reason, and so is a hang (--watchdog-timeout:
heartbeats stop, or a busy child's progress count stands still). The HTTP processes (--api-server-count of them,
radixserve/runtime/front_ends.py) are told at once (EngineFailed), so /health turns 503 and every request in flight
ends with the reason."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

from radixserve.config import ServerArgs
from radixserve.runtime.data_parallel import replica_endpoints, replica_gpus
from radixserve.runtime.front_ends import FrontEndLinks, front_end_env, front_end_name, is_front_end
from radixserve.runtime.front_ends import default_count as default_front_end_count
from radixserve.runtime.heartbeat import heartbeat_interval
from radixserve.runtime.ipc import Channel, Endpoints, make_ipc_dir
from radixserve.runtime.node_keys import SECRET_ENV, read_secret
from radixserve.runtime.node_link import BEAT_INTERVAL_S, NodeLinks, Peer, is_loopback, ranks_on_node
from radixserve.runtime.preflight import LaunchError, check_before_launch
from radixserve.runtime.process_util import child_argv, write_child_config
from radixserve.runtime.supervision_messages import ChildToLauncher, Heartbeat, ProcessFailed, ProcessReady

READY_TIMEOUT_S = 900
DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
STOP_GRACE_S = 5.0
SUPERVISE_POLL_MS = 50  # how soon a death is noticed (and /health turns 503)
API_KEY_ENV = "RADIXSERVE_API_KEY"
# One step of a CPU model on a busy 2-core machine can take tens of seconds without being stuck.
WATCHDOG_DEFAULT_S = {"cuda": 300.0, "cpu": 300.0}


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    ready: bool = False
    failure: str | None = None
    # From heartbeats: when the last one came, and the last time the child was idle or its progress count moved.
    last_beat: float | None = None
    progress: int = 0
    busy: bool = False
    warm: bool = False
    moving_at: float = 0.0
    hang: str | None = None  # why the watchdog gave up on it

    def on_heartbeat(self, beat: Heartbeat, now: float) -> None:
        if not beat.busy or beat.progress != self.progress or not self.warm:
            self.moving_at = now
        self.last_beat, self.progress, self.busy, self.warm = now, beat.progress, beat.busy, beat.warm

    def stall(self, now: float, beat_interval: float) -> tuple[float, bool] | None:
        """(seconds, silent): how long it has sent no heartbeat (silent) or, beating, been busy without progress.
        None while it moves or idles, before its first heartbeat, and during its first unit of work (compilation
        and graph capture may take minutes)."""
        if self.last_beat is None or not self.warm or self.process.poll() is not None:
            return None
        if now - self.last_beat > 2 * beat_interval:  # a beat missed, not just late
            return now - self.last_beat, True
        return (now - self.moving_at, False) if self.busy else None


def find_hung(children: list[Child], timeout: float, now: float) -> Child | None:
    """Once any child has stalled longer than timeout, the one to blame (its .hang says why), else None. Who else
    has stalled for a while is the likelier cause: a worker blocked in a collective waits on a frozen peer, the
    scheduler waits on its workers. So: frozen ones first, then in start order (workers, scheduler, tokenizer)."""
    stalls = [(c, c.stall(now, heartbeat_interval(timeout))) for c in children]
    if not any(stall is not None and stall[0] > timeout for _, stall in stalls):
        return None
    suspects = [(c, stall) for c, stall in stalls if stall is not None and stall[0] > timeout / 2]
    child, (seconds, silent) = min(suspects, key=lambda cs: not cs[1][1])
    what = "sent no heartbeat" if silent else "made no progress while it had work"
    child.hang = f"{what} for {seconds:.1f} s (--watchdog-timeout is {timeout:g} s)"
    return child


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def resolve_api_key(args: ServerArgs) -> None:
    """--api-key, else the first line of --api-key-file, else $RADIXSERVE_API_KEY (the last two keep the key out of
    ps). The key then travels to the HTTP process inside the 0600 configuration file only."""
    if args.api_key_file is not None:
        if args.api_key is not None:
            raise LaunchError("give --api-key or --api-key-file, not both")
        try:
            lines = Path(args.api_key_file).expanduser().read_text().splitlines()
        except OSError as e:
            raise LaunchError(f"cannot read --api-key-file {args.api_key_file}: {e.strerror or e}") from None
        if not lines or not lines[0].strip():
            raise LaunchError(f"--api-key-file {args.api_key_file} is empty")
        args.api_key, args.api_key_file = lines[0].strip(), None
    elif args.api_key is None and API_KEY_ENV in os.environ:
        args.api_key = os.environ[API_KEY_ENV].strip()
    if args.api_key is not None and not args.api_key.strip():
        # Without a key every route is open: a key that came out empty ("$(cat missing-file)") must not do that.
        raise LaunchError(
            f"the API key is empty (--api-key or ${API_KEY_ENV}): give a key, or leave both unset to serve without one"
        )


def single_node_loopback_env() -> dict[str, str]:
    """Keep gloo's and NCCL's own listening sockets on the loopback interface: on one node nothing else needs to
    reach them, and by default they bind the address the host name resolves to (or every interface)."""
    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if loopback is None:
        return {}
    return {
        k: v for k, v in (("GLOO_SOCKET_IFNAME", loopback), ("NCCL_SOCKET_IFNAME", loopback)) if k not in os.environ
    }


def cpu_worker_malloc_env() -> dict[str, str]:
    """glibc moves its mmap and trim thresholds with what was freed last, so by default a CPU worker hands some of
    each step's freed memory back to the system and faults it in again, zeroed, on a later step: its RSS saw-toothed by
    ~50 MiB for minutes (bench/results/soak-cpu.md). With the mmap threshold fixed at 32 MiB every per-step tensor
    comes from the heap (none is larger since radixserve/worker/cpu_logits.py), and with a 1 GiB trim threshold the
    heap keeps what a step freed for the next one. A value already in the environment wins."""
    keep = (("MALLOC_MMAP_THRESHOLD_", str(32 << 20)), ("MALLOC_TRIM_THRESHOLD_", str(1 << 30)))
    return {k: v for k, v in keep if k not in os.environ}


class Launcher:
    def __init__(self, args: ServerArgs, serve_http: bool = True):
        self.args = args
        if not serve_http and (args.api_server_count or 1) > 1:
            raise LaunchError("--api-server-count is launch.py's: Engine and the Dynamo worker are one front end")
        self.serve_http = serve_http and args.node_rank == 0  # nodes > 0 run workers only
        serve_http = self.serve_http
        if args.api_server_count is None:
            args.api_server_count = default_front_end_count(args.device) if serve_http else 1
        self.model_dir = str(resolve_model_dir(args.model))
        if args.model is None and args.served_model_name is None:
            args.served_model_name = DEMO_MODEL_NAME
        if serve_http:
            resolve_api_key(args)
        if args.watchdog_timeout is None:
            args.watchdog_timeout = WATCHDOG_DEFAULT_S[args.device]
        if args.watchdog_timeout < 0:
            raise LaunchError(f"--watchdog-timeout must be >= 0 (0 disables it), got {args.watchdog_timeout}")
        check_before_launch(args, Path(self.model_dir), serve_http)
        self.endpoints = Endpoints(make_ipc_dir())
        self.config_file = write_child_config(args, self.model_dir, self.endpoints)
        self.config_files = [self.config_file]
        self.ctx = zmq.Context()
        self.inbox = Channel(self.ctx, zmq.PULL, self.endpoints.launcher, bind=True, recv_type=ChildToLauncher)
        self.front_ends = FrontEndLinks(self.ctx, self.endpoints, args.api_server_count if serve_http else 0)
        self.children: list[Child] = []
        self.stop_requested = False
        self.links: NodeLinks | None = None  # multi-node: the links to the other nodes' launchers
        self.stop_reason: str | None = None  # why the server is going down, once a child or node has failed

    def spawn(
        self, name: str, module: str, env: dict[str, str] | None = None, config_file: str | None = None, **extra
    ) -> None:
        cmd = [sys.executable, "-m", module, *child_argv(config_file or self.config_file, **extra)]
        # The key, if it came from the environment, is in the configuration file; /proc/<pid>/environ need not
        # carry it too. Nor the nodes' secret: only this process uses it.
        child_env = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, SECRET_ENV)}
        child_env.update(env or {}, PYTHONUNBUFFERED="1")
        self.children.append(Child(name, subprocess.Popen(cmd, env=child_env)))

    def start(self) -> None:
        if self.args.nnodes > 1:
            # Before any child: the relays must hold this node's ends of the worker sockets (node_link.py).
            self.links = NodeLinks(self.args, self.endpoints, read_secret(self.args))
            self.children += [Child(f"node-{k}", peer) for k, peer in self.links.peers.items()]
        if self.args.dp_size == 1:
            self._spawn_group(self.endpoints, self.config_file, "", 0)
        else:
            for i in range(self.args.dp_size):
                replica = replica_endpoints(self.endpoints, i)
                config_file = write_child_config(self.args, self.model_dir, replica, dp_rank=i)
                self.config_files.append(config_file)
                self.inbox.socket.bind(replica.launcher)  # one inbox, an address per replica
                self._spawn_group(replica, config_file, f"dp{i}-", i)
            self.spawn("dp-controller", "scheduler_service.dp_controller")
        if self.serve_http:
            count = self.args.api_server_count
            env = front_end_env(self.endpoints, count)
            for i in range(count):  # each binds --port itself (tokenizer_service/server.py says how they share it)
                self.spawn(front_end_name(i, count), "tokenizer_service", env=env, api_server_index=i)

    def _spawn_group(self, endpoints: Endpoints, config_file: str, prefix: str, dp_rank: int) -> None:
        """One scheduler (on node 0) and this node's worker ranks, on the given endpoints."""
        if self.args.dist_init_addr:
            dist_init = f"tcp://{self.args.dist_init_addr}"
            host = self.args.dist_init_addr.rpartition(":")[0].strip("[]")
            env = single_node_loopback_env() if is_loopback(host) else {}
        else:
            # A file store in the private directory: torch's TCPStore would listen on every interface.
            dist_init, env = f"file://{Path(endpoints.ipc_dir) / 'dist_store'}", single_node_loopback_env()
        if self.args.device == "cpu":
            env.update(cpu_worker_malloc_env())
        if self.args.device == "cuda" and (self.args.dp_size > 1 or self.args.base_gpu_id):
            # Each replica sees only its GPUs, so a worker's rank still picks its device.
            env["CUDA_VISIBLE_DEVICES"] = ",".join(replica_gpus(self.args, dp_rank, visible_gpus()))
        for rank in ranks_on_node(self.args):
            self.spawn(
                f"{prefix}worker-{rank}",
                "radixserve.worker",
                env=env,
                config_file=config_file,
                rank=rank,
                dist_init_method=dist_init,
            )
        if self.args.node_rank == 0:
            self.spawn(f"{prefix}scheduler", "scheduler_service", config_file=config_file)

    def _tick_links(self) -> None:
        """Multi-node: beat, hear the other nodes, and carry what they said into their entries among the children."""
        if self.links is None:
            return
        self.links.tick(all(c.ready for c in self.children if not isinstance(c.process, Peer)))
        for child in self.children:
            if isinstance(child.process, Peer):
                child.ready, child.failure = child.process.ready, child.process.failure
        if self.links.stopped_by_head is not None:
            self.stop_requested = True

    def _blame_node(self, dead: Child) -> Child:
        """A worker whose collective lost its peer on a node that went down dies at once; the node is the cause
        worth reporting, and the links know it within a few beats. Node 0 waits longer than the others do, so that
        a node whose own worker died (after its wait here) has reported it."""
        if self.links is None or isinstance(dead.process, Peer):
            return dead
        deadline = time.monotonic() + (8 if self.args.node_rank == 0 else 4) * BEAT_INTERVAL_S
        while time.monotonic() < deadline:
            self._read_inbox(50)
            node = next((c for c in self.children if isinstance(c.process, Peer) and c.failure), None)
            if node is not None:
                return node
        return dead

    def _read_inbox(self, timeout_ms: int) -> None:
        self._tick_links()
        message = self.inbox.recv(timeout_ms)
        while message is not None:
            child = next((c for c in self.children if c.name == message.name), None)
            if child is not None:
                if isinstance(message, Heartbeat):
                    child.on_heartbeat(message, time.monotonic())
                elif isinstance(message, ProcessReady):
                    child.ready = True
                elif isinstance(message, ProcessFailed):
                    child.failure = message.message
            message = self.inbox.recv_nowait()

    def _dead_child(self) -> Child | None:
        """The first child that died or failed, else the one to blame for a hang (find_hung)."""
        for child in self.children:
            if child.failure is not None or child.process.poll() is not None or child.hang is not None:
                return child
        if self.args.watchdog_timeout:
            return find_hung(self.children, self.args.watchdog_timeout, time.monotonic())
        return None

    def tell_front_ends(self, child: Child) -> None:
        """Fail the requests in flight with the reason and turn /health to 503, before anything else is stopped."""
        what = f"is hung: it {child.hang}" if child.hang else "died"
        if isinstance(child.process, Peer):
            what = f"failed: {child.failure}"
        self.front_ends.tell(f"The engine failed: process {child.name} {what}; the server is stopping", child.name)

    def wait_until_ready(self) -> Child | None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not all(c.ready for c in self.children):
            if self.stop_requested:
                return None
            self._read_inbox(200)
            dead = self._dead_child()
            if dead is not None:
                return dead
            if time.monotonic() > deadline:
                slow = ", ".join(c.name for c in self.children if not c.ready)
                print(f"radixserve: timed out after {READY_TIMEOUT_S}s waiting for: {slow}", file=sys.stderr)
                return next(c for c in self.children if not c.ready)
        # Every child read it before reporting ready; gone, it cannot outlive a launcher killed with SIGKILL.
        for config_file in self.config_files:
            os.unlink(config_file)
        return None

    def supervise(self) -> Child | None:
        while not self.stop_requested:
            self._read_inbox(SUPERVISE_POLL_MS)
            dead = self._dead_child()
            if dead is not None:
                dead = self._blame_node(dead)
                self.tell_front_ends(dead)
                return dead
        return None

    def describe_death(self, child: Child) -> str:
        """What happened to a dead child: how it exited and the error it reported, if any."""
        time.sleep(0.3)  # a failing child sends its traceback just before it exits
        self._read_inbox(0)
        code = child.process.poll()
        if isinstance(child.process, Peer):
            self.stop_reason = f"{child.name} failed: {child.failure}"
        elif child.hang is not None:
            self.stop_reason = f"{child.name} (pid {child.process.pid}) is hung: it {child.hang}"
        else:
            state = describe_exit(code) if code is not None else "reported a fatal error"
            self.stop_reason = f"{child.name} (pid {child.process.pid}) {state}" + (
                f":\n{child.failure}" if child.failure else ""
            )
        if self.args.nnodes > 1 and not isinstance(child.process, Peer):
            self.stop_reason = f"on node {self.args.node_rank}, {self.stop_reason}"
        return self.stop_reason

    def dead_child_message(self) -> str | None:
        """None while every child lives; otherwise what happened to the first dead one."""
        self._read_inbox(0)
        dead = self._dead_child()
        return None if dead is None else self.describe_death(dead)

    def stop(self) -> None:
        if self.links is not None:  # the other nodes first: they stop their own workers meanwhile
            failed = self.stop_reason is not None
            self.links.close(self.stop_reason or "the server on node 0 was stopped", failed)
        # The front ends first, so clients get an error instead of waiting on an engine that is going away.
        for child in sorted(self.children, key=lambda c: not is_front_end(c.name)):
            if child.process.poll() is None:
                # A hung child would not act on SIGTERM (a stopped one not even receive it).
                child.process.send_signal(signal.SIGKILL if child.hang else signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for child in self.children:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
        self.inbox.close()
        self.front_ends.close()
        self.ctx.term()
        shutil.rmtree(self.endpoints.ipc_dir, ignore_errors=True)


def visible_gpus() -> list[str]:
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def resolve_model_dir(model: str | None) -> Path:
    """The model directory to serve; with none given, the SmolLM2 demo model (built on first use)."""
    if model is None:
        from radixserve.testing.smollm2 import smollm2_dir

        return smollm2_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist (pass an HF directory with config.json)")
    return path
