"""Starting the workers of a data-parallel run with PyTorch's elastic launcher
(``torch.distributed.launcher.api.elastic_launch``, what ``torchrun`` runs): kasoku starts
no process and opens no socket of its own.

``kasoku train WORKLOAD --gpus N`` (or ``--procs N``) starts N worker processes, each given the
run it resolved as JSON (``python -m kasoku.cli.train_worker REQUEST``; ``kasoku profile``'s,
``python -m kasoku.cli.profile_worker REQUEST``), each told its rank by the launcher's
environment. A worker knows it is one because that environment is set (``under_launcher``); the
same command started by ``torchrun`` or a scheduler that sets it runs as a worker directly. A
binary entrypoint rather than a Python function: each worker is a fresh interpreter, which is
also what a restart and a second machine run.

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
import tempfile
import traceback
import uuid
from pathlib import Path

from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag
from kasoku.core.interrupts import Stopped, handled
from kasoku.core.snapshot_names import snapshots
from kasoku.distributed.config import DistConfig
from kasoku.distributed.failures import JOB_DIR_ENV, blame, how, read_notes

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


def worker_main(work, argv: list[str], usage: str, parse=json.loads) -> None:
    """``python -m MODULE REQUEST_JSON`` as a worker started by ``run_module``:
    ``work(parse(REQUEST_JSON))`` (a typed request's ``from_json``), then ``exit_worker`` with
    0, or with 1 after the traceback (stderr, which the launch keeps for a failed rank)."""
    if len(argv) != 1:
        raise SystemExit(usage)
    try:
        work(parse(argv[0]))
    except BaseException:
        traceback.print_exc()
        exit_worker(1)
    exit_worker(0)


def launch_config(nproc_per_node: int, *, nnodes: int = 1, node_rank: int = 0,
                  rdzv_endpoint: str | None = None, max_restarts: int = 0,
                  numa_binding: str | None = None, **options):
    """The elastic launcher's ``LaunchConfig`` for ``nproc_per_node`` workers per machine: a
    static rendezvous (torchrun's ``--master-addr`` form) at ``rdzv_endpoint``, hosted by
    ``node_rank`` 0, or on one machine at a free local port; ``numa_binding``: its NUMA
    binding of each GPU worker (``torch.numa.binding.AffinityMode``'s value); ``options``:
    more of its fields (``logs_specs``, ...)."""
    from torch.distributed.launcher.api import LaunchConfig
    if numa_binding is not None:
        options["numa_options"] = numa_options(numa_binding, LaunchConfig)
    endpoint = rdzv_endpoint or f"localhost:{_free_port()}"
    # Its store's key prefix: the same on every machine of a job; a fresh one per launch on one.
    run_id = "kasoku" if rdzv_endpoint else f"kasoku-{uuid.uuid4().hex[:12]}"
    fields = dict(min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc_per_node,
                  max_restarts=max_restarts, monitor_interval=0.1, rdzv_backend="static",
                  rdzv_endpoint=endpoint, rdzv_configs={"rank": node_rank}, run_id=run_id,
                  **options)
    if "shutdown_timeout" in LaunchConfig.__dataclass_fields__:  # not in older torch
        fields["shutdown_timeout"] = SHUTDOWN_TIMEOUT_S
    if "signals_to_handle" not in LaunchConfig.__dataclass_fields__:  # older torch: its four
        fields.pop("signals_to_handle", None)
    return LaunchConfig(**fields)


def numa_options(mode: str, launch_config_class):
    """PyTorch's ``NumaOptions`` for ``mode``; a ``ConfigError`` saying what is missing where
    this torch's launcher takes none (before 2.9) or this machine has no ``numactl``, which
    it binds through."""
    if "numa_options" not in launch_config_class.__dataclass_fields__:
        import torch  # deferred: with the launcher
        raise ConfigError(f"{flag('dist.numa_binding')} needs PyTorch's NUMA binding (torch "
                          f"2.9 or later; this is {torch.__version__})")
    if shutil.which("numactl") is None:
        raise ConfigError(f"{flag('dist.numa_binding')}: PyTorch binds the workers through "
                          f"numactl, which is not installed here (apt install numactl)")
    from torch.numa.binding import AffinityMode, NumaOptions
    return NumaOptions(affinity_mode=AffinityMode(mode))


def launch(argv: list[str], cfg: DistConfig, resume_command: str | None = None,
           out: Path | None = None, *, module: str) -> int:
    """Run ``python -m MODULE ARGV`` (a worker's entry module and its request's JSON) in
    ``cfg.workers`` processes on this machine (the job
    spanning ``cfg.nnodes`` machines), restarted up to ``cfg.max_restarts`` times. Returns the
    exit code: 0; the failed worker's (1 or 2); 128 + N after signal N.

    A failure is one line naming the worker that failed on its own (``failures.blame``), its
    error, and, where the run folder ``out`` holds a snapshot, ``resume_command``. SIGINT or
    SIGTERM (Ctrl-C) is passed on to the workers, which stop at the same iteration after a
    snapshot (``kasoku.train.signals``), and the resume command is printed; a second one stops
    them at once."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    # SIGINT and SIGTERM are kasoku's to pass on (_stop_passed_on), not the launcher's.
    config = launch_config(cfg.workers, nnodes=cfg.nnodes, node_rank=cfg.node_rank,
                           rdzv_endpoint=cfg.rdzv_endpoint, max_restarts=cfg.max_restarts,
                           numa_binding=cfg.numa_binding, signals_to_handle="SIGHUP,SIGQUIT")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # each worker sets its own thread count
    with tempfile.TemporaryDirectory(prefix="kasoku-job-") as folder, \
            environ_set(JOB_DIR_ENV, folder), _stop_passed_on() as stop:
        folder = Path(folder)
        try:
            with quiet_launcher():
                elastic_launch(config, sys.executable)("-m", module, *argv)
        except ChildFailedError as exc:
            if stop.received is not None:
                return _stopped(stop.received, folder, resume_command, out)
            rank, failure, why = blame(exc.failures, folder)
            tries = f" after {cfg.max_restarts} restart{'s' * (cfg.max_restarts != 1)}" \
                if cfg.max_restarts else ""
            print(f"kasoku: error: worker {rank} failed ({how(failure.exitcode)}){tries}, so "
                  f"the job stopped: {why}", file=sys.stderr, flush=True)
            code = failure.exitcode
            if code != 2:  # 2: the settings were refused, and would be again on resuming
                _say_resume(resume_command, out, restarts=cfg.max_restarts)
            return code if code in (1, 2) else 1
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # the rendezvous itself: a bad endpoint, a machine never came
            text = " ".join(str(exc).split()) or type(exc).__name__
            print(f"kasoku: error: the workers could not start: {type(exc).__name__}: "
                  f"{text[:300]}", file=sys.stderr, flush=True)
            return 1
        interrupted = read_notes(folder, "interrupted")
        if interrupted or stop.received is not None:
            return _stopped(stop.received, folder, resume_command, out)
    return 0


def _stopped(received: int | None, folder: Path, resume_command: str | None,
             out: Path | None) -> int:
    """The end of a launch a signal stopped: where the workers stopped, and how to go on."""
    interrupted = read_notes(folder, "interrupted")
    signum = received or next((n.get("signal") for n in interrupted.values()), None) \
        or signal.SIGINT
    if interrupted:
        first = interrupted[min(interrupted)]
        print(f"kasoku: stopped by {signal.Signals(signum).name}: every worker stopped at "
              f"iteration {first.get('iteration')}, snapshot {first.get('snapshot')}",
              file=sys.stderr, flush=True)
    else:
        print(f"kasoku: stopped by {signal.Signals(signum).name} before a snapshot of this "
              f"attempt was written", file=sys.stderr, flush=True)
    _say_resume(resume_command, out)
    return 128 + int(signum)


def _say_resume(command: str | None, out: Path | None, restarts: int | None = None) -> None:
    """The command that resumes the run when its folder holds a snapshot; with ``restarts``
    0, that ``--max-restarts`` would have restarted it."""
    if command is None or out is None:
        return
    # a file, or a sharded run's folder (its trainer state beside the shards)
    has_snapshot = bool(snapshots(out))
    hint = f" ({flag('dist.max_restarts')} 1 would have restarted the workers from it by itself)" \
        if restarts == 0 else ""
    if has_snapshot:
        print(f"to continue this run: {command}{hint}", file=sys.stderr, flush=True)
    else:
        print(f"no snapshot was written in {out}: the run starts again from the beginning "
              f"with the same command", file=sys.stderr, flush=True)


@contextlib.contextmanager
def environ_set(key: str, value: str):
    """``os.environ[key] = value`` while the block runs, as it was after."""
    before = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


class _Stop:
    received: int | None = None


@contextlib.contextmanager
def _stop_passed_on():
    """Around a launch, in the main thread: the first SIGINT/SIGTERM is passed on to the
    workers (the launcher starts each in a session of its own, so a terminal's Ctrl-C reaches
    this process alone), which stop together after a snapshot; the second stops the launch
    at once (the launcher's ``SignalException``: it stops the workers)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    stop = _Stop()

    def handle(signum, frame):
        if stop.received is not None:
            raise SignalException(f"stopped by signal {signum}", sigval=signal.Signals(signum))
        stop.received = signum
        for pid in _children():  # as SIGINT: the workers take SIGTERM as the launcher's stop
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGINT)

    with handled(handle):
        yield stop


def _children() -> list[int]:
    """The kasoku workers this process started, from /proc (Linux; elsewhere none, and a
    signal stops the launch as the launcher does)."""
    pids = []
    for task in Path("/proc/self/task").glob("*/children"):
        with contextlib.suppress(OSError):
            pids += [int(p) for p in task.read_text().split()]
    workers = []
    for pid in pids:  # not a short-lived helper the launcher or torch may start
        with contextlib.suppress(OSError):
            words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if any(w == b"kasoku" or w.startswith(b"kasoku.") for w in words):
                workers.append(pid)
    return workers


class WorkersFailed(RuntimeError):
    """A worker of a measurement launch failed or the workers could not start: the message is
    one line naming what was launched, the rank and its error."""


def run_module(module: str, request: str, world_size: int, log_dir: Path, keep_in: Path,
               what: str, tag: str, numa_binding: str | None = None) -> None:
    """``python -m MODULE REQUEST`` in ``world_size`` processes on this machine, through the
    elastic launcher (a fresh local rendezvous, no restart: a measurement retried after a
    failure measures nothing new). The workers' stderr goes to files in ``log_dir``, their
    stdout to the terminal; a failed worker's stderr is copied to ``keep_in`` and named in
    the ``WorkersFailed`` raised (as ``stderr-TAG-rankR.log``), whose message starts with
    ``what``."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    config = launch_config(world_size, numa_binding=numa_binding,
                           logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ERR))
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
    handlers and the variable are restored; a signal that stopped the launch becomes
    ``kasoku.core.interrupts.Stopped`` (exit code 128 + N)."""
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
    except SignalException as exc:  # said by the command line (kasoku.cli: one line)
        raise Stopped(int(exc.sigval)) from None
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



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]
