"""The one map of a run's flags (kasoku.core.flags): the parser's flags are its flags, every
field of a run has one, and a change of fields goes to arguments and back."""
import argparse
import ast
import re
from dataclasses import fields
from pathlib import Path

import pytest

import kasoku
from kasoku.accel.config import AccelConfig
from kasoku.cli import build_parser
from kasoku.core.flags import FLAGS, OPTIONS, args_text, flag, from_args, to_args
from kasoku.data.config import DataConfig
from kasoku.distributed.config import DistConfig
from kasoku.kfac.config import KFACConfig
from kasoku.train.config import TrainConfig

SECTIONS = {"data": DataConfig, "train": TrainConfig, "accel": AccelConfig, "dist": DistConfig,
            "kfac": KFACConfig}
NOT_ON_THE_COMMAND_LINE = {"data.synthetic_val_size"}


def _options(command: str) -> dict[str, str]:
    """dest -> flag of the command's options."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {act.dest: s for act in sub.choices[command]._actions for s in act.option_strings
            if s.startswith("--")}


def test_every_field_of_a_run_has_one_flag_in_the_map():
    keys = {f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in fields(cls)}
    assert keys - NOT_ON_THE_COMMAND_LINE == set(FLAGS)


def test_the_parser_of_train_uses_the_map():
    options = _options("train")
    for key, name in FLAGS.items():
        dest = key.split(".", 1)[1]
        if dest == "compile_mode":
            continue  # --compile MODE sets it
        assert options[dest] == name, key


@pytest.mark.parametrize("changes, args", [
    ({"accel.compile": True}, ("--compile",)),
    ({"accel.compile": True, "accel.compile_mode": "max-autotune"},
     ("--compile", "max-autotune")),
    ({"accel.precision": "bf16", "accel.channels_last": True},
     ("--precision", "bf16", "--channels-last")),
    ({"train.progress": False}, ("--no-progress",)),
    ({"train.batch_size": 256, "train.lr": 0.1}, ("--batch-size", "256", "--lr", "0.1")),
    ({"kfac.inv_update_freq": 20}, ("--kfac-inv-update-freq", "20")),
])
def test_changes_to_arguments_and_back(changes, args):
    assert to_args(changes) == args
    assert args_text(changes) == " ".join(args)
    back = from_args(args)
    assert {k: str(v) if not isinstance(v, bool) else v for k, v in changes.items()} == back


@pytest.mark.parametrize("changes", [{"accel.cuda_graph": False}, {"train.progress": True},
                                     {"train.seed": None}])
def test_a_change_no_flag_can_make_is_refused(changes):
    with pytest.raises(ValueError):
        to_args(changes)


def test_an_argument_that_is_no_runs_flag_is_refused():
    with pytest.raises(ValueError, match="--confirm"):
        from_args(["--confirm"])


# Issue 43: no flag literal below the command line. A message below kasoku.cli names a flag by
# the map (``flag("accel.compile")``), so a renamed flag cannot leave a message naming the old
# one. Docstrings may mention flags; every other string constant, the text of f-strings too,
# may not spell one of kasoku's options.
SRC = Path(kasoku.__file__).parent
EXEMPT = {"core/flags.py"}  # the map itself
FLAG_TOKEN = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _kasoku_options(parser: argparse.ArgumentParser) -> set[str]:
    """Every long option of ``parser`` and its subcommands, at any depth."""
    out = set()
    for action in parser._actions:
        out.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _kasoku_options(sub)
    return out - {"--help", "--version"}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that stand alone as statements (docstrings of modules,
    classes and functions, and those written under an attribute)."""
    return {id(st.value) for node in ast.walk(tree)
            for st in (node.body if isinstance(getattr(node, "body", None), list) else ())
            if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant)
            and isinstance(st.value.value, str)}


def _flag_literals(source: str, options: set[str]) -> list[tuple[int, str]]:
    tree = ast.parse(source)
    docs = _docstrings(tree)
    return [(node.lineno, token) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docs
            for token in FLAG_TOKEN.findall(node.value) if token in options]


def test_the_options_map_names_options_of_their_commands():
    options = _kasoku_options(build_parser())
    assert set(OPTIONS.values()) <= options
    assert not set(OPTIONS) & set(FLAGS)
    assert flag("train.resume") == "--resume" and flag("accel.cuda_graph") == "--cuda-graph"


def test_the_scan_finds_a_flag_in_a_message_and_in_an_f_string_not_in_a_docstring():
    source = ('"""--compile in a docstring."""\n'
              'def f(x):\n    """--cuda-graph."""\n'
              '    raise ValueError(f"{x}: drop --cuda-graph")\n'
              'A = ("--epochs", 1)\n'
              'B = "pip install --upgrade torch"\n')
    assert sorted(_flag_literals(source, _kasoku_options(build_parser()))) == [
        (4, "--cuda-graph"), (5, "--epochs")]


def test_no_flag_literal_below_the_command_line():
    options = _kasoku_options(build_parser())
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("cli/") or rel in EXEMPT:
            continue
        found += [f"{rel}:{line}: {token}"
                  for line, token in _flag_literals(path.read_text(), options)]
    assert not found, "name these flags by kasoku.core.flags.flag:\n" + "\n".join(found)


def test_the_exempt_file_exists():
    assert all((SRC / rel).is_file() for rel in EXEMPT)


def test_without_drops_flags_with_their_values():
    from kasoku.core.flags import without
    argv = ["bench", "w", "--config", "+a", "--batch-size=3", "--ladder", "--out", "o",
            "--keep", "v", "--full"]
    takes = {"--config": 1, "--batch-size": 1, "--out": 1, "--ladder": 0, "--full": 0}
    assert without(argv, takes) == ["bench", "w", "--keep", "v"]
    assert without(["x", "--resume", "auto", "--resume=f", "--epochs", "3"],
                   {"--resume": 1}) == ["x", "--epochs", "3"]
    assert without(["--rounds", "2", "3"], {"--rounds": 1}) == ["3"]  # one value, not two
