"""Multi-node tensor parallelism (--nnodes 2) as two launch.py processes on one host, over gloo: the same greedy
tokens as --tp-size 2 on one node and as one rank; the links between nodes refuse anyone without the secret; a node
that never joins, or dies later, ends the server on the other node with a message naming it."""

import os
import random
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from radixserve.runtime.ipc import Endpoints, make_ipc_dir
from radixserve.runtime.launcher import free_port
from radixserve.runtime.node_keys import SECRET_ENV, derive_keys
from radixserve.runtime.node_link import BEAT_INTERVAL_S, NodeLinks, connection_lost, link_ports
from radixserve.protocol import WorkerReady
from radixserve.testing.tiny_models import tiny_model_dir

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
SECRET = "multinode-test-secret-0123456789"
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12]]
MAX_NEW = 12


def free_port_block(count: int) -> int:
    """A base port P with P .. P + count - 1 all free on the loopback interface."""
    for _ in range(200):
        base = random.randrange(20000, 60000 - count)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free block of ports")


def node_command(node_rank: int, dist_port: int, http_port: int, *extra: str) -> list[str]:
    # The same command on every node but for --node-rank.
    return [
        sys.executable,
        str(REPO / "launch.py"),
        "--model",
        str(tiny_model_dir("llama")),
        "--device",
        "cpu",
        "--tp-size",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        str(node_rank),
        "--dist-init-addr",
        f"127.0.0.1:{dist_port}",
        "--port",
        str(http_port),
        "--max-total-tokens",
        "2048",
        *extra,
    ]


