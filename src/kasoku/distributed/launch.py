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

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path

from kasoku.core.errors import ConfigError, warn_once
from kasoku.distributed.config import DistConfig

LAUNCHER_ENV = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK")

SHUTDOWN_TIMEOUT_S = 5
"""Seconds the launcher gives the other workers to stop after one fails, before SIGKILL."""


def under_launcher(environ=None) -> bool:
    """Whether this process is a worker started by a launcher (the elastic launcher, torchrun,
    or a scheduler setting ``RANK`` and ``WORLD_SIZE``)."""
    env = os.environ if environ is None else environ
    return bool(env.get("TORCHELASTIC_RUN_ID")) or ("RANK" in env and "WORLD_SIZE" in env)


def exit_worker(code: int):
    """End this worker process now with ``code``, its output flushed, without the
    interpreter's shutdown. gloo's threads free each finished collective after the caller
    has moved on, and freeing its tensors takes the GIL: a thread that asks for it once the
    interpreter is shutting down is stopped mid-C++ and the whole process aborts ("terminate
    called without an active exception", pytorch/pytorch#190489), even after
    ``destroy_process_group``: seen in two-worker test runs on a 2-core machine.
    Call it last: what the worker writes (snapshots included) is complete by then."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def failure_recorded():
    """Inside a worker, around its work and inside the ``try`` that closes its process group:
    an exception is written to the launcher's error file, then propagates. Recorded before
    the group closes: closing it fails the peers' collectives, and the launcher names the
    error recorded first as the cause."""
    try:
        yield
    except Exception as exc:
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler
        handler = get_error_handler()
        handler.initialize()
        handler.record_exception(exc)
        raise


def worker_main(work, argv: list[str], usage: str) -> None:
    """``python -m MODULE REQUEST_JSON`` as a worker started by ``run_module``:
    ``work(request)``, then ``exit_worker`` with 0, or with 1 after the traceback (stderr,
    which the launch keeps for a failed rank)."""
    if len(argv) != 1:
        raise SystemExit(usage)
    try:
        work(json.loads(argv[0]))
    except BaseException:
        traceback.print_exc()
        exit_worker(1)
    exit_worker(0)


def restart_count(environ=None) -> int:
    """How many times the launcher restarted this worker group (0 on the first attempt)."""
    env = os.environ if environ is None else environ
    text = env.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    return int(text) if text.isdigit() else 0


def launch_config(nproc_per_node: int, *, nnodes: int = 1, node_rank: int = 0,
                  rdzv_endpoint: str | None = None, max_restarts: int = 0, **options):
    """The elastic launcher's ``LaunchConfig`` for ``nproc_per_node`` workers per machine: a
    static rendezvous (torchrun's ``--master-addr`` form) at ``rdzv_endpoint``, hosted by
    ``node_rank`` 0, or on one machine at a free local port; ``options``: more of its
    fields (``logs_specs``, ...)."""
    from torch.distributed.launcher.api import LaunchConfig
    endpoint = rdzv_endpoint or f"localhost:{_free_port()}"
    # Its store's key prefix: the same on every machine of a job; a fresh one per launch on one.
    run_id = "kasoku" if rdzv_endpoint else f"kasoku-{uuid.uuid4().hex[:12]}"
    fields = dict(min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc_per_node,
                  max_restarts=max_restarts, monitor_interval=0.1, rdzv_backend="static",
                  rdzv_endpoint=endpoint, rdzv_configs={"rank": node_rank}, run_id=run_id,
                  **options)
    if "shutdown_timeout" in LaunchConfig.__dataclass_fields__:  # not in older torch
        fields["shutdown_timeout"] = SHUTDOWN_TIMEOUT_S
    return LaunchConfig(**fields)


def launch(argv: list[str], cfg: DistConfig) -> int:
    """Run ``python -m kasoku ARGV`` in ``cfg.workers`` processes on this machine (the job
    spanning ``cfg.nnodes`` machines), restarted up to ``cfg.max_restarts`` times. Returns the
    exit code: 0, or the failed worker's (its one-line error already printed by the worker);
    prints one line naming the worker that failed first."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    config = launch_config(cfg.workers, nnodes=cfg.nnodes, node_rank=cfg.node_rank,
                           rdzv_endpoint=cfg.rdzv_endpoint, max_restarts=cfg.max_restarts)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # each worker sets its own thread count
    try:
        with quiet_launcher():
            elastic_launch(config, sys.executable)("-m", "kasoku", *argv)
    except ChildFailedError as exc:
        rank, failure = first_failure(exc.failures)
        code = failure.exitcode
        tries = f" after {cfg.max_restarts} restart{'s' * (cfg.max_restarts != 1)}" \
            if cfg.max_restarts else ""
        how = f"exit code {code}" if code is not None and code >= 0 else \
            f"signal {-code}" if code is not None else "no exit code"
        print(f"kasoku: error: worker {rank} failed ({how}){tries}, so the job stopped; "
              f"its error is above", file=sys.stderr, flush=True)
        return code if code in (1, 2) else 1
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # the rendezvous itself: a bad endpoint, a machine that never came
        text = " ".join(str(exc).split()) or type(exc).__name__
        print(f"kasoku: error: the workers could not start: {type(exc).__name__}: "
              f"{text[:300]}", file=sys.stderr, flush=True)
        return 1
    return 0


