"""The GPU's hardware work queues (``CUDA_DEVICE_MAX_CONNECTIONS``).

The host hands work to the GPU through a few hardware queues, 8 unless the process asks for
more before it creates its CUDA context; CUDA spreads the streams over them. Two streams that
share a queue behave as one: work queued on the second waits for everything queued before it
on the first. A loader that decodes or copies the next batch on a side stream while the
training stream has steps queued can then do nothing until those steps are done, and the
"overlap" becomes a serial sum. On an H200, with ResNet-50's graphed step (4,800 images/s)
and a batch of JPEGs decoded beside each step, 8 queues gave 76-79% of the training rate and
32 gave 99% (``research/probes/decode_interference.py --probe``; research/notebook.md).

kasoku therefore asks for the most queues CUDA allows (32) before CUDA starts: its command
line does it first thing, and a loader with side streams does it when it is built in a
process where CUDA has not started yet. A value the user set is kept. Where CUDA already
runs with fewer queues, the side-stream loaders warn once.
"""
from __future__ import annotations

import os
import sys
import warnings

from kasoku.core.errors import KasokuWarning

ENV = "CUDA_DEVICE_MAX_CONNECTIONS"
WANTED = 32
DEFAULT = 8
"""CUDA's number of queues when ``ENV`` is unset."""


def request_queues() -> bool:
    """Ask for ``WANTED`` hardware queues: set ``ENV`` unless it is set. Takes effect only
    before this process creates its CUDA context; returns whether it set the variable."""
    if ENV in os.environ or _cuda_started():
        return False
    os.environ[ENV] = str(WANTED)
    return True


def queues() -> int:
    """The number of queues this process's CUDA context has or will have (``ENV``, else
    CUDA's default)."""
    try:
        return max(1, int(os.environ.get(ENV, DEFAULT)))
    except ValueError:
        return DEFAULT


def _cuda_started() -> bool:
    torch = sys.modules.get("torch")  # not imported yet: CUDA cannot have started
    return torch is not None and torch.cuda.is_initialized()


_warned = False


def check_queues(who: str) -> int:
    """For a loader that works on side streams: request the queues if CUDA has not started,
    else warn once when it runs with fewer than ``WANTED``. Returns ``queues()``."""
    global _warned
    request_queues()
    n = queues()
    if n < WANTED and _cuda_started() and not _warned:
        _warned = True
        warnings.warn(
            f"{who}: CUDA runs with {n} hardware work queues ({ENV}="
            f"{os.environ.get(ENV, 'unset')}); a side stream that shares a queue with the "
            f"training stream waits for the queued training steps, and loading no longer "
            f"overlaps training. Start the process with {ENV}={WANTED} (kasoku's command "
            f"line does this itself), or build the loader before CUDA starts.", KasokuWarning,
            stacklevel=3)
    return n
