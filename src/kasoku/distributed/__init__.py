"""Training across processes and machines, on PyTorch's own distributed engine (the elastic
launcher ``torch.distributed.run``, NCCL and gloo collectives): no launcher or collective of
kasoku's own.

- ``world``: a process's place in a job (``World``, from the environment that ``torchrun`` and
  schedulers set), so that a single-process command started as one of several workers says so
- ``config``: ``DistConfig``, the data-parallel settings
- ``ddp``: the process group, DistributedDataParallel's wrap, the collectives the trainer uses
- ``launch``: ``kasoku train --gpus N|--procs N`` through the elastic launcher, a module run by
  N workers, the worker that failed first named
"""
from kasoku.distributed.world import World, require_single_process

__all__ = ["World", "require_single_process"]
