"""Operator mistakes end in one line, `launch.py: error: ...` with exit code 2, before any child process starts (they
used to surface after the model loaded, as a child's traceback). Most cases build the Launcher in-process, which
runs every check and starts nothing; one case per kind of failure runs launch.py itself to show the line."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.config import ServerArgs
from radixserve.runtime.launcher import Launcher, free_port, resolve_api_key
from radixserve.runtime.preflight import LaunchError, check_devices
from radixserve.testing.tiny_models import tiny_model_dir

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]


def run_launch(*flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "launch.py"), *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("launch.py: error: "), proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout


def model_copy(tmp_path: Path, weights: bool = True, **config_changes) -> Path:
    """The tiny Llama's directory, with config.json changed and the weights dropped as asked."""
    src = tiny_model_dir("llama")
    dst = tmp_path / "model"
    shutil.copytree(src, dst, ignore=None if weights else shutil.ignore_patterns("*.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config.update(config_changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def launcher_error(model_dir: Path, **args) -> str:
    with pytest.raises(LaunchError) as raised:
        Launcher(ServerArgs(model=str(model_dir), device=args.pop("device", "cpu"), port=free_port(), **args))
    return str(raised.value)


def test_no_gpu_for_device_cuda():
    # With no GPU visible (CUDA_VISIBLE_DEVICES empty), the same on a CPU machine and a GPU one.
    proc = run_launch("--model", str(tiny_model_dir("llama")), "--device", "cuda", env={"CUDA_VISIBLE_DEVICES": ""})
    assert_one_line_error(proc, "--device cuda", "no CUDA GPU")


def test_fewer_gpus_than_tp_size(monkeypatch):
    import torch

    # Two GPUs visible, four asked for: only the count matters to the check, so give it that count.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(LaunchError, match="--tp-size 4 needs 4 GPUs, but 2 are visible"):
        check_devices("cuda", 4)
    check_devices("cuda", 2)


def test_heads_not_divisible_by_tp_size():
    proc = run_launch("--model", str(tiny_model_dir("llama")), "--device", "cpu", "--tp-size", "3")
    assert_one_line_error(proc, "attention heads (4)", "--tp-size 3")


def test_kv_heads_and_tp_size_that_do_not_divide(tmp_path):
    model = model_copy(tmp_path, num_attention_heads=6, num_key_value_heads=4, head_dim=16, intermediate_size=96)
    assert "KV heads (4)" in launcher_error(model, tp_size=3)


def test_port_taken():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_launch("--model", str(tiny_model_dir("llama")), "--device", "cpu", "--port", str(port))
    assert_one_line_error(proc, f"127.0.0.1:{port}", "--port")


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(
        json.dumps(
            {  # the shape of GPT-2's config.json: no num_attention_heads
                "architectures": ["GPT2LMHeadModel"],
                "model_type": "gpt2",
                "n_ctx": 1024,
                "n_embd": 768,
                "n_head": 12,
                "n_layer": 12,
                "n_positions": 1024,
                "vocab_size": 50257,
            }
        )
    )
    proc = run_launch("--model", str(gpt2), "--device", "cpu")
    assert_one_line_error(proc, "'GPT2LMHeadModel'", "LlamaForCausalLM", "Qwen3ForCausalLM")


def test_directory_without_weights(tmp_path):
    message = launcher_error(model_copy(tmp_path, weights=False))
    assert "no *.safetensors weights" in message and "--load-format dummy" in message


def test_directory_without_config(tmp_path):
    assert "no config.json" in launcher_error(tmp_path)


def test_bad_watchdog_timeout():
    assert "--watchdog-timeout" in launcher_error(tiny_model_dir("llama"), watchdog_timeout=-1)


# ------------------------------------------------------------------ the API key's sources


def test_api_key_from_file_env_or_flag(tmp_path, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    monkeypatch.setenv("RADIXSERVE_API_KEY", "sk-from-env")
    args = ServerArgs(device="cpu", api_key_file=str(key_file))
    resolve_api_key(args)
    assert (args.api_key, args.api_key_file) == ("sk-from-file", None)  # the file wins over the environment
    args = ServerArgs(device="cpu")
    resolve_api_key(args)
    assert args.api_key == "sk-from-env"
    args = ServerArgs(device="cpu", api_key="sk-flag")
    resolve_api_key(args)
    assert args.api_key == "sk-flag"
    with pytest.raises(LaunchError, match="not both"):
        resolve_api_key(ServerArgs(device="cpu", api_key="sk-flag", api_key_file=str(key_file)))
    with pytest.raises(LaunchError, match="cannot read --api-key-file"):
        resolve_api_key(ServerArgs(device="cpu", api_key_file=str(tmp_path / "missing")))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(LaunchError, match="is empty"):
        resolve_api_key(ServerArgs(device="cpu", api_key_file=str(tmp_path / "empty")))
