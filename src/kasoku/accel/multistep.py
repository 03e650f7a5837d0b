"""Several optimizer steps per call (Keras' ``steps_per_execution``): the host cost of one
trainer iteration -- loader bookkeeping, the copy into a graph's static inputs, the replay,
observation clones, the reporter and every extension's trigger check -- is paid once for
``K`` steps instead of once per step.

The loader hands out ``K`` batches at once, stacked as ``(inputs [k, B, ...], targets
[k, B, ...])`` (``kasoku.data.device_loader.ChunkedLoader`` and ``DeviceLoader`` with
``batches_per_call=K``); ``MultiStep`` runs the inner step on each of them in order. Under
``--cuda-graph`` the graph wraps ``MultiStep``, so one replay runs all ``K`` steps.

What changes, and what does not:

- The weights do not: the ``k`` steps are the same ``k`` optimizer steps, on the same batches
  in the same order, as ``k`` separate calls (bit-identical on a CPU, see the tests).
- ``trainer.updater.iteration`` counts optimizer steps (it advances by ``k`` per call), and
  epochs stay epochs: a chunk never straddles an epoch boundary, so epoch triggers, the stop
  trigger of a whole number of epochs and the log lines fall on the same steps as with K=1.
  ``(N, "iteration")`` triggers fire on the call that crosses a multiple of ``N``; a stop
  after a fractional epoch or after ``N`` iterations may overshoot by up to ``K - 1`` steps.
- Extensions run once per call. LR schedules are evaluated per call, so the rate is constant
  within a chunk (the rate of its first step), and a torch scheduler given as ``scheduler=``
  steps once per call; with a schedule, the weights differ from K=1 by that much (resume
  stays exact: the chunks after a resume are the chunks the uninterrupted run took).
- ``ProgressBar``'s it/s are optimizer steps per second and its samples/s (steps times the
  batch size) stay right.
- Observations are the mean over the ``k`` steps (a device op, no sync); cumulative counters
  (``LAST_VALUE_KEYS``) report their last value. A log line over whole chunks of equal size
  shows the same means as K=1 up to float summation order.
- With a CUDA graph, choose ``K`` dividing the full batches of an epoch (MNIST at batch 100:
  600 -> 20, 50, 100...). Otherwise each epoch ends with a shorter chunk, which has other
  shapes than the captured one and runs eagerly (``CudaGraphStep`` warns once).
"""
from __future__ import annotations

import numbers

import torch

from kasoku.accel.notes import warn_once
from kasoku.train.step import Step, StepWrapper

LAST_VALUE_KEYS = frozenset({"main/skipped_steps"})
"""Observation keys that are running totals: the chunk reports the last step's value."""


def apply_multistep(step_fn: Step, steps_per_call: int) -> Step:
    """Wrap ``step_fn`` in ``MultiStep`` when ``steps_per_call > 1``. Apply it after the
    per-batch wrappers (input conversion) and before the CUDA graph, which must hold all the
    steps of a call."""
    if steps_per_call == 1:
        return step_fn
    return MultiStep(step_fn)


class ShortChunkCheck:
    """Trainer extension that warns once, before training, when the CUDA-graphed step's
    ``steps_per_call`` does not divide the full batches of an epoch (``short_chunk_advice``):
    each epoch's shorter last chunk would run eagerly."""
    trigger = (1, "epoch")
    priority = 0
    name = "ShortChunkCheck"

    def __init__(self, steps_per_call: int):
        self.steps_per_call = steps_per_call

    def initialize(self, trainer) -> None:
        full = getattr(trainer.train_loader, "full_batches_per_epoch", None)
        advice = None if full is None else short_chunk_advice(self.steps_per_call, full)
        if advice is not None:
            warn_once(advice)

    def __call__(self, trainer) -> None:
        pass


def short_chunk_advice(steps_per_call: int, full_batches: int) -> str | None:
    """None when ``steps_per_call`` divides the ``full_batches`` of an epoch; else what a
    CUDA-graph user should know (each epoch ends with a shorter chunk that runs eagerly) and
    the divisors nearest to ``steps_per_call``."""
    rest = full_batches % steps_per_call
    if rest == 0 or steps_per_call > full_batches:  # the latter: one chunk per epoch, all alike
        return None
    divisors = [d for d in range(1, full_batches + 1) if full_batches % d == 0]
    near = [max(d for d in divisors if d <= steps_per_call)]
    near += [d for d in divisors if d > steps_per_call][:1]
    return (f"steps_per_call {steps_per_call} does not divide the {full_batches} batches of an "
            f"epoch: each epoch ends with a chunk of {rest}, whose shapes differ from the "
            f"captured CUDA graph's, so it runs eagerly; steps_per_call "
            f"{' or '.join(map(str, near))} keeps every step in the graph")


class MultiStep(StepWrapper):
    """``step(model, chunk, optimizer) -> observations`` for ``chunk = (inputs [k, B, ...],
    targets [k, B, ...])``: ``step_fn`` on each of the ``k`` batches in order (``k`` optimizer
    steps, the numerics of ``k`` separate calls), then the observations averaged over the
    steps, on their device (no host sync). Keys in ``last_value_keys`` take the last step's
    value; None stays None. Its inner step runs eagerly: phase marks reach it."""

    def __init__(self, step_fn: Step, last_value_keys=LAST_VALUE_KEYS):
        super().__init__(step_fn)
        self.last_value_keys = frozenset(last_value_keys)

    def __call__(self, model, chunk, optimizer) -> dict:
        inputs, targets = chunk
        # Iterating a tensor yields views along dim 0: no copies, and under capture no kernels.
        observations = [self.inner(model, (x, t), optimizer) for x, t in zip(inputs, targets)]
        if len(observations) == 1:
            return observations[0]
        return {key: self._combine(key, [obs[key] for obs in observations])
                for key in observations[0]}

    def _combine(self, key: str, values: list):
        last = values[-1]
        if key in self.last_value_keys or last is None:
            return last
        if isinstance(last, torch.Tensor):
            stacked = torch.stack(values)
            return (stacked if stacked.is_floating_point() else stacked.float()).mean(0)
        if isinstance(last, numbers.Real):
            return sum(values) / len(values)
        return last

    def __repr__(self) -> str:
        return f"MultiStep({self.inner!r})"
