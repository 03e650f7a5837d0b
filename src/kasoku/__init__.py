"""kasoku (加速): measure, explain and accelerate deep-learning training on PyTorch.

The public API below is imported on first use (PEP 562): ``import kasoku`` and ``kasoku
--version`` start without loading torch, and ``from kasoku import Trainer`` loads what it
names."""
from __future__ import annotations

from kasoku.core.lazy_exports import lazy_exports
from kasoku.core.version import __version__  # noqa: F401  (kasoku.__version__)

_EXPORTS = {
    "AccelConfig": "kasoku.accel.config",
    "ArrayDataset": "kasoku.data.base",
    "ConfigError": "kasoku.core.errors",
    "DataConfig": "kasoku.data.config",
    "DataError": "kasoku.core.errors",
    "Recipe": "kasoku.workloads.registry",
    "SerialLoader": "kasoku.data.loader",
    "TrainConfig": "kasoku.train.config",
    "Trainer": "kasoku.train",
    "TrainingInterrupted": "kasoku.train",
    "Workload": "kasoku.workloads.registry",
    "create_loader": "kasoku.data.registry",
    "create_workload": "kasoku.workloads.registry",
    "list_loaders": "kasoku.data.registry",
    "list_workloads": "kasoku.workloads.registry",
    "register_loader": "kasoku.data.registry",
    "register_workload": "kasoku.workloads.registry",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
