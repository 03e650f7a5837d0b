"""What a script's profile watches from outside the script: its steps, its batches, where its
DataLoader and its forward are, and the levers set on its objects (``--with workers=N``,
``--with replay``).

Steps are found without help: a step is one ``step()`` of the first optimizer that steps (a
global post-hook on every ``torch.optim.Optimizer``), whatever the backward passes before it
(two losses, gradient accumulation; a closure's passes inside ``step(closure)``, Lightning's
and LBFGS's, are that step's). Only a script that updates by hand is stepped by its backward
passes (``torch.Tensor.backward`` and ``torch.autograd.backward`` wrapped): one that made no
optimizer (``Optimizer.__init__`` wrapped), or whose optimizers have not stepped in
``UNUSED_OPTIMIZER`` backward passes. The wait for a batch is the time in the DataLoader
iterator's ``__next__``.

The steps, in order: ``skip`` steps not timed (the script's own warm-up: compilation,
autotuning, the loader's first workers); ``measure_steps`` steps timed without the profiler, in
windows each ended by a synchronize (``kasoku.commands.script_timing``: the throughput, its
spread and the wait for data; a measuring run's for ``measure_seconds`` at least); then
the profiled window (``kasoku.perf.profile.window.Window``: ``warmup + 1 + steps`` steps) with
kasoku's phase spans in the trace: a step starts at its first batch's wait (the
``kasoku/data`` span the analysis cuts steps at), or, for a script whose steps take no batch
from a DataLoader, at the previous step's end (a zero-length data span); ``forward`` from the
batch to the backward pass, ``backward`` in it, ``update`` from the optimizer's step (a global
pre-hook; for a hand-written update, from the backward pass's end) to the next step. A step
given a closure (Lightning's ``optimizer.step(closure)``, LBFGS's) runs the forward and the
backward inside the optimizer's step: the closure is handed on wrapped (the pre-hook's
arguments), so that each of its calls is ``forward`` to its backward pass, ``backward`` in it
and ``update`` from its end, the optimizer's own arithmetic. A measuring run (a side of the
A/B runs) ends after the timed steps. When the window ends the patches are taken off and the
script goes on at full speed (the optimizer hook stays, doing nothing, until the script ends:
removing it while it runs would break the optimizer's loop over its hooks), or it is stopped
(``stop_after_window``).
"""
from __future__ import annotations

import gc
import time
import weakref
from pathlib import Path

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.data import DataLoader
from torch.utils.data import dataloader as torch_dataloader

from kasoku.commands.script_apply import loader_arguments, loader_site, model_settings, user_site
from kasoku.commands.script_levers import ScriptFacts, ScriptLevers
from kasoku.commands.script_run import ScriptStopped
from kasoku.commands.script_timing import StepTimer, alloc_retries, batch_size_of, script_device
from kasoku.core.phases import PhaseClock
from kasoku.perf.profile.window import Window

LOADER_ITER = torch_dataloader._BaseDataLoaderIter
"""The base class of every DataLoader iterator (one process or worker processes). PyTorch
has no public hook on a DataLoader's batches; its ``__next__`` is where PyTorch opens its own
profiler span for the wait (``enumerate(DataLoader)#...``, which HTA reads), so wrapping it
times the same wait for every DataLoader the script makes."""
REPLAY_BATCHES = 8
"""``--with replay`` hands out the DataLoader's first batches, at most this many, in turn."""
UNUSED_OPTIMIZER = 64
"""Backward passes with an optimizer made and none stepped after which the script is taken to
update by hand: more than any gradient accumulation waits before its first step."""


