"""Weights into a model: safetensors (single file or sharded with an index), or random 'dummy' weights for
benchmarks that need only the shapes. Each parameter's own weight_loader takes this rank's shard."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm


def copy_whole_tensor(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """The weight_loader of parameters that are not sharded (norms, replicated biases)."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} (use --load-format dummy for random weights)")
    return files


def load_safetensors(model: nn.Module, model_dir: str | Path, show_progress: bool = True) -> None:
    model_dir = Path(model_dir)
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules_mapping", {})
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    loaded: set[str] = set()
    files = safetensors_files(model_dir)
    for path in tqdm(files, desc="Loading safetensors", disable=not show_progress or len(files) < 2):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
                    continue
                target, shard_id = name, None
                for ckpt_part, (our_part, sid) in packed.items():
                    if f".{ckpt_part}." in name:
                        target, shard_id = name.replace(f".{ckpt_part}.", f".{our_part}."), sid
                        break
                param = params.get(target)
                if param is None:
                    raise ValueError(
                        f"checkpoint tensor {name!r} in {path.name} matches no parameter of {type(model).__name__}"
                    )
                tensor = f.get_tensor(name).to(param.dtype)
                try:
                    if shard_id is None:
                        getattr(param, "weight_loader", copy_whole_tensor)(param, tensor)
                    else:
                        param.weight_loader(param, tensor, shard_id)
                except ValueError as e:
                    raise ValueError(f"{name} in {path.name}: {e}") from None
                loaded.add(target if shard_id is None else f"{target}#{shard_id}")
    _check_complete(model, packed, loaded, tied, model_dir)


def _check_complete(model: nn.Module, packed: dict, loaded: set[str], tied: bool, model_dir: Path) -> None:
    """Every parameter (and every block of a packed one) must have come from the checkpoint."""
    shards_of: dict[str, list] = {}
    for our_part, sid in packed.values():
        shards_of.setdefault(our_part, []).append(sid)
    missing = []
    for name, _ in model.named_parameters():
        if tied and name == "lm_head.weight":
            continue
        part = name.split(".")[-2]
        if part in shards_of:
            missing += [f"{name}[{sid}]" for sid in shards_of[part] if f"{name}#{sid}" not in loaded]
        elif name not in loaded:
            missing.append(name)
    if missing:
        raise ValueError(
            f"checkpoint in {model_dir} lacks tensors for: {', '.join(missing[:10])}"
            + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else "")
        )


@torch.no_grad()
def load_dummy(model: nn.Module, seed: int) -> None:
    """Random weights of a realistic scale: norms near 1, matrices with small entries (no NaN/inf in bf16)."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if param.device not in gens:
            gens[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        gen = gens[param.device]
        values = torch.randn(param.shape, generator=gen, dtype=torch.float32, device=param.device)
        param.data.copy_(1.0 + 0.1 * values if "norm" in name else 0.02 * values)
