"""Starting the workers of a data-parallel run with PyTorch's elastic launcher
(``torch.distributed.launcher.api.elastic_launch``, what ``torchrun`` runs): kasoku starts
no process and opens no socket of its own.

``kasoku train WORKLOAD --gpus N`` (or ``--procs N``) re-runs the same command line in N
worker processes (``python -m kasoku ...``), each told its rank by the launcher's environment.
A worker knows it is one because that environment is set (``under_launcher``); the same command
started by ``torchrun`` or a scheduler that sets it runs as a worker directly. A binary
entrypoint rather than a Python function: each worker is a fresh interpreter that parses the
same arguments, which is also what a restart and a second machine run.

The rendezvous is static (torchrun's ``--master-addr``/``--node-rank`` form): at
``--rdzv-endpoint``, hosted by ``--node-rank 0``; on one machine at a free local port.
"""
from __future__ import annotations

import logging
import os
import socket
import sys

from kasoku.dist.config import DistConfig

LAUNCHER_ENV = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK")

SHUTDOWN_TIMEOUT_S = 5
"""Seconds the launcher gives the other workers to stop after one fails, before SIGKILL."""


def under_launcher(environ=None) -> bool:
    """Whether this process is a worker started by a launcher (the elastic launcher, torchrun,
    or a scheduler setting ``RANK`` and ``WORLD_SIZE``)."""
    env = os.environ if environ is None else environ
    return bool(env.get("TORCHELASTIC_RUN_ID")) or ("RANK" in env and "WORLD_SIZE" in env)


def restart_count(environ=None) -> int:
    """How many times the launcher restarted this worker group (0 on the first attempt)."""
    env = os.environ if environ is None else environ
    text = env.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    return int(text) if text.isdigit() else 0


def launch(argv: list[str], cfg: DistConfig) -> int:
    """Run ``python -m kasoku ARGV`` in ``cfg.workers`` processes on this machine (the job
    spanning ``cfg.nnodes`` machines), restarted up to ``cfg.max_restarts`` times. Returns the
    exit code: 0, or the failed worker's (its one-line error already printed by the worker);
    prints one line naming the worker that failed first."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # A static rendezvous, as torchrun's --master-addr form, on one machine as on several.
    endpoint = cfg.rdzv_endpoint or f"localhost:{_free_port()}"
    rdzv = {"rdzv_backend": "static", "rdzv_endpoint": endpoint,
            "rdzv_configs": {"rank": cfg.node_rank}, "run_id": "kasoku"}
    options = dict(min_nodes=cfg.nnodes, max_nodes=cfg.nnodes, nproc_per_node=cfg.workers,
                   max_restarts=cfg.max_restarts, monitor_interval=0.1, **rdzv)
    if "shutdown_timeout" in LaunchConfig.__dataclass_fields__:
        options["shutdown_timeout"] = SHUTDOWN_TIMEOUT_S
    config = LaunchConfig(**options)
    # The launcher's own log lines (its settings, each worker's exit) would bury the workers'
    # one-line errors; kasoku says what failed itself.
    # Each of its modules sets its own logger's level, so each is quieted.
    for name in ["torch.distributed.elastic", *list(logging.root.manager.loggerDict)]:
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # each worker sets its own thread count
    try:
        elastic_launch(config, sys.executable)("-m", "kasoku", *argv)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode
        tries = f" after {cfg.max_restarts} restart{'s' * (cfg.max_restarts != 1)}" \
            if cfg.max_restarts else ""
        how = f"exit code {code}" if code is not None and code >= 0 else \
            f"signal {-code}" if code is not None else "no exit code"
        print(f"kasoku: error: worker {rank} failed ({how}){tries}, so the job stopped; "
              f"its error is above", file=sys.stderr, flush=True)
        return code if code in (1, 2) else 1
    except Exception as exc:  # the rendezvous itself: a bad endpoint, a machine that never came
        text = " ".join(str(exc).split()) or type(exc).__name__
        print(f"kasoku: error: the workers could not start: {type(exc).__name__}: "
              f"{text[:300]}", file=sys.stderr, flush=True)
        return 1
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]
