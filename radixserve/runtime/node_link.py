"""The links between the launchers of a multi-node server (--nnodes > 1), and the scheduler<->worker traffic that
crosses them.

Node 0 runs the front end, the scheduler and its share of the worker ranks; node k > 0 runs only workers. The
processes of each node still talk over ipc:// sockets in their node's private directory, unchanged. What leaves the
machine goes through relays in the two launchers, over ZeroMQ tcp, msgspec frames as they are:

    port P    torch.distributed rendezvous (TCPStore of rank 0), --dist-init-addr HOST:P
    P + 1     node k -> node 0   NodeBeat / NodeFailed                      (node 0 binds a PULL)
    P + 2     node 0 -> node k   NodeBeat / NodeStop                        (node 0 binds a PUB)
    P + 3     node k -> node 0   workers' frames for the scheduler (WorkerReady)
    P + 4 + r node 0 -> rank r   the scheduler's ForwardBatches for rank r  (one PUSH per remote rank)

Every tcp socket uses ZeroMQ CURVE with keys derived from a secret all nodes share (radixserve/runtime/node_keys.py), so
nobody else on the network can receive batches meant for a rank or drive the workers. (A PUSH hands messages round
robin to its peers: an unauthenticated one would take every other batch.)

The launchers beat to each other twice a second. A node that has not joined within --dist-timeout, or that goes
silent (or reports a failure) later, ends the whole server with a message saying which node and why."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from dataclasses import dataclass

import msgspec
import zmq
import zmq.auth.thread

from radixserve.runtime.ipc import Endpoints
from radixserve.runtime.node_keys import OnlyOurClient, curve_client, curve_server, derive_keys
from radixserve.runtime.supervision_messages import NodeBeat, NodeFailed, NodeStop, NodeToNode

JOIN_TIMEOUT_DEFAULT_S = 600.0  # loading a large model's shard on a slow file system
SILENCE_DEFAULT_S = 30.0
BEAT_INTERVAL_S = 0.5
RELAY_POLL_MS = 100  # how soon a relay notices it should stop; messages themselves pass without waiting

_ENCODER = msgspec.msgpack.Encoder()
_decode = msgspec.msgpack.Decoder(NodeToNode).decode


# ---------------------------------------------------------------- flags


def split_host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr must be HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


def check_multi_node_args(args) -> None:
    """The multi-node rules (radixserve/server_args_rules.py calls this when --nnodes or --node-rank is set)."""
    if args.nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank must be in [0, {args.nnodes}), got {args.node_rank}")
    if args.dist_init_addr is None:
        raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, the same on every node)")
    split_host_port(args.dist_init_addr)
    if args.tp_size % args.nnodes:
        raise ValueError(
            f"--tp-size {args.tp_size} must be a multiple of --nnodes {args.nnodes} "
            f"(each node runs tp_size / nnodes ranks)"
        )
    if args.dist_timeout is not None and args.dist_timeout <= 0:
        raise ValueError(f"--dist-timeout must be > 0, got {args.dist_timeout}")


def ranks_on_node(args, node_rank: int | None = None) -> range:
    """The TP ranks one node runs: node r has ranks r*n .. r*n + n - 1 (n = tp_size / nnodes), so rank 0, whose
    sampled tokens the scheduler reads, is always next to the scheduler."""
    per_node = args.tp_size // args.nnodes
    node = args.node_rank if node_rank is None else node_rank
    return range(node * per_node, (node + 1) * per_node)


def join_timeout(args) -> float:
    return args.dist_timeout or JOIN_TIMEOUT_DEFAULT_S


def silence_timeout(args) -> float:
    return args.dist_timeout or SILENCE_DEFAULT_S


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def connection_lost(dropped_at: float | None, last_beat: float, now: float) -> bool:
    """A peer is gone when its connection closed no earlier than its last beat and it has been silent for three
    beats since. A drop read in the same tick as the last beat counts (both get that tick's time): a loaded
    launcher often reads the final beat and the disconnect together, and the beat was sent first."""
    return dropped_at is not None and dropped_at >= last_beat and now - last_beat > 3 * BEAT_INTERVAL_S


@dataclass(frozen=True)
class LinkPorts:
    host: str
    base: int  # the torch.distributed rendezvous

    def _tcp(self, offset: int) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.base + offset}"

    @property
    def control_up(self) -> str:
        return self._tcp(1)

    @property
    def control_down(self) -> str:
        return self._tcp(2)

    @property
    def workers_up(self) -> str:
        return self._tcp(3)

    def batches(self, rank: int) -> str:
        return self._tcp(4 + rank)

    def ports_node0_binds(self, remote_ranks) -> list[int]:
        return [self.base + 1, self.base + 2, self.base + 3, *(self.base + 4 + r for r in remote_ranks)]


def link_ports(args) -> LinkPorts:
    return LinkPorts(*split_host_port(args.dist_init_addr))


# ---------------------------------------------------------------- relays


class Relay(threading.Thread):
    """Moves frames from one socket to another, unchanged (they are msgspec messages already), until stopped. The
    sockets belong to this thread from start() on."""

    def __init__(self, name: str, source: zmq.Socket, sink: zmq.Socket):
        super().__init__(daemon=True, name=f"relay-{name}")
        self.source, self.sink = source, sink
        self.sink.setsockopt(zmq.SNDTIMEO, RELAY_POLL_MS)  # a PUSH with no peer yet blocks; keep noticing stop
        self.stopping = threading.Event()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.source, zmq.POLLIN)
        try:
            while not self.stopping.is_set():
                if not poller.poll(RELAY_POLL_MS):
                    continue
                frame = self.source.recv(copy=False)
                while not self.stopping.is_set():
                    try:
                        self.sink.send(frame, copy=False)
                        break
                    except zmq.Again:
                        continue
        finally:
            self.source.close(linger=0)
            self.sink.close(linger=0)

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=2)


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind in (zmq.PUSH, zmq.PUB):
        sock.setsockopt(zmq.SNDHWM, 0)
    else:
        sock.setsockopt(zmq.RCVHWM, 0)
    return sock


# ---------------------------------------------------------------- the other nodes, as the launcher sees them


class Peer:
    """Another node, listed among the launcher's children: it has `ready` and `failure` like a child, and enough of
    a Popen's surface (poll() turns non-None once it has failed; there is nothing here to signal) to be one."""

    pid = None

    def __init__(self, node_rank: int, join_deadline: float):
        self.node_rank = node_rank
        self.join_deadline = join_deadline
        self.ready = False
        self.failure: str | None = None
        self.last_beat: float | None = None

    def poll(self) -> int | None:
        return None if self.failure is None else 1

    def wait(self, timeout: float | None = None) -> int | None:
        return self.poll()

    def send_signal(self, sig) -> None:
        pass  # the node stops itself on NodeStop (NodeLinks.close)

    def kill(self) -> None:
        pass

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason


class NodeLinks:
    """This node's end of the links: the relays of scheduler<->worker frames, and the control channel over which
    the launchers beat, report failures and stop one another. Driven by the launcher's loop (tick())."""

    def __init__(self, args, endpoints: Endpoints, secret: bytes):
        self.args = args
        self.node_rank = args.node_rank
        self.ports = link_ports(args)
        self.keys = derive_keys(secret)
        self.ctx = zmq.Context()
        self.relays: list[Relay] = []
        self.stopped_by_head: str | None = None  # node k: node 0 ended the server normally, with this reason
        self.dropped_at: float | None = None  # node 0: when a node's control connection last closed
        self.last_beat_sent = 0.0
        deadline = time.monotonic() + join_timeout(args)
        others = range(1, args.nnodes) if self.node_rank == 0 else (0,)
        self.peers = {k: Peer(k, deadline) for k in others}
        if self.node_rank == 0:
            self._open_head(endpoints)
        else:
            self._open_member(endpoints)
        for relay in self.relays:
            relay.start()

    def _open_head(self, endpoints: Endpoints) -> None:
        self.auth = zmq.auth.thread.ThreadAuthenticator(self.ctx)
        self.auth.start()
        self.auth.configure_curve_callback("*", credentials_provider=OnlyOurClient(self.keys.client_public))
        self.control_in = curve_server(_socket(self.ctx, zmq.PULL), self.keys)
        self.control_in.bind(self.ports.control_up)
        # A peer's launch.py that dies closes its connection at once: seen here, it shortens the wait for its beats.
        self.drops = self.control_in.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.control_out = curve_server(_socket(self.ctx, zmq.PUB), self.keys)
        self.control_out.bind(self.ports.control_down)
        up = curve_server(_socket(self.ctx, zmq.PULL), self.keys)
        up.bind(self.ports.workers_up)
        to_scheduler = _socket(self.ctx, zmq.PUSH)
        to_scheduler.connect(endpoints.workers_to_scheduler)
        self.relays.append(Relay("workers-up", up, to_scheduler))
        for rank in range(self.args.tp_size):
            if rank in ranks_on_node(self.args):
                continue
            from_scheduler = _socket(self.ctx, zmq.PULL)
            from_scheduler.connect(endpoints.scheduler_to_worker(rank))
            down = curve_server(_socket(self.ctx, zmq.PUSH), self.keys)
            down.bind(self.ports.batches(rank))
            self.relays.append(Relay(f"rank-{rank}", from_scheduler, down))

    def _open_member(self, endpoints: Endpoints) -> None:
        self.auth = None
        self.drops = None
        self.control_out = curve_client(_socket(self.ctx, zmq.PUSH), self.keys)
        self.control_out.connect(self.ports.control_up)
        self.control_in = curve_client(_socket(self.ctx, zmq.SUB), self.keys)
        self.control_in.setsockopt(zmq.SUBSCRIBE, b"")
        self.control_in.connect(self.ports.control_down)
        from_workers = _socket(self.ctx, zmq.PULL)
        from_workers.bind(endpoints.workers_to_scheduler)
        up = curve_client(_socket(self.ctx, zmq.PUSH), self.keys)
        up.connect(self.ports.workers_up)
        self.relays.append(Relay("workers-up", from_workers, up))
        for rank in ranks_on_node(self.args):
            down = curve_client(_socket(self.ctx, zmq.PULL), self.keys)
            down.connect(self.ports.batches(rank))
            to_worker = _socket(self.ctx, zmq.PUSH)
            to_worker.bind(endpoints.scheduler_to_worker(rank))
            self.relays.append(Relay(f"rank-{rank}", down, to_worker))

    # ------------------------------------------------------------------ the launcher's loop
    def tick(self, local_ready: bool) -> None:
        """Beat if one is due, take in what the other nodes said, and judge who has failed to join or gone silent."""
        now = time.monotonic()
        if now - self.last_beat_sent >= BEAT_INTERVAL_S:
            self._send(NodeBeat(self.node_rank, local_ready))
            self.last_beat_sent = now
        while self.control_in.poll(0):
            self._on_message(_decode(self.control_in.recv()), now)
        while self.drops is not None and self.drops.poll(0):
            self.drops.recv_multipart()
            self.dropped_at = now
        for peer in self.peers.values():
            self._judge(peer, now)

    def _on_message(self, message, now: float) -> None:
        if isinstance(message, NodeStop):
            if message.failed:
                self.peers[0].fail(message.reason)
            else:
                self.stopped_by_head = message.reason
            return
        peer = self.peers.get(message.node_rank)
        if peer is None:
            return  # a node started with a wrong --node-rank; its own join check tells it
        if isinstance(message, NodeBeat):
            peer.last_beat, peer.ready = now, message.ready
        elif isinstance(message, NodeFailed):
            peer.fail(message.reason)

    def _judge(self, peer: Peer, now: float) -> None:
        who = "node 0" if peer.node_rank == 0 else f"node {peer.node_rank}"
        limit = silence_timeout(self.args)
        if peer.last_beat is None:
            if now > peer.join_deadline:
                listen = (
                    f"node 0 listening at {self.ports.host}:{self.ports.base + 1}-{self.ports.base + 3}"
                    if peer.node_rank == 0
                    else f"{self.ports.host}:{self.ports.base + 1}-{self.ports.base + 3}"
                )
                peer.fail(
                    f"{who} did not join within --dist-timeout {join_timeout(self.args):g} s: is it started "
                    f"with the same command (--nnodes {self.args.nnodes}, --dist-init-addr "
                    f"{self.args.dist_init_addr}, --node-rank {peer.node_rank}) and the same secret, and can "
                    f"it reach {listen}?"
                )
            return
        silent = now - peer.last_beat
        if connection_lost(self.dropped_at, peer.last_beat, now):
            peer.fail(
                f"{who} is gone: its connection closed and it has sent nothing for {silent:.1f} s "
                f"(its launch.py was killed or its machine went down)"
            )
        elif silent > limit:
            peer.fail(
                f"{who} went silent: nothing from it for {silent:.1f} s (--dist-timeout is {limit:g} s); "
                f"its machine or the network between us is down"
            )

    def _send(self, message) -> None:
        try:
            self.control_out.send(_ENCODER.encode(message), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # beats repeat; a failure report is followed by the silence that says the same

    def close(self, reason: str, failed: bool) -> None:
        """Node 0 tells every other node to stop (failed: exit non-zero); node k, failing, tells node 0 why (node 0
        stops the server with that reason). Then the relays and sockets end."""
        if self.node_rank == 0:
            self._send(NodeStop(reason, failed))
        elif failed:
            self._send(NodeFailed(self.node_rank, reason))
        time.sleep(0.2)  # let the last message leave before its socket closes
        for relay in self.relays:
            relay.stop()
        for sock in (self.control_in, self.control_out, self.drops):
            if sock is not None:
                sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
