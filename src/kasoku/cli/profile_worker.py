"""``python -m kasoku.cli.profile_worker REQUEST``: one worker of ``kasoku profile --gpus N``
or ``--procs N``, started by ``kasoku.distributed.launch.launch``. ``REQUEST`` is a
``kasoku.commands.profile_config.ProfileRequest``'s JSON: the run the launching process
resolved and checked and the profile's settings, not its command line to parse again. Worker 0
prints what ``kasoku profile`` prints; the worker says its errors and ends with the exit codes
of ``kasoku``'s own command line (``kasoku.cli``), through ``exit_worker``."""
from __future__ import annotations

import sys

from kasoku import cli
from kasoku.cli.profile import profile_here
from kasoku.commands.profile_config import ProfileRequest
from kasoku.distributed.launch import exit_worker

USAGE = ("usage: python -m kasoku.cli.profile_worker REQUEST (started by kasoku profile "
         "--procs/--gpus)")


def main(argv: list[str]) -> int:
    return cli.run_worker(argv, USAGE, ProfileRequest.from_json,
                          lambda r: profile_here(r.run, r.profile, r.out, r.measure_only))


if __name__ == "__main__":
    exit_worker(main(sys.argv[1:]))
