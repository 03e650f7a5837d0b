"""kasoku (加速): measure, explain and accelerate deep-learning training on PyTorch."""
__version__ = "0.1.0"

from kasoku.accel.config import AccelConfig  # noqa: E402
from kasoku.config import DataConfig, TrainConfig  # noqa: E402
from kasoku.data.base import ArrayDataset  # noqa: E402
from kasoku.data.loader import SerialLoader  # noqa: E402
from kasoku.data.registry import create_loader, list_loaders, register_loader  # noqa: E402
from kasoku.errors import ConfigError, DataError  # noqa: E402
from kasoku.train import Trainer, TrainingInterrupted  # noqa: E402
from kasoku.workloads.registry import (Recipe, Workload, create_workload,  # noqa: E402
                                       list_workloads, register_workload)

__all__ = ["AccelConfig", "ArrayDataset", "ConfigError", "DataConfig", "DataError", "Recipe",
           "SerialLoader", "TrainConfig", "Trainer", "TrainingInterrupted", "Workload",
           "create_loader", "create_workload", "list_loaders", "list_workloads",
           "register_loader", "register_workload"]
