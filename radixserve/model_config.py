"""The model's shape, read from an HF config.json (ModelConfig): layers, heads, sizes, rope scaling, the context.

torch is imported only inside the functions that need it, as in radixserve/config.py (the HTTP process reads it too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class ModelConfig:
    """The shape of a decoder-only model, read from an HF config.json."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: list[int]
    bos_token_id: int | None
    dtype: str  # the checkpoint's dtype name ("bfloat16"); torch_dtype gives the torch object
    hidden_act: str = "silu"

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir} (does it exist?)")
        return cls.from_dict(json.loads(path.read_text()), model_dir)

    @classmethod
    def from_dict(cls, cfg: dict, model_dir: Path | None = None) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json names no 'architectures'")
        heads = cfg["num_attention_heads"]
        # transformers >= 5 nests rope_theta/rope_scaling under rope_parameters.
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        rope_scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if rope_scaling is not None and "rope_type" not in rope_scaling and "type" in rope_scaling:
            rope_scaling = {**rope_scaling, "rope_type": rope_scaling["type"]}
        eos = cfg.get("eos_token_id")
        if model_dir is not None and (model_dir / "generation_config.json").is_file():
            eos = json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id", eos)
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        return cls(
            architecture=archs[0],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            dtype=dtype_name if isinstance(dtype_name, str) else "float32",
            hidden_act=cfg.get("hidden_act", "silu"),
        )

    @property
    def torch_dtype(self) -> "torch.dtype":
        import torch

        return getattr(torch, self.dtype)

    def check_tp(self, tp_size: int) -> None:
        for name, n in (("attention heads", self.num_heads), ("intermediate size", self.intermediate_size)):
            if n % tp_size:
                raise ValueError(f"{name} ({n}) not divisible by --tp-size {tp_size}")
        if self.num_kv_heads % tp_size and tp_size % self.num_kv_heads:
            raise ValueError(f"KV heads ({self.num_kv_heads}) and --tp-size {tp_size} must divide one another")

    def kv_heads_per_rank(self, tp_size: int) -> int:
        # With more ranks than KV heads, each KV head is replicated on tp_size / num_kv_heads ranks.
        return max(1, self.num_kv_heads // tp_size)

    def context_len(self, override: int | None = None) -> int:
        return override or self.max_position_embeddings
