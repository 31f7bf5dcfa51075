"""Every module outside tests/ is one a reader can take in whole: at most 400 lines. A module that grows past it is
split along a seam of its own (radixserve/worker/kv_pool_size.py out of model_runner.py, bench/kernel_check_cases.py
out of check_kernels_gpu.py), not packed tighter. `ruff format` (pyproject.toml's [tool.ruff.format]) grew eleven
modules past the line; each was split so (the Triton kernels out of their launchers' modules, ModelConfig and the
flags' rules out of config.py, the client's errors out of results.py, ...), none packed."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("radixserve", "kernels", "tokenizer_service", "scheduler_service", "bench")
MAX_LINES = 400


def modules(root: Path = REPO_ROOT) -> list[Path]:
    return sorted([path for folder in FOLDERS for path in (root / folder).rglob("*.py")] + [root / "launch.py"])


def too_long(paths: list[Path], root: Path = REPO_ROOT) -> list[str]:
    lengths = {path: len(path.read_text().splitlines()) for path in paths}
    return [f"{path.relative_to(root)}: {n} lines" for path, n in lengths.items() if n > MAX_LINES]


def test_no_module_outside_tests_is_over_400_lines():
    paths = modules()
    assert len(paths) > 100 and REPO_ROOT / "launch.py" in paths  # the folders were found, not an empty glob
    long = too_long(paths)
    assert not long, f"split these along a seam (at most {MAX_LINES} lines a module):\n" + "\n".join(long)


@pytest.mark.parametrize("lines,flagged", [(MAX_LINES, False), (MAX_LINES + 1, True)])
def test_the_rule_is_at_most_400_lines(tmp_path, lines, flagged):
    path = tmp_path / "module.py"
    path.write_text("x = 1\n" * lines)
    assert too_long([path], tmp_path) == ([f"module.py: {lines} lines"] if flagged else [])
