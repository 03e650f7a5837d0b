"""``kasoku run --auto -- python train.py ARGS``: the levers chosen by measuring them, then the
script run whole with them (``kasoku.commands.script_with.run_with``).

The script's profile in a process of its own (``kasoku profile --stop-after-window``, its
verdict's levers measured beside the script as given, in fresh runs of it); the levers
measured faster kept, several of them measured together too and kept together only where that
beats the best one alone. Then it climbs (``climb``): a profile with the levers kept so far,
its verdict's levers measured on top of them (bf16 makes a convolution's layout matter, and
the layout compiling), for ``CLIMBS`` profiles at most, each step kept only where all the
levers together are faster than the script as given. The last line says what was kept, the
speed-up measured with its spread, and what the losses showed: a lever that changes the
arithmetic (bf16, TF32, the threads, a fused optimizer, channels-last, compile) is kept only
where the timed steps' losses stay within ``LOSS_TOLERANCE`` of the run without it, from the
same seed.

Under torchrun (a ``Launched``) the profiles, each measuring side and the whole run are
torchruns of their own. A Ctrl-C during a profile ends it there, with the profile's exit code
(130 where that is 0).
"""
from __future__ import annotations

import json
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

from kasoku.advisor.levers import Lever
from kasoku.commands import ab
from kasoku.commands.profile_config import ProfileConfig
from kasoku.commands.script_ab import ScriptSides, side_env, values_of
from kasoku.commands.script_launch import Launched, run_in_session
from kasoku.commands.script_levers import ScriptLevers, numerics, with_text
from kasoku.commands.script_preload import reexec_env
from kasoku.commands.script_profile import say
from kasoku.commands.script_run import ScriptCommand
from kasoku.commands.script_scratch import climbs, scratch_folder
from kasoku.commands.script_with import run_with
from kasoku.core.flags import SCRIPT_COMMAND, change_of, profile_args, with_args
from kasoku.train.run_dir import out_or_new


