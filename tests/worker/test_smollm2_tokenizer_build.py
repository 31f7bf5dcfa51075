"""The demo model's tokenizer is built from the GGUF metadata with the `tokenizers` library alone, so it comes out the
same under every transformers version (5.17's own GGUF conversion named <|im_start|> the eos and the build stopped).
A small GGUF written here with the SmolLM2 layout (ChatML specials first, byte-level BPE, pre "smollm") stands in for
the 92 MB one; the real one is checked by tests/worker/test_testing_models.py."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer
from tokenizers.pre_tokenizers import ByteLevel

from radixserve.testing.smollm2 import _write_tokenizer

REPO = Path(__file__).resolve().parents[2]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>"]
MERGES = ["Ġ t", "h e", "Ġt he", "l l", "he ll"]  # gives "Ġthe" and "hell"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_gguf(path: Path, bos: int = 1, eos: int = 2) -> None:
    alphabet = sorted(ByteLevel.alphabet())
    merged = ["Ġt", "he", "Ġthe", "ll", "hell"]
    tokens = SPECIALS + alphabet + merged
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - 4))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.add_pad_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.server
def test_built_without_transformers(tmp_path):
    write_gguf(tmp_path / "t.gguf")
    out = tmp_path / "out"
    out.mkdir()
    # In a process where `import transformers` fails: the build must not touch it.
    script = textwrap.dedent(f"""
        import sys
        sys.modules["transformers"] = None
        from pathlib import Path
        from radixserve.testing.smollm2 import _write_tokenizer
        _write_tokenizer(Path({str(tmp_path / "t.gguf")!r}), Path({str(out)!r}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    vocab = tok.get_vocab()
    encoding = tok.encode("<|im_start|>the hell 42<|im_end|>")
    assert encoding.tokens == ["<|im_start|>", "t", "he", "Ġ", "hell", "Ġ", "4", "2", "<|im_end|>"]
    assert encoding.ids[0] == 1 and encoding.ids[-1] == 2  # specials keep their GGUF ids, nothing is added
    assert tok.encode(" the").tokens == ["Ġthe"] and vocab["Ġthe"] == len(vocab) - 3
    assert tok.decode(encoding.ids, skip_special_tokens=False) == "<|im_start|>the hell 42<|im_end|>"
    assert tok.decode(encoding.ids) == "the hell 42"  # specials are special
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert config["chat_template"] == TEMPLATE == (out / "chat_template.jinja").read_text()
    assert config["add_bos_token"] is False


def test_loads_in_transformers_with_chatml_specials_and_template(tmp_path):
    from transformers import AutoTokenizer

    write_gguf(tmp_path / "t.gguf")
    _write_tokenizer(tmp_path / "t.gguf", tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "the 7"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nthe 7<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == 1 and tokenizer.decode(ids) == text  # no BOS added, exact round trip (no space clean-up)


def test_a_gguf_with_other_special_tokens_is_refused(tmp_path):
    write_gguf(tmp_path / "t.gguf", bos=2, eos=1)  # eos <|im_start|>, as 5.17's conversion had it
    with pytest.raises(RuntimeError, match="unexpected special tokens"):
        _write_tokenizer(tmp_path / "t.gguf", tmp_path)
