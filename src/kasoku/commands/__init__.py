"""The engines of kasoku's commands, above the library: each turns a command's configs into
library calls, processes, files and printed lines. The library (``workloads``, ``optim``,
``accel``, ``kfac``, ``train``, ``distributed``, ``perf``, ``data``, ``models``, ``core``) never
imports this package; ``kasoku.cli`` parses argv into configs and calls it.

- ``train``: ``kasoku train`` (``train_run``, ``build_trainer``, a data-parallel worker)
- ``profile``: ``kasoku profile`` and its ``--confirm`` A/B runs
- ``bench``: ``kasoku bench`` (the ladder), ``kasoku data bench`` and ``kasoku compare``
- ``scale`` and ``scale_worker``: ``kasoku scale``
- ``allreduce_bench`` and ``allreduce_worker``: ``kasoku allreduce-bench``
- ``device``: ``--device auto|cpu|cuda|cuda:N``, the same in every command
- ``table``: the terminal tables the commands print
"""
