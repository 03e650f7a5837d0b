"""torch.compile as a lever (seed 004's fused BN+ReLU(+add) and elementwise chains).

The model is compiled in place (``nn.Module.compile``): it stays the same object of the same
class, with the same ``state_dict`` keys (``torch.compile(model)`` would return a wrapper whose
keys gain an ``_orig_mod.`` prefix, and snapshots would not load across the lever). Compilation
happens at the first forward and the first backward, so its time lands in the warm-up steps,
which a benchmark measures apart from the steady rate.

The step's loss and metric are compiled too (``compile_fn`` of the step's
``kasoku.train.step.Objective``), one graph of their own: outside the model's compiled code a
cross-entropy runs eagerly, and over a language model's logits
that is most of a step's memory traffic (the logits copied to fp32 for the loss, PyTorch's
softmax kernels forward and back, the fp32 gradient filled), where inductor reads the bf16
logits once each way in fused kernels. nanoGPT's model computes its loss inside the compiled
forward for the same reason.
"""
from __future__ import annotations

import shutil
from typing import Callable

import torch
from torch import nn

from kasoku.accel.config import COMPILE_MODES
from kasoku.accel.notes import skip
from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag

GRAPHING_MODES = ("reduce-overhead", "max-autotune")
"""Modes that capture CUDA graphs of their own (CUDA graph trees)."""


def has_cxx_compiler() -> bool:
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def import_compiler(backend: str = "inductor") -> None:
    """Import torch.compile's machinery now rather than at the first compiled call: dynamo
    and inductor are seconds of imports, which belong to the program's start-up (before the
    trainer's clock), not to the first training step. Compilation itself still happens at
    the first step and is counted there."""
    import torch._dynamo  # noqa: F401
    if backend == "inductor":
        import torch._inductor.compile_fx  # noqa: F401


def apply_compile(model: nn.Module, device=None, notes: list[str] | None = None,
                  mode: str = "default", combo_kernels: bool = False,
                  buffer_reuse: bool = True, backend: str = "inductor",
                  static: bool = False) -> nn.Module:
    """Compile ``model`` in place in ``mode``; returns it. Apply after everything that changes
    the weights' dtype or memory format (the compiled code specializes on them). On a CPU
    inductor needs a C++ compiler: without one the lever is warned about once, noted and
    skipped. ``combo_kernels``: inductor's combo kernels (mode default only).
    ``buffer_reuse=False``: inductor's generated code never hands a buffer to a later kernel
    (``kasoku.accel.wgrad_stream`` needs it). ``backend``: torch.compile's (tests use
    ``aot_eager``). ``static``: never compiled for symbolic shapes (``dynamic=False``): a
    second batch size in the process compiles again for its own shapes, instead of once more
    with a symbolic batch dimension (torch.compile's automatic dynamic shapes)."""
    if mode not in COMPILE_MODES:
        raise ConfigError(f"unknown compile mode {mode!r}; choose one of "
                          f"{', '.join(COMPILE_MODES)}")
    device = torch.device(device) if device is not None else None
    if backend == "inductor" and device is not None and device.type == "cpu" \
            and not has_cxx_compiler():
        skip(notes, "compile: inductor needs a C++ compiler on cpu (g++ or clang++) and none "
                    "is on PATH; running eagerly")
        return model
    mode = None if mode == "default" else mode
    options = {}
    if combo_kernels:
        if mode is not None:  # torch.compile takes a mode or inductor options, not both
            raise ConfigError(f"{flag('accel.combo_kernels')} sets inductor options, which "
                              f"torch.compile does not take beside compile mode {mode!r}; use "
                              "compile mode default")
        options["combo_kernels"] = True
    if not buffer_reuse:
        # kasoku.accel.wgrad_stream: a second stream still reads gradient buffers after the
        # backward code moved on; inductor's generated code must not hand them to later kernels.
        options["allow_buffer_reuse"] = False
    if backend != "inductor" or not options:
        options = None
    import_compiler(backend)
    if options and mode is not None:  # the mode's own options, then these
        from torch._inductor import list_mode_options
        options = {**list_mode_options(mode), **options}
        mode = None
    model.compile(mode=mode, backend=backend, options=options, dynamic=False if static else None)
    return model


def compile_fn(fn: Callable | None, device=None, backend: str = "inductor",
               static: bool = False) -> Callable | None:
    """``fn`` (the step's objective: output and targets to its loss and metric) compiled in
    torch.compile's default mode, or ``fn`` itself where inductor cannot run (a CPU without
    a C++ compiler: ``apply_compile`` says so). Default mode whatever the model's: a mode that
    captures CUDA graphs of its own would capture the loss apart from the step. ``static``:
    as ``apply_compile``'s."""
    if fn is None:
        return None
    device = torch.device(device) if device is not None else None
    if backend == "inductor" and device is not None and device.type == "cpu" \
            and not has_cxx_compiler():
        return fn
    import_compiler(backend)
    return torch.compile(fn, backend=backend, dynamic=False if static else None)
