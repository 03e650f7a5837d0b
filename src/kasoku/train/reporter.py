"""Observations: producers (the step, the Evaluator, LR schedules) ``report()`` values of the
current iteration; sinks (LogReport, PrintReport, PlotReport) only read them.

Values stay 0-dim tensors where they were produced, on their device: turning one into a
Python float is a host sync on a GPU, so it happens only when a sink asks for means
(``DictSummary.compute_mean``), once per log interval, for all keys at once.
"""
from __future__ import annotations

import numbers

import torch

# Extension priorities: higher runs first within an iteration. Named for what an extension
# does with the observation, as in Chainer: writers add to it, editors change it, readers
# consume it; snapshots run last so they capture every other extension's state of this step.
PRIORITY_WRITER = 300
PRIORITY_EDITOR = 200
PRIORITY_LOG = 110
"""LogReport: a reader that other readers (PrintReport, PlotReport) read in turn."""
PRIORITY_READER = 100
PRIORITY_SNAPSHOT = -100


class Reporter:
    """Holds ``observation``, the dict of the current iteration."""

    def __init__(self):
        self.observation: dict = {}

    def start(self, observation: dict) -> None:
        """Begin an iteration with the step's observations (None values mean "not defined",
        e.g. the accuracy of a regression, and are dropped)."""
        self.observation = {k: v for k, v in observation.items() if v is not None}

    def report(self, values: dict, prefix: str = "") -> None:
        """Add ``values`` (0-dim tensors or numbers; None is skipped) under ``prefix + key``."""
        for key, value in values.items():
            if value is not None:
                self.observation[prefix + key] = value


class DictSummary:
    """Means per key over an interval, kept lazily: ``add`` only appends the values (no kernel,
    no sync per iteration); tensors are summed on their device when a key has gathered
    ``FOLD`` values, and converted to floats only by ``compute_mean``. Values may be numbers
    or one-element tensors; anything else is ignored.

    The state keeps every value as it was (floats as floats, tensors as CPU tensors), so a
    summary restored mid-interval sums the same values in the same order as one never
    interrupted: the means, not only the weights, are bit-identical after a resume.
    """
    FOLD = 1024

    def __init__(self):
        self._pending: dict[str, list] = {}
        self._sums: dict = {}
        self._counts: dict[str, int] = {}

    def add(self, observation: dict) -> None:
        pending = self._pending
        for key, value in observation.items():
            values = pending.get(key)
            if values is None:
                pending[key] = [value]
            else:
                values.append(value)
                if len(values) >= self.FOLD:
                    self._fold(key)

    def _fold(self, key: str) -> None:
        values = self._pending.pop(key, [])
        tensors = [v for v in values if isinstance(v, torch.Tensor) and v.numel() == 1]
        floats = [float(v) for v in values if isinstance(v, numbers.Real)]
        if not tensors and not floats:
            return
        total = sum(floats) if floats else None
        if tensors:
            stacked = _stack_scalars(tensors).sum()
            total = stacked if total is None else stacked + total
        self._sums[key] = total if key not in self._sums else self._sums[key] + total
        self._counts[key] = self._counts.get(key, 0) + len(tensors) + len(floats)

    def compute_mean(self) -> dict[str, float]:
        """Means of every key as Python floats. One host sync for all tensor sums."""
        for key in list(self._pending):
            self._fold(key)
        sums = dict(self._sums)
        tensor_keys = [k for k, v in sums.items() if isinstance(v, torch.Tensor)]
        if tensor_keys:
            device = sums[tensor_keys[-1]].device
            dtype = torch.float32 if device.type == "mps" else torch.float64  # mps: no fp64
            # note: .tolist() is the CPU-GPU sync point of logging, once per interval.
            stacked = torch.stack([sums[k].to(device, dtype) for k in tensor_keys])
            sums.update(zip(tensor_keys, stacked.tolist()))
        return {k: float(sums[k]) / self._counts[k] for k in sums}

    @property
    def empty(self) -> bool:
        """Whether nothing was added since the last reset."""
        return not (self._counts or any(self._pending.values()))

    def reset(self) -> None:
        self._pending.clear()
        self._sums.clear()
        self._counts.clear()

    def state_dict(self) -> dict:
        """Weights_only-safe: numbers, and tensors moved to the CPU (a sync, at snapshot time)."""
        def plain(v):
            return v.detach().cpu() if isinstance(v, torch.Tensor) else v
        return {"pending": {k: [plain(v) for v in vs] for k, vs in self._pending.items()},
                "sums": {k: plain(v) for k, v in self._sums.items()},
                "counts": dict(self._counts)}

    def load_state_dict(self, state: dict) -> None:
        self._pending = {k: list(vs) for k, vs in state["pending"].items()}
        self._sums = dict(state["sums"])
        self._counts = {k: int(v) for k, v in state["counts"].items()}


def _stack_scalars(tensors: list) -> torch.Tensor:
    """One detached 1-d tensor of the values, on the device of the newest one."""
    try:
        return torch.stack(tensors).detach().reshape(-1)
    except RuntimeError:  # mixed shapes (1,) and (), or values restored on the CPU
        device = tensors[-1].device
        return torch.stack([t.detach().reshape(()).to(device) for t in tensors])
