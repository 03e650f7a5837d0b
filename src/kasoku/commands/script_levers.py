"""The levers a script's profile can pull from outside the script, with no edit to it
(``kasoku profile --with LEVER -- python train.py``), and the verdict's levers said in the
script's terms: the change to make, at which line.

Set before the script starts (``ScriptLevers.applied``):

- ``tf32``: fp32 matrix products and convolutions on TF32 tensor cores (CUDA);
- ``cudnn-benchmark``: cuDNN tries its algorithms for each new shape and keeps the fastest;
- ``threads=N``: PyTorch's CPU threads;
- ``bf16``: bf16 autocast (on the GPU where there is one, else on the CPU) for the script's
  main thread, outside its backward passes (``bf16_autocast``): the forward and the loss in bf16
  where autocast casts, as ``torch.autocast`` blocks around them would compute them;
- ``interop-threads=N``: PyTorch's inter-op threads, for the rest of the process (PyTorch takes
  it once, before any inter-op work: later, the lever says ``too late``).

Set on the script's objects as it makes them (``kasoku.commands.script_watch``):

- ``workers=N``: every DataLoader made with ``num_workers=N`` (what the script gave, or the
  default 0, overridden);
- ``pin-memory``: every DataLoader made with ``pin_memory=True`` (its batches in page-locked
  memory, copied to the GPU without the driver's staging);
- ``replay``: the DataLoader's first batches kept during the skipped steps, then handed out
  again in turn instead of new ones: the steps without the wait for data (the input-bound
  bound's proof, as a workload's synthetic batches on the device are);
- ``fused-optimizer``: torch's Adam, AdamW and SGD made with ``fused=True`` where their
  parameters' device has fused kernels (the GPU, the CPU), else ``foreach=True``;
- ``channels-last``: the model (the first module the script's code calls, the forward's line
  the advice names) with its convolution weights and 4-D inputs in ``torch.channels_last``,
  before its first call (a model without ``Conv2d``: not applied, ``no Conv2d``);
- ``compile[=MODE]``: that model compiled in place (``model.compile(mode=MODE)``, ``default``
  or ``reduce-overhead``, ...) before its first call; not applied without inductor's C++
  compiler on the CPU (``no C++ compiler``), nor ``reduce-overhead`` (CUDA graphs) on the CPU.

Their mechanics are in ``kasoku.commands.script_apply``. A lever that could not apply
(``ScriptLevers.unapplied``: why, in a word or two) is said after the run; a measuring side
with one is no measure of it and ends in an error that says why.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kasoku.advisor.levers import Lever, estimate, given, idle_speedup
from kasoku.advisor.script_words import (
    EDITS,
    UNKNOWN_BATCH_CAVEAT,
    at,
    batch_words,
    edit_words,
    experiment_words,
)
from kasoku.advisor.verdict import Experiment, Verdict
from kasoku.commands.script_apply import (
    COMPILE_MODES,
    FUSED,
    Unapplied,
    bf16_autocast,
    compiler_missing,
    found_model,
    fused_optimizers,
    interop_threads,
)
from kasoku.core.errors import ConfigError
from kasoku.core.flags import with_args, with_value
from kasoku.perf.cpu import usable_cores
from kasoku.perf.profile.figures import StepFigures

NAMES = ("replay", "workers=N", "threads=N", "interop-threads=N", "tf32", "cudnn-benchmark",
         "bf16", "pin-memory", "fused-optimizer", "channels-last", "compile[=MODE]")
SWITCHES = ("replay", "tf32", "cudnn-benchmark", "bf16", "pin-memory", "fused-optimizer",
            "channels-last")
"""The levers without a value."""


NUMERICS = {
    "bf16": "the forward and the loss in bf16 where autocast casts (8 significant bits): the "
            "losses differ from the run as given, as with autocast written into the script",
    "tf32": "fp32 products on the GPU with TF32's 10-bit mantissa: the losses differ from the "
            "run as given in their third or fourth digit",
    "threads": "the CPU's products may sum in another order: the losses can differ in their "
               "last digits",
    "cudnn-benchmark": "cuDNN may pick other convolution algorithms: the losses can differ in "
                       "their last digits",
    "workers": "a dataset that draws random numbers draws them in the worker processes, each "
               "seeded apart: other random samples, the same data otherwise",
    "replay": "the steps train on the DataLoader's first batches again and again: a measure "
              "of the step without its wait for data, not a way to train",
    "fused-optimizer": "the update's arithmetic in another order (one kernel for all the "
                       "parameters): the losses can differ in their last digits",
    "channels-last": "the convolutions may run other algorithms on the NHWC layout: the losses "
                     "can differ in their last digits",
    "compile": "fused kernels compute the forward and the backward in another order: the "
               "losses can differ in their last digits",
}
"""What each lever changes in what the script computes (``pin-memory`` and
``interop-threads`` change nothing: the same operators, run on other threads):
said when a person asks for it, and the caveat of the advice that pulls it.
tests/test_script_numerics.py holds each to it."""


def numerics(value: str) -> str:
    """What the ``--with`` lever ``value`` (``workers=2``) changes in what the script computes,
    or ""."""
    return NUMERICS.get(value.partition("=")[0], "")


def with_text(value: str) -> str:
    """``--with VALUE``, as a person writes it."""
    return " ".join(with_args(value))


def default_workers() -> int:
    """The worker count tried for a script's DataLoader: 4, or fewer on fewer cores (as
    kasoku's own multiprocess loader)."""
    return min(4, usable_cores())


