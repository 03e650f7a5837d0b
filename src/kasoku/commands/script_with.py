"""``kasoku run [--with LEVER ...] -- python train.py ARGS``: a user's script run whole, to its
end, with levers kasoku sets from outside it (``kasoku.commands.script_levers``: the ones
``kasoku profile --with`` measures), its output and exit code its own, and one closing line:
how many training steps it ran, how long, with which levers.

``kasoku run --auto -- ...`` (``run_auto``) chooses them: the script's profile in a process of
its own (``kasoku profile --stop-after-window``, its verdict's levers measured beside the
script as given, in fresh runs of it), the levers measured faster kept, several of them
measured together too and kept together only where that beats the best one alone; then the
script runs whole with them, and the last line says what was kept, the speed-up measured with
its spread, and what the losses showed: a lever that changes the arithmetic (bf16, TF32, the
threads, a fused optimizer, channels-last, compile) is kept only where the timed steps' losses
stay within ``LOSS_TOLERANCE`` of the run without it, from the same seed.

The levers are set as the profile sets them, through the same step watch
(``kasoku.commands.script_watch``), whose window never opens here: the process-wide levers
around the run, the DataLoader's as the script makes them; the watch counts the steps. A
lever that is a measure rather than a way to train (``replay``: the first batches again and
again) is refused. What a lever changes in what the script computes is said before it runs.

Under torchrun (``kasoku run --with LEVER -- torchrun [TORCHRUN OPTIONS] train.py ARGS``,
``run_launched``) kasoku runs inside each worker as ``kasoku profile`` does there
(``kasoku.commands.script_launch``): the levers are set in every worker, the output and exit
code are torchrun's, worker 0 counts the steps and the launching process says the closing
line; ``--auto``'s profile, sides and whole run are torchruns of their own.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kasoku.advisor.levers import Lever
from kasoku.commands import ab, script_apply, script_levers, script_watch
from kasoku.commands.profile_config import ProfileConfig
from kasoku.commands.script_ab import ScriptSides
from kasoku.commands.script_launch import Launched, run_in_session
from kasoku.commands.script_levers import ScriptLevers, numerics, with_text
from kasoku.commands.script_profile import say, script_root
from kasoku.commands.script_run import ScriptCommand, run_script
from kasoku.commands.script_watch import StepWatch
from kasoku.core.errors import ConfigError
from kasoku.core.flags import SCRIPT_COMMAND, change_of, option, profile_args, with_args
from kasoku.distributed.launch import under_launcher
from kasoku.distributed.world import World
from kasoku.train.run_dir import out_or_new

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


def run_with(command: ScriptCommand | Launched, given: list[str] | None) -> int:
    """Run ``command`` to its end with the ``given`` levers (``--with`` values); returns the
    script's exit code, under torchrun torchrun's (``run_launched``)."""
    levers = ScriptLevers.parse(given)
    if levers.replay:
        replay = with_text("replay")
        raise ConfigError(f"{replay} trains on the DataLoader's first batches again and again: "
                          f"a measure of the step without its wait for data (kasoku profile "
                          f"{replay}), no way to train")
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


def run_auto(command: ScriptCommand | Launched, cfg: ProfileConfig) -> int:
    """Profile ``command``, keep the levers measured faster (``choose``), run it whole with
    them (``run_with``; the levers that change the arithmetic only where the losses stay the
    run's: ``check_losses``) and end with the line of what was kept (``kept_line``); returns
    the script's exit code. Under torchrun (a ``Launched``) the profile, each measuring side
    and the whole run are torchruns of their own. A Ctrl-C during the profile ends it there,
    with the profile's exit code (130 where that is 0)."""
    script = command.script if isinstance(command, Launched) else command
    out = out_or_new(None, Path(script.name).stem, "profile", "the profile")
    say(f"profiling {script.name} and measuring the levers kasoku sets from outside it "
        f"(the profile: {out}); its output in this run is not shown")
    argv = [sys.executable, "-m", "kasoku", "profile",
            *profile_args({"stop_after_window": True, "out": out, "rounds": cfg.rounds,
                           "skip": cfg.skip,
                           "measure_steps": cfg.measure_steps,
                           "measure_seconds": cfg.measure_seconds, "warmup": cfg.warmup,
                           "steps": cfg.steps}), SCRIPT_COMMAND,
            *command.argv]
    # kasoku's lines (stderr) pass through: the profile's progress; the script's stdout is
    # the whole run's, below
    code, passed = run_in_session(argv, stdout=subprocess.DEVNULL)
    if passed:  # its exit code, else the signal's (a profile that ended well all the same)
        say("interrupted while profiling: the script was not run whole")
        return code or 128 + passed[0]
    profile = out / "profile.json"
    tried = (json.loads(profile.read_text())["verdict"].get("tried") or []
             if profile.is_file() else None)
    kept, proof, checked = [], None, None
    if tried is None:
        say("the profile did not finish (see above): the script runs as given")
    else:
        sides = command.sides(cfg, []) if isinstance(command, Launched) \
            else ScriptSides(command, cfg, [])
        kept, proof = choose(tried, sides, cfg.rounds)
        kept, checked = check_losses(kept, sides)
    code = run_with(command, kept)
    say(kept_line(kept, proof, tried, checked))
    return code


def values_of(args) -> list[str]:
    """The ``--with`` values of a side's arguments (``--with workers=4`` -> ``workers=4``)."""
    args, flag = list(args), option("with")
    return [args[i + 1] for i in range(len(args) - 1) if args[i] == flag]


def choose(tried: list[dict], sides: ScriptSides, rounds: int) -> tuple[list[str], dict | None]:
    """The ``--with`` values to keep and the outcome that proved them: the fastest measured
    faster; where several were faster, all of them together, measured against the script as
    given in the same way, kept only where faster than the best one alone."""
    faster = sorted((t for t in tried if t.get("result") == "faster"),
                    key=lambda t: -(t.get("ratio") or 0.0))
    if not faster:
        return [], None
    best = values_of(faster[0]["args"])
    if len(faster) == 1:
        return best, faster[0]
    together = [v for t in faster for v in values_of(t["args"])]
    say(f"measuring {', '.join(together)} together beside the script as given:")
    lever = Lever("together", "", change_of(with_args(*together)))
    outcome = ab.try_levers([], [lever], say=lambda line: say(line.strip()), rounds=rounds,
                            measure=sides.measure)
    if outcome and outcome[0].result == "faster" \
            and (outcome[0].ratio or 0.0) > (faster[0].get("ratio") or 0.0):
        return together, outcome[0].to_dict()
    return best, faster[0]


ARITHMETIC = ("bf16", "tf32", "threads", "cudnn-benchmark", "fused-optimizer", "channels-last",
              "compile")
"""The levers that change the arithmetic (``numerics``): kept only where the losses stay
within ``LOSS_TOLERANCE`` of the run without them. (``workers`` changes which random samples
a dataset draws, not the arithmetic.)"""
LOSS_TOLERANCE = 0.02
"""The largest relative difference, at any timed step, between the losses with a lever that
changes the arithmetic and without it, from the same seed, for the lever to be kept: the
same training as far as the timed steps show. bf16's 8-bit mantissa moves a loss in its
third digit."""


def check_losses(kept: list[str], sides: ScriptSides) -> tuple[list[str], str | None]:
    """``kept`` with the levers that change the arithmetic dropped where their losses over
    the timed steps differ from the run without them (the other levers kept) by more than
    ``LOSS_TOLERANCE``; and what was found (None: nothing to check). The run without them
    runs twice: two runs that differ by more (a script not seeded) leave nothing checked."""
    arithmetic = [v for v in kept if v.partition("=")[0] in ARITHMETIC]
    if not arithmetic:
        return kept, None
    rest = [v for v in kept if v not in arithmetic]
    say(f"comparing the losses of the timed steps with and without {', '.join(arithmetic)}:")
    base, again, side = (sides.measure(with_args(*values))
                         for values in (rest, rest, kept))
    losses = [m.get("losses") or [] for m in (base, again, side)]
    if any("error" in m for m in (base, again, side)) or not all(losses):
        return kept, "the losses were not compared (a side did not report them)"
    noise, moved = differ(losses[0], losses[1]), differ(losses[0], losses[2])
    if noise > LOSS_TOLERANCE:
        return kept, (f"the losses were not compared: two runs without the levers differ by "
                      f"{100 * noise:.1f}% (is the script seeded?)")
    if moved > LOSS_TOLERANCE:
        return rest, (f"{', '.join(arithmetic)} faster, but changes the losses by "
                      f"{100 * moved:.1f}%: not kept")
    return kept, (f"the losses of the timed steps within {100 * moved:.2f}% of the run without "
                  f"{', '.join(arithmetic)}")


def differ(a: list[float], b: list[float]) -> float:
    """The largest relative difference between two runs' losses, step by step, over the
    steps both timed (a faster side times more of them: ``--measure-seconds``)."""
    pairs = list(zip(a, b))
    if not pairs:
        return float("inf")
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in pairs)


def kept_line(kept: list[str], proof: dict | None, tried: list[dict] | None,
              checked: str | None = None) -> str:
    """The last line of ``--auto``: the levers kept with their measured speed-up and spread,
    or why none was; then what the comparison of the losses found (``check_losses``)."""
    if tried is None:
        return "no lever kept: the profile did not finish"
    if not kept:
        shown = "; ".join(f"{' '.join(values_of(t['args']))} {t['ratio']:.2f}x, {t['result']}"
                          for t in tried if t.get("ratio")) or "none could be tried"
        return f"no lever kept: none was measured faster (tried: {shown})"
    ratios = proof.get("ratios") or []
    spread = (f"{min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} rounds" if len(ratios) > 1
              else f"1 round, noise {100 * proof.get('noise', 0.0):.0f}%")
    changes = [v for v in kept if numerics(v)]
    numbers = (f"; {checked}" if checked else
               f"; {', '.join(changes)} {'changes' if len(changes) == 1 else 'change'} what "
               f"the script computes, not its arithmetic" if changes
               else "; what the script computes is unchanged")
    return (f"kept {' '.join(with_text(v) for v in kept)}: measured {proof['ratio']:.2f}x "
            f"({spread}) beside the script as given{numbers}")
