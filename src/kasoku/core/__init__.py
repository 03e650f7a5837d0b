"""The ground layer: what every other part of kasoku uses, importing nothing of kasoku's above
it (and no torch but the phase clock's).

- ``errors``: the one error policy (``ConfigError``, ``DataError``, ``NonFiniteError``,
  ``KasokuWarning`` and ``warn_once``)
- ``phases``: the always-on phase clock every training step marks (``PhaseClock``)
- ``queues``: ``CUDA_DEVICE_MAX_CONNECTIONS``, set before CUDA starts
- ``lazy_kernel``: Triton kernels defined on first use, once per interpreter mode
- ``snapshot_names``: the names of a run's snapshot files, for training and the launcher alike
- ``version``: kasoku's version
"""
