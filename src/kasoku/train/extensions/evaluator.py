"""Evaluator: one pass over validation data, reported as ``validation/main/*``."""
from __future__ import annotations

import torch

from kasoku.data.loader import SerialLoader
from kasoku.distributed import ddp
from kasoku.distributed.fsdp import gathered
from kasoku.train.reporter import PRIORITY_WRITER


class Evaluator:
    """Runs ``model`` in eval mode under ``torch.no_grad()`` over one pass of the data and
    reports the batch-size-weighted means of ``loss_fn`` and ``metric_fn`` as
    ``{prefix}main/loss`` and ``{prefix}main/accuracy`` into the trainer's current observation
    (so LogReport picks them up). The model's previous train/eval mode is restored after.

    ``loader_or_dataset``: a dataset (wrapped in a non-shuffled, non-repeating
    ``SerialLoader`` of ``batch_size``), a non-repeating ``SerialLoader`` (rewound before each
    pass), or any iterable of ``(inputs, targets)`` batches that can be iterated again.
    ``device``: None means the trainer's. The sums stay on the device (no host sync here),
    except in a data-parallel run: there each worker passes over its share of the data and
    the sums are added over the workers (one all-reduce).
    """
    trigger = (1, "epoch")
    priority = PRIORITY_WRITER
    name = "Evaluator"

    def __init__(self, loader_or_dataset, model, loss_fn, metric_fn=None, device=None,
                 batch_size: int = 100, prefix: str = "validation/"):
        source = loader_or_dataset
        if isinstance(source, SerialLoader):
            if source.repeat:
                raise ValueError("the Evaluator needs a loader with repeat=False (a repeating "
                                 "one never ends a pass); or pass the dataset itself")
        elif hasattr(source, "__getitem__") and hasattr(source, "__len__"):
            source = SerialLoader(source, batch_size, shuffle=False, repeat=False)
        self.loader, self.model, self.loss_fn, self.metric_fn = source, model, loss_fn, metric_fn
        self.device = None if device is None else torch.device(device)
        self.prefix = prefix

    def __call__(self, trainer) -> None:
        trainer.reporter.report(self.evaluate(self.device or trainer.device), prefix=self.prefix)

    def evaluate(self, device=None) -> dict:
        """``{"main/loss": tensor, "main/accuracy": tensor | None}`` over one pass."""
        device = torch.device(device or self.device or "cpu")
        if hasattr(self.loader, "reset"):
            self.loader.reset()
        was_training = self.model.training
        self.model.eval()
        try:
            # A sharded model is gathered whole for the pass: the workers' shares of the data
            # may differ by a batch, and a forward that all-gathers would wait for the others.
            with torch.no_grad(), gathered(self.model):
                return self._pass(device)
        finally:
            self.model.train(was_training)

    def _pass(self, device: torch.device) -> dict:
        loss_sum = metric_sum = None
        count = 0
        for inputs, targets in self.loader:
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            output = self.model(inputs)
            n = len(targets)
            loss = self.loss_fn(output, targets).float() * n
            loss_sum = loss if loss_sum is None else loss_sum + loss
            metric = None if self.metric_fn is None else self.metric_fn(output, targets)
            if metric is not None:
                metric = metric.float() * n
                metric_sum = metric if metric_sum is None else metric_sum + metric
            count += n
        if ddp.active():  # each worker saw its share of the samples: the sums of all
            zero = torch.zeros((), device=device)
            sums = ddp.sum_over_workers([zero if loss_sum is None else loss_sum,
                                         zero if metric_sum is None else metric_sum,
                                         torch.tensor(float(count))])
            loss_sum, metric_sum = sums[0], (None if self.metric_fn is None else sums[1])
            count = int(sums[2].item())
        if count == 0:
            raise ValueError(f"the Evaluator's data {self.loader!r} yielded no batch")
        return {"main/loss": (loss_sum / count).float(),
                "main/accuracy": None if metric_sum is None else (metric_sum / count).float()}
