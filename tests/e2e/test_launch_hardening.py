"""One TP=2 server on gloo, started the way the README says (the API key in $RADIXSERVE_API_KEY), looked at from
outside as another local user or a hostile network would: no secret in any process's command line or the children's
environment, no listening socket on anything but the configured host, and a hung worker (SIGSTOP) failing every
request in flight with a clear error, /health turning 503 and launch.py exiting non-zero.

The tests run in file order against the same server; the last one stops a worker and ends it."""

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from radixserve.runtime.process_util import process_tree_argv
from radixserve.testing.tiny_models import tiny_model_dir
from server_fixture import LaunchedServer

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

API_KEY = "sk-test-0123456789abcdef"
WATCHDOG_S = 3


def process_tree(root: int) -> dict[int, str]:
    """root and all its descendants, with their command lines."""
    return {pid: " ".join(argv) for pid, argv in process_tree_argv(root).items()}


def listening_sockets(pids) -> list[tuple[int, str, str]]:
    """(pid, local ip, port) of every listening TCP socket (IPv4 and IPv6) any of pids holds open."""
    by_inode = {}
    for family in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{family}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                ip_hex, port_hex = fields[1].split(":")
                by_inode[fields[9]] = (decode_ip(ip_hex), str(int(port_hex, 16)))
    found = []
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in by_inode:
                found.append((pid, *by_inode[target[8:-1]]))
    return found


def decode_ip(ip_hex: str) -> str:
    """/proc/net/tcp{,6} addresses: 32-bit words in host (little-endian) byte order."""
    import ipaddress

    raw = b"".join(bytes.fromhex(ip_hex[i : i + 8])[::-1] for i in range(0, len(ip_hex), 8))
    address = ipaddress.ip_address(raw)
    if address.version == 6 and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


@pytest.fixture(scope="module")
def server():
    os.environ["RADIXSERVE_API_KEY"] = API_KEY  # inherited by launch.py only: Popen runs inside start()
    try:
        server = LaunchedServer(
            tiny_model_dir("llama"), "--tp-size", "2", "--watchdog-timeout", str(WATCHDOG_S)
        ).start()
    finally:
        del os.environ["RADIXSERVE_API_KEY"]
    try:
        yield server
    finally:
        server.stop()


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def test_api_key_from_the_environment_is_enforced_and_never_shown(server):
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/v1/models", headers=auth(), timeout=10).status_code == 200
    # Every GET route that shows state, the SGLang-router ones (not in the schema) included, shows no key.
    schema = httpx.get(f"{server.url}/openapi.json", headers=auth(), timeout=10).json()
    paths = {path for path, ops in schema["paths"].items() if "get" in ops and "{" not in path}
    paths |= {"/server_info", "/get_server_info", "/model_info", "/get_model_info", "/get_load", "/metrics"}
    for path in sorted(paths):
        info = httpx.get(f"{server.url}{path}", headers=auth(), timeout=10)
        assert info.status_code == 200 and API_KEY not in info.text, (path, info.status_code)
    assert API_KEY not in server.log()


def test_no_process_has_the_key_on_its_command_line_or_children_in_their_environment(server):
    tree = process_tree(server.process.pid)
    assert len(tree) == 5, tree  # launch.py, worker-0, worker-1, scheduler, tokenizer
    for pid, cmdline in tree.items():
        assert API_KEY not in cmdline, f"pid {pid}: {cmdline}"
    # The children read their configuration from a file in the private IPC directory, removed once all are up.
    config_files = {cmd.split("--config-file ")[1].split()[0] for cmd in tree.values() if "--config-file" in cmd}
    assert len(config_files) == 1 and not Path(config_files.pop()).exists()
    for pid in tree:
        if pid != server.process.pid:  # launch.py has it: the operator put it in its environment
            assert API_KEY.encode() not in Path(f"/proc/{pid}/environ").read_bytes(), tree[pid]
    # What `ps -eo args` shows: the arguments of every process on the machine.
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            assert API_KEY.encode() not in cmdline.read_bytes(), cmdline
        except OSError:
            continue  # exited meanwhile


