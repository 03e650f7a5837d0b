import os
from pathlib import Path

import pytest
import torch

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


@pytest.fixture
def one_thread_fresh_lever_warnings():
    """Tiny tensors on one thread (a second only adds contention), and the accel levers'
    warn-once memory cleared so each test sees its own warnings."""
    from kasoku.accel.notes import reset_warnings
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    reset_warnings()
    yield
    torch.set_num_threads(before)
