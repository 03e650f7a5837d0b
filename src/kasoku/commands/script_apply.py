"""How the ``--with`` levers that act inside a script's process are applied
(``kasoku.commands.script_levers`` says which there are and parses them), and where in the
script a call comes from (``user_site``, ``loader_site``). Kept apart from ``script_levers`` so
that each stays under the modules' size limit: this one is the mechanics (patches of torch's
constructors and calls), that one the levers' names, their validation and the advice.

- ``bf16_autocast``: bf16 autocast for the script's main thread, outside its backward passes;
- ``fused_optimizers``: torch's Adam, AdamW and SGD made with ``fused=True`` where every
  parameter is on a device with fused kernels (the GPU, and the CPU in torch 2.4 and later),
  else ``foreach=True``;
- ``found_model``: the first module with parameters the script's own code calls (the model, as
  ``StepWatch``'s forward hook finds its line) changed before that call runs: its convolution
  weights and 4-D inputs in ``torch.channels_last``, and/or compiled in place
  (``nn.Module.compile``);
- ``interop_threads``: ``torch.set_num_interop_threads``, which PyTorch takes once per process
  and only before any inter-op work;
- ``loader_arguments``: a DataLoader's arguments with the levers' ``num_workers``,
  ``pin_memory``, and where it then has worker processes, ``persistent_workers`` and
  ``prefetch_factor``.

What a lever could not do is kept in ``Unapplied``, a word or two each (``no Conv2d``), for
the run to say and for a measuring side to be no measure of the lever.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path

import torch

FUSED = ("Adam", "AdamW", "SGD")
"""torch.optim's optimizers made fused by ``--with fused-optimizer`` (each takes ``fused=``
and ``foreach=`` as keywords)."""
FUSED_DEVICES = ("cuda", "cpu")
"""Devices with fused kernels for ``FUSED`` (torch 2.4 and later have them on the CPU too):
an optimizer with a parameter elsewhere is made ``foreach`` instead."""
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


class Unapplied(dict):
    """A lever's name (``channels-last``) -> why it did not apply, in a word or two."""


def compiler_missing(device: str) -> str | None:
    """Why ``torch.compile``'s inductor cannot build kernels on ``device`` here, or None: on
    the CPU it compiles C++ (``$CXX``, else ``g++``, as inductor's own default)."""
    if device == "cpu" and not shutil.which(os.environ.get("CXX") or "g++"):
        return "no C++ compiler"
    return None


# --- fused optimizers -----------------------------------------------------------------------

@contextlib.contextmanager
def fused_optimizers(made: list[str]):
    """While the block runs, every ``FUSED`` optimizer the script makes is made fused where
    its parameters allow, else foreach (whatever the script gave for either); ``made`` gets
    ``"fused"``, ``"foreach"`` or ``"differentiable"`` (left as given: neither implementation
    differentiates through the update) for each."""
    classes = [getattr(torch.optim, name) for name in FUSED]
    saved = [(cls, cls.__dict__["__init__"]) for cls in classes]
    for cls, init in saved:
        cls.__init__ = _fused_init(init, made)
    try:
        yield
    finally:
        for cls, init in saved:
            cls.__init__ = init


def _fused_init(original, made: list[str]):
    def __init__(optimizer, params, *args, **kwargs):
        # a generator is read once: here, and again by the optimizer
        params = [{**p, "params": _listed(p["params"])} if isinstance(p, dict) else p
                  for p in params]
        if kwargs.get("differentiable"):
            made.append("differentiable")
        elif all(p.device.type in FUSED_DEVICES and torch.is_floating_point(p)
                 for p in _tensors(params)):
            kwargs.update(fused=True, foreach=None)
            made.append("fused")
        else:
            kwargs.update(fused=None, foreach=True)
            made.append("foreach")
        original(optimizer, params, *args, **kwargs)
    return __init__


