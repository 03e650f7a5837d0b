"""Training across processes and machines, on PyTorch's own distributed engine (the elastic
launcher ``torch.distributed.run``, NCCL and gloo collectives): no launcher or collective of
kasoku's own.

- ``world``: a process's place in a job (``World``, from the environment that ``torchrun`` and
  schedulers set), so that a single-process command started as one of several workers says so
- ``config``: ``DistConfig``, the data-parallel settings
- ``ddp``: the process group, DistributedDataParallel's wrap, the collectives the trainer uses
  (and ``AgreedFlag``: a stop request every worker sees at the same step)
- ``fsdp``: sharded data parallelism (FSDP2's ``fully_shard`` per block, then the root), and
  its snapshots through ``torch.distributed.checkpoint``
- ``launch``: ``kasoku train --gpus N|--procs N`` through the elastic launcher, a module run by
  N workers; Ctrl-C passed on to the workers
- ``failures``: the workers' notes to the launching process, and which worker failed on its own
- ``plan``: the world sizes a measurement launches, checked against this machine
"""
from kasoku.distributed.world import World, require_single_process

__all__ = ["World", "require_single_process"]
