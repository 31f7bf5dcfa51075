"""Imports run one way: the services (tokenizer_service, scheduler_service) -> radixserve -> kernels.

Every .py of the four packages is parsed with `ast` (never imported), so an import hidden inside a function, under
`if TYPE_CHECKING`, relative, or spelled `importlib.import_module("...")` counts as well. Starting a service by
module name (`python -m scheduler_service`) is a string on a command line, not an import, and is allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("tokenizer_service", "scheduler_service")
OURS = ("radixserve", "kernels", *SERVICES)

# package -> the packages of ours it must never import
FORBIDDEN = {
    "kernels": {"radixserve", *SERVICES},  # kernels import torch and triton only
    "radixserve": set(SERVICES),  # the library is imported by the services, never the reverse
    # One package per process: what two services share belongs in radixserve (protocol, config, ...).
    "tokenizer_service": {"scheduler_service"},
    "scheduler_service": {"tokenizer_service"},
}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path = REPO_ROOT) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            else:
                found.append((node.lineno, node.module))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("__import__", "import_module")))):
            found.append((node.lineno, node.args[0].value))
    return found


def violations(package: str, root: Path = REPO_ROOT) -> list[str]:
    bad = []
    for path in sorted((root / package).rglob("*.py")):
        for line, module in imported_modules(path, root):
            top = module.split(".")[0]
            if top in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(root)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("package", list(FORBIDDEN))
def test_imports_run_one_way(package):
    assert (REPO_ROOT / package / "__init__.py").is_file()
    bad = violations(package)
    assert not bad, f"{package} may not import {sorted(FORBIDDEN[package])}:\n" + "\n".join(bad)


def test_the_checker_sees_every_kind_of_import(tmp_path):
    # The rule is only as good as the parser: each spelling below must be found.
    package = tmp_path / "radixserve"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .. import loader\n")
    (package / "sub" / "mod.py").write_text(
        "import scheduler_service.scheduler\n"
        "def later():\n"
        "    from tokenizer_service import app\n"
        "    import importlib\n"
        "    importlib.import_module('scheduler_service.request')\n"
        "from . import sibling\n"
        "from ..cache import radix_cache\n")
    assert sorted(m for _, m in imported_modules(package / "sub" / "mod.py", tmp_path)) == [
        "importlib", "radixserve.cache", "radixserve.sub", "scheduler_service.request",
        "scheduler_service.scheduler", "tokenizer_service"]
    assert [m for _, m in imported_modules(package / "sub" / "__init__.py", tmp_path)] == ["radixserve"]
    assert len(violations("radixserve", tmp_path)) == 3


def test_ci_runs_the_readme_test_command_verbatim():
    # What a new user types (README) is what CI runs (.ci/run): a drift would let CI pass on another command.
    readme = [line for line in (REPO_ROOT / "README.md").read_text().splitlines() if "pytest" in line]
    ci = [line for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()
          if "pytest" in line and not line.lstrip().startswith("#")]
    assert len(readme) >= 1 and len(ci) == 1, (readme, ci)
    assert ci[0].strip() in [line.strip() for line in readme], f".ci/run runs {ci[0]!r}; the README says {readme}"
