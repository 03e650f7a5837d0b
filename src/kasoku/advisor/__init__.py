"""What a profiled step's figures say, and what to do about it: the advisor, above the
libraries whose configs it reads (``kasoku.accel``, ``kasoku.train``, ``kasoku.data``,
``kasoku.distributed``) and below the commands that run it.

``verdict`` (the rules table: which bottleneck; ``judge``), ``levers`` (the candidate levers
of each rule for this run), ``advice`` (the candidates measured, one noise rule, the best
advised), ``profiling`` (``ProfileWindow`` and ``profiling()``: a window measured by
``kasoku.perf.profile`` and judged here, outside a command), ``script`` (a script's verdict,
typed: ``ScriptVerdict``). The measuring is
``kasoku.perf.profile``'s; the A/B runs that measure the levers are
``kasoku.commands.ab``'s.
"""
