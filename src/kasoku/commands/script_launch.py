"""A script that starts its own DDP under torchrun: ``kasoku profile [OPTIONS] -- torchrun
[TORCHRUN OPTIONS] train.py ARGS`` (or ``python -m torch.distributed.run ...``), and ``kasoku
run`` alike (``kasoku.commands.script_with.run_launched``).

kasoku runs torchrun as given with kasoku inside each of its workers: ``torchrun [TORCHRUN
OPTIONS] -m kasoku profile [OPTIONS] -- train.py ARGS``. Each worker runs the script unchanged
under the step watch and profiles the same steps (every rank steps alike under DDP, so the
windows line up): worker 0 writes the profile to ``--out``, worker R its trace to
``--out/workerR``, as ``kasoku profile --gpus N`` does for a workload. The A/B runs are made
from here once torchrun has ended, each side a torchrun of its own (``ScriptSides`` with
the launcher), and the report is written again.

torchrun's options are read by torchrun's own parser (``torch.distributed.run``), so what it
takes, kasoku takes. torchrun runs in a session of its own (``run_in_session``): a terminal's
Ctrl-C reaches kasoku alone, which passes it on to torchrun once and waits for it to stop its
workers, rather than leaving them behind.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from torch.distributed.run import get_args_parser

from kasoku.commands.profile import ProfileConfig, write_outputs
from kasoku.commands.profile_config import check_window
from kasoku.commands.script_ab import ScriptSides, advise_script, saved_result
from kasoku.commands.script_levers import ScriptFacts, ScriptLevers
from kasoku.commands.script_run import PYTHON, ScriptCommand, parse_command
from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag, option
from kasoku.train.run_dir import out_or_new

LAUNCHED = "KASOKU_SCRIPT_LAUNCHED"
"""Set for the workers of ``profile_launched``: worker 0 leaves the verdict's lines to the
process that launched them, which measures the levers."""


@dataclass(frozen=True)
class Launched:
    """A script's command under torchrun: torchrun's options and the script's command."""
    argv: tuple[str, ...]
    """As given."""
    options: tuple[str, ...]
    """torchrun's options, without ``-m``/``--module`` (the script's command says it)."""
    script: ScriptCommand

    def launcher(self) -> list[str]:
        """What starts kasoku in each worker: ``python -m torch.distributed.run OPTIONS -m``
        (kasoku's arguments follow)."""
        return [sys.executable, "-m", "torch.distributed.run", *self.options, "-m"]

    def sides(self, cfg, given: list[str] | None) -> ScriptSides:
        """The A/B sides of the script's profile, each a torchrun of its own."""
        return ScriptSides(self.script, cfg, list(given or ()), launcher=self.launcher(),
                           shown=list(self.argv))


def parse_launched(words: list[str]) -> Launched | None:
    """``torchrun OPTS SCRIPT ARGS`` or ``python -m torch.distributed.run OPTS SCRIPT ARGS``
    as ``Launched``; None for any other command; a ``ConfigError`` for a command kasoku cannot
    run inside (``--no-python``, a missing script)."""
    if words[:1] and Path(words[0]).name == "torchrun":
        rest = words[1:]
    elif len(words) >= 3 and PYTHON.match(Path(words[0]).name) and \
            words[1:3] == ["-m", "torch.distributed.run"]:
        rest = words[3:]
    else:
        return None
    try:
        args = get_args_parser().parse_args(rest)
    except SystemExit:  # torchrun's parser printed what it lacks
        raise ConfigError(f"torchrun could not read {' '.join(rest)!r} (see above)") from None
    if args.no_python:
        raise ConfigError("torchrun --no-python runs no Python script: kasoku profiles a "
                          "Python script under torchrun")
    at = len(rest) - len(args.training_script_args) - 1
    options = tuple(w for w in rest[:at] if w not in ("-m", "--module"))
    if args.run_path:
        raise ConfigError("torchrun --run-path is not taken: give the script's path")
    script = ["python", "-m", args.training_script] if args.module else \
        ["python", args.training_script]
    return Launched(tuple(words), options,
                    parse_command([*script, *args.training_script_args]))


def profile_launched(launched: Launched, cfg: ProfileConfig, out: Path | None,
                     given: list[str] | None, kasoku_args: list[str], say
                     ) -> tuple[int, dict | None]:
    """Run the script under torchrun with kasoku in each worker (``kasoku_args``: the
    profile's options, without ``--out``), then measure the levers from here and rewrite the
    report; returns torchrun's exit code and the profile (None where none was written)."""
    ScriptLevers.parse(given)  # a mistake is said once, not by each worker
    check_window(cfg)
    out = out_or_new(out, Path(launched.script.name).stem, "profile", "the profile")
    cmd = [*launched.launcher(), "kasoku", "profile", *kasoku_args, flag("profile.out"), str(out),
           "--", *launched.script.argv]
    code, passed = run_in_session(cmd, {**os.environ, LAUNCHED: "1"})
    path = out / "profile.json"
    if not path.is_file():
        if code == 0:
            say("torchrun ended well but worker 0 wrote no profile")
        return code or 1, None
    result = saved_result(path)
    if passed:  # Ctrl-C: stop here, with the profile written
        say(f"interrupted: the levers were not measured (the profile is kept; "
            f"{option('estimate')} is what was said)")
        cfg = replace(cfg, estimate=True, confirm=False)
    advise_script(result, ScriptFacts(**result["facts"]), launched.sides(cfg, given), cfg, say)
    write_outputs(out, result)
    return code, result


PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The signals kasoku passes on to the process it waits for (``run_in_session``)."""


def run_in_session(cmd: list[str], env: dict | None = None, stdout=None, cwd=None
                   ) -> tuple[int, list[int]]:
    """Run ``cmd`` to its end in a session of its own and return its exit code and the
    signals passed on to it: each of ``PASSED_ON`` this process gets is passed on to its
    process group (as a terminal's reaches its foreground group: a ``kasoku profile`` and the
    torchrun of the side it measures alike), so a terminal's Ctrl-C reaches it once, never
    twice (torchrun's second SIGINT while it stops
    its workers would cut that short), and this process waits for it to stop them
    (``subprocess.run`` kills its child a quarter of a second after a KeyboardInterrupt,
    torchrun's workers left running in sessions of their own). Main thread only (signal
    handlers). ``cwd``: the folder it runs in (default: this one)."""
    proc = subprocess.Popen(cmd, env=env, stdout=stdout, cwd=cwd, start_new_session=True)
    passed: list[int] = []

    def pass_on(signum, frame):
        passed.append(signum)
        try:
            os.killpg(proc.pid, signum)  # its group's id is its pid: a session of its own
        except ProcessLookupError:  # it has ended and been waited for
            pass
    previous = {s: signal.signal(s, pass_on) for s in PASSED_ON}
    try:
        return proc.wait(), passed  # retried after each handler (PEP 475)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
