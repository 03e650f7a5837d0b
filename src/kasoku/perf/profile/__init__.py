"""Where a step's time goes: profiles of training steps and what they say.

``window`` (torch.profiler over a few steps, with the phase clock's phases as host spans;
``profiling()``), ``trace`` (the analysis of its Chrome trace), ``verdict`` (the rules table:
which bottleneck, which lever), ``kfac_cost`` (K-FAC's phases against the rest of the step,
over whole K-FAC cycles), ``timeline`` and ``html`` (the picture and the report), ``kernels``
(device or operator time by kind of kernel, for ``kasoku bench --kernels``). The phase clock
itself is ``kasoku.core.phases``; ``kasoku profile`` and its ``--confirm`` A/B runs are
``kasoku.commands.profile``.
"""
