"""docs/architecture.md is the map of the code: every file, folder, module, class and function
it names in backquotes must exist in the code as it is. Read from the source as text (its
definitions by ``ast``), nothing imported: a renamed function fails here, not in a reader's
hands.

What counts as a name of the code: a path (``train/step.py``, ``accel/``), a dotted name whose
head is a module or class of kasoku (``window.machine_facts``, ``accel/compose.check_sharding``,
``kasoku.workloads``), a CamelCase word (``DevicePrefetcher``) and a word with an underscore
(``train_run``, ``apply_*`` as a prefix). Flags, file names of run folders (``log.jsonl``)
and plain words are prose. A name the structure does not resolve (PyTorch's
``clip_grad_norm_``, a JSON key such as ``figures.stability``, an environment variable) must
still be written somewhere in kasoku's source, each of its dotted parts: the code that calls,
writes or reads it."""
from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "kasoku"
DOC = ROOT / "docs" / "architecture.md"
TOP = ("benchmarks", "tests", "docs", "scripts", "examples", "research", "src", ".ci")

NOT_CODE = re.compile(r"[\s,;()=<>|'\"]|^-|^\.|^~|^[A-Z_]+=|\.(jsonl|json|png|pt|html|txt|"
                      r"md|toml|sh|gz|bin|jpg)$")


@cache
def modules() -> dict[str, list[Path]]:
    """Every kasoku module by its dotted tail: ``accel.compose`` and ``compose`` both name
    ``src/kasoku/accel/compose.py``."""
    out: dict[str, list[Path]] = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        for i in range(len(parts)):
            out.setdefault(".".join(parts[i:]), []).append(path)
    out["kasoku"] = [SRC / "__init__.py"]
    for key, paths in list(out.items()):
        out["kasoku." + key] = paths
    return out


