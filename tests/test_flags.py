"""The one map of a run's flags (kasoku.core.flags): the parser's flags are its flags, every
field of a run has one, and a change of fields goes to arguments and back."""
import argparse
from dataclasses import fields

import pytest

from kasoku.accel.config import AccelConfig
from kasoku.cli import build_parser
from kasoku.core.flags import FLAGS, args_text, from_args, to_args
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
    for key, flag in FLAGS.items():
        dest = key.split(".", 1)[1]
        if dest == "compile_mode":
            continue  # --compile MODE sets it
        assert options[dest] == flag, key


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
