"""BadFileLog: every bad input file the run's loaders skip, with its reason, in
``out/bad_files.jsonl``."""
from __future__ import annotations

import sys

from kasoku.data.bad_files import BAD_FILES, BadFileWriter
from kasoku.train.extensions.evaluator import Evaluator
from kasoku.train.reporter import PRIORITY_READER


class BadFileLog:
    """Appends each bad file the training loader and the evaluators' loaders skipped
    (``loader.bad_file_list``, ``kasoku.data.bad_files``) to ``out/bad_files.jsonl``, one JSON
    line per file, once per run folder (a file met again in a later epoch, or in a run resumed
    there, is not listed again)::

        {"path": "/data/n01/x.jpg", "reason": "truncated", "split": "train", "epoch": 3,
         "iteration": 1207}

    ``split``: ``train`` or the evaluator's name (``validation``); ``epoch`` and ``iteration``:
    the trainer's counters when it was found (epochs done, iterations done; batches are made
    ahead, so a file may belong to a batch a few iterations later).

    Lines are appended after every iteration, on an error and at the end, each flushed: a crash
    or Ctrl-C loses none found before it. The first warning about a bad file names the list (it
    sets the loaders' ``listed_in``); the end of the run prints the count and the file, on
    stderr, when there were any. The workers of a data-parallel run may each have one: they
    append to the same file, under a lock, and only after their first step (by then worker 0
    has prepared the folder); only the writer (worker 0) prints.
    """
    trigger = (1, "iteration")
    priority = PRIORITY_READER - 20  # its last line after the progress bar's
    name = "BadFileLog"

    def __init__(self):
        self._writer: BadFileWriter | None = None
        self._lists: list = []  # [split, BadFileList, records written so far]

    def initialize(self, trainer) -> None:
        self._writer = BadFileWriter(trainer.out / BAD_FILES)
        loaders = [("train", trainer.train_loader)]
        loaders += [(e.extension.prefix.strip("/") or e.name, e.extension.loader)
                    for e in trainer.extensions if isinstance(e.extension, Evaluator)]
        self._lists = []
        for split, loader in loaders:
            bad = getattr(loader, "bad_file_list", None)
            if bad is not None:
                bad.listed_in = str(self._writer.path)
                self._lists.append([split, bad, 0])

    def __call__(self, trainer) -> None:
        for entry in self._lists:
            if len(entry[1]) > entry[2]:
                self._write(trainer)
                return

    def _write(self, trainer) -> None:
        if not trainer.writer and trainer.updater.iteration == 0:
            return  # worker 0 may not have prepared the folder yet: after the first step
        u, lines = trainer.updater, []
        for entry in self._lists:
            split, bad, done = entry
            new = bad.since(done)
            entry[2] = done + len(new)
            lines += [{"path": r.path, "reason": r.reason, "split": split, "epoch": u.epoch,
                       "iteration": u.iteration} for r in new]
        if lines:
            self._writer.append(lines)

    def on_error(self, trainer, exc: BaseException) -> None:
        if self._writer is not None:
            self._write(trainer)

    def finalize(self, trainer) -> None:
        if self._writer is None:
            return
        self._write(trainer)
        count = self._writer.count()
        if count and trainer.writer:
            noun = "bad file" if count == 1 else "bad files"
            print(f"{count} {noun} skipped, each listed with its reason in "
                  f"{self._writer.path}", file=sys.stderr, flush=True)
        for _, bad, _ in self._lists:
            bad.listed_in = None  # the loaders may serve another run
