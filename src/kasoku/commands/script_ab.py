"""The A/B runs of a script's profile: each side a fresh ``kasoku profile --measure-only
[--with LEVER] -- COMMAND`` process that runs the script to the same step (``--skip`` steps,
then ``--measure-steps`` timed, for ``--measure-seconds`` at least) and stops it there; its
figures come back in a file (``measure.json`` in a folder of its own), since the script's
stdout is the script's. Each side runs in a scratch folder (``kasoku.commands.script_scratch``),
its side effects not the user's.

The rounds, the noise rule and the advice are the workloads' (``kasoku.commands.ab``,
``kasoku.advisor.advice``); only the side differs.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import kasoku
from kasoku.advisor.advice import advise
from kasoku.advisor.script import ScriptVerdict
from kasoku.advisor.script_words import script_fallback
from kasoku.advisor.verdict import Verdict
from kasoku.commands import ab
from kasoku.commands.script_levers import ScriptFacts, ScriptLevers
from kasoku.commands.script_offers import script_candidates, script_experiments
from kasoku.commands.script_run import ScriptCommand
from kasoku.commands.script_scratch import climbs, scratch_folder
from kasoku.core.flags import SCRIPT_COMMAND, option, profile_args, with_args
from kasoku.perf.profile.figures import StepFigures

MEASURE_FILE = "measure.json"


class ScriptSides:
    """How one side of a script's A/B runs: the same command, window and levers as the
    profile, plus the side's ``--with`` args. ``launcher``: what starts kasoku in each
    worker of a script under torchrun (``kasoku.commands.script_launch``), ``shown`` the
    command as the user gave it, ``folder`` the one it was given in (default: the working
    directory; the script may have moved it since)."""

    def __init__(self, command: ScriptCommand, cfg, given: list[str],
                 launcher: list[str] | None = None, shown: list[str] | None = None,
                 folder: Path | None = None):
        self.command, self.cfg = command, cfg
        self.folder = Path(folder or Path.cwd()).resolve()
        self.launcher = launcher or [sys.executable, "-m"]
        self.shown = shown or list(command.argv)
        self.own = [*profile_args({"skip": cfg.skip, "measure_steps": cfg.measure_steps}),
                    *with_args(*given)]

    def argv(self, extra=(), own=()) -> list[str]:
        return ["profile", *self.own, *extra, *own, SCRIPT_COMMAND, *self.command.argv]

    def text(self, extra=()) -> str:
        """The side as a command the user can run."""
        return shlex.join(["kasoku", "profile", *self.own, *extra, SCRIPT_COMMAND, *self.shown])

    def measure(self, extra=(), timeout_s: float = ab.SIDE_TIMEOUT_S) -> dict:
        """One fresh process: ``{"samples_per_s", "window_rates", "phases"}``, or
        ``{"error": its last line}``. It runs in a scratch folder (``script_scratch``: the
        script's side effects land there, and go with it), or in the working directory where
        the command's arguments climb above it. Its environment has what its levers need from
        the process's start (``ScriptLevers.start_env``: the allocator preloaded)."""
        in_place = climbs(self.command.argv)
        with tempfile.TemporaryDirectory(prefix="kasoku-side-") as folder, \
                (nullcontext(None) if in_place else scratch_folder(self.folder)) as cwd:
            own = profile_args({"measure_only": True, "out": folder,  # before the command
                                "measure_seconds": self.cfg.measure_seconds})
            cmd = [*self.launcher, "kasoku", *self.argv(extra, own)]
            args = [*self.own, *extra]
            levers = ScriptLevers.parse(values_of(args))
            try:
                proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True, timeout=timeout_s, cwd=cwd or self.folder,
                                      env=levers.start_env(side_env(cwd, self.folder)))
            except subprocess.TimeoutExpired:
                return {"error": f"timed out after {timeout_s:.0f} s"}
            path = Path(folder) / MEASURE_FILE
            if not path.is_file():
                lines = proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"]
                return {"error": lines[-1].removeprefix("kasoku: ")}
            return json.loads(path.read_text())


