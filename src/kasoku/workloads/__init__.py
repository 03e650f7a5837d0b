"""Built-in workloads; importing this package registers them."""
from kasoku.workloads.registry import (Recipe, Workload, create_workload, list_workloads,
                                       register_workload)
from kasoku.workloads import (mnist_mlp, cifar10_lenet5, sine_lstm,  # noqa: F401  (registers)
                              cifar10_resnet18, cifar10_resnet152, imagenet_resnet50, gpt)

__all__ = ["Recipe", "Workload", "create_workload", "list_workloads", "register_workload"]
