"""The levers a script's profile can pull from outside the script, with no edit to it
(``kasoku profile --with LEVER -- python train.py``), and the verdict's levers said in the
script's terms: the change to make, at which line.

Set before the script starts (``ScriptLevers.applied``):

- ``tf32``: fp32 matrix products and convolutions on TF32 tensor cores (CUDA);
- ``cudnn-benchmark``: cuDNN tries its algorithms for each new shape and keeps the fastest;
- ``threads=N``: PyTorch's CPU threads;
- ``bf16``: bf16 autocast (on the GPU where there is one, else on the CPU) for the script's
  main thread, outside its backward passes (``bf16_autocast``): the forward and the loss in bf16
  where autocast casts, as ``torch.autocast`` blocks around them would compute them.

Set on the script's objects as it makes them (``kasoku.commands.script_watch``):

- ``workers=N``: every DataLoader made with ``num_workers=N`` (what the script gave, or the
  default 0, overridden);
- ``pin-memory``: every DataLoader made with ``pin_memory=True`` (its batches in page-locked
  memory, copied to the GPU without the driver's staging);
- ``replay``: the DataLoader's first batches kept during the skipped steps, then handed out
  again in turn instead of new ones: the steps without the wait for data (the input-bound
  bound's proof, as a workload's synthetic batches on the device are).
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kasoku.advisor.levers import Lever, estimate, given, idle_speedup
from kasoku.advisor.script_words import (
    UNKNOWN_BATCH_CAVEAT,
    at,
    batch_words,
    edit_words,
    experiment_words,
)
from kasoku.advisor.verdict import Experiment, Verdict
from kasoku.core.errors import ConfigError
from kasoku.core.flags import with_args, with_value
from kasoku.perf.cpu import usable_cores
from kasoku.perf.profile.figures import StepFigures

NAMES = ("replay", "workers=N", "threads=N", "tf32", "cudnn-benchmark", "bf16", "pin-memory")


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
}
"""What each lever changes in what the script computes (``pin-memory`` changes nothing):
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
    """The ``--with`` levers of one run of a script."""
    replay: bool = False
    workers: int | None = None
    threads: int | None = None
    tf32: bool = False
    cudnn_benchmark: bool = False
    bf16: bool = False
    pin_memory: bool = False
    given: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, values: list[str] | None) -> "ScriptLevers":
        """``--with`` values as levers; a ``ConfigError`` naming the levers for any other."""
        levers = cls(given=list(values or ()))
        for value in levers.given:
            name, _, count = value.partition("=")
            if name in ("workers", "threads") and count:
                if not count.isdigit() or (name == "threads" and int(count) < 1):
                    raise ConfigError(f"{with_text(value)}: {name}=N takes a whole number"
                                      + (" from 1" if name == "threads" else ""))
                setattr(levers, name, int(count))
            elif not count and name in ("replay", "tf32", "cudnn-benchmark", "bf16",
                                        "pin-memory"):
                setattr(levers, name.replace("-", "_"), True)
            else:
                raise ConfigError(f"{with_text(value)}: not a lever kasoku sets from outside a "
                                  f"script (it sets {', '.join(NAMES)})")
        return levers

    @contextlib.contextmanager
    def applied(self):
        """The process-wide levers set while the script runs, put back after."""
        saved = (torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32,
                 torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
        with contextlib.ExitStack() as stack:
            if self.threads:
                torch.set_num_threads(self.threads)
            if self.tf32:
                torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
            if self.cudnn_benchmark:
                torch.backends.cudnn.benchmark = True
            if self.bf16:
                device = "cuda" if torch.cuda.is_available() else "cpu"
                stack.enter_context(bf16_autocast(device))
            try:
                yield self
            finally:
                torch.set_num_threads(saved[0])
                (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                 torch.backends.cudnn.benchmark) = saved[1:]


@contextlib.contextmanager
def bf16_autocast(device: str):
    """bf16 autocast on ``device`` for the calling thread while the block runs, computing what
    ``torch.autocast`` blocks around each forward and loss compute, with the block left open.

    One ``torch.autocast`` block around the whole script would train on stale weights:
    autocast keeps the bf16 copy of each weight it casts and drops those copies only when its
    outermost block exits, so every forward after the first would use the first one's weights
    while the optimizer updates the fp32 ones. Here the autocast state is set, not entered as a
    block, with its weight cache off: each forward casts the weights as they are, and a block
    the script enters itself stays the outermost one (its exit clears its cache as it would).
    The backward passes (``torch.Tensor.backward``, ``torch.autograd.backward``) run with
    autocast off, as after a block's exit; the optimizer's step casts nothing either way. The
    cost of the cache's absence: a weight used twice in one forward is cast twice."""
    saved = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device),
             torch.is_autocast_cache_enabled())
    patched = [(torch.Tensor, "backward", torch.Tensor.backward),
               (torch.autograd, "backward", torch.autograd.backward)]
    for owner, name, original in patched:
        setattr(owner, name, _without_autocast(original, device))
    torch.set_autocast_enabled(device, True)
    torch.set_autocast_dtype(device, torch.bfloat16)
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device, saved[0])
        torch.set_autocast_dtype(device, saved[1])
        torch.set_autocast_cache_enabled(saved[2])
        for owner, name, original in patched:
            setattr(owner, name, original)


