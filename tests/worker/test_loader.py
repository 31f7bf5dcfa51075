"""Loader: dtypes, dummy weights, sharded checkpoints, and a clear error for each broken input."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.config import ServerArgs
from radixserve.model_config import ModelConfig
from radixserve.testing.tiny_models import tiny_model_dir
from radixserve.worker.model_runner import ModelRunner


def runner(model_dir, **kw):
    return ModelRunner(ServerArgs(device="cpu", max_total_tokens=256, max_running_requests=4, **kw), model_dir)


def copy_model(tmp_path, arch="qwen2"):
    dst = tmp_path / arch
    shutil.copytree(tiny_model_dir(arch), dst)
    return dst


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loads(dtype):
    r = runner(tiny_model_dir("llama"), dtype=dtype)
    assert all(p.dtype == getattr(torch, dtype) for p in r.model.parameters())
    assert r.kv_cache.k_cache(0).dtype == getattr(torch, dtype)


def test_dummy_weights_need_only_config(tmp_path):
    d = tmp_path / "dummy"
    d.mkdir()
    shutil.copy(tiny_model_dir("qwen3") / "config.json", d / "config.json")
    r = runner(d, load_format="dummy")
    assert all(torch.isfinite(p).all() for p in r.model.parameters())


def test_sharded_checkpoint_with_index(tmp_path):
    d = copy_model(tmp_path)
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate([names[:half], names[half:]]):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, d / file)
        weight_map.update({n: file for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = runner(d)
    whole = runner(tiny_model_dir("qwen2"))
    for (name, a), (_, b) in zip(sharded.model.named_parameters(), whole.model.named_parameters()):
        assert torch.equal(a, b), name


def test_missing_dir():
    with pytest.raises(FileNotFoundError, match="no config.json"):
        runner("/nonexistent/model")


def test_missing_tensor(tmp_path):
    d = copy_model(tmp_path)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks tensors for: model.layers.1.self_attn.qkv_proj.weight\[k\]"):
        runner(d)


def test_shape_mismatch(tmp_path):
    d = copy_model(tmp_path)
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"] = tensors["model.layers.0.mlp.down_proj.weight"][:, :-1].clone()
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match="down_proj.weight.*shape mismatch"):
        runner(d)


def test_unsupported_architecture(tmp_path):
    d = copy_model(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        runner(d)


def test_model_config_reads_rope_and_eos():
    cfg = ModelConfig.from_dir(tiny_model_dir("llama"))
    assert cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.tie_word_embeddings and cfg.eos_token_ids
    assert ModelConfig.from_dir(tiny_model_dir("qwen2")).head_dim == 16
