"""``kasoku run [--with LEVER ...] -- python train.py ARGS``: a user's script run whole, to its
end, with levers kasoku sets from outside it (``kasoku.commands.script_levers``: the ones
``kasoku profile --with`` measures), its output and exit code its own, and one closing line:
how many training steps it ran, how long, with which levers.

``kasoku run --auto -- ...`` chooses them (``kasoku.commands.script_auto``) and runs the
script whole with them here.

The levers are set as the profile sets them, through the same step watch
(``kasoku.commands.script_watch``), whose window never opens here: the process-wide levers
around the run, the DataLoader's as the script makes them, the allocator by executing this
process again with it in ``LD_PRELOAD`` (``kasoku.commands.script_preload``); the watch counts
the steps. A lever that is a measure rather than a way to train (``replay``: the first batches
again and again) is refused. What a lever changes in what the script computes is said before
it runs.

Under torchrun (``kasoku run --with LEVER -- torchrun [TORCHRUN OPTIONS] train.py ARGS``,
``run_launched``) kasoku runs inside each worker as ``kasoku profile`` does there
(``kasoku.commands.script_launch``): the levers are set in every worker, the output and exit
code are torchrun's, worker 0 counts the steps and the launching process says the closing
line.
"""
from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kasoku.commands import script_apply, script_levers, script_watch
from kasoku.commands.profile_config import ProfileConfig
from kasoku.commands.script_launch import Launched, run_in_session
from kasoku.commands.script_levers import ScriptLevers, numerics, with_text
from kasoku.commands.script_preload import preload
from kasoku.commands.script_profile import say, script_root
from kasoku.commands.script_run import ScriptCommand, run_script
from kasoku.commands.script_watch import StepWatch
from kasoku.core.errors import ConfigError
from kasoku.core.flags import SCRIPT_COMMAND, with_args
from kasoku.distributed.launch import under_launcher
from kasoku.distributed.world import World

NEVER = 2 ** 62
"""The step the watch's timing and window would start at: never."""
RUN_COUNT = "KASOKU_RUN_COUNT"
"""Set for the workers of ``run_launched``: the file where worker 0 writes its ``Count`` for
the launching process's closing line; no worker says a line of kasoku's own."""


@dataclass
class Count:
    """What a run counted: its training steps, its seconds, how the script ended
    (``closing_line``'s words), its exit code, the lines of the levers that did not apply."""
    steps: int
    elapsed_s: float
    how: str
    code: int
    unapplied: list[str] = field(default_factory=list)


def run_with(command: ScriptCommand | Launched, given: list[str] | None,
             argv: list[str] | None = None) -> int:
    """Run ``command`` to its end with the ``given`` levers (``--with`` values); returns the
    script's exit code, under torchrun torchrun's (``run_launched``). Where the allocator is
    asked for and not preloaded, this process is first replaced by ``argv`` (default: its own
    command line) started with it (``script_preload.preload``)."""
    levers = ScriptLevers.parse(given)
    if levers.replay:
        replay = with_text("replay")
        raise ConfigError(f"{replay} trains on the DataLoader's first batches again and again: "
                          f"a measure of the step without its wait for data (kasoku profile "
                          f"{replay}), no way to train")
    preload(levers.allocator, argv)
    rank = World.from_env().rank if under_launcher() else 0
    counted = os.environ.get(RUN_COUNT)  # a worker of run_launched: the launcher speaks
    speak = say if rank == 0 and not counted else (lambda line: None)
    for value in levers.given:
        if numerics(value):
            speak(f"{with_text(value)} changes what the script computes: {numerics(value)}")
    if isinstance(command, Launched):
        return run_launched(command, levers)
    count = run_counted(command, levers, Path(counted) if counted and rank == 0 else None)
    for line in count.unapplied:  # a lever that could not apply: the run without it
        speak(line)
    speak(closing_line(command.name, levers.given, count))
    return count.code


