"""Build (or find) a cached model directory and print its path, e.g. for `launch.py --model`:

python -m radixserve.testing smollm2
python -m radixserve.testing tiny qwen3 --set num_hidden_layers=4 --set seed=1
python -m radixserve.testing dummy qwen3-8b --tokenizer DIR_WITH_A_TOKENIZER
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from radixserve.testing import TINY_ARCHS, dummy_config_dir, smollm2_dir, tiny_model_dir
from radixserve.testing.tiny_models import DUMMY_CONFIGS


def _parse_override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)  # numbers, booleans, null, JSON objects
    except json.JSONDecodeError:
        return key, value  # plain strings such as dtype=bfloat16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m radixserve.testing", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("smollm2", help="the demo model SmolLM2-135M-Instruct")
    tiny = sub.add_parser("tiny", help="a tiny random model")
    tiny.add_argument("arch", choices=TINY_ARCHS)
    tiny.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        type=_parse_override,
        metavar="KEY=VALUE",
        help="seed, dtype or a config key (value parsed as JSON if it can be)",
    )
    dummy = sub.add_parser("dummy", help="config.json of a real shape, for --load-format dummy")
    dummy.add_argument("name", choices=sorted(DUMMY_CONFIGS))
    dummy.add_argument("--tokenizer", default=None, help="directory whose tokenizer files to copy in")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        if args.what == "smollm2":
            path = smollm2_dir()
        elif args.what == "tiny":
            path = tiny_model_dir(args.arch, **dict(args.overrides))
        else:
            path = dummy_config_dir(args.name, args.tokenizer)
    except (RuntimeError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
