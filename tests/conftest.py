import os
from pathlib import Path

import pytest

SHARED_DATA = Path(os.environ.get("KASOKU_SHARED_DATA",
                                  Path(__file__).resolve().parents[1].parent / "shared" / "data"))


@pytest.fixture
def mnist_dir():
    d = SHARED_DATA / "mnist"
    if not (d / "train-images-idx3-ubyte.gz").exists():
        pytest.skip(f"real MNIST not found under {d}")
    return d


@pytest.fixture
def cifar10_dir():
    d = SHARED_DATA / "cifar10"
    if not (d / "cifar-10-batches-bin" / "data_batch_1.bin").exists():
        pytest.skip(f"real CIFAR-10 not found under {d}")
    return d
