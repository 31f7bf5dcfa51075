"""Loading a model directory's tokenizer, the same way in every process that needs one (the HTTP front end, the
scheduler for stop strings, the offline Engine).

transformers' AutoTokenizer finds the tokenizer class through the model's configuration, and that path imports torch:
5.4 s and a few hundred MB in a process that never runs a tensor op (measured on the 2-core CI machine, where it was
most of a server's start-up). A directory with a `tokenizer.json` holds everything the fast tokenizer needs (vocabulary,
merges, normalizer, pre- and post-processor; the special tokens and chat template come from `tokenizer_config.json`),
so it loads through PreTrainedTokenizerFast directly, in under a second and without torch. Anything else (a
sentencepiece-only model) goes through AutoTokenizer as before."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(path: str | Path):
    # Each import where it is used: importing AutoTokenizer alone already imports torch.
    if (Path(path) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