class Interrupted(Exception):
    """A profile ended by a signal passed on to it: ``code``, the exit code to end with."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


CLIMBS = 3
"""The most profiles ``--auto`` makes: each with the levers kept so far, its verdict's levers
measured on top of them (bf16 makes a convolution's layout matter, and the layout compiling)."""


def run_auto(command: ScriptCommand | Launched, cfg: ProfileConfig) -> int:
    """Profile ``command``, keep the levers measured faster (``choose``), profile again with
    them and keep what is faster on top (``climb``), run it whole with them (``run_with``; the
    levers that change the arithmetic only where the losses stay the run's:
    ``check_losses``) and end with the line of what was kept (``kept_line``; said first where
    the allocator kept makes the whole run a process of its own, ``whole_run_argv``); returns
    the script's exit code."""
    script = command.script if isinstance(command, Launched) else command
    out = out_or_new(None, Path(script.name).stem, "profile", "the profile")
    try:
        kept, proof, tried = climb(command, cfg, out)
    except Interrupted as stop:
        say("interrupted while profiling: the script was not run whole")
        return stop.code
    checked = None
    if kept:
        given = kept
        kept, checked = check_losses(kept, sides_of(command, cfg, []))
        if kept and kept != given:  # the proof was of more levers than are kept
            proof = together(kept, sides_of(command, cfg, []), cfg.rounds)
    if reexec_env(ScriptLevers.parse(kept).allocator) is not None:
        # the whole run needs a process started with the allocator: this one is replaced
        say(kept_line(kept, proof, tried, checked))
    code = run_with(command, kept, argv=whole_run_argv(kept))
    say(kept_line(kept, proof, tried, checked))
    return code


def whole_run_argv(kept: list[str]) -> list[str]:
    """``kasoku run --with KEPT ... -- COMMAND``: the whole run as a command line of its own
    (this process's command after ``--``)."""
    argv = sys.orig_argv
    command = argv[argv.index(SCRIPT_COMMAND) + 1:] if SCRIPT_COMMAND in argv else []
    return [sys.executable, "-m", "kasoku", "run", *with_args(*kept), SCRIPT_COMMAND, *command]


def sides_of(command: ScriptCommand | Launched, cfg: ProfileConfig, given: list[str]
             ) -> ScriptSides:
    """The A/B sides of ``command`` with the ``given`` levers: under torchrun each side a
    torchrun of its own."""
    if isinstance(command, Launched):
        return command.sides(cfg, given)
    return ScriptSides(command, cfg, given)


def together(values: list[str], sides: ScriptSides, rounds: int,
             beside: str = "the script as given") -> dict | None:
    """The ``--with values`` measured together beside ``sides``' run (the script as given, or
    with the levers kept so far), in ``rounds`` rounds of fresh runs: the outcome
    (``Outcome.to_dict``), None where a side failed."""
    say(f"measuring {', '.join(values)} together beside {beside}:")
    lever = Lever("together", "", change_of(with_args(*values)))
    outcome = ab.try_levers([], [lever], say=lambda line: say(line.strip()), rounds=rounds,
                            measure=sides.measure)
    return outcome[0].to_dict() if outcome and outcome[0].ratio else None


def names(values: list[str]) -> set[str]:
    """The levers' names (``compile=reduce-overhead`` -> ``compile``)."""
    return {v.partition("=")[0] for v in values}


def climb(command: ScriptCommand | Launched, cfg: ProfileConfig, out: Path
          ) -> tuple[list[str], dict | None, list[dict] | None]:
    """Up to ``CLIMBS`` profiles of ``command``, the first as given, each next with the levers
    kept so far, each keeping the levers its tries measured faster on top of them (``choose``)
    where all of them together are faster than the script as given too. Returns the levers
    kept, the outcome that proves them against the script as given, and the first profile's
    tries (None: it did not finish)."""
    kept, proof, first = [], None, None
    for n in range(1, CLIMBS + 1):
        folder = out if n == 1 else out / f"with-{len(kept)}-levers"
        tried = profile_tries(command, cfg, kept, folder)
        if tried is None:
            if n == 1:
                say("the profile did not finish (see above): the script runs as given")
            break
        first = tried if first is None else first
        fresh = [t for t in tried if not names(values_of(t["args"])) & names(kept)]
        on_top = f"the script with {', '.join(kept)}" if kept else "the script as given"
        more, step = choose(fresh, sides_of(command, cfg, kept), cfg.rounds, on_top)
        if not more:
            break
        if n == 1:
            kept, proof = more, step
            continue
        whole = together(kept + more, sides_of(command, cfg, []), cfg.rounds)
        if not whole or whole.get("result") != "faster":
            break  # on top, but not against the script as given: the climb ends below it
        kept, proof = kept + more, whole
    return kept, proof, first


def profile_tries(command: ScriptCommand | Launched, cfg: ProfileConfig, given: list[str],
                  out: Path) -> list[dict] | None:
    """``kasoku profile --stop-after-window`` of ``command`` with the ``given`` levers, in a
    process of its own (its lines pass through; the script's output does not): the levers
    its verdict tried, measured beside the script with ``given``; None where it wrote no
    profile. ``Interrupted`` where a signal was passed on to it."""
    script = command.script if isinstance(command, Launched) else command
    on_top = f" with {' '.join(with_text(v) for v in given)}" if given else ""
    say(f"profiling {script.name}{on_top} and measuring the levers kasoku sets from outside "
        f"it (the profile: {out}); its output in this run is not shown")
    argv = [sys.executable, "-m", "kasoku", "profile",
            *profile_args({"stop_after_window": True, "out": out.resolve(),
                           "rounds": cfg.rounds, "skip": cfg.skip,
                           "measure_steps": cfg.measure_steps,
                           "measure_seconds": cfg.measure_seconds, "warmup": cfg.warmup,
                           "steps": cfg.steps}), *with_args(*given), SCRIPT_COMMAND,
            *command.argv]
    # kasoku's lines (stderr) pass through: the profile's progress; the script's stdout is
    # the whole run's, below. The profile runs in a scratch folder, as each side does: what
    # the script leaves in its folder (a logger's lightning_logs/version_N, checkpoints) is
    # the whole run's alone.
    with (nullcontext(None) if climbs(script.argv) else scratch_folder()) as cwd:
        code, passed = run_in_session(argv, env=side_env(cwd, Path.cwd()),
                                      stdout=subprocess.DEVNULL, cwd=cwd)
    if passed:  # its exit code, else the signal's (a profile that ended well all the same)
        raise Interrupted(code or 128 + passed[0])
    profile = out / "profile.json"
    if not profile.is_file():
        return None
    return json.loads(profile.read_text())["verdict"].get("tried") or []


def choose(tried: list[dict], sides: ScriptSides, rounds: int,
           beside: str = "the script as given") -> tuple[list[str], dict | None]:
    """The ``--with`` values to keep and the outcome that proved them: the fastest measured
    faster; where several were faster, all of them together, measured beside ``sides``' run
    (``beside`` says which) in the same way, kept only where faster than the best one alone."""
    faster = sorted((t for t in tried if t.get("result") == "faster"),
                    key=lambda t: -(t.get("ratio") or 0.0))
    if not faster:
        return [], None
    best = values_of(faster[0]["args"])
    if len(faster) == 1:
        return best, faster[0]
    values = [v for t in faster for v in values_of(t["args"])]
    outcome = together(values, sides, rounds, beside)
    if outcome and outcome.get("result") == "faster" \
            and (outcome.get("ratio") or 0.0) > (faster[0].get("ratio") or 0.0):
        return values, outcome
    return best, faster[0]


ARITHMETIC = ("bf16", "tf32", "threads", "cudnn-benchmark", "fused-optimizer", "channels-last",
              "compile")
"""The levers that change the arithmetic (``numerics``): kept only where the losses stay
within ``LOSS_TOLERANCE`` of the run without them. (``workers`` changes which random samples
a dataset draws, not the arithmetic.)"""
LOSS_TOLERANCE = 0.02
"""The largest difference, at any timed step, between the losses with a lever that changes
the arithmetic and without it, from the same seed, relative to the mean loss without it over
those steps, for the lever to be kept: the same training as far as the timed steps show.
bf16's 8-bit mantissa moves a loss in its third digit. (Relative to each step's own loss, a
loss trained towards zero made any lever fail: ResNet-50 learning its one batch, the H200's
bf16, channels-last and CUDA graphs dropped.)"""


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
    """The largest difference between two runs' losses, step by step, over the steps both
    timed (a faster side times more of them: ``--measure-seconds``), relative to the mean
    size of ``a``'s losses over those steps."""
    pairs = list(zip(a, b))
    if not pairs:
        return float("inf")
    scale = max(sum(abs(x) for x, _ in pairs) / len(pairs), 1e-12)
    return max(abs(x - y) for x, y in pairs) / scale


def kept_line(kept: list[str], proof: dict | None, tried: list[dict] | None,
              checked: str | None = None) -> str:
    """The last line of ``--auto``: the levers kept with their measured speed-up and spread,
    or why none was; then what the comparison of the losses found (``check_losses``)."""
    if tried is None:
        return "no lever kept: the profile did not finish"
    if not kept:  # none faster, or the faster ones changed the losses (checked says so)
        shown = "; ".join(f"{' '.join(values_of(t['args']))} {t['ratio']:.2f}x, {t['result']}"
                          for t in tried if t.get("ratio")) or "none could be tried"
        return f"no lever kept: {checked or 'none was measured faster'} (tried: {shown})"
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