def _without_autocast(backward, device: str):
    def run(*args, **kwargs):
        enabled = torch.is_autocast_enabled(device)
        torch.set_autocast_enabled(device, False)
        try:
            return backward(*args, **kwargs)
        finally:
            torch.set_autocast_enabled(device, enabled)
    return run


# --- where in the script --------------------------------------------------------------------

_NOT_USER = tuple(str(Path(p).resolve()) + os.sep for p in
                  {Path(torch.__file__).parent, Path(__file__).parents[1],
                   Path(contextlib.__file__).parent})


def user_site(roots: tuple[Path, ...], depth: int = 2) -> str | None:
    """``file.py:LINE`` of the innermost caller in the script's own files (under ``roots``,
    not PyTorch's, kasoku's, Python's or an installed package's), or None."""
    frame = sys._getframe(depth)
    while frame is not None:
        name = frame.f_code.co_filename
        if _is_user(name, roots):
            return f"{_shown(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _is_user(name: str, roots: tuple[Path, ...]) -> bool:
    if name.startswith("<") or "site-packages" in name or "dist-packages" in name:
        return False
    path = str(Path(name).resolve())
    return not path.startswith(_NOT_USER) and any(
        path.startswith(str(root) + os.sep) for root in roots)


def _shown(name: str) -> str:
    """A path as the user would write it: relative to the working directory where it can be."""
    try:
        return os.path.relpath(name)
    except ValueError:
        return name


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


def _as(lever: Lever, text: str, change: dict) -> Lever:
    """The script's lever for ``lever``: ``change`` of its ``--with`` levers, or {} (an
    edit), with what that changes in what the script computes as its caveat."""
    caveat = "".join(numerics(with_value(k, v)) for k, v in change.items())
    return Lever(text, lever.expect, change, lever.speedup, lever.caveat or caveat)


H2D_PCT = 5.0
"""Copies to the GPU from pageable memory taking this share of the step offer pinned memory."""
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
    (``H2D_PCT``)."""
    f = figures or StepFigures()
    data_pct, out = given(f.data_pct, 0.0), []
    h2d_pct = 100 * given(f.h2d_ms, 0.0) / f.step_ms if f.step_ms else 0.0
    if device == "cuda" and facts.loader_steps and f.h2d_pageable and h2d_pct >= H2D_PCT:
        out.append(Lever(f"copy the batches from pinned memory: DataLoader(..., pin_memory="
                         f"True){at(facts.loader_site)}, and .to(device, non_blocking=True) "
                         f"(the copies from pageable memory take {h2d_pct:.0f}% of the step)",
                         estimate(None, "the copies' share at most"), {"with.pin_memory": True}))
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
    out += extra_levers(verdict.rule, facts, device, figures)
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
