"""K-FAC's phases on the phase clock, declared to it (``kasoku.core.phases.declare_phases``:
the clock knows no K-FAC), so a step's time shows K-FAC's curvature work split out of the
phases it runs in.

``kfac_factors``: each layer's batch factors (``A`` in forward hooks, ``G`` in backward hooks,
on factor steps), their running averages and, with data-parallel workers, their average over
the workers; ``kfac_inverse``: the eigendecompositions or inverses (inverse steps);
``kfac_precondition``: the preconditioned gradients and the KL clip (every step). ``update`` is
then the base optimizer's own step.
"""
from __future__ import annotations

from kasoku.core.phases import declare_phases

FACTORS = "kfac_factors"
INVERSE = "kfac_inverse"
PRECONDITION = "kfac_precondition"
PHASES = declare_phases((FACTORS, INVERSE, PRECONDITION))
"""K-FAC's phases, in the order the phase clock lists them (after ``update``)."""
