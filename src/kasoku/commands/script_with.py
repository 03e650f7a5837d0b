"""``kasoku run [--with LEVER ...] -- python train.py ARGS``: a user's script run whole, to its
end, with levers kasoku sets from outside it (``kasoku.commands.script_levers``: the ones
``kasoku profile --with`` measures), its output and exit code its own, and one closing line:
how many training steps it ran, how long, with which levers.

The levers are set as the profile sets them, through the same step watch
(``kasoku.commands.script_watch``), whose window never opens here: the process-wide levers
around the run, the DataLoader's as the script makes them; the watch counts the steps. A
lever that is a measure rather than a way to train (``replay``: the first batches again and
again) is refused. What a lever changes in what the script computes is said before it runs.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from kasoku.commands import script_levers, script_watch
from kasoku.commands.profile_config import ProfileConfig
from kasoku.commands.script_levers import ScriptLevers, numerics, with_text
from kasoku.commands.script_profile import say, script_root
from kasoku.commands.script_run import ScriptCommand, run_script
from kasoku.commands.script_watch import StepWatch
from kasoku.core.errors import ConfigError

NEVER = 2 ** 62
"""The step the watch's timing and window would start at: never."""


def run_with(command: ScriptCommand, given: list[str] | None) -> int:
    """Run ``command`` to its end with the ``given`` levers (``--with`` values); returns the
    script's exit code."""
    levers = ScriptLevers.parse(given)
    if levers.replay:
        replay = with_text("replay")
        raise ConfigError(f"{replay} trains on the DataLoader's first batches again and again: "
                          f"a measure of the step without its wait for data (kasoku profile "
                          f"{replay}), no way to train")
    for value in levers.given:
        if numerics(value):
            say(f"{with_text(value)} changes what the script computes: {numerics(value)}")
    cfg = ProfileConfig(skip=NEVER, measure_steps=1, warmup=0, steps=1)
    with tempfile.TemporaryDirectory(prefix="kasoku-run-") as unused:
        watch = StepWatch(cfg, Path(unused), levers, roots=(script_root(command),))
        start = time.perf_counter()
        with levers.applied():
            watch.install()
            try:
                end = run_script(command, hidden=(__file__, script_watch.__file__,
                                                  script_levers.__file__))
            finally:
                watch.uninstall()
        elapsed = time.perf_counter() - start
    say(closing_line(command, levers.given, watch.steps, elapsed, end))
    return end.code


def closing_line(command: ScriptCommand, given: list[str], steps: int, elapsed_s: float,
                 end) -> str:
    """``train.py ran to its end with --with bf16: 1,200 steps in 61.2 s (19.6 steps/s)``,
    or how it ended otherwise."""
    how = ("was interrupted" if end.interrupted else "failed" if end.raised
           else f"ended with exit code {end.code}" if end.code else "ran to its end")
    with_ = " ".join(with_text(v) for v in given) if given else "no lever (as given)"
    rate = f" ({steps / elapsed_s:,.1f} steps/s)" if steps and elapsed_s > 0 else ""
    return (f"{command.name} {how} with {with_}: {steps:,} training step"
            f"{'' if steps == 1 else 's'} in {elapsed_s:,.1f} s{rate}")
