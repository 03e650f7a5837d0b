"""``kasoku profile``'s own options in ``kasoku.core.flags`` (``PROFILE_OPTIONS``, a script's
``--with`` levers): the parser's options are these, a lever's change goes to arguments and
back through them."""
import argparse
from dataclasses import fields

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
