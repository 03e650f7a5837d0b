"""Acceleration levers of seed 004, each an ``apply_*`` transform in its own module:

- ``cudnn.apply_cudnn_benchmark``, ``memory_format.apply_channels_last``,
  ``precision.apply_precision`` (with ``loss_scale.LossScaler`` / ``MasterWeights``),
  ``compile.apply_compile``, ``graph.apply_cuda_graph``;
- the Triton Adam (``triton_adam``; LARS and LAMB are ``kasoku.optim``'s, all by name through
  ``kasoku.optim.make_optimizer``) and the large-batch learning-rate rules in ``lr_rules``;
- ``compose.accelerate``: applies a whole ``config.AccelConfig`` in the order the levers need
  (``kasoku.cli.accel`` makes the command-line flags that build one).
"""