class WorkersFailed(RuntimeError):
    """A worker of a measurement launch failed or the workers could not start: the message is
    one line naming what was launched, the rank and its error."""


def run_module(module: str, request: str, world_size: int, log_dir: Path, keep_in: Path,
               what: str, tag: str) -> None:
    """``python -m MODULE REQUEST`` in ``world_size`` processes on this machine, through the
    elastic launcher (a fresh local rendezvous, no restart: a measurement retried after a
    failure measures nothing new). The workers' stderr goes to files in ``log_dir``, their
    stdout to the terminal; a failed worker's stderr is copied to ``keep_in`` and named in
    the ``WorkersFailed`` raised (as ``stderr-TAG-rankR.log``), whose message starts with
    ``what``."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    config = launch_config(world_size, logs_specs=DefaultLogsSpecs(log_dir=str(log_dir),
                                                                   redirects=Std.ERR))
    try:
        with quiet_launcher():
            elastic_launch(config, sys.executable)("-m", module, request)
    except ChildFailedError as exc:
        rank, failure = first_failure(exc.failures)
        message = failure.message
        if isinstance(message, dict):  # written by the worker's torch error recorder
            message = message.get("message", "")
        code = failure.exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        cause = " ".join(str(message).split())[:400] if message and "errors.html" not in \
            str(message) else "no error recorded"
        kept = _keep_stderr(Path(log_dir), failure.local_rank,
                            Path(keep_in) / f"stderr-{tag}-rank{rank}.log")
        raise WorkersFailed(f"{what}: rank {rank} failed ({how}): {cause}"
                            + (f"; its stderr: {kept}" if kept else "")) from None
    except (KeyboardInterrupt, WorkersFailed):
        raise
    except Exception as exc:  # the rendezvous itself, or the workers could not be started
        text = " ".join(str(exc).split()) or type(exc).__name__
        raise WorkersFailed(f"{what}: the workers could not start: {type(exc).__name__}: "
                            f"{text[:300]}") from None


def _keep_stderr(log_dir: Path, local_rank: int, to: Path) -> Path | None:
    """Copy worker ``local_rank``'s stderr file from the launcher's ``log_dir``
    (``RUN/attempt_N/RANK/stderr.log``) to ``to``; None when there is none."""
    found = sorted(log_dir.glob(f"*/attempt_*/{local_rank}/stderr.log"))
    if not found:
        return None
    to.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(found[-1], to)
    return to


def first_failure(failures: dict) -> tuple:
    """``(rank, failure)`` of the worker that failed first: by its error file's time to the
    nanosecond (the launcher's own choice compares whole seconds, and the peers' "connection
    reset" errors land in the same second as the cause)."""
    def when(item):
        path = item[1].error_file
        return (os.stat(path).st_mtime_ns if os.path.isfile(path) else float("inf"),
                item[1].timestamp, item[0])
    return min(failures.items(), key=when)



@contextlib.contextmanager
def quiet_launcher():
    """The elastic launcher installs signal handlers raising its ``SignalException`` (kept
    after it returns), sets ``TORCHELASTIC_SIGNALS_TO_HANDLE`` and logs its settings and each
    worker's exit: around one launch, the launcher's log is quieted, and afterwards the
    handlers and the variable are restored; a signal that stopped the launch becomes a
    ``KeyboardInterrupt`` carrying the exit code 128 + N."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    saved = {s: signal.getsignal(s) for s in (getattr(signal, n, None) for n in names)
             if s is not None}
    env_key = "TORCHELASTIC_SIGNALS_TO_HANDLE"
    env_before = os.environ.get(env_key)
    # Each of the launcher's modules sets its own logger's level: quieting the parent alone
    # does nothing. kasoku says in one line what failed.
    logs = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
            if name.startswith("torch.distributed.elastic")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    except SignalException as exc:
        stop = KeyboardInterrupt(str(exc))
        stop.exit_code = 128 + int(exc.sigval)
        raise stop from None
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)
        if env_before is None:
            os.environ.pop(env_key, None)
        else:
            os.environ[env_key] = env_before



@dataclass(frozen=True)
class Plan:
    backend: str
    """nccl (one GPU per process) or gloo (CPU processes)."""
    world_sizes: tuple[int, ...]
    """Processes of each launch, in order."""
    note: str = ""
    """How the world sizes were chosen when they were not given."""

    @property
    def device_type(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"


def plan_worlds(gpus: list[int] | None = None, procs: list[int] | None = None,
                from_one: bool = False) -> Plan:
    """What to launch: ``gpus`` (NCCL, a process per GPU) or ``procs`` (gloo on the CPU), each
    a list of world sizes; neither: every visible GPU when CUDA is there, else 2 CPU
    processes, and 1 before them with ``from_one``. A request this machine cannot run is a
    ``ConfigError`` saying what to give."""
    import torch
    import torch.distributed as dist
    if gpus and procs:
        raise ConfigError("give --gpus (NCCL on GPUs) or --procs (gloo on the CPU), not both")
    if not dist.is_available():
        raise ConfigError("this torch build has no torch.distributed; install a torch build "
                          "with distributed support (the Linux wheels have it)")
    note = ""
    if not gpus and not procs:
        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            gpus = sorted({1, count}) if from_one else [count]
            note = (f"all {count} visible GPUs" if count > 1 else "the one visible GPU") \
                + " (--gpus N[,N...] to choose)"
        else:
            procs = [1, 2] if from_one else [2]
            note = "no GPU here: CPU processes over gloo (--procs N[,N...] to choose)"
    if gpus:
        if not torch.cuda.is_available():
            raise ConfigError("--gpus needs CUDA and torch sees no GPU here; use --procs N for "
                              "gloo on the CPU")
        visible = torch.cuda.device_count()
        if max(gpus) > visible:
            raise ConfigError(f"--gpus {max(gpus)}: only {visible} GPU{'s' * (visible != 1)} "
                              f"visible (torch.cuda.device_count()); give at most {visible}")
        if not dist.is_nccl_available():
            raise ConfigError("--gpus needs NCCL and this torch build has none; use --procs N "
                              "for gloo on the CPU")
        return Plan("nccl", tuple(dict.fromkeys(gpus)), note)
    cores = cpu_cores()
    if max(procs) > 4 * cores:
        raise ConfigError(f"--procs {max(procs)}: at most {4 * cores} (4 x the {cores} cores "
                          f"here)")
    if max(procs) > cores:
        warn_once(f"--procs {max(procs)} on {cores} cores: processes share cores, and the "
                  f"times include that sharing")
    return Plan("gloo", tuple(dict.fromkeys(procs)), note)


def cpu_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]
