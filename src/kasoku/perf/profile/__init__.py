"""Where a step's time goes: profiles of training steps, measured.

``window`` (torch.profiler over a few steps, with the phase clock's phases as host spans),
``trace`` (the analysis of its Chrome trace), ``kfac_cost`` (K-FAC's phases against the rest
of the step, over whole K-FAC cycles), ``timeline`` and ``html`` (the picture and the report),
``kernels`` (device or operator time by kind of kernel, for ``kasoku bench --kernels``). The
phase clock itself is ``kasoku.core.phases``; what the figures say (which bottleneck, which
lever) is ``kasoku.advisor``; ``kasoku profile`` and its ``--confirm`` A/B runs are
``kasoku.commands.profile``.
"""
