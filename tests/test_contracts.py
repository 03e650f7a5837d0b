"""The contracts said in types: the step and its wrappers (``kasoku.train.step``: ``Step``,
``StepWrapper`` and its ``inner`` link, walked by ``steps_of``), the distribute step
(``kasoku.distributed.fsdp.Distribute``), the loader (``kasoku.data.base.Loader``) and the
snapshots' names (``kasoku.core.snapshot_names``), each checked on what kasoku builds."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kasoku.accel.compose  # noqa: F401  (every wrapper accelerate composes, defined)
from kasoku.accel.attention import PinnedAttention
from kasoku.accel.compose import accelerate
from kasoku.accel.config import AccelConfig
from kasoku.accel.graph import CudaGraphStep
from kasoku.accel.memory_format import ChannelsLastInputs
from kasoku.accel.multistep import MultiStep
from kasoku.core import snapshot_names
from kasoku.core.phases import PhaseClock, no_mark
from kasoku.data.base import LOADER_MEMBERS, ArrayDataset
from kasoku.data.prefetch import DevicePrefetcher
from kasoku.data.registry import accepts, create_loader, list_loaders, loader_kind
from kasoku.distributed.config import DistConfig
from kasoku.distributed.fsdp import Distribute, data_parallel, sharder
from kasoku.optim import make_optimizer
from kasoku.train.run_dir import RUN_FILES, SNAPSHOT, find_snapshot
from kasoku.train.step import StandardStep, StepWrapper, markable, steps_of

WRAPPERS = {ChannelsLastInputs: lambda s: ChannelsLastInputs(s),
            PinnedAttention: lambda s: PinnedAttention(s, "math"),
            MultiStep: lambda s: MultiStep(s),
            CudaGraphStep: lambda s: CudaGraphStep(s, torch.device("cpu"))}


def all_wrappers(cls=StepWrapper) -> set:
    return {w for sub in cls.__subclasses__() for w in {sub, *all_wrappers(sub)}}


def test_every_wrapper_kasoku_composes_links_its_inner_step():
    """Each wrapper kasoku defines holds the step it wraps as ``inner``, and ``steps_of``
    walks the chain through them all; a new wrapper must be added here."""
    assert all_wrappers() == set(WRAPPERS)
    step = StandardStep(F.cross_entropy)
    chain = step
    for wrap in WRAPPERS.values():
        outer = wrap(chain)
        assert outer.inner is chain
        chain = outer
    found = steps_of(chain)
    assert [type(s) for s in found] == [*reversed(WRAPPERS), StandardStep]
    assert found[-1] is step and steps_of(None) == []
    # The graph's replay runs no Python: the marks stop there; below it they reach the step.
    assert markable(chain) is None and markable(chain.inner) is step


def conv_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 8 * 8, 10))


def sgd(params, impl):
    return make_optimizer("sgd", params, 0.1, momentum=0.9, impl=impl)


def test_accelerates_chain_is_walked_and_the_marks_reach_its_eager_step():
    torch.manual_seed(0)
    acc = accelerate(conv_net(), F.cross_entropy, None,
                     AccelConfig(channels_last=True, sdpa_backend="math", steps_per_call=2),
                     "cpu", sgd)
    found = steps_of(acc.step_fn)
    assert [type(s) for s in found] == [MultiStep, PinnedAttention, ChannelsLastInputs,
                                        StandardStep]
    eager = markable(acc.step_fn)
    assert eager is found[-1] and eager.mark is no_mark
    clock = PhaseClock("cpu")
    eager.mark = clock.mark
    chunk = (torch.randn(2, 8, 3, 8, 8), torch.randint(0, 10, (2, 8)))
    clock.step()
    clock.mark("data")
    first = float(acc.step_fn(acc.model, chunk, acc.optimizer)["main/loss"])
    clock.step()
    phases = clock.take()
    assert {"time/forward", "time/backward", "time/update"} <= set(phases)
    later = float(acc.step_fn(acc.model, chunk, acc.optimizer)["main/loss"])
    assert later < first  # two steps per call, on the same chunk: it learns


def test_the_distribute_step_says_whether_it_compiles_blocks():
    ddp_step = data_parallel(DistConfig(), torch.device("cpu"))
    shard_step = sharder(torch.device("cpu"))
    assert isinstance(ddp_step, Distribute) and not ddp_step.compiles_blocks
    assert isinstance(shard_step, Distribute) and shard_step.compiles_blocks
    model = nn.Linear(2, 2)
    assert Distribute(lambda m: m)(model) is model


def test_every_loader_that_reads_an_in_memory_set_keeps_the_loader_contract():
    """What the trainer reads of a loader, on every kind that takes an in-memory dataset on a
    CPU (and the device prefetcher around one): one batch a call, or a chunk of K."""
    x = torch.randn(24, 3)
    dataset = ArrayDataset(x, (x[:, 0] > 0).long())
    kinds = [k for k in list_loaders() if accepts(loader_kind(k), dataset)
             and loader_kind(k).needs != "image-folder"]
    assert {"serial", "device", "threads"} <= set(kinds)
    for kind in kinds:
        per_call = 2 if loader_kind(kind).chunks else 1
        loader = create_loader(kind, dataset, 4, "cpu", batches_per_call=per_call, seed=0)
        for made in (loader, DevicePrefetcher(loader, "cpu")):
            missing = [m for m in LOADER_MEMBERS if not hasattr(made, m)]
            assert not missing, (kind, type(made).__name__, missing)
            assert made.batches_per_call == per_call and len(made) == made.batches_per_epoch
            state = made.state_dict()
            inputs, _ = next(made)
            assert inputs.shape[:per_call] == ((per_call, 4) if per_call > 1 else (4,))
            assert made.last_chunk_batches == per_call
            made.load_state_dict(state)
            again, _ = next(made)
            assert torch.equal(again, inputs), kind  # exact resume
        loader.close()


def test_the_snapshot_names_are_the_run_folders_and_the_launchers(tmp_path):
    """``run_dir`` lists and finds snapshots by the names ``snapshot_names`` says, which the
    launcher reads too: a file, or a complete sharded folder (an unfinished one is none)."""
    assert SNAPSHOT == snapshot_names.LATEST == "snapshot_latest.pt"
    assert {snapshot_names.FILES, snapshot_names.SHARDED} <= set(RUN_FILES)
    assert snapshot_names.snapshots(tmp_path / "none") == []
    (tmp_path / "snapshot_iter_5.dcp").mkdir()  # no trainer file yet: not a snapshot
    assert snapshot_names.snapshots(tmp_path) == []
    (tmp_path / "snapshot_iter_5.dcp" / snapshot_names.TRAINER_FILE).write_bytes(b"")
    assert snapshot_names.snapshots(tmp_path) == [tmp_path / "snapshot_iter_5.dcp"]
    (tmp_path / SNAPSHOT).write_bytes(b"")
    assert find_snapshot(tmp_path) == tmp_path / SNAPSHOT
    assert set(snapshot_names.snapshots(tmp_path)) == {tmp_path / SNAPSHOT,
                                                       tmp_path / "snapshot_iter_5.dcp"}


def test_a_loader_of_ones_own_that_lacks_the_contract_is_told_what_in_one_line():
    from kasoku.train import Trainer

    class Batches:  # iterates, but none of the rest
        def __next__(self):
            return torch.zeros(2, 4), torch.zeros(2, dtype=torch.long)

    model = nn.Linear(4, 2)
    with pytest.raises(TypeError, match=r"not a kasoku loader: it lacks __len__, "
                                        r"batches_per_call, batches_per_epoch, close"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), Batches(), F.cross_entropy,
                writer=False, handle_signals=False)
    # the names the message reads are the protocol's, each of them
    assert sorted(LOADER_MEMBERS) == [
        "__len__", "__next__", "batches_per_call", "batches_per_epoch", "close", "epoch",
        "epoch_detail", "is_new_epoch", "last_chunk_batches", "load_state_dict", "state_dict"]