@dataclass
class ScriptLevers:
    """The ``--with`` levers of one run of a script, and those that could not apply."""
    replay: bool = False
    workers: int | None = None
    threads: int | None = None
    interop_threads: int | None = None
    tf32: bool = False
    cudnn_benchmark: bool = False
    bf16: bool = False
    pin_memory: bool = False
    fused_optimizer: bool = False
    channels_last: bool = False
    compile: str | None = None
    """The mode of ``--with compile[=MODE]`` (``default`` when none is given), or None."""
    given: list[str] = field(default_factory=list)
    unapplied: Unapplied = field(default_factory=Unapplied)
    """A lever's name -> why it did not apply, as the run found (``applied``)."""
    optimizers: list[str] = field(default_factory=list)
    """How ``fused-optimizer`` made each optimizer (``fused``, ``foreach``, ...)."""

    @classmethod
    def parse(cls, values: list[str] | None) -> "ScriptLevers":
        """``--with`` values as levers; a ``ConfigError`` of one line for a value a lever does
        not take, or naming the levers for any other."""
        levers = cls(given=list(values or ()))
        for value in levers.given:
            name, _, count = value.partition("=")
            if name in ("workers", "threads", "interop-threads") and count:
                if not count.isdigit() or (name != "workers" and int(count) < 1):
                    raise ConfigError(f"{with_text(value)}: {name}=N takes a whole number"
                                      + (" from 1" if name != "workers" else ""))
                setattr(levers, name.replace("-", "_"), int(count))
            elif name == "compile":
                if count and count not in COMPILE_MODES:
                    raise ConfigError(f"{with_text(value)}: compile=MODE takes one of "
                                      f"torch.compile's modes: {', '.join(COMPILE_MODES)}")
                levers.compile = count or "default"
            elif not count and name in SWITCHES:
                setattr(levers, name.replace("-", "_"), True)
            else:
                raise ConfigError(f"{with_text(value)}: not a lever kasoku sets from outside a "
                                  f"script (it sets {', '.join(NAMES)})")
        return levers

    @contextlib.contextmanager
    def applied(self, roots: tuple[Path, ...] = ()):
        """The levers set while the script runs (its own files under ``roots``: where the
        model it calls first is found), put back after, except ``interop-threads`` (PyTorch
        takes it once per process). ``unapplied`` says why any could not apply once the
        block has run."""
        saved = (torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32,
                 torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
        with contextlib.ExitStack() as stack:
            if self.threads:
                torch.set_num_threads(self.threads)
            if self.interop_threads:
                interop_threads(self.interop_threads, self.unapplied)
            if self.tf32:
                torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
            if self.cudnn_benchmark:
                torch.backends.cudnn.benchmark = True
            if self.bf16:
                device = "cuda" if torch.cuda.is_available() else "cpu"
                stack.enter_context(bf16_autocast(device))
            if self.fused_optimizer:
                stack.enter_context(fused_optimizers(self.optimizers))
            stack.enter_context(found_model(roots, self.unapplied, self.channels_last,
                                            self.compile))
            try:
                yield self
            finally:
                torch.set_num_threads(saved[0])
                (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                 torch.backends.cudnn.benchmark) = saved[1:]
                if self.fused_optimizer and not self.optimizers:
                    self.unapplied["fused-optimizer"] = f"no {'/'.join(FUSED)}"
                elif self.fused_optimizer and "differentiable" in self.optimizers:
                    self.unapplied["fused-optimizer"] = "differentiable"

    def unapplied_lines(self) -> list[str]:
        """What the run says of each lever that could not apply."""
        return [f"{with_text(name)} was not applied: {why}"
                for name, why in self.unapplied.items()]


# --- the verdict's levers in the script's terms --------------------------------------------

@dataclass
class ScriptFacts:
    """What the profile saw of the script: where its DataLoader and its forward are, how
    many workers it gave, and the settings in force at its profiled window."""
    loader_site: str | None = None
    num_workers: int | None = None
    forward_site: str | None = None
    autocast: str | None = None
    """The dtype of an autocast the script entered itself (``bfloat16``), or None."""
    tf32: bool = False
    cudnn_benchmark: bool = False
    has_conv: bool = False
    loader_steps: bool = False
    """Whether the steps take their batches from a DataLoader."""
    batch_size: int | None = None
    """The first batch's length; None where no batch came from a DataLoader."""
    optimizer_impl: str | None = None
    """How the optimizer whose steps are the steps updates (``script_apply.optimizer_impl``:
    ``fused``, ``foreach``, ``for-loop``) where ``--with fused-optimizer`` can make it fused
    (``script_apply.FUSED``); else None."""


def script_lever(lever: Lever, facts: ScriptFacts, device: str) -> Lever | None:
    """``lever`` (one of the verdict's candidates, a change of the run's fields) as the
    script's lever: a change of its ``--with`` levers where kasoku can pull it from outside
    (measured), else none (the edit to make, an estimate); None where it makes no sense for a
    script."""
    change = dict(lever.change)
    if change == {"train.loader": "multiprocess"}:
        if not facts.loader_steps:
            return None  # --with workers=N sets a DataLoader's: none gives the steps batches
        n = default_workers()
        return _as(lever, f"load in {n} worker processes: DataLoader(..., num_workers={n})"
                   f"{at(facts.loader_site)}", {"with.workers": n})
    if change == {"accel.precision": "bf16"}:
        where = f" (the forward: {facts.forward_site})" if facts.forward_site else ""
        return _as(lever, f"bf16: torch.autocast('{device}', dtype=torch.bfloat16) around the "
                   f"forward and the loss{where}", {"with.bf16": True})
    outside = _outside(change, facts, device)
    where = f" (the forward: {facts.forward_site})" if facts.forward_site else ""
    if outside is not None:
        return _as(lever, outside[1] + where, outside[0])
    why = compiler_missing(device)
    if why and change.keys() & {"accel.compile", "accel.cuda_graph"}:
        # an edit would not compile either: said in a word, not offered as a measure
        return _as(lever, f"{EDITS[next(iter(change.items()))]}{where} ({why}: not measured)",
                   {})
    if change.keys() == {"train.threads"}:
        n = change["train.threads"]
        return _as(lever, f"torch.set_num_threads({n}) (or OMP_NUM_THREADS={n})",
                   {"with.threads": n})
    if change.keys() == {"train.batch_size"}:
        # its size only where the steps take their batches from a DataLoader kasoku saw
        words = batch_words(facts.batch_size if facts.loader_steps else None,
                            facts.loader_site, facts.forward_site)
        if not (facts.loader_steps and facts.batch_size):
            lever = replace(lever, caveat=UNKNOWN_BATCH_CAVEAT)
    else:
        words = edit_words(change, facts.loader_site)
    if words is None:
        return None
    return _as(lever, words + " (needs an edit: not measured)", {})


def _outside(change: dict, facts: ScriptFacts, device: str) -> tuple[dict, str] | None:
    """The ``--with`` levers that make the run's ``change`` from outside the script, and their
    words, where they can apply to it, else None (an edit): a fused optimizer where the
    script's is one of ``FUSED`` and not fused, channels_last for a model with convolutions,
    the model compiled where inductor has its compiler (its CUDA graphs: ``reduce-overhead``,
    on the GPU)."""
    item = next(iter(change.items()), None)
    if change == {"accel.optimizer_impl": "fused"}:
        if facts.optimizer_impl in (None, "fused"):
            return None
        return {"with.fused_optimizer": True}, EDITS[item]
    if change == {"accel.channels_last": True}:
        return ({"with.channels_last": True}, EDITS[item]) if facts.has_conv else None
    if compiler_missing(device):
        return None
    if change == {"accel.compile": True}:
        return {"with.compile": True}, "torch.compile the model: model.compile()"
    if change == {"accel.cuda_graph": True} and device == "cuda":
        return ({"with.compile": "reduce-overhead"}, "CUDA graphs for the model's forward and "
                "backward: model.compile(mode='reduce-overhead')")
    return None


def _as(lever: Lever, text: str, change: dict) -> Lever:
    """The script's lever for ``lever``: ``change`` of its ``--with`` levers, or {} (an
    edit), with what that changes in what the script computes as its caveat."""
    caveat = "".join(numerics(with_value(k, v)) for k, v in change.items())
    return Lever(text, lever.expect, change, lever.speedup, lever.caveat or caveat)


H2D_PCT = 5.0
"""Copies to the GPU from pageable memory taking this share of the step offer pinned memory."""
UPDATE_PCT = 10.0
"""An optimizer that is not fused taking this share of the step offers a fused one."""
WAIT_PCT = 10.0
"""A step that waits this share of its time for batches from a DataLoader in the script's
own process is offered worker processes whatever its bound: the loading is host time, and a
host-bound step's host is its bound."""


def extra_levers(rule: str, facts: ScriptFacts, device: str,
                 figures: StepFigures | None = None) -> list[Lever]:
    """Levers a script may lack that kasoku's workloads never do (kasoku sets them itself):
    TF32 for fp32 products and cuDNN's autotuning on a GPU-bound step; worker processes for
    a step that waits for its batches (``WAIT_PCT``), where the bound is not the input's
    (whose own levers include them); pinned memory for batches copied from pageable memory
    (``H2D_PCT``); a fused optimizer for an update not fused that takes a share of the step
    (``UPDATE_PCT``)."""
    f = figures or StepFigures()
    data_pct, out = given(f.data_pct, 0.0), []
    h2d_pct = 100 * given(f.h2d_ms, 0.0) / f.step_ms if f.step_ms else 0.0
    if device == "cuda" and facts.loader_steps and f.h2d_pageable and h2d_pct >= H2D_PCT:
        out.append(Lever(f"copy the batches from pinned memory: DataLoader(..., pin_memory="
                         f"True){at(facts.loader_site)}, and .to(device, non_blocking=True) "
                         f"(the copies from pageable memory take {h2d_pct:.0f}% of the step)",
                         estimate(None, "the copies' share at most"), {"with.pin_memory": True}))
    update_pct = 100 * given((f.by_class_ms or {}).get("optimizer"), 0.0) / f.step_ms \
        if f.step_ms else 0.0
    if facts.optimizer_impl in ("for-loop", "foreach") and update_pct >= UPDATE_PCT:
        out.append(Lever(f"{EDITS[('accel.optimizer_impl', 'fused')]} (the update takes "
                         f"{update_pct:.0f}% of the step)",
                         estimate(None, "the update's share at most"),
                         {"with.fused_optimizer": True}, caveat=NUMERICS["fused-optimizer"]))
    if rule != "input-bound" and facts.loader_steps and data_pct >= WAIT_PCT \
            and not facts.num_workers:
        n = default_workers()
        out.append(Lever(f"load in {n} worker processes: DataLoader(..., num_workers={n})"
                         f"{at(facts.loader_site)} (the step waits {data_pct:.0f}% for its "
                         f"batches)", estimate(idle_speedup(data_pct), "up to"),
                         {"with.workers": n}, idle_speedup(data_pct), NUMERICS["workers"]))
    if device != "cuda" or "device-bound" not in rule:
        return out
    if not facts.tf32 and facts.autocast is None:
        out.append(Lever("fp32 products on TF32 tensor cores: torch.backends.cuda.matmul."
                         "allow_tf32 = True (or torch.set_float32_matmul_precision('high'))",
                         "estimate: up to the TF32/fp32 peak ratio", {"with.tf32": True},
                         caveat=NUMERICS["tf32"]))
    if facts.has_conv and not facts.cudnn_benchmark:
        out.append(Lever("let cuDNN pick the fastest convolutions: torch.backends.cudnn."
                         "benchmark = True", "estimate: the convolutions' fastest algorithms",
                         {"with.cudnn_benchmark": True},
                         caveat=NUMERICS["cudnn-benchmark"]))
    return out


def script_candidates(verdict: Verdict, facts: ScriptFacts, device: str,
                      figures: StepFigures | None = None) -> list[Lever]:
    """The verdict's candidate levers for this script, best first: those kasoku pulls from
    outside (to be measured), then those that need an edit (estimates)."""
    out, seen = [], set()
    for candidate in verdict.candidates:
        lever = script_lever(candidate, facts, device)
        if lever is not None and lever.text not in seen:
            seen.add(lever.text)
            out.append(lever)
    changes = [lever.change for lever in out]  # a lever the verdict offers already: once
    out += [lever for lever in extra_levers(verdict.rule, facts, device, figures)
            if lever.change not in changes]
    return sorted(out, key=lambda lever: not lever.change)


def script_experiments(verdict: Verdict, facts: ScriptFacts
                       ) -> tuple[list[Experiment], list[str]]:
    """The verdict's ``--confirm`` experiments a script's runs can make (synthetic batches on
    the device: the DataLoader's batches replayed, where its steps take them from one), and
    the labels of those that cannot be made without an edit (a larger batch's size only where
    the steps take their batches from a DataLoader whose batches were seen)."""
    kept, left = [], []
    for e in verdict.experiments:
        change = dict(e.change)
        if "data.synthetic" in change and facts.loader_steps:
            kept.append(Experiment("replayed batches (no wait for data)", {"with.replay": True},
                                   e.faster))
        else:
            words = experiment_words(e)
            if "train.batch_size" in change:  # the size only of a DataLoader's batches seen
                known = facts.batch_size if facts.loader_steps else None
                words = f"{words.split(' (')[0]} ({2 * known})" if known else "batch x2"
            left.append(words)
    return kept, left
