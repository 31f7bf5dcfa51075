"""Imports run one way: the services (tokenizer_service, scheduler_service) -> radixserve -> kernels.

Every .py of the four packages is parsed with `ast` (never imported), so an import hidden inside a function, under
`if TYPE_CHECKING`, relative, or spelled `importlib.import_module("...")` counts as well. Starting a service by
module name (`python -m scheduler_service`) is a string on a command line, not an import, and is allowed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
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
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (isinstance(node.func, ast.Name) and node.func.id in ("__import__", "import_module"))
            )
        ):
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
        "from ..cache import radix_cache\n"
    )
    assert sorted(m for _, m in imported_modules(package / "sub" / "mod.py", tmp_path)) == [
        "importlib",
        "radixserve.cache",
        "radixserve.sub",
        "scheduler_service.request",
        "scheduler_service.scheduler",
        "tokenizer_service",
    ]
    assert [m for _, m in imported_modules(package / "sub" / "__init__.py", tmp_path)] == ["radixserve"]
    assert len(violations("radixserve", tmp_path)) == 3


def test_ci_runs_the_readme_test_command_verbatim():
    # What a new user types (README) is what CI runs (.ci/run): a drift would let CI pass on another command.
    readme = [line for line in (REPO_ROOT / "README.md").read_text().splitlines() if "pytest" in line]
    ci = [
        line
        for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()
        if "pytest" in line and not line.lstrip().startswith("#")
    ]
    assert len(readme) >= 1 and len(ci) == 1, (readme, ci)
    assert ci[0].strip() in [line.strip() for line in readme], f".ci/run runs {ci[0]!r}; the README says {readme}"


# ------------------------------------------------------------------ docs/architecture.md's request walk

WALK_ROW = re.compile(r"^\| (\d+) \| `([^`]+)` \| (.*?) \| (.*) \|$")


def request_walk(doc: str) -> tuple[int, list[tuple[int, str, list[str]]]]:
    """(the file count the text claims, the table's rows: number, file, functions) of "The life of one request"."""
    section = doc.split("## The life of one request", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    claimed = re.search(r"\*\*(\d+) files carry it\*\*", section)
    assert claimed, "the walk must say how many files carry the request (**N files carry it**)"
    rows = []
    for line in section.splitlines():
        match = WALK_ROW.match(line)
        if match:
            rows.append((int(match[1]), match[2], re.findall(r"`([^`]+)`", match[3])))
    return int(claimed[1]), rows


def defined_names(path: Path) -> tuple[set[str], set[str]]:
    """(every name a def, class or top-level assignment defines anywhere in the file, `Class.member` of each class's
    own functions and attributes)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names, members = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    members.add(f"{node.name}.{item.name}")
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names, members


def walk_problems(doc: str, root: Path = REPO_ROOT) -> list[str]:
    claimed, rows = request_walk(doc)
    problems = []
    if [n for n, _, _ in rows] != list(range(1, len(rows) + 1)):
        problems.append(f"rows are not numbered 1..{len(rows)}: {[n for n, _, _ in rows]}")
    files = [f for _, f, _ in rows]
    if len(set(files)) != len(files):
        problems.append(f"a file is named twice: {sorted(f for f in set(files) if files.count(f) > 1)}")
    if claimed != len(set(files)):
        problems.append(f"the text says {claimed} files carry the request; the table names {len(set(files))}")
    for _, file, functions in rows:
        path = root / file
        if not path.is_file():
            problems.append(f"{file}: no such file")
            continue
        if not functions:
            problems.append(f"{file}: no function named")
        names, members = defined_names(path)
        problems += [f"{file}: no {name}" for name in functions if name not in (members if "." in name else names)]
    return problems


def test_the_request_walk_names_files_and_functions_that_exist():
    problems = walk_problems((REPO_ROOT / "docs" / "architecture.md").read_text())
    assert not problems, "docs/architecture.md's request walk does not match the code:\n" + "\n".join(problems)


def test_the_walk_checker_catches_a_wrong_count_file_or_function(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("X = 1\nclass A:\n    def run(self):\n        def inner(): pass\n")
    doc = (
        "## The life of one request\n\n**{n} files carry it**.\n\n| # | file | functions | what |\n"
        "| --- | --- | --- | --- |\n{rows}\n## Next\n| 9 | `pkg/gone.py` | `f` | outside the section |\n"
    )
    good = "| 1 | `pkg/a.py` | `A.run`, `inner`, `X` | fine |"
    assert walk_problems(doc.format(n=1, rows=good), tmp_path) == []
    assert walk_problems(doc.format(n=2, rows=good), tmp_path) == [
        "the text says 2 files carry the request; the table names 1"
    ]
    assert walk_problems(doc.format(n=1, rows="| 1 | `pkg/a.py` | `A.stop`, `B.run`, `nothing` | x |"), tmp_path) == [
        "pkg/a.py: no A.stop",
        "pkg/a.py: no B.run",
        "pkg/a.py: no nothing",
    ]
    assert walk_problems(doc.format(n=2, rows=good + "\n| 2 | `pkg/b.py` | `f` | x |"), tmp_path) == [
        "pkg/b.py: no such file"
    ]
    assert (
        "a file is named twice"
        in walk_problems(doc.format(n=1, rows=good + "\n" + good.replace("| 1 |", "| 2 |")), tmp_path)[0]
    )


def test_the_client_imports_nothing_of_ours_outside_itself():
    # The Python client needs httpx alone: importing it must not pull in torch through the engine's modules.
    bad = [
        f"{path.relative_to(REPO_ROOT)}:{line} imports {module}"
        for path in sorted((REPO_ROOT / "radixserve" / "client").rglob("*.py"))
        for line, module in imported_modules(path)
        if module.split(".")[0] in OURS and not module.startswith("radixserve.client")
    ]
    assert not bad, "\n".join(bad)


def test_tests_are_grouped_by_what_they_exercise():
    # README "While working" names the folders; a test file outside them would be in no one's loop.
    tests = REPO_ROOT / "tests"
    files = sorted(tests.rglob("test_*.py"))
    folders = {path.parent.relative_to(tests).as_posix() for path in files}
    assert folders == {"unit", "scheduler", "worker", "http", "e2e"}, folders
    names = [path.name for path in files]
    assert len(names) == len(set(names)), "test module names must be unique across folders (pytest's import mode)"
