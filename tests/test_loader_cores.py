"""kasoku.accel.loader_cores: the CPU's cores split between the training step and the
loader's workers, on fake topologies, and for real: worker processes and threads that report
their own affinity, the main process's threads all on the step's cores, and a training run
that records it."""
from __future__ import annotations

import os

import pytest
import torch
from test_cpuinfo import EPYC_FLAGS, XEON_FLAGS, fake_tree

from kasoku.accel import loader_cores
from kasoku.accel.loader_cores import (
    CoreSplit,
    apply_loader_cores,
    describe,
    pin_threads,
    split_cores,
)
from kasoku.core.errors import ConfigError
from kasoku.data.base import ArrayDataset
from kasoku.data.registry import create_loader, host_workers
from kasoku.perf.cpuinfo import core_cpus

HAS_AFFINITY = hasattr(os, "sched_getaffinity") and hasattr(os, "sched_setaffinity")


def usable_cores() -> list[int]:
    return (core_cpus("/", os.sched_getaffinity(0)) or []) if HAS_AFFINITY else []


CORES = usable_cores()
"""Read once, when the tests are collected: the cores the skip mark below counted."""

needs_two_cores = pytest.mark.skipif(len(CORES) < 2,
                                     reason="needs 2 usable physical cores and the affinity API")


@pytest.fixture
def restore_cpus():
    """Every thread of this process back on its CPUs, and PyTorch's thread count back, after a
    test that pins them."""
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    yield
    pin_threads(affinity)
    torch.set_num_threads(threads)


def test_split_on_two_sockets_of_hyperthreaded_cores(tmp_path):
    # 2 sockets x 4 cores x 2 threads: CPU i and i + 8 share a core.
    cores = [(s, c) for s in range(2) for c in range(4)]
    root = fake_tree(tmp_path, name="Xeon", vendor="GenuineIntel", family=6, model=143,
                     flags=XEON_FLAGS, topology=cores + cores, nodes=2)
    cpus = core_cpus(root)
    assert cpus == list(range(8))  # one hardware thread per core, as the compute threads
    assert split_cores(cpus, 2) == CoreSplit((0, 1, 2, 3, 4, 5), (6, 7))
    assert split_cores(cpus, 8) == CoreSplit((0, 1, 2, 3, 4, 5), (6, 7))  # at most a quarter
    assert split_cores(cpus, 2, threads=3) == CoreSplit((0, 1, 2), (6, 7))
    assert split_cores(cpus, 6, threads=5) == CoreSplit((0, 1, 2, 3, 4), (5, 6, 7))
    # A mask of two cores' four hardware threads: shared, unless a thread count is asked for.
    assert "2 physical cores usable" in split_cores(core_cpus(root, {0, 8, 1, 9}), 4)
    assert split_cores(core_cpus(root, {0, 8, 1, 9}), 4, threads=1) == CoreSplit((0,), (1,))
    # One core, two hardware threads: nothing to split.
    assert "1 physical core usable" in split_cores(core_cpus(root, {3, 11}), 1)


def test_split_on_a_two_core_vm(tmp_path):
    root = fake_tree(tmp_path, name="AMD EPYC", vendor="AuthenticAMD", family=25, model=1,
                     flags=EPYC_FLAGS, topology=[(0, 0), (0, 1)])
    # A core of two would cost the step half its compute: shared unless --threads says 1.
    assert "would cost the step half" in split_cores(core_cpus(root), 1)
    assert split_cores(core_cpus(root), 1, threads=1) == CoreSplit((0,), (1,))
    assert "take all 2 physical cores" in split_cores(core_cpus(root), 1, threads=2)


@pytest.mark.parametrize("cores", range(1, 10))
def test_the_step_always_keeps_a_core(cores):
    cpus = list(range(0, 2 * cores, 2))  # ids with gaps, as a mask can have
    for workers in range(1, 13):
        for threads in [None, *range(1, cores + 2)]:
            split = split_cores(cpus, workers, threads)
            if isinstance(split, str):
                assert cores < 2 or (threads is None and cores < 4) or threads >= cores
                continue
            step, loader = set(split.compute_cpus), set(split.worker_cpus)
            assert step and loader and not step & loader and step | loader <= set(cpus)
            assert len(loader) <= workers
            assert len(step) == (threads or cores - len(loader))
            if threads is None:
                assert len(loader) <= cores // 4
    with pytest.raises(ValueError, match=">= 1"):
        split_cores([0, 1], 0)