@cache
def definitions(path: Path) -> dict[str, set[str]]:
    """The names a module defines at its top (functions, classes, assignments, imports), and
    for each class the names in its body (methods, fields), as ``{"": top, "Class": ...}``."""
    tree = ast.parse(path.read_text())
    out: dict[str, set[str]] = {"": set()}

    def names(body) -> set[str]:
        found = set()
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(node.name)
            elif isinstance(node, ast.Assign):
                found |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                found.add(node.target.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                found |= {(a.asname or a.name).split(".")[0] for a in node.names}
        return found

    out[""] = names(tree.body)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            out[node.name] = names(node.body)
            # attributes set on self in methods are the class's too
            out[node.name] |= {t.attr for t in ast.walk(node) if isinstance(t, ast.Attribute)
                               and isinstance(t.value, ast.Name) and t.value.id == "self"
                               and isinstance(t.ctx, ast.Store)}
    return out


@cache
def source_words() -> set[str]:
    """Every word written anywhere in kasoku's source: names, strings, comments."""
    return {w for path in SRC.rglob("*.py") for w in re.findall(r"\w+", path.read_text())}


@cache
def everything() -> set[str]:
    """Every name any kasoku module defines, at its top or in a class."""
    return {name for path in SRC.rglob("*.py") for names in definitions(path).values()
            for name in names}


def exists(name: str) -> bool:
    """Whether ``name``, as the doc writes it, names something in the code."""
    name = name.removesuffix("()").rstrip(":")
    return resolved(name) or all(part in source_words() or part in ("N", "PHASE", "")
                                 for part in re.split(r"[./]", name.rstrip("*")))


def resolved(name: str) -> bool:
    """Whether ``name`` resolves to a file, module, class or definition of kasoku."""
    if name.endswith("*"):  # a family: apply_*, kasoku.commands.script_*
        stem = name.rstrip("*")
        return any(n.startswith(stem.rsplit(".", 1)[-1].rsplit("/", 1)[-1])
                   for n in everything() | set(modules()))
    if "/" in name and "." not in name.rsplit("/", 1)[-1] or name.endswith(".py"):
        return any((base / name).exists() for base in (SRC, SRC.parent, ROOT))
    if "/" in name:  # accel/compose.check_sharding
        name = name.replace("/", ".").replace(".py.", ".")
    if "." in name:
        head, attrs = name, []
        while head and head not in modules():
            head, _, tail = head.rpartition(".")
            attrs.insert(0, tail)
        if head:
            return any(_defines(path, attrs) for path in modules()[head])
        cls, _, attr = name.partition(".")
        return any(cls in definitions(p) and attr.split(".")[0] in definitions(p)[cls]
                   for p in SRC.rglob("*.py"))
    return name in everything() or name in modules()


def _defines(path: Path, attrs: list[str]) -> bool:
    if not attrs:
        return True
    defs = definitions(path)
    if attrs[0] not in defs[""]:
        return False
    return len(attrs) == 1 or attrs[0] not in defs or attrs[1] in defs[attrs[0]]


def named_in_doc() -> list[str]:
    """The doc's backquoted words that name code (the module docstring says which)."""
    out = []
    for word in sorted(set(re.findall(r"`([^`\n]+)`", DOC.read_text()))):
        if NOT_CODE.search(word) or word.split("/")[0] in TOP and not word.startswith("src"):
            continue
        looks = ("/" in word or "." in word or "_" in word
                 or re.fullmatch(r"[A-Z][a-z0-9]+[A-Z]\w*", word))
        if looks and re.fullmatch(r"[\w./*]+(\(\))?", word):
            out.append(word)
    return out


def test_the_doc_names_code():
    assert len(named_in_doc()) > 100  # the map does name the code it maps


def test_every_name_in_the_doc_is_in_the_code():
    missing = [word for word in named_in_doc() if not exists(word)]
    assert not missing, f"docs/architecture.md names what the code lacks: {missing}"


@pytest.mark.parametrize("word,found", [
    ("train/step.py", True), ("train/stepper.py", False),
    ("accel/compose.check_sharding", True), ("accel/compose.check_shard", False),
    ("window.machine_facts", True), ("Window.start", True), ("Window.begin", False),
    ("DevicePrefetcher", True), ("DevicePrefetch", False), ("apply_*", True),
    ("confirm_saved", False), ("kasoku.workloads", True),
    ("clip_grad_norm_", True), ("figures.stability", True), ("figures.stabilty", False),
])
def test_the_check_tells_names_that_exist_from_names_that_do_not(word, found):
    assert exists(word) is found


def test_the_layers_table_is_the_contract():
    """The doc's table of layers, top to bottom, is ``pyproject.toml``'s import-linter
    contract."""
    import tomllib
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = [sorted(p.strip() for p in layer.split("|"))
              for layer in contract["contracts"][0]["layers"]]
    rows = re.findall(r"^\| (\d+) \| (.+?) \| [^|]", DOC.read_text(), re.M)
    table = [sorted(re.findall(r"`(\w+)/?`", packages))
             for _, packages in sorted(rows, key=lambda row: -int(row[0]))]
    assert table == layers


def signature(cls: str, method: str) -> list[str] | None:
    """The parameters of ``cls.method`` in kasoku's source (``self`` left out), or None."""
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name == cls:
                for f in node.body:
                    if isinstance(f, ast.FunctionDef) and f.name == method:
                        a = f.args
                        return [p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]][1:]
    return None


def test_the_signatures_the_doc_writes_are_the_codes():
    """Each call in the doc's Python blocks to a kasoku class or to a method of an object
    made by one names the parameters of the code's signature, all of them, in order."""
    calls = 0
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S):
        made = {}
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                    and isinstance(node.value.func, ast.Name):
                made[node.targets[0].id] = node.value.func.id
        for node in ast.walk(ast.parse(block)):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Name) and f.id in made.values():
                cls, method = f.id, "__init__"
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
                    and f.value.id in made:
                cls, method = made[f.value.id], f.attr
            else:
                continue
            written = [a.id for a in node.args if isinstance(a, ast.Name)] + \
                [k.arg for k in node.keywords]
            assert written == signature(cls, method), f"{cls}.{method}"
            calls += 1
    assert calls >= 3
