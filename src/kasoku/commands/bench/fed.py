"""The ladder's last rung, seed 004's "+ the fastest loader": the step of the rung before it,
fed by a loader from the workload's real dataset instead of synthetic batches already on the
device.

``kasoku bench WORKLOAD --data DIR [--loader KIND[:N]]`` appends the rung ``+loader``. Every
window then times the loader's batches too: reading and decoding them, and copying them to the
device (``kasoku.data.prefetch.wrap_for_device``, as ``kasoku train`` does). Read against the
rung before it, it shows what the input pipeline costs. The loader is kasoku's pick
(``fastest_loader``) unless ``--loader`` names one. Batches are dropped at each epoch's end
when incomplete, so every step has one shape (a captured CUDA graph replays only that shape).

On a CPU, a loader with worker processes or threads gets cores of its own and the step the
rest (``kasoku.accel.loader_cores``, as ``kasoku train`` does; ``--no-loader-cores``: not),
decided once the loader is known, before it is built.

The numerics guard does not compare this rung: its batches are real data, not the fixed
synthetic batches of the other rungs. A loss that is not finite still fails it.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from kasoku.accel.loader_cores import loader_split
from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag
from kasoku.data.config import DataConfig
from kasoku.data.imagefolder import ImageFolder
from kasoku.data.prefetch import wrap_for_device
from kasoku.data.registry import create_loader, parse_loader_spec

LABEL = "+loader"
FASTEST = "fastest"
NUMERICS_REASON = ("fed real batches: not compared with the fp32 rung's synthetic ones (a loss "
                   "that is not finite still fails)")


def fastest_loader(dataset, device_type: str) -> str:
    """kasoku's pick for ``dataset`` on ``device_type`` (docs/benchmarks.md measured each):

    - ``device`` for an in-memory dataset (MNIST, CIFAR-10): the images stay on the device and a
      batch is one gather and one batched transform;
    - ``gpu-jpeg`` for a JPEG folder on a GPU: read by threads, decoded and augmented on the GPU;
    - ``multiprocess`` with one worker per core otherwise.
    """
    if isinstance(getattr(dataset, "inputs", None), torch.Tensor) \
            and isinstance(getattr(dataset, "targets", None), torch.Tensor):
        return "device"
    if device_type == "cuda" and isinstance(dataset, ImageFolder):
        return "gpu-jpeg"
    return f"multiprocess:{os.cpu_count() or 1}"


def check_data(data: Path | None, loader: str | None) -> None:
    """Refuse settings that cannot make the rung, before any run starts."""
    if loader is not None and data is None:
        raise ConfigError(f"{flag('train.loader')} needs {flag('data.root')} DIR: the loader rung "
                          "reads the workload's dataset from DIR")
    if data is not None and not Path(data).is_dir():
        raise ConfigError(f"{flag('data.root')} {data}: no such folder (give the folder `kasoku "
                          f"train {flag('data.root')}` reads for this workload)")
    if loader is not None and loader != FASTEST:
        parse_loader_spec(loader)  # an unknown kind is a ConfigError listing the kinds


class FedBatches:
    """The training split of ``workload`` under ``root``, batched by ``spec`` (or kasoku's
    pick) onto ``device``: ``take(n)`` yields the next ``n`` batches, pulled as they are
    consumed (inside the timed window). ``cores``: on a CPU, split the cores of ``affinity``
    (None: this process's mask) between the step (``threads`` of them, None: the rest) and the
    loader's workers; ``self.cores`` is ``apply_loader_cores``' record (None where the loader
    runs no workers on the host)."""

    def __init__(self, workload, root: Path, spec: str | None, batch_size: int,
                 device: torch.device, seed: int = 0, cores: bool = True,
                 threads: int | None = None, affinity: set[int] | None = None):
        train, _ = workload.build_datasets(DataConfig(root=Path(root)), seed=seed)
        if len(train) < batch_size:
            raise ConfigError(f"{flag('data.root')} {root}: {len(train)} training samples, fewer "
                              f"than one batch of {batch_size}")
        self.spec = spec if spec and spec != FASTEST else fastest_loader(train, device.type)
        self.samples = len(train)
        # Before the loader starts its workers: the split pins every thread here.
        self.cores = loader_split(self.spec, device.type, cores, threads, affinity)
        pinned = (self.cores or {}).get("loader_cpus")
        self.loader = wrap_for_device(
            create_loader(self.spec, train, batch_size, device, seed=seed, drop_last=True,
                          **({"worker_cpus": pinned} if pinned else {})), device)

    def take(self, n: int):
        for _ in range(n):
            yield next(self.loader)

    def describe(self, root: Path) -> dict:
        return {"source": f"{self.spec} loader, {root}", "loader": self.spec,
                "root": str(root), "train_samples": self.samples}

    def close(self) -> None:
        self.loader.close()