class StepWatch:
    """The hooks on the script's steps and batches, the timed steps and the profiled window
    they drive. ``measure_only``: stop the script after the timed steps."""

    def __init__(self, cfg, out: Path, levers: ScriptLevers | None = None,
                 roots: tuple[Path, ...] = (), measure_only: bool = False):
        self.cfg, self.out = cfg, Path(out)
        self.levers = levers or ScriptLevers()
        self.roots, self.measure_only = roots, measure_only
        self.steps = 0
        """Training steps seen (to the window's end)."""
        self.window: Window | None = None
        self.clock = None
        self.done = False
        self.batch_size: int | None = None
        self.num_workers: int | None = None
        self.measured: dict | None = None
        self.facts = ScriptFacts()
        self._stepper = None  # the optimizer whose steps are the steps
        self.optimizer = None
        """The optimizer whose steps were the steps, once the window has ended."""
        self._backwards = 0  # outside an optimizer's step, while none has stepped
        self._in_backward = 0
        self._in_step = 0  # optimizer steps under way (an LBFGS closure's passes are in one)
        self._in_closure = 0  # inside the stepping optimizer's closure: its phases are marked
        self._made_optimizer = False
        self._loader_calls = 0  # this step's
        self._loader_steps = False
        self._pending = False  # the next batch's wait starts a step
        self._in_data = False
        self._in_next = 0  # inside the DataLoader iterator's __next__
        self._saved: list[tuple[object, str, object]] = []
        self._hook = self._pre_hook = self._forward_hook = None
        self._model = lambda: None  # the module the forward's line calls, once called
        self._retries = 0  # the CUDA allocator's retries when the window started
        # id(dataset): site, num_workers of its first DataLoader, the script's (a library makes
        # another from the same dataset, as Accelerate's prepare does)
        self._sites: dict[int, tuple[str | None, int]] = {}
        self._replay: list = []
        self._replayed = 0
        self._timing: StepTimer | None = None
        self.on_window_end = None
        """Called with the step count when the window has ended and the script runs on."""

    # --- the patches --------------------------------------------------------------------
    def install(self) -> None:
        self._hook = register_optimizer_step_post_hook(self._optimizer_step)
        self._pre_hook = register_optimizer_step_pre_hook(self._optimizer_starts)
        self._patch(torch.Tensor, "backward", self._wrap_backward(torch.Tensor.backward))
        self._patch(torch.autograd, "backward", self._wrap_backward(torch.autograd.backward))
        self._patch(torch.optim.Optimizer, "__init__",
                    self._wrap_optimizer_init(torch.optim.Optimizer.__init__))
        self._patch(LOADER_ITER, "__next__", self._wrap_next(LOADER_ITER.__next__))
        self._patch(DataLoader, "__init__", self._wrap_loader_init(DataLoader.__init__))
        autocast = torch.amp.autocast_mode.autocast
        self._patch(autocast, "__enter__", self._wrap_autocast(autocast.__enter__))

    def _patch(self, owner, name: str, new) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def unpatch(self) -> None:
        """Put back what ``install`` patched, and drop the optimizer pre-hook (its loop is
        over when a post-hook calls this); the post-hook stays (``uninstall``)."""
        if self._pre_hook is not None:
            self._pre_hook.remove()
            self._pre_hook = None
        while self._saved:
            owner, name, old = self._saved.pop()
            setattr(owner, name, old)
        self._unhook_forward()

    def uninstall(self) -> None:
        self.unpatch()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._stepper = None
        self._replay = []

    def _wrap_backward(self, original):
        watch = self

        def backward(*args, **kwargs):
            if not watch._in_backward and watch.clock is not None and \
                    (watch._in_closure or not watch._in_step):
                watch.clock.mark("backward")
            if watch._timing is not None and not watch._in_backward and args \
                    and isinstance(args[0], torch.Tensor) and args[0].dim() == 0:
                watch._timing.losses.append(args[0].detach())  # read after: a read syncs
            watch._in_backward += 1
            try:
                return original(*args, **kwargs)
            finally:
                watch._in_backward -= 1
                if not watch._in_backward:  # Tensor.backward calls autograd.backward
                    watch._backward_done()
        return backward

    def _wrap_optimizer_init(self, original):
        watch = self

        def __init__(optimizer, *args, **kwargs):
            original(optimizer, *args, **kwargs)
            watch._made_optimizer = True
        return __init__

    def _wrap_next(self, original):
        watch = self

        def __next__(it):
            opened = watch._batch_wait(it)
            t0 = time.perf_counter()
            if watch._replay and watch.steps >= watch.cfg.skip:
                batch = watch._replay[watch._replayed % len(watch._replay)]
                watch._replayed += 1
            else:
                watch._in_next += 1  # the dataset's transforms may be modules: not the model
                try:
                    batch = original(it)  # StopIteration: the wait goes on in the next one
                finally:
                    watch._in_next -= 1
                if watch.levers.replay and len(watch._replay) < REPLAY_BATCHES:
                    watch._replay.append(batch)
            if watch._timing is not None:
                watch._timing.wait_s += time.perf_counter() - t0
            watch._batch_came(batch, opened)
            return batch
        return __next__

    def _wrap_loader_init(self, original):
        watch = self

        def __init__(loader, dataset, *args, **kwargs):
            workers = args[4] if len(args) > 4 else kwargs.get("num_workers", 0)
            args, kwargs = loader_arguments(args, kwargs, watch.levers)
            watch._sites.setdefault(id(dataset), (loader_site(watch.roots), workers))
            original(loader, dataset, *args, **kwargs)
        return __init__

    def _wrap_autocast(self, original):
        watch = self

        def __enter__(ctx):
            if getattr(ctx, "_enabled", False) and watch.steps >= 1:
                watch.facts.autocast = str(ctx.fast_dtype).removeprefix("torch.")
            return original(ctx)
        return __enter__

    def _hook_forward(self) -> None:
        # run as it is, not traced, inside a model compiled in place (--with compile)
        @torch.compiler.disable
        def first_forward(module, args):
            # a module without parameters is no model: a transform, as found_model skips it
            if self._in_next or next(module.parameters(), None) is None:
                return
            site = user_site(self.roots)
            if site is not None:
                self.facts.forward_site = site
                self._model = weakref.ref(module)
                self._unhook_forward()
        self._forward_hook = torch.nn.modules.module.register_module_forward_pre_hook(
            first_forward)

    def _unhook_forward(self) -> None:
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None

    # --- the events ---------------------------------------------------------------------
    def _optimizer_step(self, optimizer, args, kwargs) -> None:
        if self.done:  # its pre-hook is gone: no count of steps under way to keep
            return
        self._in_step -= 1
        if self._stepper is None:
            self._stepper = optimizer
        if optimizer is self._stepper:
            self._step_end()

    def _optimizer_starts(self, optimizer, args, kwargs):
        self._in_step += 1
        if self.clock is None or optimizer is not self._stepper:
            return None
        # the closure's passes are the step's forward and backward (args[0]: the optimizer)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if not callable(closure):
            self.clock.mark("update")
            return None
        if "closure" in kwargs:
            return args, {**kwargs, "closure": self._watched_closure(closure)}
        return (args[0], self._watched_closure(closure), *args[2:]), kwargs

    def _watched_closure(self, closure):
        watch = self

        def watched(*args, **kwargs):
            clock = watch.clock
            if clock is None:  # the window ended in an earlier pass
                return closure(*args, **kwargs)
            clock.mark("forward")
            watch._in_closure += 1
            try:
                return closure(*args, **kwargs)
            finally:
                watch._in_closure -= 1
                if watch.clock is not None:
                    watch.clock.mark("update")
        return watched

    def _backward_done(self) -> None:
        if self._stepper is not None or self._in_step or self.done:
            return
        self._backwards += 1
        if self._made_optimizer and self._backwards <= UNUSED_OPTIMIZER:
            return  # its first step() ends the first step
        if self.clock is not None:
            self.clock.mark("update")  # a hand-written update follows its backward pass
        self._step_end()

    def _batch_wait(self, it) -> bool:
        self._loader_calls += 1
        if self.num_workers is None:
            self.num_workers = getattr(it, "_num_workers", None)
            self.facts.prefetch_factor = getattr(it, "_prefetch_factor", None)  # None: no workers
            self.facts.persistent_workers = bool(getattr(it, "_persistent_workers", False))
            site = self._sites.get(id(getattr(it, "_dataset", None)))
            if site is not None:
                self.facts.loader_site, self.facts.num_workers = site
        if self.clock is None or not self._loader_steps:
            return False
        if self._pending:
            self._pending = False
            self._in_data = True
            self.clock.mark("data")
        return self._in_data

    def _batch_came(self, batch, opened: bool) -> None:
        if self.batch_size is None:
            self.batch_size = batch_size_of(batch)
        if opened:
            self._in_data = False
            self.clock.mark("forward")

    def _step_end(self) -> None:
        self.steps += 1
        took_batch, self._loader_calls = self._loader_calls > 0, 0
        skip, measured = self.cfg.skip, self.cfg.skip + self.cfg.measure_steps
        if self.steps == 1:
            self._hook_forward()
        if self.steps == skip:
            self._start_timing()
        elif self._timing is not None:
            self._timed_step(self.steps - skip)
        if self._timing is not None or self.steps < measured:  # a side's may time longer
            return
        if self.window is None:
            self._start(took_batch)
        elif self.window.step():
            self._end()
            return
        else:
            # the facts the advice reads narrow with it
            self._loader_steps = self.facts.loader_steps = self._loader_steps and took_batch
        if self._loader_steps:
            self._pending = True
        else:  # a step that takes no batch starts here, with a wait of none
            self.clock.mark("data")
            self.clock.mark("forward")

    # --- the timed steps (kasoku.commands.script_timing) --------------------------------
    def _start_timing(self) -> None:
        self._timing = StepTimer(script_device(), self.cfg.measure_steps,
                                 self.cfg.measure_seconds if self.measure_only else 0.0)

    def _timed_step(self, n: int) -> None:
        if self._timing.step(n):
            self._timed()
            if self.measure_only:
                raise ScriptStopped

    def script_ended(self) -> None:
        """The script ended while its steps were timed: a side's steps are timed to there
        (``StepTimer.close``), if at least the steps asked."""
        if self._timing is not None and self.measure_only and \
                self._timing.close(self.steps - self.cfg.skip):
            self._timed()

    def _timed(self) -> None:
        self.measured = self._timing.figures(self.batch_size, list(self.levers.given))
        self._timing = None
        if self.measure_only:
            self.done = True
            self.unpatch()

    # --- the profiled window ------------------------------------------------------------
    def _start(self, took_batch: bool) -> None:
        device = script_device()
        self.facts.tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
        if self.levers.bf16 and self.facts.autocast is None:
            self.facts.autocast = "bfloat16"  # the lever's autocast is set, not entered
        self.facts.cudnn_benchmark = bool(torch.backends.cudnn.benchmark)
        if (model := self._model()) is not None:
            compiled, self.facts.channels_last = model_settings(model)
            self.facts.compiled = (self.levers.compile or "compiled") if compiled else None
        # type(), not isinstance(): a deprecated module attribute warns when its class is asked
        self.facts.has_conv = any(issubclass(type(o), torch.nn.modules.conv._ConvNd)
                                  for o in gc.get_objects())
        # the shapes in the window's own session on a CPU only: on a GPU the work step's
        self.window = Window(device, self.out, self.cfg.steps, self.cfg.warmup, work_step=True,
                             cpu_shapes=torch.device(device).type == "cpu")
        self.clock = self.window.start(PhaseClock(device))
        self._retries = alloc_retries()  # the window's own, from here to its end
        self._loader_steps = self.facts.loader_steps = took_batch

    def _end(self) -> None:
        self.clock, self.done = None, True
        self.facts.alloc_retries = alloc_retries() - self._retries
        self.optimizer = self._stepper  # kept for the update's bytes: uninstall forgets it
        self.unpatch()
        if self.cfg.stop_after_window:
            raise ScriptStopped
        if self.on_window_end is not None:
            self.on_window_end(self.steps)

    @property
    def window_steps(self) -> int:
        c = self.cfg
        if self.measure_only:
            return c.skip + c.measure_steps  # a side's steps past these are its figures' own
        return c.skip + c.measure_steps + (self.window.total_steps if self.window is not None
                                           else c.warmup + 1 + c.steps)

