"""The hot step (forward, loss, backward, update) and the Updater that feeds it batches.

Features (mixed precision, CUDA graphs, compilation, gradient accumulation) attach from
outside by wrapping or replacing the step function (``trainer.step_fn``), never as ``if``s in
here. A step function is a ``Step``: ``step(model, batch, optimizer) -> observations``, where
the observations are detached 0-dim tensors: converting them to floats would be a host sync.
A step around another is a ``StepWrapper``, its inner step ``inner``; ``steps_of`` walks the
chain, ``markable`` finds the eager step that takes phase marks in it.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, ClassVar, Protocol

import torch

from kasoku.core.errors import ConfigError
from kasoku.core.phases import NoClock, PhaseClock, TakesMarks, no_mark
from kasoku.data.base import Loader, check_loader
from kasoku.train.reporter import Reporter

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Step(Protocol):
    """The trainer's step: ``step(model, batch, optimizer) -> observations`` on ``batch =
    (inputs, targets)`` already on the model's device (a chunk of several batches for a step
    that runs several per call), the observations detached 0-dim tensors by name."""

    def __call__(self, model: torch.nn.Module, batch: tuple,
                 optimizer: torch.optim.Optimizer) -> dict: ...


class StepWrapper:
    """A step around another, ``inner``: how a lever attaches to the step from outside
    (channels_last inputs, a pinned attention kernel, several steps per call, a CUDA graph).
    ``passes_marks``: whether ``inner`` runs eagerly inside this step, so that phase marks
    reach it (``markable``); a CUDA graph's replay runs no Python, and does not."""
    passes_marks: ClassVar[bool] = True

    def __init__(self, inner: Step):
        self.inner = inner


def steps_of(step: Step | None) -> list[Step]:
    """``step`` and the steps it wraps, outermost first, down each ``StepWrapper``'s ``inner``
    (``[]`` for None)."""
    chain: list[Step] = []
    while step is not None and not any(s is step for s in chain):
        chain.append(step)
        step = step.inner if isinstance(step, StepWrapper) else None
    return chain


def markable(step: Step | None) -> TakesMarks | None:
    """The eager step in ``step``'s chain that takes phase marks (``StandardStep``), reached
    through wrappers that pass them (``StepWrapper.passes_marks``); None when one that does not
    (a CUDA graph) is in the way, or no step of the chain takes marks."""
    for inner in steps_of(step):
        if isinstance(inner, TakesMarks):
            return inner
        if not (isinstance(inner, StepWrapper) and inner.passes_marks):
            return None
    return None


class Update(Protocol):
    """How a step turns a loss into a weight update (``PlainUpdate``, a loss scaler,
    ``ClippedUpdate``); see ``PlainUpdate``."""

    def zero_grad(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self, optimizer: torch.optim.Optimizer) -> None: ...

    def observation(self) -> dict: ...


class PlainUpdate:
    """How ``StandardStep`` turns a loss into a weight update when nothing is attached:
    ``loss.backward()`` then ``optimizer.step()``.

    The protocol a replacement implements (``Update``; ``kasoku.accel.loss_scale.LossScaler``
    does, for fp16; ``ClippedUpdate`` wraps an inner one):
    ``zero_grad(model, optimizer)``, ``backward(loss)``, ``step(optimizer)`` and
    ``observation() -> dict`` (0-dim tensors merged into the step's observations).
    """

    def zero_grad(self, model, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, optimizer) -> None:
        optimizer.step()

    def observation(self) -> dict:
        return {}

    def __repr__(self) -> str:
        return "PlainUpdate()"


