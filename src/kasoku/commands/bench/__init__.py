"""``kasoku bench`` (seed 004's acceleration ladder on any machine, in one command), ``kasoku
data bench`` and ``kasoku compare``.

The ladder: rungs (what is measured) -> sweep (one fresh process per rung and batch size) ->
worker (one measurement: numerics phase, warm-up, timed windows; its pieces: pool, runner,
plain, timing, numerics, fed) -> results (JSON lines) -> report (table and chart).
``kasoku data bench``: data_bench -> data_measure (one loader measured) over data_sources ->
data_report. ``kasoku compare``: compare (each device's sweep, best rungs, the reading) ->
compare_report; compare_train (the time-to-accuracy form).
"""
