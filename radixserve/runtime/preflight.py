"""Operator mistakes caught before any child process starts, each as one sentence (launch.py prints it as
`launch.py: error: ...` and exits 2). Without these checks they surface minutes later as a child's traceback
after the model has loaded (a modulo by zero for a missing GPU, a KeyError for a GPT-2 config, EADDRINUSE from
the HTTP process)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from radixserve.config import ServerArgs
from radixserve.model_config import ModelConfig


class LaunchError(ValueError):
    """A configuration that cannot work; the message says what to change."""


def check_model_dir(model_dir: Path, load_format: str, tp_size: int) -> None:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise LaunchError(f"no config.json in model directory {model_dir} (pass an HF model directory)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise LaunchError(f"cannot read {config_path}: {e}") from None
    from radixserve.models.registry import MODEL_REGISTRY  # imports torch: only once the config is known to parse

    architectures = config.get("architectures") or []
    supported = ", ".join(sorted(MODEL_REGISTRY))
    if not architectures or architectures[0] not in MODEL_REGISTRY:
        named = repr(architectures[0]) if architectures else "no architecture"
        raise LaunchError(f"{config_path} names {named}, which radixserve does not support; supported: {supported}")
    try:
        model_config = ModelConfig.from_dict(config, model_dir)
    except (KeyError, TypeError, ValueError) as e:
        raise LaunchError(
            f"{config_path} is not a usable {architectures[0]} config ({type(e).__name__}: {e})"
        ) from None
    # The vocabulary needs no check: each rank's slice of the embedding and LM head is padded up.
    try:
        model_config.check_tp(tp_size)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    if load_format != "dummy":
        from radixserve.loader import safetensors_files

        try:
            safetensors_files(model_dir)
        except (FileNotFoundError, KeyError, ValueError) as e:
            raise LaunchError(str(e)) from None


def check_devices(device: str, tp_size: int, extra_gpus: int = 0) -> None:
    """tp_size: this node's ranks of one replica; extra_gpus: the GPUs before them and the other replicas'."""
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise LaunchError(
            f"--device cuda, but no CUDA GPU is visible (torch {torch.__version__} is {build}); "
            f"use --device cpu or a machine with a GPU"
        )
    count = torch.cuda.device_count()
    if count < tp_size + extra_gpus:
        if not extra_gpus:
            raise LaunchError(f"--tp-size {tp_size} needs {tp_size} GPUs, but {count} are visible")
        raise LaunchError(
            f"--base-gpu-id + --dp-size x --tp-size (per node) needs {tp_size + extra_gpus} GPUs, "
            f"but {count} are visible"
        )


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """Binds the way the HTTP process will (SO_REUSEADDR), so a port only in TIME_WAIT is not taken for busy."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise LaunchError(
                f"cannot listen on {host}:{port}: {e.strerror or e} (is another server running? pick another {flag})"
            ) from None


def check_node_links(args: ServerArgs) -> None:
    """Node 0 of a multi-node server listens on the rendezvous port and the few after it (node_link.py); every
    node needs the shared secret."""
    from radixserve.runtime.node_keys import read_secret
    from radixserve.runtime.node_link import link_ports, ranks_on_node

    try:
        read_secret(args)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    if args.node_rank != 0:
        return
    ports = link_ports(args)
    remote = [r for r in range(args.tp_size) if r not in ranks_on_node(args)]
    for port in (ports.base, *ports.ports_node0_binds(remote)):
        check_port_free(ports.host, port, "--dist-init-addr port (node 0 uses it and the next 3 + tp-size ports)")


def host_memory_available() -> int | None:
    """Bytes of memory the kernel says can be allocated without swapping (Linux MemAvailable), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_host_memory(hicache_gb: float, ranks: int, available: int | None = None) -> None:
    """The host KV pool (--hicache-size GB per rank, pinned on CUDA) must fit in the memory available now: pinning
    more than there is does not fail cleanly later, it stalls the machine or gets a worker killed."""
    available = host_memory_available() if available is None else available
    if hicache_gb <= 0 or available is None:
        return
    need = hicache_gb * 1e9 * ranks
    if need > available:
        per_rank = f" ({ranks} ranks on this node)" if ranks > 1 else ""
        raise LaunchError(
            f"--hicache-size {hicache_gb:g} GB of host KV per rank{per_rank} needs {need / 1e9:.1f} GB "
            f"of host memory, but this machine has {available / 1e9:.1f} GB available"
        )


def check_before_launch(args: ServerArgs, model_dir: Path, serve_http: bool) -> None:
    check_model_dir(model_dir, args.load_format, args.tp_size)
    per_node = args.tp_size // args.nnodes
    check_devices(args.device, per_node, args.base_gpu_id + (args.dp_size - 1) * per_node)
    check_host_memory(args.hicache_size, per_node * args.dp_size)
    if args.nnodes > 1:
        check_node_links(args)
    if serve_http:
        check_port_free(args.host, args.port)
