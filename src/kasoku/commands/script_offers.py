"""The verdict's levers said in a script's terms (``kasoku profile -- python train.py``):
the ``--with`` levers kasoku pulls from outside the script where they apply to it (measured in
fresh runs of it), else the edit to make, at the script's line (an estimate); the levers a
script may lack that kasoku's own workloads never do (``extra_levers``); the ``--confirm``
experiments its runs can make. The levers themselves, their names and what each changes in
what the script computes are ``kasoku.commands.script_levers``'s.
"""
from __future__ import annotations

from dataclasses import replace

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
from kasoku.commands.script_apply import compiler_missing
from kasoku.commands.script_levers import NUMERICS, ScriptFacts, default_workers, numerics
from kasoku.commands.script_preload import ALLOCATORS, find_allocator, missing
from kasoku.core.flags import with_value
from kasoku.perf.profile.figures import StepFigures


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
    if change == {"accel.keep_memory": True}:
        found = find_allocator()
        if found is None:  # said in a word, not offered as a measure
            return _as(lever, f"{EDITS[('accel.keep_memory', True)]}; not tried: "
                       f"{missing(tuple(ALLOCATORS))}", {})
        return _as(lever, f"keep freed memory: {found[0]}'s malloc (LD_PRELOAD={found[1]})",
                   {"with.allocator": found[0]})
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
    (whose own levers include them), and where its DataLoader has workers already, whatever
    the bound, those workers kept from one epoch to the next and loading further ahead;
    pinned memory for batches copied from pageable memory (``H2D_PCT``); a fused optimizer
    for an update not fused that takes a share of the step (``UPDATE_PCT``); CUDA's
    expandable segments where the caching allocator retried allocations in the profiled
    steps."""
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
    if device == "cuda" and facts.alloc_retries:
        out.append(Lever(f"expandable segments: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:"
                         f"True (the caching allocator freed its cache and retried "
                         f"{facts.alloc_retries} allocation{'s' * (facts.alloc_retries != 1)} "
                         f"in the profiled steps: its memory is fragmented)",
                         estimate(None, "the retries' waits"), {"with.expandable_segments": True}))
    if rule != "input-bound" and facts.loader_steps and data_pct >= WAIT_PCT \
            and not facts.num_workers:
        n = default_workers()
        out.append(Lever(f"load in {n} worker processes: DataLoader(..., num_workers={n})"
                         f"{at(facts.loader_site)} (the step waits {data_pct:.0f}% for its "
                         f"batches)", estimate(idle_speedup(data_pct), "up to"),
                         {"with.workers": n}, idle_speedup(data_pct), NUMERICS["workers"]))
    if facts.loader_steps and data_pct >= WAIT_PCT and facts.prefetch_factor:
        out += _worker_levers(facts, data_pct)
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


def _worker_levers(facts: ScriptFacts, data_pct: float) -> list[Lever]:
    """For a DataLoader with worker processes whose batches the step waits ``data_pct`` for:
    its workers kept between epochs (not restarted at each), and twice as many batches loaded
    ahead by each (an uneven loading absorbed)."""
    waits, out = f"(the step waits {data_pct:.0f}% for its batches)", []
    expect = estimate(idle_speedup(data_pct), "up to")
    if not facts.persistent_workers:
        out.append(Lever(f"keep the worker processes from one epoch to the next: DataLoader("
                         f"..., persistent_workers=True){at(facts.loader_site)} {waits}",
                         expect, {"with.persistent_workers": True}, idle_speedup(data_pct)))
    n = 2 * facts.prefetch_factor
    out.append(Lever(f"load further ahead: DataLoader(..., prefetch_factor={n})"
                     f"{at(facts.loader_site)} {waits}", expect, {"with.prefetch": n},
                     idle_speedup(data_pct)))
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
