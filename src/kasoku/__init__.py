"""kasoku (加速): measure, explain and accelerate deep-learning training on PyTorch."""
__version__ = "0.1.0"

from kasoku.config import DataConfig, TrainConfig  # noqa: E402
from kasoku.errors import ConfigError, DataError  # noqa: E402
from kasoku.data.loader import SerialLoader  # noqa: E402
from kasoku.train import Trainer, TrainingInterrupted  # noqa: E402
from kasoku.workloads.registry import (Recipe, Workload, create_workload,  # noqa: E402
                                       list_workloads, register_workload)

__all__ = ["ConfigError", "DataConfig", "DataError", "Recipe", "SerialLoader", "TrainConfig", "Trainer",
           "TrainingInterrupted", "Workload",
           "create_workload", "list_workloads", "register_workload"]
