"""``kasoku bench``: seed 004's acceleration ladder on any machine, in one command.

rungs (what is measured) -> sweep (one fresh process per rung and batch size) -> worker
(one measurement: numerics phase, warm-up, timed windows) -> results (JSON lines) -> report
(table and chart). ``python -m kasoku.commands.bench WORKLOAD ...`` runs it without the main CLI.
"""