def side_env(cwd: Path | None, folder: Path) -> dict:
    """This process's environment for a side run in ``cwd``: this kasoku's own folder first
    on ``PYTHONPATH`` (the side runs the same kasoku, wherever it was found), the relative
    entries made absolute against the user's ``folder``, and ``PWD`` the side's folder."""
    env = dict(os.environ)
    if cwd is None:
        return env
    paths = [str(Path(kasoku.__file__).resolve().parents[1])]
    paths += [str(folder / p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(PYTHONPATH=os.pathsep.join(paths), PWD=str(cwd))
    return env


def advise_script(result: dict, facts: ScriptFacts, sides: ScriptSides, cfg,
                  say) -> ScriptVerdict:
    """The verdict's levers for the script (``script_candidates``), those pulled from outside
    measured in rounds of fresh runs unless ``cfg.estimate``, the best one measured faster
    advised, else the first edit, else the rule's fallback in the script's terms
    (``script_fallback``, kept as the verdict's ``fallback``); with ``cfg.confirm`` the
    bound's proof (replayed batches) and the advice once more, under a header only where
    there is one to run (else a line saying why none). ``result["verdict"]`` (a
    ``ScriptVerdict``) is replaced by the advised one, which is returned (and
    ``result["ladder"]`` set)."""
    judged: Verdict = result["verdict"].verdict
    device = result["device"].split(":")[0]
    candidates = script_candidates(judged, facts, device, result["figures"])
    edits = [c for c in candidates if not c.change]
    fallback = script_fallback(judged, result["figures"], facts.loader_site)
    lever = candidates[0] if candidates else fallback or judged.lever
    advised = Verdict(judged.rule, judged.reason, lever, fallback=fallback)
    if not cfg.estimate and any(c.change for c in candidates):
        say(f"trying the levers for {judged.rule} in fresh runs of the script, each "
            f"beside the run as given ({option('estimate')} skips this):")
        outcomes = ab.try_levers([], candidates, say=lambda line: say(line.strip()),
                                 rounds=cfg.rounds, measure=sides.measure)
        if any("with.workers" in dict(o.lever.change) and o.result != "faster"
               for o in outcomes):  # the fallback no longer offers what was measured
            fallback = script_fallback(judged, result["figures"], facts.loader_site,
                                       workers_not_faster=True)
            advised = replace(advised, fallback=fallback)
        advised = advise(advised, outcomes)
        if (advised.lever.measured or {}).get("result") == "none faster" and edits:
            advised = Verdict(advised.rule, advised.reason, edits[0], tried=advised.tried)
    verdict = ScriptVerdict(replace(judged, lever=advised.lever, tried=advised.tried,
                                    fallback=fallback), edits, measured=bool(advised.tried))
    result["verdict"] = verdict
    if cfg.confirm:
        kept, left = script_experiments(judged, facts)
        result["ladder"] = []
        if kept or (advised.lever.measured or {}).get("result") == "faster":
            say("confirming the bound and the advice in fresh runs of the script:")
            result["ladder"] = ab.confirm([], kept, advised.lever, rounds=cfg.rounds,
                                          measure=sides.measure, command=sides.text,
                                          say=lambda line: say(line.strip()))
        else:  # no header over nothing: why there is nothing to run
            say(f"{option('confirm')}: nothing to run in fresh runs of the script: "
                + ("each proof of the bound needs an edit to it" if left
                   else f"{judged.rule} has no proof to run")
                + (f", and no lever was measured ({option('estimate')})" if cfg.estimate
                   else ", and no lever was measured faster"))
        if len(result["ladder"]) < 2:  # nothing measured: no table, only what was not
            result["ladder"] = []
        verdict.unconfirmed = left
    return verdict


def saved_result(path: Path) -> dict:
    """A script's ``profile.json`` read back, its verdict and figures typed again
    (``ScriptVerdict``, ``StepFigures``)."""
    result = json.loads(Path(path).read_text())
    result.update(verdict=ScriptVerdict.from_dict(result["verdict"]),
                  figures=StepFigures.from_dict(result["figures"]))
    return result


def values_of(args) -> list[str]:
    """The ``--with`` values of a side's arguments (``--with workers=4`` -> ``workers=4``)."""
    args, flag = list(args), option("with")
    return [args[i + 1] for i in range(len(args) - 1) if args[i] == flag]
