"""``kasoku profile``'s own options in ``kasoku.core.flags`` (``PROFILE_OPTIONS``, a script's
``--with`` levers): the parser's options are these, a lever's change goes to arguments and
back through them, and no module that advises or A/B-runs a lever writes a flag itself."""
import argparse
import ast
import re
from dataclasses import fields
from pathlib import Path

from kasoku.cli import build_parser
from kasoku.commands.profile_config import ProfileConfig
from kasoku.core.flags import (
    PROFILE_OPTIONS,
    change_args,
    change_of,
    profile_args,
    setting_flag,
    with_args,
)

SRC = Path(__file__).parents[1] / "src" / "kasoku"
NO_FLAG_LITERALS = [*sorted((SRC / "advisor").glob("*.py")),
                    *(SRC / "commands" / name for name in (
                        "ab.py", "script_levers.py", "script_offers.py", "script_ab.py",
                        "script_profile.py", "profile.py", "bench/rung_advice.py"))]
"""The modules that say, run or read levers: their flags come from kasoku.core.flags."""
DEST = {"with": "with_levers"}
"""An option whose argparse dest is not its name."""


def _profile_options() -> dict[str, str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {act.dest: s for act in sub.choices["profile"]._actions for s in act.option_strings
            if s.startswith("--")}


def test_the_profile_parser_has_the_maps_options():
    options = _profile_options()
    for name, flag in PROFILE_OPTIONS.items():
        assert options[DEST.get(name, name)] == flag, name
    assert {f.name for f in fields(ProfileConfig)} <= set(PROFILE_OPTIONS)
    assert options["attention"] == setting_flag("attention")  # gpt's, named in the advice


def test_own_options_and_script_levers_as_arguments():
    assert profile_args({"measure_only": True, "out": "d", "skip": 10}) == (
        "--measure-only", "--out", "d", "--skip", "10")
    assert with_args("bf16", "workers=2") == ("--with", "bf16", "--with", "workers=2")
    change = {"accel.compile": True, "with.pin_memory": True, "with.workers": 4}
    args = change_args(change)
    assert args == ("--compile", "--with", "pin-memory", "--with", "workers=4")
    assert change_of(args) == {"accel.compile": True, "with.pin_memory": True,
                               "with.workers": "4"}


def _strings(path: Path):
    """The string constants of a module (f-strings' parts too), docstrings aside."""
    tree = ast.parse(path.read_text())
    docs = {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docs:
            yield node.lineno, node.value


def test_no_flag_is_written_out_where_levers_are_said_or_run():
    found = [f"{path.relative_to(SRC)}:{line}: {text!r}"
             for path in NO_FLAG_LITERALS for line, text in _strings(path)
             if re.search(r"(?<![\w-])--", text)]
    assert found == []
