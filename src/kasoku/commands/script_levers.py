"""The levers a script's profile can pull from outside the script, with no edit to it
(``kasoku profile --with LEVER -- python train.py``), and what the profile saw of the script
(``ScriptFacts``).

Set before the script starts (``ScriptLevers.applied``):

- ``tf32``: fp32 matrix products and convolutions on TF32 tensor cores (CUDA);
- ``cudnn-benchmark``: cuDNN tries its algorithms for each new shape and keeps the fastest;
- ``threads=N``: PyTorch's CPU threads;
- ``bf16``: bf16 autocast (on the GPU where there is one, else on the CPU) for the script's
  main thread, outside its backward passes (``bf16_autocast``): the forward and the loss in bf16
  where autocast casts, as ``torch.autocast`` blocks around them would compute them;
- ``interop-threads=N``: PyTorch's inter-op threads, for the rest of the process (PyTorch takes
  it once, before any inter-op work: later, the lever says ``too late``);
- ``expandable-segments``: CUDA's caching allocator with expandable segments
  (``PYTORCH_CUDA_ALLOC_CONF``, before the script's first CUDA allocation; ``no CUDA`` on a
  CPU).

In force from the process's start (``kasoku.commands.script_preload``):

- ``allocator[=jemalloc|tcmalloc]``: a malloc from a library found on this machine, first in
  ``LD_PRELOAD`` (freed memory kept for the next allocations rather than returned to the
  OS); where none is found, not applied: ``no jemalloc or tcmalloc here (apt install
  libjemalloc2)``.

Set on the script's objects as it makes them (``kasoku.commands.script_watch``):

- ``workers=N``: every DataLoader made with ``num_workers=N`` (what the script gave, or the
  default 0, overridden);
- ``pin-memory``: every DataLoader made with ``pin_memory=True`` (its batches in page-locked
  memory, copied to the GPU without the driver's staging);
- ``persistent-workers``, ``prefetch=N``: every DataLoader with worker processes (the script's,
  or ``workers=N``'s) made with ``persistent_workers=True`` (its workers kept from one epoch
  to the next), with ``prefetch_factor=N`` (N batches loaded ahead by each worker); where no
  DataLoader has workers, not applied: ``no worker processes``;
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
with one is no measure of it and ends in an error that says why. The verdict's levers as the
script's (``--with`` levers where they apply, else edits) are in
``kasoku.commands.script_offers``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kasoku.commands.script_apply import (
    COMPILE_MODES,
    FUSED,
    Unapplied,
    bf16_autocast,
    found_model,
    fused_optimizers,
    interop_threads,
    loaders_unapplied,
)
from kasoku.commands.script_preload import (
    ALLOCATORS,
    allocator_unapplied,
    expandable_segments,
    start_env,
)
from kasoku.core.errors import ConfigError
from kasoku.core.flags import with_args
from kasoku.perf.cpu import usable_cores

NAMES = ("replay", "workers=N", "threads=N", "interop-threads=N", "tf32", "cudnn-benchmark",
         "bf16", "pin-memory", "persistent-workers", "prefetch=N", "fused-optimizer",
         "channels-last", "compile[=MODE]", "allocator[=jemalloc|tcmalloc]",
         "expandable-segments")
SWITCHES = ("replay", "tf32", "cudnn-benchmark", "bf16", "pin-memory", "persistent-workers",
            "fused-optimizer", "channels-last", "expandable-segments")
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
"""What each lever changes in what the script computes (``pin-memory``,
``interop-threads``, ``persistent-workers``, ``prefetch``, ``allocator`` and
``expandable-segments`` change nothing: the same operators, on other threads or memory):
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
    persistent_workers: bool = False
    prefetch: int | None = None
    fused_optimizer: bool = False
    channels_last: bool = False
    compile: str | None = None
    """The mode of ``--with compile[=MODE]`` (``default`` when none is given), or None."""
    allocator: tuple[str, ...] = ()
    """The mallocs ``--with allocator[=NAME]`` takes, the first found (``ALLOCATORS``' keys)."""
    expandable_segments: bool = False
    given: list[str] = field(default_factory=list)
    unapplied: Unapplied = field(default_factory=Unapplied)
    """A lever's name -> why it did not apply, as the run found (``applied``)."""
    optimizers: list[str] = field(default_factory=list)
    """How ``fused-optimizer`` made each optimizer (``fused``, ``foreach``, ...)."""
    loaders: list[int] = field(default_factory=list)
    """The worker processes of each DataLoader the script made, as the levers made it."""

    @classmethod
    def parse(cls, values: list[str] | None) -> "ScriptLevers":
        """``--with`` values as levers; a ``ConfigError`` of one line for a value a lever does
        not take, or naming the levers for any other."""
        levers = cls(given=list(values or ()))
        for value in levers.given:
            name, _, count = value.partition("=")
            if name in ("workers", "threads", "interop-threads", "prefetch") and count:
                if not count.isdigit() or (name != "workers" and int(count) < 1):
                    raise ConfigError(f"{with_text(value)}: {name}=N takes a whole number"
                                      + (" from 1" if name != "workers" else ""))
                setattr(levers, name.replace("-", "_"), int(count))
            elif name == "compile":
                if count and count not in COMPILE_MODES:
                    raise ConfigError(f"{with_text(value)}: compile=MODE takes one of "
                                      f"torch.compile's modes: {', '.join(COMPILE_MODES)}")
                levers.compile = count or "default"
            elif name == "allocator":
                if count and count not in ALLOCATORS:
                    raise ConfigError(f"{with_text(value)}: allocator=NAME takes "
                                      f"{' or '.join(ALLOCATORS)}")
                levers.allocator = (count,) if count else tuple(ALLOCATORS)
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
            if self.expandable_segments:
                stack.enter_context(expandable_segments(self.unapplied))
            if self.allocator and (why := allocator_unapplied(self.allocator)):
                self.unapplied["allocator"] = why
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
                self.unapplied.update(loaders_unapplied(
                    self.loaders, self.persistent_workers, self.prefetch))

    def start_env(self, env: dict) -> dict:
        """``env`` for a fresh process that runs the script with these levers (a measuring
        side): the allocator preloaded, CUDA's allocator settings."""
        return start_env(env, self.allocator, self.expandable_segments)

    def unapplied_lines(self) -> list[str]:
        """What the run says of each lever that could not apply."""
        return [f"{with_text(name)} was not applied: {why}"
                for name, why in self.unapplied.items()]


# --- what the profile saw of the script (``script_offers`` reads it) ----------------------

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
    compiled: str | None = None
    """The model's torch.compile mode (``default``, ``reduce-overhead``, ...; ``compiled`` where
    the script compiled it itself, its mode unseen), or None where it runs eagerly."""
    channels_last: bool = False
    """Whether the model's convolution weights are in ``torch.channels_last``."""
    alloc_retries: int = 0
    """The CUDA caching allocator's retries during the profiled steps (a fragmented cache:
    each frees it and waits for the device)."""
    loader_steps: bool = False
    """Whether the steps take their batches from a DataLoader."""
    prefetch_factor: int | None = None
    """The batches each worker of the steps' DataLoader loads ahead (torch's default 2), or
    None where it has no worker processes (as the levers made it)."""
    persistent_workers: bool = False
    batch_size: int | None = None
    """The first batch's length; None where no batch came from a DataLoader."""
    optimizer_impl: str | None = None
    """How the optimizer whose steps are the steps updates (``script_apply.optimizer_impl``:
    ``fused``, ``foreach``, ``for-loop``) where ``--with fused-optimizer`` can make it fused
    (``script_apply.FUSED``); else None."""