class ClippedUpdate:
    """``inner`` (``PlainUpdate``, or a loss scaler) with the gradients' global L2 norm
    clipped to ``max_norm`` just before each optimizer step (GPT-2's recipe clips at 1.0):
    after a loss scaler has unscaled them, so the true gradients are clipped. The clip is the
    optimizer's step pre-hook, registered at the first step, so it runs wherever the step
    does: inside a compiled optimizer step, a CUDA graph's capture, each step of several per
    call. FSDP2's sharded gradients are clipped by the norm of the whole (torch's
    ``clip_grad_norm_`` reduces over the shards); K-FAC's raw gradients, before its
    preconditioning. ``observation()`` adds ``main/grad_norm``, the norm before clipping
    (0-dim, on the device): NaN on a step a loss scaler skipped without calling the optimizer,
    inf where the optimizer skips it itself (the gradients overflowed)."""

    def __init__(self, inner: Update, max_norm: float):
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) \
                or not math.isfinite(max_norm) or max_norm <= 0:
            raise ConfigError(f"gradient clipping needs a positive, finite norm, got "
                              f"{max_norm!r}")
        self.inner, self.max_norm = inner, max_norm
        self._hooked = None  # the optimizer the clip is registered on
        self._norm: torch.Tensor | None = None  # written in place: a graph replays it

    def zero_grad(self, model, optimizer) -> None:
        self.inner.zero_grad(model, optimizer)

    def backward(self, loss: torch.Tensor) -> None:
        self.inner.backward(loss)

    def step(self, optimizer) -> None:
        if self._hooked is not optimizer:
            optimizer.register_step_pre_hook(self._clip)
            self._hooked = optimizer
            first = optimizer.param_groups[0]["params"][0]
            self._norm = torch.zeros((), dtype=torch.float32, device=first.device)
        self._norm.fill_(math.nan)  # stays NaN if the optimizer's step does not run
        self.inner.step(optimizer)

    def _clip(self, optimizer, args, kwargs) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm)
        # a sharded model's norm is a DTensor: the whole one, for the log
        self._norm.copy_(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def observation(self) -> dict:
        seen = dict(self.inner.observation())
        if self._norm is not None:
            seen["main/grad_norm"] = self._norm.clone()
        return seen

    def __repr__(self) -> str:
        return f"ClippedUpdate({self.inner!r}, max_norm={self.max_norm})"


def _no_metric(output, targets) -> None:
    return None


class Objective:
    """What a step computes from its output: ``(loss, metric)``, the metric of the output
    detached, without gradients. One callable, which ``--compile`` compiles as one graph
    (``kasoku.accel.compile``). Over GPT-2's 50,304 logits on an H200 the accuracy costs 0.8
    ms of a 33 ms step either way: inductor keeps its argmax a kernel of its own beside the
    loss's (one graph 33.3-33.4 ms, loss and metric compiled apart 33.7, within the windows'
    spread; research/probes/gpt_peer.py)."""

    def __init__(self, loss_fn: LossFn, metric_fn: LossFn | None = None):
        self.loss_fn, self.metric_fn = loss_fn, metric_fn or _no_metric

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> tuple:
        loss = self.loss_fn(output, targets)
        with torch.no_grad():
            metric = self.metric_fn(output.detach(), targets)
        return loss, metric

    def __repr__(self) -> str:
        return f"Objective(loss_fn={self.loss_fn!r}, metric_fn={self.metric_fn!r})"


class StandardStep:
    """The hot step, the only one: ``step(model, batch, optimizer) -> observations`` on
    ``batch = (inputs, targets)``, already on the model's device.

    Forward, loss and metric (``objective``, an ``Objective``) run inside ``autocast()`` (a
    mixed-precision context, or none); the backward pass and the update go through ``update``
    (``PlainUpdate``, or a loss scaler).
    Returns ``{"main/loss": loss, "main/accuracy": metric, **update.observation()}`` as
    detached 0-dim tensors (``metric_fn`` None, or returning None, means "not defined": the
    reporter drops it). What a lever changes is attached here from outside; the step itself
    has no branch.

    ``mark(phase)`` is called as each phase begins (forward, backward, update, other: what
    follows the update); the Updater sets it to its phase clock (``kasoku.core.phases``), a no-op
    otherwise.
    """
    mark = staticmethod(no_mark)

    def __init__(self, loss_fn: LossFn, metric_fn: LossFn | None = None,
                 autocast: Callable = contextlib.nullcontext, update: Update | None = None):
        self.objective: Callable = Objective(loss_fn, metric_fn)
        self.autocast = autocast
        self.update: Update = update or PlainUpdate()

    def __call__(self, model, batch, optimizer) -> dict:
        inputs, targets = batch
        mark = self.mark
        mark("forward")
        self.update.zero_grad(model, optimizer)
        with self.autocast():
            output = model(inputs)
            loss, metric = self.objective(output, targets)
        mark("backward")
        self.update.backward(loss)
        mark("update")
        self.update.step(optimizer)
        mark("other")
        return {"main/loss": loss.detach(), "main/accuracy": metric, **self.update.observation()}

    def __repr__(self) -> str:
        return f"StandardStep(objective={self.objective!r}, update={self.update!r})"


class Updater:
    """Pulls a batch, moves it to the device, runs the step, and counts.

    ``iteration`` counts optimizer steps done (k per call when the loader hands out chunks of
    k batches: ``kasoku.data.device_loader.ChunkedLoader``); ``epoch``, ``epoch_detail`` and
    ``is_new_epoch`` are the loader's; ``previous_iteration`` / ``previous_epoch_detail`` are the
    values before the latest call (what stateless triggers compare against); ``samples``
    counts the samples the steps took (a batch's length, not the batch size asked for: the
    last batch of an epoch may be short); ``elapsed_time`` counts seconds inside ``run()``
    across resumes; ``observation`` is the current call's dict.

    ``phases`` times every step's phases (``kasoku.core.phases.PhaseClock``: data
    wait, copy, forward, backward, update, K-FAC's, other); LogReport logs them.
    ``phase_timing=False`` times nothing. Assigning another clock to ``phases`` (a profiled
    window's) gives the step that clock's marks from the next step on.
    """

    def __init__(self, loader: Loader, model, optimizer, step_fn: Step, device: torch.device,
                 reporter: Reporter, phase_timing: bool = True):
        check_loader(loader)
        self.loader, self.model, self.optimizer = loader, model, optimizer
        self.step_fn, self.device, self.reporter = step_fn, device, reporter
        self.iteration = self.previous_iteration = self.samples = 0
        self.previous_epoch_detail = 0.0
        # A chunk of K batches is [K, B, ...]: its samples are the first two dimensions.
        self._sample_dims = 2 if loader.batches_per_call > 1 else 1
        self._elapsed_before, self._started_at = 0.0, None
        self._marked_fn, self._marks_inside = None, False
        self.phases = PhaseClock(device) if phase_timing else NoClock()

    def update(self) -> None:
        self.previous_iteration = self.iteration
        self.previous_epoch_detail = self.loader.epoch_detail
        clock = self.phases
        clock.step()
        clock.mark("data")
        inputs, targets = next(self.loader)
        clock.mark("h2d")
        # non_blocking: the copy overlaps with the host work before the step when the batch
        # sits in pinned memory; from pageable memory it is a plain copy.
        batch = (inputs.to(self.device, non_blocking=True),
                 targets.to(self.device, non_blocking=True))
        if self.step_fn is not self._marked_fn:
            self._attach_marks()
        if not self._marks_inside:
            clock.mark("compute")
        observation = self.step_fn(self.model, batch, self.optimizer)
        if not self._marks_inside:
            clock.mark("other")
        self.reporter.start(observation)
        self.samples += targets.shape[:self._sample_dims].numel()  # a shape: no device sync
        # A loader that hands out several batches per call (``batches_per_call``, for a step
        # that runs one optimizer step per batch) says how many the chunk held.
        self.iteration += self.loader.last_chunk_batches

    @property
    def phases(self):
        return self._phases

    @phases.setter
    def phases(self, clock) -> None:
        self._phases = clock
        self._marked_fn = None  # the step takes the new clock's marks at its next call

    def _attach_marks(self) -> None:
        """Give the step function's eager step (if it has one) this updater's clock, and the
        optimizer too when it times phases of its own (``TakesMarks``: K-FAC's factors,
        inverses and preconditioning, each handing back to the phase it interrupts)."""
        inner = markable(self.step_fn)
        if inner is not None:
            inner.mark = self.phases.mark
        if isinstance(self.optimizer, TakesMarks):
            self.optimizer.mark = self.phases.mark
        self._marked_fn, self._marks_inside = self.step_fn, inner is not None

    @property
    def phases_split(self) -> bool:
        """Whether forward, backward and update are timed apart (else one ``compute``)."""
        if self.step_fn is not self._marked_fn:
            self._attach_marks()
        return self._marks_inside

    epoch = property(lambda self: self.loader.epoch)
    epoch_detail = property(lambda self: self.loader.epoch_detail)
    is_new_epoch = property(lambda self: self.loader.is_new_epoch)
    batches_per_epoch = property(lambda self: self.loader.batches_per_epoch)
    observation = property(lambda self: self.reporter.observation)

    @property
    def elapsed_time(self) -> float:
        running = 0.0 if self._started_at is None else time.perf_counter() - self._started_at
        return self._elapsed_before + running

    def start_clock(self) -> None:
        self._started_at = time.perf_counter()

    def stop_clock(self) -> None:
        self._elapsed_before, self._started_at = self.elapsed_time, None

    def state_dict(self) -> dict:
        return {"iteration": self.iteration, "elapsed_time": self.elapsed_time,
                "samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        self.iteration = self.previous_iteration = int(state["iteration"])
        self.samples = int(state.get("samples", 0))
        self.previous_epoch_detail = self.loader.epoch_detail
        self._elapsed_before = float(state["elapsed_time"])
