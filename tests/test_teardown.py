"""A data-parallel worker's end (``kasoku.commands.job.leave_job``): the step's CUDA graphs and
the compiled code released while the process group still lives, then the group destroyed;
the group left even when releasing fails. On the CPU with a real gloo group of one process;
the graph is a stand-in recording when it was reset (a CUDA graph needs a GPU: the 2-GPU run
that hung without this order is `benchmarks/ddp_exit.py`, on the device)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from kasoku.accel.graph import CudaGraphStep
from kasoku.accel.memory_format import ChannelsLastInputs
from kasoku.accel.teardown import release_levers
from kasoku.commands.job import leave_job


class RecordingGraph:
    """Stands in for ``torch.cuda.CUDAGraph``: records whether the group lived at reset."""

    def __init__(self):
        self.reset_while_group_lived = None

    def reset(self):
        self.reset_while_group_lived = dist.is_initialized()


class FakeTrainer:
    def __init__(self, step_fn):
        self.step_fn = step_fn


def _join_alone():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def _graphed_step():
    graphed = CudaGraphStep(lambda model, batch, opt: {}, torch.device("cpu"))
    graphed.graph = RecordingGraph()
    return graphed, graphed.graph


def test_graphs_and_compiled_code_are_released_before_the_group_is_left():
    compiles = []

    def counting_backend(gm, example_inputs):
        compiles.append(1)
        return gm.forward

    fn = torch.compile(lambda x: x * 2 + 1, backend=counting_backend)
    x = torch.ones(3)
    fn(x)
    fn(x)
    assert len(compiles) == 1  # compiled once, then cached
    graphed, graph = _graphed_step()
    step = ChannelsLastInputs(graphed)  # the graph found inside a wrapper too
    _join_alone()
    try:
        leave_job(FakeTrainer(step), torch.device("cpu"))
    finally:
        if dist.is_initialized():  # the test failed: leave no group to the next test
            dist.destroy_process_group()
    assert graph.reset_while_group_lived is True
    assert graphed.graph is None and graphed.eager_steps == 0
    assert not dist.is_initialized()
    fn(x)
    assert len(compiles) == 2  # the compiled code was dropped: it compiles again


def test_the_group_is_left_even_when_releasing_fails():
    class Exploding:
        def reset(self):
            raise RuntimeError("graph reset failed")

    graphed = CudaGraphStep(lambda model, batch, opt: {}, torch.device("cpu"))
    graphed.graph = Exploding()
    _join_alone()
    try:
        leave_job(FakeTrainer(graphed), torch.device("cpu"))
    except RuntimeError as exc:
        assert "graph reset failed" in str(exc)
    else:
        raise AssertionError("the release's error was swallowed")
    finally:
        left = not dist.is_initialized()
        if not left:
            dist.destroy_process_group()
    assert left


def test_release_is_safe_without_a_step_or_twice():
    release_levers(None, torch.device("cpu"))
    graphed, graph = _graphed_step()
    release_levers(graphed)
    release_levers(graphed)  # nothing left to free: no error
    assert graphed.graph is None and graph.reset_while_group_lived is False
