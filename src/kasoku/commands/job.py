"""A data-parallel worker's start and end inside a command (train, profile): joining the job
on its device, one voice (worker 0's), and leaving it in the order that lets it leave."""
from __future__ import annotations

import dataclasses
import warnings

import torch

from kasoku.accel.teardown import release_levers
from kasoku.core.errors import KasokuWarning
from kasoku.distributed import World, ddp
from kasoku.distributed.config import DistConfig
from kasoku.train import Trainer
from kasoku.train.config import TrainConfig


def join_as_worker(world: World, train: TrainConfig, dist_cfg: DistConfig,
                   device: torch.device) -> TrainConfig:
    """Join the data-parallel job as worker ``world.rank``: its device (GPU ``LOCAL_RANK``
    with ``--gpus``, or under another launcher when ``device`` is a GPU; else the CPU), worker
    0 the only voice (the others print no warnings and no progress), the process group
    joined. Returns ``train`` on this worker's device."""
    wants_gpu = dist_cfg.gpus is not None or (dist_cfg.procs is None and device.type == "cuda")
    device = ddp.worker_device(world, "cuda" if wants_gpu else "cpu")
    train = dataclasses.replace(train, device=str(device))
    if not world.is_main:  # one voice: worker 0's
        warnings.simplefilter("ignore", KasokuWarning)
        train = dataclasses.replace(train, progress=False)
    ddp.join(world, device, dist_cfg.dist_timeout)
    return train


def leave_job(trainer: Trainer | None, device: torch.device) -> None:
    """A data-parallel worker's end, in the order that lets it: the step's CUDA graphs and the
    compiled code released (``release_levers``: a graph holding captured collectives must not
    outlive the communicator, or ``destroy_process_group`` never returns), then the process
    group left."""
    try:
        release_levers(trainer.step_fn if trainer is not None else None, device)
    finally:
        ddp.leave()