def _listed(params) -> list:
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _tensors(params: list):
    """The tensors of an optimizer's ``params`` (listed): tensors, ``(name, tensor)`` pairs,
    or param groups (dicts) of either."""
    for item in params:
        if isinstance(item, dict):
            yield from _tensors(item["params"])
        elif isinstance(item, tuple):
            yield item[1]
        else:
            yield item


def optimizer_impl(optimizer) -> str | None:
    """How ``optimizer`` updates: ``fused``, ``foreach``, ``for-loop`` (as torch defaults it:
    ``foreach`` on the GPU), or None where it is not one of ``FUSED``."""
    if type(optimizer) not in [getattr(torch.optim, name) for name in FUSED]:
        return None
    if optimizer.defaults.get("fused"):
        return "fused"
    foreach = optimizer.defaults.get("foreach")
    if foreach is None:  # torch's default: foreach where every parameter is on the GPU
        foreach = all(p.is_cuda for g in optimizer.param_groups for p in g["params"])
    return "foreach" if foreach else "for-loop"


# --- the model the script calls first -------------------------------------------------------

def model_settings(module) -> tuple[bool, bool]:
    """Whether ``module`` (the model the script calls first) runs compiled (``torch.compile``
    of it, or compiled in place), and whether its convolution weights are in
    ``torch.channels_last``: set by the script or by a lever, so that the verdict offers
    neither again."""
    compiled = any(getattr(m, "_compiled_call_impl", None) is not None
                   or type(m).__name__ == "OptimizedModule" for m in module.modules())
    convs = [m.weight for m in module.modules() if isinstance(m, torch.nn.Conv2d)]
    # a 1x1 weight is contiguous in both layouts: one other than it says which
    channels_last = all(w.is_contiguous(memory_format=torch.channels_last) for w in convs) \
        and any(not w.is_contiguous() for w in convs)
    return compiled, channels_last


@contextlib.contextmanager
def found_model(roots: tuple[Path, ...], unapplied: Unapplied, channels_last: bool = False,
                compile_mode: str | None = None):
    """While the block runs, the first module with parameters called from the script's own
    code (under ``roots``) is changed before that call runs: with ``channels_last``, its convolution
    weights and every 4-D tensor it is given in ``torch.channels_last`` (a model without
    ``Conv2d`` is left as it is); with ``compile_mode``, compiled in place
    (``module.compile(mode=...)``: the script's references to it stay the same object).
    ``unapplied`` says why one could not apply (``no Conv2d``, ``no C++ compiler``, ``no CUDA
    graphs on the CPU``, ``no model called``)."""
    if not (channels_last or compile_mode):
        yield
        return
    original = torch.nn.Module.__call__
    found: list = []

    # Module.__call__, not a forward pre-hook: a pre-hook runs inside the call, too late for
    # the call itself to run compiled
    def first_call(module, *args, **kwargs):
        # a module without parameters is no model: a transform (torchvision's v2 are
        # modules) called for the first batch before it, a loss
        if found or next(module.parameters(), None) is None or user_site(roots) is None:
            return original(module, *args, **kwargs)
        found.append(module)
        torch.nn.Module.__call__ = original  # once: every later call as torch makes it
        _change(module, unapplied, channels_last, compile_mode)
        return module(*args, **kwargs)

    torch.nn.Module.__call__ = first_call
    try:
        yield
    finally:
        torch.nn.Module.__call__ = original
        if not found:
            for name, wanted in (("channels-last", channels_last), ("compile", compile_mode)):
                if wanted:
                    unapplied.setdefault(name, "no model called")


