"""LogReport: the averaged observations of each interval, kept in ``log`` and appended as one
JSON line per interval to ``out/log.jsonl``."""
from __future__ import annotations

import json
import os

from kasoku.train.reporter import PRIORITY_LOG, DictSummary
from kasoku.train.snapshot import fsync_dir
from kasoku.train.triggers import get_trigger


class LogReport:
    """Accumulates every iteration's observation (lazily, see ``DictSummary``) and, when
    ``trigger`` fires, appends the means plus ``epoch``, ``iteration`` and ``elapsed_time`` to
    ``log`` and as one flushed line to ``out/filename``; with a train loader that counts the
    bad files it skipped (``loader.skipped``), also ``data/skipped``, that count so far.

    With ``unit`` (a workload's ``sample_unit``: ``tokens``, ``images``), each entry also counts
    what the run has trained on so far under that name: the samples the steps took, times
    ``units_per_sample`` (a language model's block of tokens), times the data-parallel
    workers (each takes as many).

    Each entry also has ``epoch_detail`` (the progress as a float, what charts plot against).
    When the stop trigger ends the run between two log lines, the last iteration writes the
    last, partial interval as one more line, marked ``"final": true``, whose ``epoch`` is where
    the run stopped (1.5); it is shown and plotted (``entries``) but kept out of the state, so
    a run resumed from the last snapshot goes on with the interval as it was.

    It is called every iteration (class ``trigger``); its own ``trigger`` argument is the log
    interval, exposed as ``log_trigger``. ``keys``: the observation keys to log (None: all).
    Unless ``keys`` is given, each line also has the step's phases timed since the previous
    line (``time/step``, ``time/data``, ``time/forward``... in ms, ``time/data%``... in % of
    the step; ``kasoku.core.phases``).
    ``log`` and the running sums are in its state, so a resumed run continues the same log;
    ``initialize`` rewrites the file from ``log``, dropping lines written after the snapshot.
    When the run fails, the file is cut back to the latest snapshot's moment too, so the log
    and the snapshot left in the folder agree; the lines logged after it are moved to
    ``log.failed.jsonl`` (``failed_filename``), not lost.
    """
    failed_filename = "log.failed.jsonl"
    trigger = (1, "iteration")
    priority = PRIORITY_LOG
    name = "LogReport"

    def __init__(self, keys=None, trigger=(1, "epoch"), filename: str | None = "log.jsonl",
                 unit: str | None = None, units_per_sample: int = 1):
        self.keys = None if keys is None else list(keys)
        self.unit, self.units_per_sample = unit, units_per_sample
        self.log_trigger = get_trigger(trigger)
        self.filename = filename
        self.log: list[dict] = []
        self.final: dict | None = None
        self._summary = DictSummary()
        self._file = None

    @property
    def entries(self) -> list[dict]:
        """``log``, and the final partial interval's line once the run has ended."""
        return self.log + ([self.final] if self.final is not None else [])

    def initialize(self, trainer) -> None:
        self.final = None  # a final line of an earlier run() is not part of the log
        if self.filename is None:
            return
        path = trainer.out / self.filename
        _rewrite(path, self.log)
        self._file = open(path, "a")

    def __call__(self, trainer) -> None:
        obs = trainer.updater.observation
        self._summary.add(obs if self.keys is None else
                          {k: obs[k] for k in self.keys if k in obs})
        if self.log_trigger(trainer):
            self._write(trainer)
        elif getattr(trainer, "stopping", False):
            self._write_final(trainer)

    def _write(self, trainer) -> None:
        self.log.append(self._entry(trainer, self._summary))
        self._summary.reset()
        if self._file is not None:
            self._file.write(_line(self.log[-1]))
            self._file.flush()

    def _entry(self, trainer, summary: DictSummary) -> dict:
        u = trainer.updater
        entry = summary.compute_mean()
        phases = getattr(u, "phases", None)
        if self.keys is None and phases is not None:
            # The phases of the steps timed since the last line (after compute_mean's sync:
            # on a GPU, their events have completed).
            entry.update(phases.take())
        entry.update(epoch=u.epoch, epoch_detail=u.epoch_detail, iteration=u.iteration,
                     elapsed_time=u.elapsed_time)
        samples = getattr(u, "samples", None)
        if self.unit is not None and samples is not None:
            entry[self.unit] = samples * self.units_per_sample * _world_size()
        skipped = getattr(trainer.train_loader, "skipped", None)
        if skipped is not None:
            entry["data/skipped"] = int(skipped)
        return entry

    def on_error(self, trainer, exc: BaseException) -> None:
        at = trainer.last_snapshot_iteration
        if self._file is None or at is None:
            return  # no snapshot to agree with: the log stays whole
        after = [e for e in self.log if e["iteration"] > at]
        if not after:
            return
        self._file.close()
        self._file = None
        with open(trainer.out / self.failed_filename, "a") as f:
            f.writelines(_line(entry) for entry in after)
        self.log = [e for e in self.log if e["iteration"] <= at]
        _rewrite(trainer.out / self.filename, self.log)

    def _write_final(self, trainer) -> None:
        # The means of a copy: the summary itself stays as a resume from this moment needs it.
        partial = DictSummary()
        partial.load_state_dict(self._summary.state_dict())
        self.final = {**self._entry(trainer, partial), "final": True}
        # Its epoch is where the run stopped (1.5), not the epochs completed (1).
        self.final["epoch"] = round(self.final["epoch_detail"], 6)
        if self._file is not None:
            self._file.write(_line(self.final))
            self._file.flush()

    def finalize(self, trainer) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def state_dict(self) -> dict:
        return {"log": [dict(e) for e in self.log], "summary": self._summary.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.log = [dict(e) for e in state["log"]]
        self._summary.load_state_dict(state["summary"])
        self.final = None


def _line(entry: dict) -> str:
    return json.dumps(entry) + "\n"


def _rewrite(path, entries: list[dict]) -> None:
    """Replace ``path`` by ``entries``, atomically (a crash leaves the old file or the new)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.writelines(_line(entry) for entry in entries)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _world_size() -> int:
    """The data-parallel workers (1 outside a process group)."""
    import torch.distributed as dist  # deferred: loaded already wherever a trainer runs
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
