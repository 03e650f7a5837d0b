"""``kasoku run [--with LEVER ...] -- python train.py ARGS``: a user's training script run whole
with levers set from outside it (``kasoku.commands.script_with``)."""
from __future__ import annotations

from kasoku.cli import args as a
from kasoku.cli.profile import PROFILE_FLAGS, TRAINING_LEVERS
from kasoku.commands.profile_config import ProfileConfig
from kasoku.core.errors import ConfigError
from kasoku.distributed.launch import under_launcher

WITH_HELP = ("a lever kasoku sets from outside the script (repeat for several): "
             + TRAINING_LEVERS + "; kasoku profile -- python train.py measures which help")


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run your own training script with levers set from "
                       "outside it",
                       description="Run a training script to its end, unchanged, with levers "
                       "kasoku sets from outside it: kasoku run --with bf16 --with workers=4 -- "
                       "python train.py ARGS (or -- python -m MODULE ARGS). Its output and exit "
                       "code are its own; a last line says how many training steps it ran and "
                       "how long. Under torchrun (-- torchrun [OPTIONS] train.py ARGS) the "
                       "levers are set in every worker and worker 0 counts the steps.")
    p.add_argument("--with", dest="with_levers", action="append", metavar="LEVER",
                   help=WITH_HELP)
    p.add_argument("--auto", action="store_true",
                   help="choose the levers: profile the script first (kasoku profile "
                   "--stop-after-window, its levers measured in fresh runs of it), keep those "
                   "measured faster (together where that is faster still), then run it whole "
                   "with them; the last line says what was kept and the speed-up measured")
    a.add_fields(p.add_argument_group("--auto's profile"), ProfileConfig,
                 {k: v for k, v in PROFILE_FLAGS.items()
                  if k in ("skip", "measure_steps", "measure_seconds", "warmup", "steps",
                           "rounds")})
    p.set_defaults(handler=run, script=None)


def run(args) -> int:
    if args.script is None:
        raise ConfigError("give the script's command after --: kasoku run --with bf16 -- "
                          "python train.py")
    if args.auto and args.with_levers:
        raise ConfigError("--auto chooses the levers itself: give --auto or --with, not both")
    from kasoku.commands.script_auto import run_auto  # deferred: torch (cli's doc)
    from kasoku.commands.script_launch import parse_launched  # deferred: torch (cli's doc)
    from kasoku.commands.script_run import parse_command  # deferred: torch (cli's doc)
    from kasoku.commands.script_with import run_with  # deferred: torch (cli's doc)
    command = parse_launched(args.script)
    if command is not None and under_launcher():
        raise ConfigError("torchrun inside torchrun: give the script's command after --")
    command = command or parse_command(args.script)
    if args.auto:
        return run_auto(command, a.config_from(args, ProfileConfig))
    return run_with(command, args.with_levers)