def _change(module, unapplied: Unapplied, channels_last: bool, compile_mode: str | None):
    if channels_last:
        if any(isinstance(m, torch.nn.Conv2d) for m in module.modules()):
            module.to(memory_format=torch.channels_last)  # in place: the optimizer's tensors
            # first: the script's own hooks see the inputs as the model does
            module.register_forward_pre_hook(_channels_last_inputs, prepend=True,
                                             with_kwargs=True)
        else:
            unapplied["channels-last"] = "no Conv2d"
    if compile_mode:
        device = next((p.device.type for p in module.parameters()), "cpu")
        why = compiler_missing(device) or (
            "no CUDA graphs on the CPU" if device != "cuda" and "reduce-overhead" in compile_mode
            else None)
        if why:
            unapplied["compile"] = why
        else:
            module.compile(mode=compile_mode)


def _channels_last_inputs(module, args, kwargs):
    def nhwc(x):
        return x.contiguous(memory_format=torch.channels_last) \
            if isinstance(x, torch.Tensor) and x.dim() == 4 else x
    return tuple(nhwc(a) for a in args), {k: nhwc(v) for k, v in kwargs.items()}


# --- DataLoaders -----------------------------------------------------------------------------

def loader_arguments(args: tuple, kwargs: dict, levers) -> tuple[tuple, dict]:
    """A DataLoader's arguments after its dataset (``args``, ``kwargs``) as ``levers`` (the
    run's ``ScriptLevers``) make them: ``num_workers`` (``workers=N``), ``pin_memory``, and
    where it then has worker processes, ``persistent_workers`` and ``prefetch_factor``
    (keyword-only; a DataLoader without workers refuses them). ``levers.loaders`` gets its
    number of workers."""
    args, kwargs = list(args), dict(kwargs)

    def put(index: int, name: str, value) -> None:  # as the script gave it, or by name
        if len(args) > index:
            args[index] = value
        else:
            kwargs[name] = value
    if levers.workers is not None:
        put(4, "num_workers", levers.workers)
    if levers.pin_memory:
        put(6, "pin_memory", True)
    workers = args[4] if len(args) > 4 else kwargs.get("num_workers", 0)
    levers.loaders.append(workers)
    if workers > 0 and levers.persistent_workers:
        kwargs["persistent_workers"] = True
    if workers > 0 and levers.prefetch:
        kwargs["prefetch_factor"] = levers.prefetch
    return tuple(args), kwargs


def loaders_unapplied(loaders: list[int], persistent_workers: bool, prefetch: int | None
                      ) -> Unapplied:
    """Why ``persistent-workers`` and ``prefetch`` did not apply to the DataLoaders made
    with ``loaders`` worker processes each: ``no DataLoader``, ``no worker processes``."""
    why = None if any(loaders) else "no worker processes" if loaders else "no DataLoader"
    wanted = (("persistent-workers", persistent_workers), ("prefetch", prefetch))
    return Unapplied({name: why for name, on in wanted if on and why})


# --- threads ----------------------------------------------------------------------------------

def interop_threads(n: int, unapplied: Unapplied) -> None:
    """PyTorch's inter-op threads set to ``n``, for the rest of the process (PyTorch takes the
    setting once, and only before any inter-op work: after, ``unapplied`` says ``too late``)."""
    if torch.get_num_interop_threads() == n:
        return
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:
        unapplied["interop-threads"] = "too late"


# --- bf16 autocast ----------------------------------------------------------------------------

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


def loader_site(roots: tuple[Path, ...]) -> str | None:
    """``user_site`` of a DataLoader being made (called from its ``__init__``'s wrapper), and
    where a library made it inside a call of the script's (Hugging Face's ``Trainer`` makes
    its own in ``train()``), the library that did: ``train.py:40 (made by transformers in
    that call)``, so an edit at that line reads as the library's setting, not a DataLoader
    the line writes."""
    site = user_site(roots, depth=3)
    maker = sys._getframe(2)  # what called DataLoader(...): 1 is the wrapper
    if site is None or _is_user(maker.f_code.co_filename, roots):
        return site
    package = str(maker.f_globals.get("__name__") or "").partition(".")[0]
    return f"{site} (made by {package} in that call)" if package else site


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