def test_without_the_affinity_api_nothing_changes(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    record = apply_loader_cores(2)
    assert record == {"loader_workers": 2, "loader_cpus": None,
                      "loader_note": "no CPU affinity API on this platform"}
    assert describe(record) == ("2 loader workers on the compute cores (no CPU affinity API "
                                "on this platform)")


def test_a_one_core_mask_leaves_things_as_they_are(monkeypatch):
    first = usable_cores()[:1] or [0]
    monkeypatch.setattr(loader_cores.os, "sched_getaffinity", lambda pid: set(first))
    called = []
    monkeypatch.setattr(loader_cores, "pin_threads", lambda cpus: called.append(cpus))
    record = apply_loader_cores(1)
    assert record["loader_cpus"] is None and "1 physical core usable" in record["loader_note"]
    assert not called


def test_the_registry_says_which_kinds_have_workers_to_pin():
    from kasoku.data.parallel_loader import ProcessLoader, ThreadLoader
    assert host_workers("multiprocess:3") == 3
    assert host_workers("multiprocess") == ProcessLoader.default_workers()
    assert host_workers("threads:2") == 2 and host_workers("threads") == \
        ThreadLoader.default_threads()
    for spec in ("serial", "device", "gpu-jpeg:4", "gpu-jpeg-procs:2"):
        assert host_workers(spec) == 0
    with pytest.raises(ConfigError, match="no workers on the host"):
        create_loader("serial", ArrayDataset(torch.zeros(4, 2), torch.zeros(4)), 2,
                      worker_cpus=[0])


class AffinityReport:
    """Each sample reports the CPUs the thread that made it may run on, as a bit mask (a
    sample at a time: no ``get_batch``, so a thread loader hands each to a pool thread)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor(_mask(os.sched_getaffinity(0))), torch.tensor(i)


class BatchAffinityReport(AffinityReport):
    """The same, a batch at a time (a worker process makes it)."""

    def get_batch(self, indices):
        return torch.full((len(indices),), _mask(os.sched_getaffinity(0))), indices


def _mask(cpus) -> int:
    return sum(1 << c for c in cpus)


def _thread_cpus() -> set[int]:
    """The union of the affinity masks of every thread of this process."""
    cpus = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            cpus |= os.sched_getaffinity(int(tid))
        except OSError:  # ended since listed
            pass
    return cpus


@needs_two_cores
@pytest.mark.parametrize("spec,dataset", [("multiprocess:2", BatchAffinityReport),
                                          ("threads:2", AffinityReport)])
def test_workers_run_on_their_cores_and_the_step_on_the_others(spec, dataset, restore_cpus):
    torch.ones(256, 256) @ torch.ones(256, 256)  # PyTorch's pool started before the split
    # A thread count asked for: the split happens on any machine of 2 cores or more.
    record = apply_loader_cores(host_workers(spec), threads=len(CORES) - 1)
    assert "pinned_cpus" in record, record
    step, workers = set(record["pinned_cpus"]), set(record["loader_cpus"])
    assert step and workers and not step & workers, record
    assert record["threads"] == torch.get_num_threads() == len(step)
    assert os.sched_getaffinity(0) == step and _thread_cpus() == step
    loader = create_loader(spec, dataset(12), 3, worker_cpus=record["loader_cpus"])
    try:
        for _ in range(6):  # both epochs' batches, from every worker
            x, _ = next(loader)
            assert set(x.tolist()) == {_mask(workers)}
        assert os.sched_getaffinity(0) == step
    finally:
        loader.close()


@needs_two_cores
def test_a_cpu_run_records_the_split_and_can_turn_it_off(tmp_path, restore_cpus):
    from kasoku.commands.train import build_trainer, close_run
    from kasoku.data.config import DataConfig
    from kasoku.train.config import TrainConfig
    from kasoku.workloads import create_workload
    data = DataConfig(synthetic=True, synthetic_train_size=64, synthetic_val_size=16)
    affinity, cpus = os.sched_getaffinity(0), usable_cores()
    for on, spec in ((True, "multiprocess:1"), (False, "multiprocess:1"), (True, "serial")):
        train = TrainConfig(epochs=1, batch_size=16, device="cpu", loader=spec,
                            threads=len(cpus) - 1,
                            loader_cores=on, progress=False, out=tmp_path / f"{on}-{spec}")
        trainer = build_trainer(create_workload("mnist-mlp"), data, train)
        try:
            cores = trainer.setup.get("cpu_threads")
            if spec == "serial":
                assert cores is None
            elif on:
                assert cores["loader_cpus"] == cpus[-1:]  # one worker: the last core
                assert trainer.train_loader.worker_cpus == cores["loader_cpus"]
                assert os.sched_getaffinity(0) == set(cores["pinned_cpus"])
            else:
                assert cores["loader_cpus"] is None
                assert cores["loader_note"] == "--no-loader-cores"
                assert trainer.train_loader.worker_cpus is None
        finally:
            close_run(trainer)
        assert os.sched_getaffinity(0) == affinity  # the next run starts unpinned


@needs_two_cores
def test_a_training_run_says_its_cores_and_gives_them_back(tmp_path, capsys, restore_cpus):
    from kasoku.commands.train import train_run
    from kasoku.data.config import DataConfig
    from kasoku.run import resolve
    from kasoku.train.config import TrainConfig
    from kasoku.workloads import create_workload
    before, threads_before = os.sched_getaffinity(0), torch.get_num_threads()
    run = resolve(create_workload("mnist-mlp"),
                  DataConfig(synthetic=True, synthetic_train_size=64, synthetic_val_size=16),
                  TrainConfig(epochs=1, batch_size=16, device="cpu", loader="threads:1",
                              threads=len(usable_cores()) - 1,
                              progress=False, out=tmp_path / "run"))
    run.check()
    train_run(run)
    header = capsys.readouterr().err.splitlines()[0]
    cpus = usable_cores()
    assert header.endswith(f"cores: {len(cpus) - 1} compute thread{'s' * (len(cpus) > 2)} on "
                           f"CPUs {cpus[:-1]}, 1 loader worker on CPUs {cpus[-1:]}"), header
    assert os.sched_getaffinity(0) == before and _thread_cpus() == before
    assert torch.get_num_threads() == threads_before


@needs_two_cores
def test_a_build_that_fails_after_the_split_gives_the_cores_back(tmp_path, monkeypatch):
    import multiprocessing

    import kasoku.commands.train
    from kasoku.commands.train import build_trainer
    from kasoku.data.config import DataConfig
    from kasoku.train.config import TrainConfig
    from kasoku.workloads import create_workload

    def refuse(*args, **kwargs):
        raise RuntimeError("the trainer could not be made")

    monkeypatch.setattr(kasoku.commands.train, "Trainer", refuse)  # after the loaders were built
    data = DataConfig(synthetic=True, synthetic_train_size=64, synthetic_val_size=16)
    train = TrainConfig(epochs=1, batch_size=16, device="cpu", loader="multiprocess:1",
                        threads=len(CORES) - 1, progress=False, out=tmp_path / "run")
    before, threads_before = os.sched_getaffinity(0), torch.get_num_threads()
    children = set(multiprocessing.active_children())
    with pytest.raises(RuntimeError, match="could not be made"):
        build_trainer(create_workload("mnist-mlp"), data, train)
    assert os.sched_getaffinity(0) == before and _thread_cpus() == before
    assert torch.get_num_threads() == threads_before
    assert set(multiprocessing.active_children()) <= children  # the loader's workers ended


def test_a_thread_count_below_one_is_refused():
    with pytest.raises(ValueError, match="threads must be None or >= 1"):
        split_cores([0, 1, 2, 3], 1, threads=0)


def test_turning_it_off_where_there_is_nothing_to_split_is_said(tmp_path):
    from kasoku.commands.train import build_trainer, close_run
    from kasoku.core.errors import KasokuWarning, reset_warnings
    from kasoku.data.config import DataConfig
    from kasoku.train.config import TrainConfig
    from kasoku.workloads import create_workload
    reset_warnings()
    train = TrainConfig(epochs=1, batch_size=16, device="cpu", loader="serial",
                        loader_cores=False, progress=False, out=tmp_path / "run")
    with pytest.warns(KasokuWarning, match="--no-loader-cores has no effect: the serial"):
        trainer = build_trainer(create_workload("mnist-mlp"),
                                DataConfig(synthetic=True, synthetic_train_size=32,
                                           synthetic_val_size=16), train)
    close_run(trainer)
    assert "cpu_threads" not in trainer.setup


def test_the_flag_turns_it_off():
    from kasoku.cli import build_parser
    from kasoku.cli.args import config_from
    from kasoku.train.config import TrainConfig
    parser = build_parser()
    for argv, want in ((["train", "mnist-mlp"], True),
                       (["train", "mnist-mlp", "--no-loader-cores"], False),
                       (["profile", "mnist-mlp", "--no-loader-cores"], False)):
        assert config_from(parser.parse_args(argv), TrainConfig).loader_cores is want