def start_node(node_rank: int, dist_port: int, http_port: int, *extra: str, secret: str = SECRET):
    env = {**os.environ, SECRET_ENV: secret}
    return subprocess.Popen(
        node_command(node_rank, dist_port, http_port, *extra),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_healthy(url: str, procs, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"launch.py exited early:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"server did not become healthy in {timeout} s")


def greedy_tokens_over_http(url: str) -> list[list[int]]:
    r = httpx.post(
        f"{url}/generate",
        timeout=120,
        json={
            "input_ids": PROMPTS,
            "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
        },
    )
    assert r.status_code == 200, r.text
    return [item["output_ids"] for item in r.json()]


def test_two_nodes_match_one_node_then_a_killed_node_ends_the_server():
    from radixserve import Engine, SamplingParams
    from scheduler_service.in_process_engine import InProcessEngine

    dist_port, http_port = free_port_block(4 + 2), free_port()
    node0 = start_node(0, dist_port, http_port, "--dist-timeout", "10")
    node1 = start_node(1, dist_port, http_port, "--dist-timeout", "10")
    try:
        url = f"http://127.0.0.1:{http_port}"
        wait_healthy(url, (node0, node1))
        two_nodes = greedy_tokens_over_http(url)

        params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
        model = str(tiny_model_dir("llama"))
        one_rank = [
            r.token_ids for r in InProcessEngine(model, device="cpu", max_total_tokens=2048).generate(PROMPTS, params)
        ]
        with Engine(model, device="cpu", max_total_tokens=2048, tp_size=2) as one_node:
            tp2 = [r.token_ids for r in one_node.generate(PROMPTS, params)]
        assert two_nodes == tp2 == one_rank
        assert all(len(tokens) == MAX_NEW for tokens in two_nodes)

        # Node 1 dies (SIGKILL: no goodbye) with a request in flight: node 0 fails it and exits, naming node 1.
        outcome = {}

        def long_request():
            try:
                r = httpx.post(
                    f"{url}/generate",
                    timeout=60,
                    json={"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}},
                )
                outcome["body"] = r.text
            except httpx.HTTPError as e:
                outcome["error"] = repr(e)

        client = threading.Thread(target=long_request)
        client.start()
        time.sleep(1.0)
        node1.kill()
        killed_at = time.monotonic()
        code = node0.wait(timeout=30)
        ended_after = time.monotonic() - killed_at
        output = node0.stdout.read()
        assert code == 1, output[-3000:]
        assert ended_after < 10, f"node 0 took {ended_after:.1f} s (--dist-timeout 10)"
        assert "node-1 failed: node 1 is gone" in output, output[-3000:]
        client.join(timeout=30)
        assert not client.is_alive()
        assert "error" in outcome or "node 1" in outcome.get("body", ""), outcome
    finally:
        for proc in (node0, node1):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_node_that_never_joins_is_named_on_the_other():
    """Node 0 alone, and node 1 alone (against another address): each gives up after --dist-timeout, saying who."""
    alone0 = start_node(0, free_port_block(6), free_port(), "--dist-timeout", "3")
    alone1 = start_node(1, free_port_block(6), free_port(), "--dist-timeout", "3")
    out0, _ = alone0.communicate(timeout=120)
    out1, _ = alone1.communicate(timeout=120)
    assert alone0.returncode == 1 and "node 1 did not join within --dist-timeout 3 s" in out0, out0[-2000:]
    assert alone1.returncode == 1 and "node 0 did not join within --dist-timeout 3 s" in out1, out1[-2000:]


@pytest.mark.parametrize(
    "extra,secret,message",
    [
        ((), "", "needs a secret shared by every node"),
        ((), "short", "too short"),
        (("--tp-size", "3"), SECRET, "must be a multiple of --nnodes"),
        (("--node-rank", "2"), SECRET, "--node-rank must be in [0, 2)"),
    ],
)
def test_bad_multi_node_flags_fail_fast(extra, secret, message):
    cmd = node_command(0, free_port_block(6), free_port()) + list(extra)
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    if secret:
        env[SECRET_ENV] = secret
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


# ---------------------------------------------------------------- the links alone, in this process


def link_args(node_rank: int, base: int, timeout: float = 5.0):
    return types.SimpleNamespace(
        nnodes=2, node_rank=node_rank, tp_size=2, dist_init_addr=f"127.0.0.1:{base}", dist_timeout=timeout
    )


def handshake_events(monitor: zmq.Socket, wait_s: float) -> set[int]:
    events, deadline = set(), time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if monitor.poll(100):
            events.add(recv_monitor_message(monitor)["event"])
    return events


def test_links_carry_frames_and_refuse_peers_without_the_secret():
    base = free_port_block(6)
    head_ep, member_ep = Endpoints(make_ipc_dir()), Endpoints(make_ipc_dir())
    head = NodeLinks(link_args(0, base), head_ep, SECRET.encode())
    member = NodeLinks(link_args(1, base), member_ep, SECRET.encode())
    ctx = zmq.Context()
    try:
        # The scheduler's and worker 1's sockets, as they are on each node (ipc, private directories).
        scheduler_out = ctx.socket(zmq.PUSH)
        scheduler_out.bind(head_ep.scheduler_to_worker(1))
        scheduler_in = ctx.socket(zmq.PULL)
        scheduler_in.bind(head_ep.workers_to_scheduler)
        worker_in = ctx.socket(zmq.PULL)
        worker_in.connect(member_ep.scheduler_to_worker(1))
        worker_out = ctx.socket(zmq.PUSH)
        worker_out.connect(member_ep.workers_to_scheduler)

        # Would-be workers on the network, each pulling rank 1's batches: no security at all, a random key pair
        # that knows the server key, and the keys of another secret.
        ports = link_ports(link_args(0, base))
        intruders, monitors = [], []
        wrong = derive_keys(b"some-other-secret-of-enough-length")
        for keys in (None, "random", wrong):
            sock = ctx.socket(zmq.PULL)
            if keys == "random":
                public, secret = zmq.curve_keypair()
                sock.curve_secretkey, sock.curve_publickey = secret, public
                sock.curve_serverkey = derive_keys(SECRET.encode()).server_public
            elif keys is not None:
                sock.curve_secretkey, sock.curve_publickey = keys.client_secret, keys.client_public
                sock.curve_serverkey = keys.server_public
            monitors.append(sock.get_monitor_socket())
            sock.connect(ports.batches(1))
            intruders.append(sock)

        deadline = time.monotonic() + 10
        while not (head.peers[1].ready and member.peers[0].ready) and time.monotonic() < deadline:
            head.tick(True)
            member.tick(True)
            time.sleep(0.05)
        assert head.peers[1].ready and member.peers[0].ready

        worker_out.send(msgspec.msgpack.encode(WorkerReady(rank=1, num_kv_slots=64, context_len=128)))
        assert scheduler_in.poll(5000)
        assert msgspec.msgpack.decode(scheduler_in.recv(), type=WorkerReady).rank == 1

        frames = [f"batch {i}".encode() for i in range(20)]
        for frame in frames:
            scheduler_out.send(frame)
        got = []
        while len(got) < len(frames) and worker_in.poll(5000):
            got.append(worker_in.recv())
        assert got == frames  # every batch reached the real rank 1; a PUSH would have shared them with a peer
        for sock, monitor in zip(intruders, monitors):
            assert not sock.poll(200), "an unauthenticated peer received a batch"
            events = handshake_events(monitor, 1.0)
            assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events
            assert events & {
                zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                zmq.EVENT_DISCONNECTED,
            }, events
    finally:
        ctx.destroy(linger=0)
        member.close("test over", failed=False)
        head.close("test over", failed=False)


def test_a_drop_read_with_the_last_beat_still_means_the_node_is_gone():
    # A loaded launcher reads node 1's last beat and its disconnect in one tick, so both carry that tick's time; the
    # strict comparison once left such a node "alive" until --dist-timeout and node 0 blamed its own worker.
    beat = 100.0
    assert connection_lost(dropped_at=beat, last_beat=beat, now=beat + 4 * BEAT_INTERVAL_S)
    assert connection_lost(dropped_at=beat + 0.1, last_beat=beat, now=beat + 4 * BEAT_INTERVAL_S)
    assert not connection_lost(dropped_at=beat, last_beat=beat, now=beat + 2 * BEAT_INTERVAL_S)  # not silent yet
    assert not connection_lost(dropped_at=beat - 1, last_beat=beat, now=beat + 10)  # it came back and beat since
    assert not connection_lost(dropped_at=None, last_beat=beat, now=beat + 10)
