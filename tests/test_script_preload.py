"""The ``--with`` levers of a script's DataLoader workers (``persistent-workers``,
``prefetch=N``) and of its memory allocators (``allocator``, in ``LD_PRELOAD`` from the
process's start: ``kasoku.commands.script_preload``; ``expandable-segments``): parsed, applied
to a real DataLoader, given to a measuring side's environment, and offered by the verdict
where they apply, else said why not. The end-to-end run of the loader levers is
tests/test_profile_script_ab.py's (``--with`` levers reach the script)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from kasoku.advisor.levers import Lever
from kasoku.advisor.verdict import Verdict
from kasoku.commands import script_ab, script_auto, script_preload
from kasoku.commands.script_apply import loader_arguments, loaders_unapplied
from kasoku.commands.script_levers import ScriptFacts, ScriptLevers
from kasoku.commands.script_offers import script_candidates, script_lever
from kasoku.commands.script_run import ScriptCommand
from kasoku.core.errors import ConfigError
from kasoku.perf.profile.figures import StepFigures

NOT_HERE = "no jemalloc or tcmalloc here (apt install libjemalloc2)"


@pytest.fixture
def libs(tmp_path, monkeypatch):
    """A lib folder of this test's own, the machine's hidden: a library is found only where
    the test puts one (``put("libjemalloc.so.2")``)."""
    monkeypatch.setattr(script_preload, "LIB_FOLDERS", (str(tmp_path),))
    monkeypatch.setattr(script_preload.sys, "prefix", str(tmp_path / "env"))
    monkeypatch.setattr(script_preload.ctypes.util, "find_library", lambda name: None)
    monkeypatch.delenv("LD_PRELOAD", raising=False)

    def put(name: str) -> str:
        (tmp_path / name).write_bytes(b"")
        return str(tmp_path / name)
    return put


def test_parse_reads_the_loader_and_allocator_levers():
    levers = ScriptLevers.parse(["persistent-workers", "prefetch=4", "allocator",
                                 "expandable-segments"])
    assert levers.persistent_workers and levers.prefetch == 4 and levers.expandable_segments
    assert levers.allocator == ("jemalloc", "tcmalloc")
    assert ScriptLevers.parse(["allocator=tcmalloc"]).allocator == ("tcmalloc",)
    for value, error in [("prefetch=0", "prefetch=N takes a whole number from 1"),
                         ("allocator=mimalloc", "allocator=NAME takes jemalloc or tcmalloc"),
                         ("persistent-workers=2", "not a lever kasoku sets")]:
        with pytest.raises(ConfigError, match=error):
            ScriptLevers.parse([value])


def test_a_dataloader_made_under_the_levers_keeps_its_workers_and_loads_ahead():
    data = list(range(8))
    levers = ScriptLevers.parse(["workers=2", "persistent-workers", "prefetch=4"])
    with levers.applied():
        args, kwargs = loader_arguments((4,), {"shuffle": False}, levers)
        made = DataLoader(data, *args, **kwargs)
        # the script's own workers, given by position, take them too
        args, kwargs = loader_arguments((4, False, None, None, 1), {}, levers)
        given = DataLoader(data, *args, **kwargs)
    assert (made.num_workers, made.persistent_workers, made.prefetch_factor) == (2, True, 4)
    assert (given.num_workers, given.persistent_workers, given.prefetch_factor) == (2, True, 4)
    assert levers.loaders == [2, 2] and not levers.unapplied


def test_without_worker_processes_they_are_not_applied_and_say_why():
    levers = ScriptLevers.parse(["persistent-workers", "prefetch=4"])
    with levers.applied():
        args, kwargs = loader_arguments((4,), {}, levers)
        made = DataLoader(list(range(8)), *args, **kwargs)  # torch refuses either without
    assert (made.num_workers, made.persistent_workers, made.prefetch_factor) == (0, False, None)
    assert levers.unapplied == {"persistent-workers": "no worker processes",
                                "prefetch": "no worker processes"}
    assert levers.unapplied_lines()[0] == ("--with persistent-workers was not applied: no "
                                           "worker processes")
    assert loaders_unapplied([], True, None) == {"persistent-workers": "no DataLoader"}


def test_an_allocator_is_found_in_the_lib_folders_or_said_missing(libs):
    assert script_preload.find_allocator() is None
    assert script_preload.missing(("jemalloc", "tcmalloc")) == NOT_HERE
    assert script_preload.missing(("tcmalloc",)) == ("no tcmalloc here (apt install "
                                                    "libtcmalloc-minimal4)")
    tcmalloc = libs("libtcmalloc_minimal.so.4")
    assert script_preload.find_allocator() == ("tcmalloc", tcmalloc)
    assert script_preload.find_allocator(("jemalloc",)) is None
    jemalloc = libs("libjemalloc.so.2")
    assert script_preload.find_allocator() == ("jemalloc", jemalloc)  # the first asked for


def test_a_measuring_side_has_the_allocator_in_its_environment(libs, monkeypatch, tmp_path):
    seen = {}

    def run(cmd, **kwargs):
        seen.update(kwargs["env"])
        return type("Proc", (), {"returncode": 1, "stderr": "kasoku: stopped"})()
    monkeypatch.setattr(script_ab.subprocess, "run", run)
    monkeypatch.setenv("LD_PRELOAD", "libother.so")
    sides = script_ab.ScriptSides(ScriptCommand(("python", "train.py"), Path("train.py"),
                                                None, ()),
                                  type("Cfg", (), {"skip": 1, "measure_steps": 2,
                                                   "measure_seconds": 0.1})(), [],
                                  folder=tmp_path)
    sides.measure(("--with", "allocator"))
    assert seen["LD_PRELOAD"] == "libother.so"  # none found: the side says why not
    jemalloc = libs("libjemalloc.so.2")
    sides.measure(("--with", "allocator", "--with", "expandable-segments"))
    assert seen["LD_PRELOAD"] == f"{jemalloc}:libother.so"
    assert seen["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_in_the_process_an_allocator_not_loaded_is_said(libs):
    levers = ScriptLevers.parse(["allocator"])
    with levers.applied():
        pass
    assert levers.unapplied == {"allocator": NOT_HERE}
    libs("libjemalloc.so.2")  # on the machine, but this process did not start with it
    levers = ScriptLevers.parse(["allocator=jemalloc"])
    with levers.applied():
        pass
    assert levers.unapplied == {"allocator": "not preloaded (LD_PRELOAD)"}


def test_kasoku_run_starts_again_with_the_allocator_preloaded(libs, monkeypatch):
    calls = []
    monkeypatch.setattr(script_preload.os, "execve", lambda *call: calls.append(call))
    script_preload.preload(("jemalloc", "tcmalloc"))
    assert calls == []  # none found: the run goes on without it, and says so
    jemalloc = libs("libjemalloc.so.2")
    script_preload.preload(("jemalloc", "tcmalloc"))
    executable, argv, env = calls[0]
    assert (executable, argv, env["LD_PRELOAD"]) == (sys.executable, sys.orig_argv, jemalloc)
    monkeypatch.setenv("LD_PRELOAD", jemalloc)
    script_preload.preload(("jemalloc",))
    assert len(calls) == 1  # started with it already: no second start
    # --auto's whole run: kasoku run with the levers kept, the command as given
    monkeypatch.setattr(script_auto.sys, "orig_argv",
                        ["python", "-m", "kasoku", "run", "--auto", "--", "python", "t.py"])
    assert script_auto.whole_run_argv(["allocator=jemalloc"]) == [
        sys.executable, "-m", "kasoku", "run", "--with", "allocator=jemalloc", "--", "python",
        "t.py"]


def test_expandable_segments_are_set_before_the_script_on_cuda(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    levers = ScriptLevers.parse(["expandable-segments"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with levers.applied():
        assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    assert levers.unapplied == {"expandable-segments": "no CUDA"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    levers = ScriptLevers.parse(["expandable-segments"])
    with levers.applied():
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == ("max_split_size_mb:64,"
                                                         "expandable_segments:True")
    assert not levers.unapplied
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"


def test_the_verdicts_allocator_is_the_lever_where_a_library_is_found(libs):
    keep = Lever("keep freed memory instead of returning it to the OS: --keep-memory",
                 "estimate: the page faults of fresh allocations saved",
                 {"accel.keep_memory": True})
    said = script_lever(keep, ScriptFacts(), "cpu")
    assert said.args == () and said.text == (
        "keep freed memory: a memory allocator such as jemalloc or tcmalloc (LD_PRELOAD); "
        f"not tried: {NOT_HERE}")
    jemalloc = libs("libjemalloc.so.2")
    lever = script_lever(keep, ScriptFacts(), "cpu")
    assert lever.args == ("--with", "allocator=jemalloc") and lever.caveat == ""
    assert lever.text == f"keep freed memory: jemalloc's malloc (LD_PRELOAD={jemalloc})"


def test_a_wait_for_a_loader_with_workers_offers_keeping_them_and_loading_ahead():
    verdict = Verdict("host-bound", "", Lever("", ""), candidates=[])
    waits = StepFigures(step_ms=10.0, data_pct=30.0)
    facts = ScriptFacts(loader_site="train.py:9", num_workers=2, loader_steps=True,
                        prefetch_factor=2)
    offered = script_candidates(verdict, facts, "cpu", waits)
    assert [x.args for x in offered] == [("--with", "persistent-workers"),
                                         ("--with", "prefetch=4")]
    assert offered[1].text == ("load further ahead: DataLoader(..., prefetch_factor=4) at "
                               "train.py:9 (the step waits 30% for its batches)")
    facts.persistent_workers = True  # kept already: loading further ahead only
    assert [x.args for x in script_candidates(verdict, facts, "cpu", waits)] == [
        ("--with", "prefetch=4")]
    # a short wait, or a loader without workers (worker processes offered instead): none
    assert script_candidates(verdict, facts, "cpu", StepFigures(step_ms=10.0,
                                                                data_pct=5.0)) == []
    no_workers = ScriptFacts(loader_site="train.py:9", num_workers=0, loader_steps=True)
    assert [x.args[1].partition("=")[0] for x in
            script_candidates(verdict, no_workers, "cpu", waits)] == ["workers"]
