"""``python -m kasoku.cli.profile_worker REQUEST``: one worker of ``kasoku profile --gpus N``
or ``--procs N``, started by ``kasoku.distributed.launch.launch``. ``REQUEST`` is a
``kasoku.commands.profile_config.ProfileRequest``'s JSON: the run the launching process
resolved and checked and the profile's settings, not its command line to parse again. Worker 0
prints what ``kasoku profile`` prints; the worker says its errors and ends with the exit codes
of ``kasoku``'s own command line (``kasoku.cli``), through ``exit_worker``."""
from __future__ import annotations

import argparse
import sys
import warnings

from kasoku import cli
from kasoku.cli.profile import profile_here
from kasoku.commands.profile_config import ProfileRequest
from kasoku.core.queues import request_queues
from kasoku.distributed.launch import exit_worker

USAGE = ("usage: python -m kasoku.cli.profile_worker REQUEST (started by kasoku profile "
         "--procs/--gpus)")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(USAGE, file=sys.stderr)
        return cli.EXIT_USAGE
    request = ProfileRequest.from_json(argv[0])
    request_queues()  # before anything starts CUDA, as kasoku's command line does
    with warnings.catch_warnings():
        warnings.showwarning = cli._show_warning
        return cli._run(argparse.Namespace(
            handler=lambda _args: profile_here(request.run, request.profile, request.out,
                                               request.measure_only),
            dist_timeout=request.run.dist.dist_timeout))


if __name__ == "__main__":
    exit_worker(main(sys.argv[1:]))