def run_counted(command: ScriptCommand, levers: ScriptLevers, path: Path | None) -> Count:
    """Run ``command`` to its end with ``levers`` through the step watch; returns its
    ``Count``, also written to ``path`` where given (worker 0 of ``run_launched``), and there
    too when torchrun stops the worker (SIGTERM: another worker failed), just before the
    signal's own end."""
    cfg = ProfileConfig(skip=NEVER, measure_steps=1, warmup=0, steps=1)
    with tempfile.TemporaryDirectory(prefix="kasoku-run-") as unused:
        watch = StepWatch(cfg, Path(unused), levers, roots=(script_root(command),))
        start = time.perf_counter()

        def count(how: str, code: int) -> Count:
            counted = Count(watch.steps, time.perf_counter() - start, how, code,
                            levers.unapplied_lines())
            if path is not None:
                path.write_text(json.dumps(asdict(counted)))
            return counted

        with levers.applied(roots=watch.roots), stopped_by_torchrun(path, count):
            watch.install()
            try:
                end = run_script(command, hidden=(__file__, script_watch.__file__,
                                                  script_levers.__file__,
                                                  script_apply.__file__))
            finally:
                watch.uninstall()
        return count(ended(end), end.code)


@contextmanager
def stopped_by_torchrun(path: Path | None, count):
    """Around worker 0's run (``path`` given): a SIGTERM, torchrun stopping the workers once
    another failed, has ``count`` write what was counted, then ends the process by the
    signal, as it would without kasoku. Nothing where ``path`` is None."""
    if path is None:
        yield
        return

    def stopped(signum, frame):
        count("was stopped by torchrun", 128 + signum)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    previous = signal.signal(signal.SIGTERM, stopped)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_launched(launched: Launched, levers: ScriptLevers) -> int:
    """The script under torchrun with kasoku run in each worker (``torchrun OPTIONS -m kasoku
    run --with ... -- train.py ARGS``: the levers set in every worker), its output and exit
    code torchrun's; worker 0 counts the steps (``RUN_COUNT``) and the closing line is said
    here, once."""
    with tempfile.TemporaryDirectory(prefix="kasoku-run-") as folder:
        path = Path(folder) / "count.json"
        cmd = [*launched.launcher(), "kasoku", "run", *with_args(*levers.given),
               SCRIPT_COMMAND, *launched.script.argv]
        start = time.perf_counter()
        code, passed = run_in_session(cmd, {**os.environ, RUN_COUNT: str(path)})
        elapsed_s = time.perf_counter() - start
        count = Count(**json.loads(path.read_text())) if path.is_file() else None
    name, how = f"{launched.script.name} under torchrun", how_launched(code, count, passed)
    if count is None:  # worker 0 ended before it could say (killed, or never started)
        say(f"{name} {how} with {with_words(levers.given)}: no count of steps from worker 0, "
            f"{elapsed_s:,.1f} s in all")
        return code
    for line in count.unapplied:
        say(line)
    say(closing_line(name, levers.given, replace(count, how=how, code=code),
                     whose=" (worker 0's)"))
    return code


def ended(end) -> str:
    """How the script ended (a ``ScriptEnd``), in ``closing_line``'s words."""
    return ("was interrupted" if end.interrupted else "failed" if end.raised
            else f"ended with exit code {end.code}" if end.code else "ran to its end")


def how_launched(code: int, count: Count | None, passed: list[int]) -> str:
    """How a run under torchrun ended: torchrun's exit ``code``, or where a signal was
    ``passed`` on to torchrun or worker 0 was interrupted, that (torchrun ends with 1 then)."""
    if code == 0:
        return "ran to its end"
    if passed or (count is not None and count.how == "was interrupted"):
        return "was interrupted"
    return f"ended with exit code {code}"


def with_words(given: list[str]) -> str:
    return " ".join(with_text(v) for v in given) if given else "no lever (as given)"


def closing_line(name: str, given: list[str], count: Count, whose: str = "") -> str:
    """``train.py ran to its end with --with bf16: 1,200 steps in 61.2 s (19.6 steps/s)``,
    or how it ended otherwise (``count.how``); ``whose``: whose steps they are."""
    steps, elapsed_s = count.steps, count.elapsed_s
    rate = f" ({steps / elapsed_s:,.1f} steps/s)" if steps and elapsed_s > 0 else ""
    return (f"{name} {count.how} with {with_words(given)}: {steps:,} training step"
            f"{'' if steps == 1 else 's'}{whose} in {elapsed_s:,.1f} s{rate}")
