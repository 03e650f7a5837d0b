"""What an interrupted ``kasoku bench`` says and leaves (``sweep.run_sweep``): the runs it
finished are kept (their lines in ``results.jsonl``, their table and chart); the rungs and
batch sizes it did not reach are named, with the commands that measure them into the same
folder and the one that then shows the whole ladder (bench has no resume of its own: its
lines are appended, and ``--report`` draws the latest run of each rung and batch size). The
sweep removes a folder it created and left empty (``kasoku.train.run_dir.remove_empty``).
"""
from __future__ import annotations

import signal
from pathlib import Path

from kasoku.commands.bench.rung_spec import LADDER_LABELS
from kasoku.core.flags import flag, without

_DROPPED = (flag("bench.config"), flag("train.batch_size"), flag("train.out"))
_SWITCHES = (flag("bench.ladder"), flag("bench.full"), flag("bench.report"))


def missing_runs(rungs, batch_sizes, records: list[dict]) -> list[tuple[str, tuple[int, ...]]]:
    """``(rung label, batch sizes)`` of every rung of the sweep with a run not in
    ``records``, in the sweep's order (rungs this machine skips are never measured: not
    missing)."""
    done = {(r["rung"], r["batch_size"]) for r in records}
    missing = []
    for rung in rungs:
        sizes = tuple(bs for bs in batch_sizes if (rung.label, bs) not in done)
        if sizes and not rung.skip:
            missing.append((rung.label, sizes))
    return missing


def interrupted_lines(signum: int, done: int, total: int,
                      missing: list[tuple[str, tuple[int, ...]]], argv: list[str], out: Path,
                      removed: bool = False) -> list[str]:
    """The lines an interrupted sweep prints: the signal and how many runs finished, then
    (some finished) the runs not measured and the commands that measure them into ``out``
    (``argv``: the sweep's command words after ``kasoku``), and the one that shows the whole
    ladder; or (none finished) that nothing was measured, ``removed`` saying the empty folder
    ``out`` was removed."""
    name = signal.Signals(signum).name
    if not done:
        return [f"interrupted ({name}) before the first run finished: nothing was measured"
                + (f"; removed the empty folder {out}" if removed else "")]
    lines = [f"interrupted ({name}) after {done} of {total} runs: the table and chart show "
             f"those"]
    if not missing:
        return lines
    lines.append("not measured: " + "; ".join(f"{label} at bs {_sizes(sizes)}"
                                             for label, sizes in missing))
    base = ["kasoku", *_without(argv), flag("train.out"), str(out)]
    if any(label not in LADDER_LABELS for label, _ in missing):
        # a rung no --config can name (+loader): the whole command again, appended
        lines.append("to measure them, run the command again (its lines are appended to "
                     f"results.jsonl): {' '.join(['kasoku', *argv])}")
    else:
        lines.append("to measure them into the same folder (plain is measured again beside "
                     "them, as the speed-ups are over it):")
        for sizes in dict.fromkeys(sizes for _, sizes in missing):
            configs = [w for label, s in missing if s == sizes
                       for w in (flag("bench.config"), label)]
            lines.append("  " + " ".join([*base, *configs, flag("train.batch_size"),
                                          ",".join(map(str, sizes))]))
    lines.append(f"then the whole ladder: {' '.join([*base, flag('bench.report')])}")
    return lines


def _sizes(sizes: tuple[int, ...]) -> str:
    return ", ".join(map(str, sizes))


def _without(argv: list[str]) -> list[str]:
    """``argv`` less what the finishing commands set themselves: the rungs, the batch sizes,
    the folder and the ladder's switches (``--flag V`` and ``--flag=V`` alike)."""
    return without(argv, {**dict.fromkeys(_DROPPED, 1), **dict.fromkeys(_SWITCHES, 0)})
