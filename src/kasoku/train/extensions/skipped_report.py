"""SkippedReport: one line on stderr at the end of an epoch that skipped new bad files."""
from __future__ import annotations

import sys

from kasoku.core.flags import flag


class SkippedReport:
    """At each epoch's end, when the train loader's count of skipped bad files
    (``loader.skipped``, see ``ImageFolder`` without ``strict``) grew during the epoch, prints

        epoch 3: 2 bad files skipped so far (first: /data/x.jpg), listed in
        runs/r/bad_files.jsonl; --strict-data makes the first one an error

    (one line) to stderr; ``listed in`` where ``BadFileLog`` writes the list (the loader's
    ``bad_file_list.listed_in``). Loaders without the count are ignored. Nothing is kept in the
    snapshot: after a resume the loader counts from zero again, and so does this.
    """
    trigger = (1, "epoch")
    name = "SkippedReport"

    def __init__(self):
        self._reported = 0

    def __call__(self, trainer) -> None:
        loader = trainer.train_loader
        count = getattr(loader, "skipped", None)
        if count is None or count <= self._reported:
            return
        self._reported = count
        files = getattr(loader, "skipped_files", None)
        first = f" (first: {files[0]})" if files else ""
        listed_in = getattr(getattr(loader, "bad_file_list", None), "listed_in", None)
        listed = f", listed in {listed_in}" if listed_in else ""
        noun = "bad file" if count == 1 else "bad files"
        print(f"epoch {trainer.updater.epoch}: {count} {noun} skipped so far{first}{listed}; "
              f"{flag('data.strict')} makes the first one an error", file=sys.stderr, flush=True)
