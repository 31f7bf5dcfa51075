"""Tiny random-weight Llama / Qwen2 / Qwen3 model directories for unit and parity tests.

Each is a genuine HF directory (config.json, model.safetensors, generation_config.json) that HF
transformers loads, so tests can compare the engine against HF on the same files. They reuse the real
SmolLM2 tokenizer (vocab 49152 = the models' vocab_size), so text round-trips and chat templates work.

Shapes (hidden 64, 4 query heads, 2 KV heads, head_dim 16) keep the head counts divisible by 2 and 4
for tensor-parallel tests. Each architecture also covers a variant the others do not:

    llama   tied embeddings + llama3 rope scaling (all three frequency bands of it, see below)
    qwen2   untied LM head + QKV bias; no head_dim in config.json (derived from hidden / heads)
    qwen3   per-head q/k RMSNorm, tied embeddings, 3 layers

Every parameter, including biases and norm weights, gets seeded random values: a loader that skipped
a bias or a norm weight (left at 0 or 1) would then produce different logits and fail parity tests.

Also `dummy_config_dir(name)`: config.json of real Qwen3 shapes for benchmarks with dummy weights.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

from radixserve.testing._cache import build_cached_dir
from radixserve.testing.qwen3_tokenizer import QWEN3_TOKENIZER_CACHE_NAME, QWEN3_VOCAB_SIZE, qwen3_tokenizer_dir
from radixserve.testing.smollm2 import SMOLLM2_CACHE_NAME, _add_legacy_rope_keys, smollm2_dir

# Bump when the files a build writes change, so stale cached directories are not reused.
TINY_BUILD_VERSION = "v1"

_COMMON_CONFIG: dict[str, Any] = dict(
    vocab_size=49152,  # the SmolLM2 tokenizer's
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    hidden_act="silu",
    # SmolLM2 tokenizer ids: <|im_start|>, <|im_end|>; generation stops on <|im_end|> like the demo model.
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)

_ARCH_CONFIG: dict[str, dict[str, Any]] = {
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        head_dim=16,
        num_hidden_layers=2,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        # With theta 5e5 and head_dim 16 the 8 rope wavelengths are ~6, 32, 167, 860, 4.4e3, ... tokens:
        # original_max_position_embeddings 1024 puts the first three below the high-frequency bound
        # (1024/4 = 256, kept), 860 in the smoothed band (256..1024) and the rest above it (divided by
        # factor), so every branch of the llama3 formula is exercised.
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=1024,
        ),
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        num_hidden_layers=2,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
    ),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        head_dim=16,
        num_hidden_layers=3,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    ),
}

TINY_ARCHS = tuple(_ARCH_CONFIG)

# Std of the random weights, chosen by measuring greedy decoding of the three tiny models. HF's
# default (0.02) leaves logits nearly flat and greedy decoding stuck on one token. Large embeddings
# (~1) make tied models predict their own input token forever; small embeddings under large layers
# make the output ignore the context. Embeddings 0.3 with layers 0.3 give logits of std ~2.4 and
# 32-token greedy continuations of ~30 distinct tokens. Q/K projections get less (0.15) so that
# attention scores have std ~1.5: soft attention over many positions, not a near one-hot pick.
_EMBEDDING_STD = 0.3  # embed_tokens and an untied lm_head
_QK_PROJ_STD = 0.15
_WEIGHT_STD = 0.3  # every other matrix and every bias
_NORM_WEIGHT_STD = 0.1  # norm weights are 1 + N(0, this)

_DTYPES = ("float32", "bfloat16", "float16")

# Which tokenizer a tiny model carries. "smollm2" (the default) keeps the models small; "qwen3" gives the Qwen3
# tokenizer and chat template (thinking blocks, tool calls) with the vocabulary and special ids it needs.
TOKENIZERS = ("smollm2", "qwen3")
_TOKENIZER_CONFIG: dict[str, dict[str, Any]] = {
    "smollm2": {},
    # <|endoftext|> 151643, <|im_end|> 151645; chat ends on <|im_end|>.
    "qwen3": dict(vocab_size=QWEN3_VOCAB_SIZE, bos_token_id=151643, eos_token_id=151645, pad_token_id=151643),
}


def _config_class(arch: str):
    import transformers

    return {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[arch]


def tiny_config(arch: str, **config_overrides: Any):
    """The transformers config of a tiny model (defaults above, then `config_overrides`)."""
    if arch not in _ARCH_CONFIG:
        raise ValueError(f"unknown tiny model architecture {arch!r}; expected one of {TINY_ARCHS}")
    config_class = _config_class(arch)
    # transformers config classes accept any keyword silently; catch typos such as num_layers=3.
    known = set(config_class().to_dict()) | {"rope_theta", "rope_scaling", "head_dim"}
    unknown = sorted(set(config_overrides) - known)
    if unknown:
        raise ValueError(f"unknown config keys for {arch}: {unknown}")
    return config_class(**{**_COMMON_CONFIG, **_ARCH_CONFIG[arch], **config_overrides})


def make_tiny_model(
    arch: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    tokenizer: str = "smollm2",
    **config_overrides: Any,
) -> Path:
    """Write a tiny random-weight HF model directory for `arch` into `out_dir` and return its path.

    The same (arch, seed, dtype, tokenizer, overrides) always gives the same weights.
    """
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {tokenizer!r}")
    config_overrides = {**_TOKENIZER_CONFIG[tokenizer], **config_overrides}
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    config = tiny_config(arch, **config_overrides)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # named_parameters() lists a tied embedding once, so tied weights stay tied.
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if param.ndim == 1 and name.endswith("norm.weight"):
                param.copy_(1.0 + _NORM_WEIGHT_STD * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                param.copy_(_EMBEDDING_STD * noise)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                param.copy_(_QK_PROJ_STD * noise)
            else:
                param.copy_(_WEIGHT_STD * noise)
    model.to(getattr(torch, dtype))
    model.config.dtype = getattr(torch, dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out_dir)
    _add_legacy_rope_keys(out_dir / "config.json")

    _copy_tokenizer_files(smollm2_dir() if tokenizer == "smollm2" else qwen3_tokenizer_dir(), out_dir)
    # The tokenizer should not promise more context than the model has.
    tok_config_path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["model_max_length"] = config.max_position_embeddings
    tok_config_path.write_text(json.dumps(tok_config, ensure_ascii=False, indent=2, sort_keys=True) + "\n")
    return out_dir


def tiny_model_dir(arch: str, **overrides: Any) -> Path:
    """A cached `make_tiny_model(arch, **overrides)` directory, built once per machine.

    `overrides` may hold seed, dtype, tokenizer ("smollm2" or "qwen3") and config keys; each distinct set gets its
    own directory.
    """
    tiny_config(arch, **{k: v for k, v in overrides.items() if k not in ("seed", "dtype", "tokenizer")})  # early
    tokenizer = overrides.get("tokenizer", "smollm2")
    cache_name = SMOLLM2_CACHE_NAME if tokenizer == "smollm2" else QWEN3_TOKENIZER_CACHE_NAME
    key = json.dumps({"arch": arch, "overrides": overrides, "tokenizer": cache_name}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    name = f"tiny-{arch}-{digest}-{TINY_BUILD_VERSION}"
    return build_cached_dir(name, lambda tmp_dir: make_tiny_model(arch, tmp_dir, **overrides))


def _copy_tokenizer_files(src_dir: Path, dst_dir: Path) -> None:
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
    for file_name in names:
        if (Path(src_dir) / file_name).is_file():
            shutil.copyfile(Path(src_dir) / file_name, Path(dst_dir) / file_name)
    if not (Path(dst_dir) / "tokenizer.json").is_file():
        raise RuntimeError(f"no tokenizer.json in {src_dir}")


# ---------------------------------------------------------------------------------------------------
# Real shapes, no weights: for benchmarks with --load-format dummy.

DUMMY_CONFIGS = {"qwen3-0.6b": "qwen3-0.6b.json", "qwen3-8b": "qwen3-8b.json"}

# Token ids of the Qwen3 tokenizer: <|endoftext|> 151643, <|im_end|> 151645. Chat ends on either.
# The published generation_config.json also sets sampling defaults (temperature 0.6, top_p 0.95,
# top_k 20); they are left out so that a benchmark's sampling is what its requests say.
_QWEN3_GENERATION_CONFIG = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}


def dummy_config_json(name: str) -> dict[str, Any]:
    """The packaged config.json of a real model shape (see DUMMY_CONFIGS)."""
    key = name.lower()
    if key not in DUMMY_CONFIGS:
        raise ValueError(f"unknown dummy config {name!r}; expected one of {sorted(DUMMY_CONFIGS)}")
    text = resources.files("radixserve.testing").joinpath("configs", DUMMY_CONFIGS[key]).read_text()
    return json.loads(text)


def dummy_config_dir(name: str, tokenizer_dir: str | Path | None = None) -> Path:
    """A cached directory with config.json (+ generation_config.json) of a real shape, no weights.

    With `tokenizer_dir` (e.g. a Qwen3 tokenizer directory) its tokenizer files are copied in,
    so the directory serves as `--model DIR --load-format dummy` on its own.
    """
    config = dummy_config_json(name)
    parts = [name.lower()]
    if tokenizer_dir is not None:
        tokenizer_dir = Path(tokenizer_dir)
        if not (tokenizer_dir / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {tokenizer_dir}")
        # Keyed by the tokenizer's content, not its path, so an edited tokenizer gets a new directory.
        digest = hashlib.sha256()
        for file_name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (tokenizer_dir / file_name).is_file():
                digest.update(file_name.encode() + b"\0" + (tokenizer_dir / file_name).read_bytes())
        parts.append("tok" + digest.hexdigest()[:12])
    # The config's own content is part of the key too, so editing a packaged JSON invalidates the cache.
    parts.append(hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:8])
    name_in_cache = "dummy-" + "-".join(parts) + f"-{TINY_BUILD_VERSION}"

    def build(tmp_dir: Path) -> None:
        (tmp_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp_dir / "generation_config.json").write_text(json.dumps(_QWEN3_GENERATION_CONFIG, indent=2) + "\n")
        if tokenizer_dir is not None:
            _copy_tokenizer_files(tokenizer_dir, tmp_dir)

    return build_cached_dir(name_in_cache, build)