def test_every_listening_socket_binds_the_configured_host(server):
    tree = process_tree(server.process.pid)
    sockets = listening_sockets(tree)
    assert (str(server.port)) in {port for _, _, port in sockets}, sockets  # the HTTP port is among them
    names = {pid: tree[pid].split(" -m ")[-1].split()[0] for pid, _, _ in sockets if pid in tree}
    # gloo keeps listeners for its pairs in both workers: they must be on loopback too, and so must everything else
    # (torch's TCPStore, the rendezvous of the old launcher, listened on every interface).
    assert sum(1 for pid, _, _ in sockets if "radixserve.worker" in tree[pid]) >= 1, sockets
    for pid, ip, port in sockets:
        assert ip == "127.0.0.1", f"{names.get(pid)} (pid {pid}) listens on {ip}:{port}"
    # gloo binds the address the host name resolves to: 127.0.0.1 on some machines (where the check above cannot
    # tell), a LAN address on most. So the workers must be told the loopback interface, whatever this host does.
    for pid, cmdline in tree.items():
        if "radixserve.worker" in cmdline:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert any(v.startswith(b"GLOO_SOCKET_IFNAME=lo") for v in environ), f"pid {pid}: {cmdline}"


def test_cpu_workers_keep_their_freed_memory(server):
    """A CPU worker's malloc keeps each step's freed memory for the next (radixserve/runtime/launcher.py
    cpu_worker_malloc_env): by default glibc hands part of it back and the worker's RSS saw-tooths
    (bench/results/soak-cpu.md)."""
    workers = [pid for pid, cmd in process_tree(server.process.pid).items() if "radixserve.worker" in cmd]
    assert workers
    for pid in workers:
        environ = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        assert f"MALLOC_MMAP_THRESHOLD_={32 << 20}".encode() in environ
        assert f"MALLOC_TRIM_THRESHOLD_={1 << 30}".encode() in environ


def test_front_end_and_scheduler_never_load_torch(server):
    """Neither the HTTP process nor the scheduler runs a tensor op, so neither maps libtorch at runtime (the tokenizer
    loader once imported it through AutoTokenizer: ~190 MB and seconds of start-up in each, on every server)."""
    tree = process_tree(server.process.pid)
    services = {pid: cmd for pid, cmd in tree.items() if "-m tokenizer_service" in cmd or "-m scheduler_service" in cmd}
    assert len(services) == 2, tree
    for pid, cmdline in services.items():
        assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text(), cmdline


def test_a_stopped_worker_fails_requests_turns_health_503_and_ends_launch(server):
    url = server.url
    warmup = httpx.post(
        f"{url}/v1/completions", headers=auth(), timeout=60, json={"prompt": "warm up", "max_tokens": 4}
    )
    assert warmup.status_code == 200  # the first batch (not timed by the watchdog) is behind us
    tree = process_tree(server.process.pid)
    worker1 = next(pid for pid, cmd in tree.items() if "radixserve.worker" in cmd and "--rank 1" in cmd)
    outcome = {}

    def long_request():
        try:
            r = httpx.post(
                f"{url}/v1/completions",
                headers=auth(),
                timeout=60,
                json={"prompt": "count", "max_tokens": 3000, "ignore_eos": True, "stream": True},
            )
            outcome["status"], outcome["body"] = r.status_code, r.text
        except httpx.HTTPError as e:
            outcome["error"] = repr(e)

    client = threading.Thread(target=long_request)
    client.start()
    time.sleep(1.0)
    os.kill(worker1, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        client.join(timeout=WATCHDOG_S + 15)
        assert not client.is_alive(), "the client still waits on a hung engine"
        assert time.monotonic() - stopped_at < WATCHDOG_S + 10
        body = outcome.get("body", "")
        assert '"error"' in body and "worker-1" in body and "hung" in body, outcome
        try:  # 503 from the moment the launcher saw the hang; or nobody listens any more
            assert httpx.get(f"{url}/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass
        code = server.process.wait(timeout=20)
        assert code == 1
        log = server.log()
        assert "worker-1" in log and "hung" in log and "--watchdog-timeout is 3 s" in log, log[-3000:]
        time.sleep(0.5)
        assert not [
            pid
            for pid in tree
            if pid != server.process.pid
            and Path(f"/proc/{pid}").exists()
            and "Z" != Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        ], "orphans"
    finally:
        if Path(f"/proc/{worker1}").exists():
            os.kill(worker1, signal.SIGKILL)
