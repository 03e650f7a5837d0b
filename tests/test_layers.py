"""The layout's rules, checked over kasoku's own source: the layers of ``pyproject.toml``'s
import-linter contract (deferred imports inside functions included), a reason beside every
import that stays deferred, no private name imported from another package, no module over
400 lines. The layer check is shown to fail on planted upward imports."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = SRC / "kasoku"
MAX_LINES = 400
LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True, no_logo=True))")

pytest.importorskip("importlinter", reason="the layer test needs import-linter "
                                           "(bash scripts/setup.sh --test installs it)")


def lint(src: Path) -> subprocess.CompletedProcess:
    """import-linter's run of the project's contracts over the ``kasoku`` package in ``src``
    (the first on the path, ahead of the installed one)."""
    env = dict(os.environ, PYTHONPATH=str(src))
    return subprocess.run([sys.executable, "-c", LINT, str(ROOT / "pyproject.toml")], env=env,
                          capture_output=True, text=True, timeout=120, cwd=src)


def modules() -> list[tuple[str, Path]]:
    """``(dotted name, path)`` of every module of the package."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append((".".join(parts), path))
    return out


def package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rsplit(".", 1)[0]


def kasoku_imports(tree: ast.AST, package: str):
    """``(node, [imported module or name], deferred)`` for each of kasoku's own imports."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        if not any(t.split(".")[0] == "kasoku" for t in targets):
            continue
        up, deferred = parents.get(node), False
        while up is not None and not deferred:
            deferred = isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef))
            up = parents.get(up)
        yield node, targets, deferred


def deferred_without_reason(source: str, package: str = "kasoku") -> list[int]:
    """Lines of deferred kasoku imports in ``source`` with no comment on their line."""
    lines = source.splitlines()
    return [node.lineno for node, _, deferred in kasoku_imports(ast.parse(source), package)
            if deferred and "#" not in lines[node.lineno - 1]]


def test_the_layers_hold():
    done = lint(SRC)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "kasoku's layers KEPT" in done.stdout


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    shutil.copytree(PACKAGE, src / "kasoku", ignore=shutil.ignore_patterns("__pycache__"))
    return src


@pytest.mark.parametrize("module, line, broken", [
    # the ground layer reaching up, from inside a function
    ("core/errors.py", "def planted():\n    from kasoku.data import loader\n",
     "kasoku.core.errors -> kasoku.data.loader"),
    # the library importing a command's engine at module level
    ("train/step.py", "from kasoku.commands import train as planted\n",
     "kasoku.train.step -> kasoku.commands.train"),
    # two packages of one layer that must not know each other
    ("data/base.py", "def planted():\n    import kasoku.models.mlp\n",
     "kasoku.data.base -> kasoku.models.mlp"),
])
def test_a_planted_upward_import_breaks_the_layers(copy, module, line, broken):
    target = copy / "kasoku" / module
    original = target.read_text()
    target.write_text(original + "\n\n" + line)
    try:
        done = lint(copy)
    finally:
        target.write_text(original)
    assert done.returncode == 1, done.stdout[-3000:]
    assert "kasoku's layers BROKEN" in done.stdout and broken in done.stdout, done.stdout[-3000:]


def test_every_deferred_import_says_why_on_its_line():
    missing = [f"{path.relative_to(ROOT)}:{line}" for name, path in modules()
               for line in deferred_without_reason(path.read_text(), package_of(name, path))]
    assert not missing, f"deferred imports without a reason on their line: {missing}"


def test_the_reason_check_finds_a_bare_deferred_import():
    source = ("import torch\nfrom kasoku.core import errors\n\n"
              "def f():\n    import json\n    from kasoku.data import loader\n"
              "    from kasoku.models import mlp  # deferred: a reason\n")
    assert deferred_without_reason(source) == [6]


def test_no_private_name_is_imported_from_another_package():
    found = []
    for name, path in modules():
        package = package_of(name, path)
        for node, targets, _ in kasoku_imports(ast.parse(path.read_text()), package):
            for target in targets:
                parts = target.split(".")
                private = [i for i, p in enumerate(parts) if p.startswith("_")
                           and not p.startswith("__")]
                if private and not within(package, holder_package(parts[:private[0]])):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {target}")
    assert not found, found


def holder_package(parts: list[str]) -> str:
    """The package a private name or module belongs to: ``parts`` name what holds it, a
    package or a module (whose package it then is)."""
    folder = SRC.joinpath(*parts)
    return ".".join(parts if folder.is_dir() else parts[:-1])


def within(package: str, owner: str) -> bool:
    return package == owner or package.startswith(owner + ".")


def test_the_private_check_tells_packages_apart():
    assert holder_package(["kasoku", "accel"]) == "kasoku.accel"  # kasoku.accel._recast
    assert holder_package(["kasoku", "data", "loader"]) == "kasoku.data"  # loader._stack
    assert within("kasoku.data", "kasoku.data") and not within("kasoku.train", "kasoku.data")


def test_no_module_is_over_400_lines():
    long = {str(path.relative_to(ROOT)): n for _, path in modules()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long
