"""``kasoku run [--with LEVER ...] -- python train.py ARGS``: a user's training script run whole
with levers set from outside it (``kasoku.commands.script_with``)."""
from __future__ import annotations

from kasoku.core.errors import ConfigError

WITH_HELP = ("a lever kasoku sets from outside the script (repeat for several): workers=N "
             "(every DataLoader with num_workers=N), pin-memory (every DataLoader with "
             "pin_memory=True), threads=N, tf32, cudnn-benchmark, bf16 (the script under "
             "torch.autocast bf16); kasoku profile -- python train.py measures which help")


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run your own training script with levers set from "
                       "outside it",
                       description="Run a training script to its end, unchanged, with levers "
                       "kasoku sets from outside it: kasoku run --with bf16 --with workers=4 -- "
                       "python train.py ARGS (or -- python -m MODULE ARGS). Its output and exit "
                       "code are its own; a last line says how many training steps it ran and "
                       "how long.")
    p.add_argument("--with", dest="with_levers", action="append", metavar="LEVER",
                   help=WITH_HELP)
    p.set_defaults(handler=run, script=None)


def run(args) -> int:
    if args.script is None:
        raise ConfigError("give the script's command after --: kasoku run --with bf16 -- "
                          "python train.py")
    from kasoku.commands.script_run import parse_command  # deferred: torch (cli's doc)
    from kasoku.commands.script_with import run_with  # deferred: torch (cli's doc)
    return run_with(parse_command(args.script), args.with_levers)
