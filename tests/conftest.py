import os
import signal
from pathlib import Path

import pytest
import torch

# The tests act as a terminal's Ctrl-C does: a runner that starts pytest with SIGINT ignored (a
# background job of a shell script, a pytest-xdist worker) would leave Python without its
# handler, and every process the tests start with SIGINT ignored too (ignored stays ignored
# across exec), so a test's Ctrl-C would reach nothing.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

SHARED_DATA = Path(os.environ.get("KASOKU_SHARED_DATA",
                                  Path(__file__).resolve().parents[1].parent / "shared" / "data"))


@pytest.fixture(autouse=True, scope="session")
def _data_cache(tmp_path_factory):
    """Derived data (gpt's tokenized text) in a folder of the session's, never the user's
    cache; worker processes the tests start inherit it."""
    before = os.environ.get("KASOKU_CACHE")
    os.environ["KASOKU_CACHE"] = str(tmp_path_factory.mktemp("kasoku-cache"))
    yield
    if before is None:
        os.environ.pop("KASOKU_CACHE", None)
    else:
        os.environ["KASOKU_CACHE"] = before


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


_START_CPUS = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
_START_THREADS = torch.get_num_threads()


def _restore_cpus_and_threads() -> None:
    if _START_CPUS is not None and os.sched_getaffinity(0) != _START_CPUS:
        from kasoku.accel.loader_cores import pin_threads
        pin_threads(_START_CPUS)
    if torch.get_num_threads() != _START_THREADS:
        torch.set_num_threads(_START_THREADS)


@pytest.fixture(autouse=True)
def _cpus_and_threads_restored():
    """Every test starts and ends with this process's threads on the CPUs, and PyTorch's
    thread count, the session started with: a bench worker run in-process (a module fixture
    among them) pins the calling thread (one core per thread asked for), a run with a loader
    split pins them all, and a test after them would see fewer cores than the machine has."""
    _restore_cpus_and_threads()
    yield
    _restore_cpus_and_threads()
