"""Where a step's time goes: profiles of training steps and what they say.

``phases`` (the always-on phase clock of every training step), ``window`` (torch.profiler over
a few steps, with the phases as host spans), ``trace`` (the analysis of its Chrome trace),
``verdict`` (the rules table: which bottleneck, which lever), ``session`` (``kasoku profile``
and its ``--confirm`` A/B), ``kfac_cost`` (K-FAC's phases against the rest of the step, over
whole K-FAC cycles), ``timeline`` and ``html`` (the picture and the report), ``kernels``
(device or operator time by kind of kernel, for ``kasoku bench --kernels``).
"""
