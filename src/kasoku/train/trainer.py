"""The Trainer: a loop of ``updater.update()`` then the extensions whose trigger fires.

Everything that is not forward/loss/backward/update (evaluation, logging, schedules,
snapshots, progress) is an extension: a callable ``ext(trainer)`` with optional ``trigger``,
``priority``, ``name``, ``initialize``, ``finalize``, ``on_error``, ``state_dict`` and
``load_state_dict`` (see docs/architecture.md).
"""
from __future__ import annotations

import sys
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kasoku.core.errors import KasokuWarning, warn_once
from kasoku.core.flags import flag
from kasoku.data.base import Loader
from kasoku.distributed import ddp, fsdp
from kasoku.distributed.ddp import unwrap
from kasoku.train.reporter import PRIORITY_READER, PRIORITY_WRITER, Reporter
from kasoku.train.run_dir import SNAPSHOT, prepare_out
from kasoku.train.signals import StopSignals
from kasoku.train.snapshot import (
    SnapshotError,
    capture_rng_state,
    load_snapshot,
    restore_rng_state,
    save_snapshot,
)
from kasoku.train.step import StandardStep, Step, Updater
from kasoku.train.triggers import IntervalTrigger, get_trigger

SNAPSHOT_FORMAT = 1


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped training after a snapshot was written. ``exit_code`` is what a
    shell reports for the signal (130 SIGINT, 143 SIGTERM); ``snapshot`` resumes the run."""

    def __init__(self, signum: int, iteration: int, snapshot: Path):
        self.signum, self.iteration, self.snapshot = signum, iteration, snapshot
        self.exit_code = 128 + int(signum)
        super().__init__(f"interrupted at iteration {iteration}; resume with: "
                         f"{flag('train.resume')} {snapshot}")


@dataclass
class _Entry:
    extension: Callable
    trigger: Callable
    priority: int
    name: str


class _SchedulerStep:
    """Steps a torch LR scheduler once per iteration and reports the ``lr`` the step used (the
    scheduler's state lives in the snapshot's ``scheduler`` entry)."""
    priority = PRIORITY_WRITER

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def __call__(self, trainer) -> None:
        lr = trainer.optimizer.param_groups[0]["lr"]
        # A tensor lr (under a CUDA graph) is updated in place: report a copy.
        trainer.reporter.report({"lr": lr.detach().clone() if torch.is_tensor(lr) else lr})
        self.scheduler.step()


class Trainer:
    """Chainer-style training loop; see the module docstring and docs/architecture.md.

    ``stop_trigger`` ends the run when it fires (``(20, "epoch")``: after 20 epochs).
    ``scheduler``: an optional torch LR scheduler, stepped every iteration. ``step_fn``:
    ``step(model, batch, optimizer) -> observations`` (default ``StandardStep``); it can be
    replaced later through ``trainer.step_fn`` by transforms (precision, graphs).
    ``run_info``: what identifies the run (``{"workload": ..., "batch_size": ...}``), kept in
    snapshots; a resume from a snapshot whose values differ is refused, naming both. ``out``
    holding another run's files (``kasoku.train.run_dir.RUN_FILES``) is refused when the run
    starts fresh, unless ``overwrite``: a second run never writes over a first one's log.
    ``phase_timing``: time every step's phases (``kasoku.core.phases``; LogReport logs
    them as ``time/...``). ``writer``: whether this process owns ``out`` (False in the workers
    of a data-parallel run other than worker 0, which neither check nor clear it).
    ``handle_signals``: SIGINT/SIGTERM finish the step and write a snapshot
    (``kasoku.train.signals``; in a data-parallel run every worker stops at the same iteration,
    whichever got the signal).

    The model may be wrapped (``DistributedDataParallel``): snapshots hold the module inside
    (``module``), so they load in runs with any number of workers.
    """

    def __init__(self, model, optimizer, train_loader: Loader, loss_fn, metric_fn=None,
                 device="cpu", stop_trigger=(20, "epoch"), out="result", scheduler=None,
                 step_fn: Step | None = None, run_info: dict | None = None, overwrite: bool = False,
                 phase_timing: bool = True, writer: bool = True, handle_signals: bool = True):
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.optimizer, self.train_loader = optimizer, train_loader
        self.loss_fn, self.metric_fn, self.scheduler = loss_fn, metric_fn, scheduler
        self.stop_trigger = get_trigger(stop_trigger)
        self.out = Path(out)
        self.overwrite, self.writer, self.handle_signals = overwrite, writer, handle_signals
        self.run_info = dict(run_info or {})
        self.setup: dict = {}
        """How the run was set up on this machine (``cpu_threads``: the cores of the step and
        of the loader's workers, ``kasoku.accel.loader_cores``): said when it starts; unlike
        ``run_info``, neither kept in snapshots nor compared on resume."""
        self.last_snapshot_iteration: int | None = None
        """The iteration of the latest snapshot written (or resumed from), None before one."""
        self.stopping = False
        """Whether the iteration whose extensions are running is the run's last."""
        self._loaded_from: Path | None = None  # the snapshot file of the state loaded
        self._ran = False
        self.reporter = Reporter()
        self.updater = Updater(train_loader, self.model, optimizer,
                               step_fn or StandardStep(loss_fn, metric_fn), self.device,
                               self.reporter, phase_timing=phase_timing)
        self._entries: dict[str, _Entry] = {}
        if scheduler is not None:
            self.extend(_SchedulerStep(scheduler), trigger=(1, "iteration"), name="scheduler")

    @property
    def module(self) -> torch.nn.Module:
        """The model without its data-parallel wrapper (``model`` when it has none)."""
        return unwrap(self.model)

    step_fn = property(lambda self: self.updater.step_fn,
                       lambda self, fn: setattr(self.updater, "step_fn", fn))
    observation = property(lambda self: self.reporter.observation)

    def extend(self, extension, trigger=None, priority=None, name=None) -> None:
        """Register ``extension``. ``None`` arguments take the extension's own ``trigger``
        (else every iteration), ``priority`` (else PRIORITY_READER) and ``name`` (else its class
        or function name; a repeated name gets a ``_1``, ``_2`` suffix)."""
        trigger = getattr(extension, "trigger", (1, "iteration")) if trigger is None else trigger
        priority = getattr(extension, "priority", PRIORITY_READER) if priority is None \
            else priority
        base = name or getattr(extension, "name", None) or getattr(extension, "__name__", None) \
            or type(extension).__name__
        name, k = base, 0
        while name in self._entries:
            k += 1
            name = f"{base}_{k}"
        self._entries[name] = _Entry(extension, get_trigger(trigger), priority, name)

    def get_extension(self, name: str):
        if name not in self._entries:
            raise ValueError(f"no extension named {name!r}; registered: {list(self._entries)}")
        return self._entries[name].extension

    @property
    def extensions(self) -> list[_Entry]:
        """Registered extensions in the order they run (priority, then registration)."""
        return sorted(self._entries.values(), key=lambda e: -e.priority)

    def run(self, resume=None) -> None:
        """Train until the stop trigger fires; ``resume``: a snapshot path to continue from.

        SIGINT/SIGTERM finish the current step, write a snapshot, finalize the extensions and
        raise ``TrainingInterrupted``. Any other exception runs every extension's
        ``on_error(trainer, exc)``, then finalize, then is re-raised unchanged. On the last
        iteration ``stopping`` is True and the extensions with ``at_end = True`` run whatever
        their trigger (the divergence check, a last snapshot; the log writes its last partial
        interval then).

        ``out`` must not hold another run's files, unless ``overwrite``: files of the run this
        trainer continues (a snapshot in ``out``) or already ran are its own.
        """
        if resume is not None:
            self.load_state_dict(load_snapshot(resume, map_location="cpu"), source=resume)
            self.resumed_from(resume)
        own = self._ran or (self._loaded_from is not None
                            and self._loaded_from.parent.resolve() == self.out.resolve())
        if not own and self.writer:
            prepare_out(self.out, overwrite=self.overwrite,
                        advice="continue it with run(resume=SNAPSHOT), give another out, or "
                               "pass overwrite=True to replace it")
        self._ran = True
        if self.writer:
            self.out.mkdir(parents=True, exist_ok=True)
        entries = self.extensions
        with StopSignals(active=self.handle_signals, agree=ddp.active(),
                         quiet=not self.writer) as signals:
            self._run_guarded(entries, signals)

    def resumed_from(self, snapshot) -> None:
        """Record and say that the state just loaded (``load_state_dict``) came from
        ``snapshot``: ``resumed from PATH at epoch E, iteration I`` on stderr."""
        u = self.updater
        self.last_snapshot_iteration = u.iteration
        print(f"resumed from {snapshot} at epoch {u.epoch_detail:.4g}, iteration "
              f"{u.iteration}", file=sys.stderr, flush=True)

    def _run_guarded(self, entries: list[_Entry], signals: StopSignals) -> None:
        initialized, failed = [], True
        try:
            for entry in entries:
                _call_optional(entry.extension, "initialize", self)
                initialized.append(entry)
            self.updater.start_clock()
            self._loop(entries, signals)
            failed = False
        except TrainingInterrupted:
            raise
        except BaseException as exc:
            for entry in entries:
                _call_quietly(entry, "on_error", self, exc)
            raise
        finally:
            self.updater.stop_clock()
            _finalize(initialized, self, quiet=failed)

    def _loop(self, entries: list[_Entry], signals: StopSignals) -> None:
        if getattr(self.stop_trigger, "reached", lambda t: False)(self):
            u, stop = self.updater, self.stop_trigger
            where = f"{stop.period:g} {stop.unit}s" if isinstance(stop, IntervalTrigger) \
                else "its stop"
            warn_once(f"the run is already at epoch {u.epoch_detail:.4g} (iteration "
                      f"{u.iteration}), at or past {where}: nothing to train; ask for more "
                      f"epochs to train on")
            return
        updater, stop = self.updater, self.stop_trigger
        while True:
            updater.update()
            # Whether this iteration is the last one, known before the extensions run (the
            # stop trigger is a pure function of the counters): those marked ``at_end`` (the
            # divergence check, the last snapshot) run then, whatever their trigger, so a run
            # that stops between them ends checked and saved.
            self.stopping = last = stop(self)
            for entry in entries:
                if entry.trigger(self) or (last and getattr(entry.extension, "at_end", False)):
                    entry.extension(self)
            if last:
                return
            due = signals.due()
            if due is not None:
                self._interrupt(due)

    def _interrupt(self, signum: int) -> None:
        writer = next((e.extension for e in self.extensions
                       if hasattr(e.extension, "write_snapshot")), None)
        path = writer.write_snapshot(self) if writer is not None else \
            save_snapshot(self.state_dict(), self.out / SNAPSHOT)
        self.last_snapshot_iteration = self.updater.iteration
        raise TrainingInterrupted(signum, self.updater.iteration, path)

    def state_dict(self) -> dict:
        """Everything exact resume needs; weights_only-safe (see ``kasoku.train.snapshot``)."""
        # A sharded model's state is its shards, named (fsdp.state), for a sharded snapshot.
        sharded = fsdp.state(self.model, self.optimizer) if fsdp.is_sharded(self.model) \
            else {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}
        return {"format": SNAPSHOT_FORMAT,
                "run": dict(self.run_info),
                **sharded,
                "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
                "loader": self.train_loader.state_dict(),
                "updater": self.updater.state_dict(),
                "rng": capture_rng_state(),
                "rng_by_worker": _rng_by_worker(),
                "extensions": {name: e.extension.state_dict() for name, e in self._entries.items()
                               if hasattr(e.extension, "state_dict")}}

    def load_state_dict(self, state: dict, source="the snapshot") -> None:
        """Continue from ``state``. A state of another run -- another workload or batch size
        (``run_info``), another model shape, another data layout -- raises ``SnapshotError``
        naming what differs; the run is then not started."""
        if state.get("format") != SNAPSHOT_FORMAT:
            raise SnapshotError(f"{source}: snapshot format {state.get('format')!r} is not "
                                f"{SNAPSHOT_FORMAT}: it was written by another kasoku version "
                                f"or another program")
        saved_run = state.get("run") or {}
        differ = [f"{k} {saved_run[k]!r} there, {v!r} here" for k, v in self.run_info.items()
                  if k in saved_run and saved_run[k] != v]
        if differ:
            raise SnapshotError(f"{source} belongs to another run ({'; '.join(differ)}); "
                                f"resume with that run's settings, or start a new run "
                                f"without {flag('train.resume')}")
        _load_model(self, state, source)
        try:
            self.train_loader.load_state_dict(state["loader"])
        except (RuntimeError, ValueError, KeyError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise SnapshotError(f"{source} does not fit this run ({first})") from None
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.updater.load_state_dict(state["updater"])
        self._loaded_from = Path(source) if isinstance(source, (str, Path)) \
            and Path(source).exists() else None
        restore_rng_state(_my_rng(state))
        saved = state.get("extensions", {})
        for name, entry in self._entries.items():
            if name in saved and hasattr(entry.extension, "load_state_dict"):
                entry.extension.load_state_dict(saved[name])
        unknown = sorted(set(saved) - set(self._entries))
        if unknown:
            warnings.warn(f"snapshot holds state of extensions not registered now: {unknown}; "
                          f"it is ignored", KasokuWarning, stacklevel=2)


def _load_model(trainer: Trainer, state: dict, source) -> None:
    """The model's and the optimizer's state from ``state``, or from the sharded snapshot's
    folder it names (into any number of workers); ``SnapshotError`` where they do not fit."""
    if "sharded" not in state and fsdp.is_sharded(trainer.model):
        raise SnapshotError(f"{source} was written without {flag('dist.shard')}, and this run "
                            f"shards its model; resume it without {flag('dist.shard')}")
    try:
        if "sharded" in state:
            fsdp.load_sharded(trainer.model, trainer.optimizer, state["sharded"])
            return
        _check_shapes(trainer.module.state_dict(), state["model"], source)
        trainer.module.load_state_dict(state["model"])
        trainer.optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        if isinstance(exc, SnapshotError):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SnapshotError(f"{source} does not fit this run ({first})") from None


def _rng_by_worker() -> list | None:
    """Every worker's RNG states, in rank order, in a data-parallel run (None alone): a
    collective, so every worker takes the snapshot's state at the same iteration."""
    return ddp.gather_objects(capture_rng_state()) if ddp.active() else None


def _my_rng(state: dict) -> dict:
    """This worker's RNG states from a snapshot: its own when the snapshot has one per worker
    of this run's number of workers, else worker 0's."""
    by_worker = state.get("rng_by_worker")
    if by_worker and ddp.active():
        import torch.distributed as dist
        if len(by_worker) == dist.get_world_size():
            return by_worker[dist.get_rank()]
    return state["rng"]


def _check_shapes(mine: dict, saved: dict, source) -> None:
    """``SnapshotError`` naming the first weights whose names or shapes differ."""
    missing = [k for k in mine if k not in saved]
    extra = [k for k in saved if k not in mine]
    if missing or extra:
        what = f"its model lacks {missing[:3]}" if missing else f"its model has {extra[:3]} more"
        raise SnapshotError(f"{source} holds another model ({what}); resume with the workload and "
                            "model that wrote it, or start a new run without "
                            f"{flag('train.resume')}")
    for key, value in mine.items():
        other = saved[key]
        if hasattr(value, "shape") and hasattr(other, "shape") and value.shape != other.shape:
            raise SnapshotError(f"{source} holds another model shape ({key}: "
                                f"{tuple(other.shape)} there, {tuple(value.shape)} here); "
                                f"resume with the settings that wrote it, or start a new run")


def _call_optional(extension, method: str, *args) -> None:
    fn = getattr(extension, method, None)
    if fn is not None:
        fn(*args)


def _finalize(entries: list[_Entry], trainer, quiet: bool) -> None:
    """Finalize every extension even if one fails; after a clean run the first failure is
    raised, on a failure path it is only printed (the original exception wins)."""
    first = None
    for entry in entries:
        try:
            _call_optional(entry.extension, "finalize", trainer)
        except Exception as exc:
            if quiet:
                _print_failure(entry, "finalize")
            first = first or exc
    if first is not None and not quiet:
        raise first


def _print_failure(entry: _Entry, method: str) -> None:
    print(f"kasoku: {entry.name}.{method} failed:\n{traceback.format_exc()}",
          file=sys.stderr, flush=True)


def _call_quietly(entry: _Entry, method: str, *args) -> None:
    """Call a failure-path hook; its own failure is printed, never allowed to mask the
    exception being handled."""
    try:
        _call_optional(entry.extension, method, *args)
    except Exception:
        _print_failure(entry, method)
