"""The ``--with`` levers set on a script's optimizers and model and on PyTorch's inter-op
threads (``kasoku.commands.script_apply``): each reaches an unchanged script run through
``kasoku profile --measure-only`` (as an A/B side runs it), the script's output and exit code
intact; a lever that cannot apply says why and makes its side no measure of it."""
from __future__ import annotations

import json

import pytest
import torch
from test_profile_script import kasoku, write

from kasoku.advisor.levers import Lever, host_candidates
from kasoku.advisor.verdict import Verdict
from kasoku.cli import main
from kasoku.commands import script_apply, script_profile, script_timing
from kasoku.commands.script_levers import NUMERICS, ScriptFacts, ScriptLevers
from kasoku.commands.script_offers import script_candidates, script_lever
from kasoku.core.errors import ConfigError
from kasoku.perf.profile.figures import StepFigures

CONV = """
import sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = nn.Identity()(torch.randn(4, 3, 8, 8))  # called first, as a transform: no model
seen = []
model.register_forward_pre_hook(lambda m, args: seen.append(args[0].is_contiguous(
    memory_format=torch.channels_last)))
for step in range(12):
    loss = model(x).square().mean()
    print("fused", opt.defaults["fused"], "foreach", opt.defaults["foreach"],
          "weights", model[0].weight.is_contiguous(memory_format=torch.channels_last),
          "inputs", seen[-1], "compiled", model._compiled_call_impl is not None,
          "interop", torch.get_num_interop_threads(), flush=True)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

MLP = """
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.RMSprop(model.parameters(), lr=0.1)
for step in range(12):
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
print("done")
"""


def side(*levers: str, script: str = "conv.py") -> None:
    """``kasoku profile --measure-only`` of ``script`` with ``levers``, in this process."""
    argv = ["profile", "--skip", "2", "--measure-steps", "3", "--measure-seconds", "0.001",
            "--measure-only", "--out", "side"]  # exactly 3 timed steps, however fast
    for value in levers:
        argv += ["--with", value]
    assert main([*argv, "--", "python", script]) == 0


@pytest.fixture
def scripts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "conv.py", CONV)
    write(tmp_path, "mlp.py", MLP)
    return tmp_path


def lines(capsys) -> list[dict[str, str]]:
    out = capsys.readouterr().out.split("\n")
    return [dict(zip(words[::2], words[1::2])) for words in (line.split() for line in out)
            if words]


def test_fused_optimizer_and_channels_last_reach_the_script(scripts, capsys):
    side("fused-optimizer", "channels-last")
    seen = lines(capsys)
    assert len(seen) == 5  # 2 skipped, 3 timed: stopped in the 5th step's opt.step()
    # made fused (the CPU has fused AdamW), its weights and every input NHWC from the first call
    assert {tuple(line.values())[:4] for line in seen} == {("True", "None", "True", "True")}
    assert "steps_per_s" in json.loads((scripts / "side" / "measure.json").read_text())
    # the run as given: the lever's patches are off again
    side()
    assert {tuple(line.values())[:4] for line in lines(capsys)} == {
        ("None", "None", "False", "False")}
    assert "fused" not in torch.optim.AdamW.__init__.__qualname__
    assert torch.nn.Module.__call__ is torch.nn.Module._wrapped_call_impl


def test_a_model_on_a_device_without_fused_kernels_is_made_foreach():
    made: list[str] = []
    params = [torch.nn.Parameter(torch.zeros(2, device="meta"))]
    with script_apply.fused_optimizers(made):
        sgd = torch.optim.SGD(params, lr=0.1)
        adam = torch.optim.Adam([{"params": torch.nn.Linear(2, 2).parameters()}])
    assert (sgd.defaults["foreach"], sgd.defaults["fused"]) == (True, None)
    assert adam.defaults["fused"] is True and made == ["foreach", "fused"]
    assert script_apply.optimizer_impl(adam) == "fused"
    assert script_apply.optimizer_impl(torch.optim.SGD(params, lr=0.1)) == "for-loop"
    assert script_apply.optimizer_impl(torch.optim.RMSprop(params)) is None  # no fused=


def test_a_lever_that_cannot_apply_says_why_and_measures_nothing(scripts, capsys):
    side("channels-last", "fused-optimizer", script="mlp.py")
    assert capsys.readouterr().out == ""  # stopped in its 5th step, before its print
    error = json.loads((scripts / "side" / "measure.json").read_text())["error"]
    assert error == ("--with channels-last was not applied: no Conv2d; --with fused-optimizer "
                     "was not applied: no Adam/AdamW/SGD")
    # a profile says it, and the script ends as it would
    assert main(["profile", "--skip", "2", "--measure-steps", "2", "--warmup", "1", "--steps",
                 "2", "--estimate", "--out", "prof", "--with", "channels-last", "--", "python",
                 "mlp.py"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "done\n"
    assert "kasoku: --with channels-last was not applied: no Conv2d" in captured.err


@pytest.mark.parametrize("value,error", [
    ("compile=fast", "--with compile=fast: compile=MODE takes one of torch.compile's modes: "
                     "default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs"),
    ("interop-threads=0", "--with interop-threads=0: interop-threads=N takes a whole number "
                          "from 1"),
    ("fused-optimizer=1", "--with fused-optimizer=1: not a lever kasoku sets from outside"),
])
def test_a_bad_value_is_one_clear_line(value, error):
    with pytest.raises(ConfigError) as raised:
        ScriptLevers.parse([value])
    assert str(raised.value).startswith(error) and "\n" not in str(raised.value)


def test_parse_reads_the_new_levers():
    levers = ScriptLevers.parse(["compile", "interop-threads=3", "channels-last",
                                 "fused-optimizer"])
    assert (levers.compile, levers.interop_threads, levers.channels_last,
            levers.fused_optimizer) == ("default", 3, True, True)
    assert ScriptLevers.parse(["compile=reduce-overhead"]).compile == "reduce-overhead"


@pytest.mark.slow  # a process of its own: about 12 s on 2 cores
def test_interop_threads_are_set_before_the_script_runs(scripts):
    """In a process of its own: PyTorch takes the setting once per process."""
    n = 3 if torch.get_num_interop_threads() != 3 else 2
    run = kasoku("profile", "--skip", "2", "--measure-steps", "3", "--measure-only", "--out",
                 "side", "--with", f"interop-threads={n}", "--", "python", "conv.py",
                 cwd=scripts)
    assert run.returncode == 0, run.stderr
    assert {line.split()[-1] for line in run.stdout.splitlines()} == {str(n)}


def test_interop_threads_too_late_is_said(monkeypatch):
    unapplied = script_apply.Unapplied()
    monkeypatch.setattr(torch, "set_num_interop_threads", _refused)  # after inter-op work
    script_apply.interop_threads(torch.get_num_interop_threads() + 1, unapplied)
    assert unapplied == {"interop-threads": "too late"}


def _refused(n):
    raise RuntimeError("Error: cannot set number of interop threads after parallel work has "
                       "started or set_num_interop_threads called")


@pytest.mark.slow  # inductor compiles the forward and the backward: 25 s on 2 cores, cache cold
@pytest.mark.skipif(script_apply.compiler_missing("cpu") is not None, reason="needs g++")
def test_compile_compiles_the_model_in_place_before_its_first_call(scripts, capsys):
    side("compile")
    seen = lines(capsys)
    assert len(seen) == 5 and {line["compiled"] for line in seen} == {"True"}
    assert "steps_per_s" in json.loads((scripts / "side" / "measure.json").read_text())


def test_compile_reduce_overhead_needs_a_gpu(scripts, capsys):
    side("compile=reduce-overhead")  # CUDA graphs: none on the CPU
    assert {line["compiled"] for line in lines(capsys)} == {"False"}
    error = json.loads((scripts / "side" / "measure.json").read_text())["error"]
    assert error == "--with compile was not applied: no CUDA graphs on the CPU"


def test_no_compiler_no_compile(monkeypatch):
    monkeypatch.setattr(script_apply.shutil, "which", lambda name: None)
    assert script_apply.compiler_missing("cpu") == "no C++ compiler"
    lever = Lever("fused kernels: --compile", "estimate ~1.2x", {"accel.compile": True}, 1.2)
    edit = script_lever(lever, ScriptFacts(), "cpu")
    assert edit.args == () and edit.text == "torch.compile the model (no C++ compiler: not " \
                                            "measured)"


def test_the_verdicts_levers_pulled_from_outside_where_they_apply():
    facts = ScriptFacts(forward_site="train.py:30", has_conv=True, optimizer_impl="for-loop")

    def lever(change):
        return script_lever(Lever("", "estimate ~1.2x", change, 1.2), facts, "cuda")
    assert lever({"accel.channels_last": True}).args == ("--with", "channels-last")
    assert lever({"accel.channels_last": True}).caveat == NUMERICS["channels-last"]
    assert lever({"accel.optimizer_impl": "fused"}).args == ("--with", "fused-optimizer")
    assert lever({"accel.compile": True}).args == ("--with", "compile")
    assert lever({"accel.compile": True}).text == ("torch.compile the model: model.compile() "
                                                   "(the forward: train.py:30)")
    assert lever({"accel.cuda_graph": True}).args == ("--with", "compile=reduce-overhead")
    # no convolutions, an optimizer fused already: edits at most, not measured
    facts.has_conv, facts.optimizer_impl = False, "fused"
    assert lever({"accel.channels_last": True}).args == ()
    assert lever({"accel.optimizer_impl": "fused"}).args == ()
    # an update that takes a fifth of the step, not fused: a fused optimizer offered, once
    facts.optimizer_impl = "foreach"
    figures = StepFigures(step_ms=10.0, by_class_ms={"optimizer": 2.0})
    verdict = Verdict("host-bound", "", Lever("", ""), candidates=[])
    offered = script_candidates(verdict, facts, "cpu", figures)
    assert [x.args for x in offered] == [("--with", "fused-optimizer")]
    assert "(the update takes 20% of the step)" in offered[0].text
    verdict.candidates = [Lever("", "", {"accel.optimizer_impl": "fused"})]
    assert len(script_candidates(verdict, facts, "cpu", figures)) == 1


def test_the_models_layout_and_compilation_are_read_from_it():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 8, 1))
    assert script_apply.model_settings(model) == (False, False)
    model.to(memory_format=torch.channels_last)  # the 1x1 weight is contiguous both ways
    assert script_apply.model_settings(model) == (False, True)
    assert script_apply.model_settings(torch.compile(model)) == (True, True)  # not run: lazy
    model.compile()
    assert script_apply.model_settings(model) == (True, True)
    assert script_apply.model_settings(torch.nn.Linear(2, 2)) == (False, False)
    wrapped = torch.nn.Sequential(torch.compile(torch.nn.Linear(2, 2)))  # a wrapper's inside
    assert script_apply.model_settings(wrapped) == (True, False)


def test_a_profile_with_levers_set_sees_them_and_offers_none_again(scripts):
    run = kasoku("profile", "--skip", "2", "--measure-steps", "2", "--warmup", "1", "--steps",
                 "3", "--estimate", "--with", "channels-last", "--out", "prof", "--", "python",
                 "conv.py", cwd=scripts)
    assert run.returncode == 0, run.stderr
    facts = json.loads((scripts / "prof" / "profile.json").read_text())["facts"]
    assert facts["channels_last"] is True and facts["compiled"] is None
    graphed = ScriptFacts(compiled="reduce-overhead", channels_last=True, optimizer_impl="fused")
    accel = script_profile.script_accel("bf16", graphed)
    assert (accel.compile, accel.cuda_graph, accel.channels_last, accel.optimizer_impl) == \
        (True, True, True, "fused")
    # a host-bound step whose model runs in CUDA graphs already: neither offered again
    figures = StepFigures(device="cuda", step_ms=10.0, idle_host_pct=30.0, has_conv=True)
    offered = {key for lever in host_candidates(figures, accel) for key, _ in lever.change}
    assert offered == {"train.batch_size"}
    eager = script_profile.script_accel("fp32", ScriptFacts())
    offered = {key for lever in host_candidates(figures, eager) for key, _ in lever.change}
    assert offered == {"accel.compile", "accel.cuda_graph", "train.batch_size"}


def test_a_fragmented_cuda_cache_offers_expandable_segments():
    verdict = Verdict("host-bound", "", Lever("", ""), candidates=[])
    figures = StepFigures(step_ms=10.0)
    retried = ScriptFacts(alloc_retries=3)
    (lever,) = script_candidates(verdict, retried, "cuda", figures)
    assert lever.args == ("--with", "expandable-segments")
    assert "retried 3 allocations in the profiled steps" in lever.text
    assert script_candidates(verdict, ScriptFacts(), "cuda", figures) == []
    assert script_candidates(verdict, retried, "cpu", figures) == []
    assert script_timing.alloc_retries() == 0  # no CUDA here: none
