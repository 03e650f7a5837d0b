"""Built-in workloads; importing this package registers them."""
from kasoku.workloads import (  # noqa: F401  (registers)
    cifar10_lenet5,
    cifar10_resnet18,
    cifar10_resnet152,
    gpt,
    imagenet_resnet50,
    mnist_mlp,
    sine_lstm,
)
from kasoku.workloads.registry import (
    Recipe,
    Workload,
    create_workload,
    list_workloads,
    register_workload,
)

__all__ = ["Recipe", "Workload", "create_workload", "list_workloads", "register_workload"]
