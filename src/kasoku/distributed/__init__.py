"""Training across processes and machines, on PyTorch's own distributed engine (the elastic
launcher ``torch.distributed.run``, NCCL and gloo collectives): no launcher or collective of
kasoku's own.

Today this package reads the process's place in a job (``World``, from the environment that
``torchrun`` and schedulers set) so that a single-process command started as one of several
workers says so instead of training several unsynchronized copies. Data-parallel training
(``--gpus N``), its launcher and its all-reduce hooks are to be built here.
"""
from kasoku.distributed.world import World, require_single_process

__all__ = ["World", "require_single_process"]
