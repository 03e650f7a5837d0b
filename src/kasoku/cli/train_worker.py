"""``python -m kasoku.cli.train_worker REQUEST``: one worker of ``kasoku train --gpus N`` or
``--procs N``, started by ``kasoku.distributed.launch.launch``. ``REQUEST`` is a
``kasoku.run.TrainRequest``'s JSON: the run the launching process resolved and
checked, not its command line to parse again. The worker says its errors and ends with the exit
codes of ``kasoku``'s own command line (``kasoku.cli``), through ``exit_worker``."""
from __future__ import annotations

import sys

from kasoku import cli
from kasoku.cli.train import says_how_to_continue
from kasoku.commands.train import train_run
from kasoku.distributed.launch import exit_worker
from kasoku.run import TrainRequest

USAGE = "usage: python -m kasoku.cli.train_worker REQUEST (started by kasoku train --procs/--gpus)"


def main(argv: list[str]) -> int:
    def train(request: TrainRequest) -> int:
        with says_how_to_continue(list(request.argv)):
            train_run(request.run, request.resume)
        return 0
    return cli.run_worker(argv, USAGE, TrainRequest.from_json, train)


if __name__ == "__main__":
    exit_worker(main(sys.argv[1:]))
