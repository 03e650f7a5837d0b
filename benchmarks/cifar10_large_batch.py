"""``cifar10-resnet18`` at batch 4,096 with the linear scaling rule (Goyal et al. 2017: lr 0.1
per 128 samples -> 3.2, 5 warm-up epochs, then cosine), the large-batch case where SGD loses
accuracy and K-FAC is meant to keep it. A workload file for ``kasoku train``:

    kasoku train benchmarks/cifar10_large_batch.py:ResNet18Batch4096 --data DIR ...
"""
from kasoku.workloads.cifar10_resnet18 import Cifar10ResNet18
from kasoku.workloads.registry import Recipe


class ResNet18Batch4096(Cifar10ResNet18):
    description = "ResNet-18 on CIFAR-10 at batch 4096, linear scaling rule with warmup"
    recipe = Recipe(optimizer="momentum", lr=0.1 * 4096 / 128, momentum=0.9, weight_decay=5e-4,
                    batch_size=4096, epochs=30, schedule="cosine", warmup_epochs=5)
