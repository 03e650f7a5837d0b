"""The README's first command, ``kasoku bench mnist-mlp``: a short CPU ladder at one batch size
by default (``--full``: the whole one)."""
from __future__ import annotations

import pytest

from kasoku.cli import build_parser
from kasoku.commands.bench.rung_spec import SHORT_CPU_LADDER
from kasoku.commands.bench.rungs import cpu_ladder, default_ladder, gpu_ladder, ladder_or_specs
from kasoku.core.flags import flag
from kasoku.workloads.registry import default_batch_sizes

FULL = flag("bench.full")


# --- the default ladder and batch sizes ------------------------------------------------------

def test_the_cpu_default_is_the_short_ladder_and_full_is_the_whole_one():
    assert [r.label for r in default_ladder("cpu", full=False)] == list(SHORT_CPU_LADDER)
    assert default_ladder("cpu") == default_ladder("cpu", full=True) == cpu_ladder()
    assert ladder_or_specs("cpu", None, full=False) == default_ladder("cpu", full=False)
    # a GPU's ladder is the same either way
    assert default_ladder("cuda", full=False) == default_ladder("cuda") == gpu_ladder()
    # a rung of the whole ladder can still be named by its label
    assert [r.label for r in ladder_or_specs("cpu", ["+compile"], full=False)] == [
        "plain", "+compile"]


def test_the_cpu_default_batch_is_the_recipes_as_in_the_readmes_cpu_row():
    assert default_batch_sizes(100, "bench", "cpu") == (100,)
    assert default_batch_sizes(100, "bench", "cpu", full=True) == (12, 25, 100)
    assert default_batch_sizes(256, "bench", "cpu") == (100,)  # at most CPU_MAX_BATCH
    assert default_batch_sizes(100, "bench", "cuda", full=True) == \
        default_batch_sizes(100, "bench", "cuda") == (12, 25, 50, 100)


def _sweep_config(argv, tmp_path):
    from kasoku.cli.bench import sweep_config
    from kasoku.commands.device import resolve_device
    from kasoku.workloads import create_workload
    args = build_parser().parse_args(["bench", "mnist-mlp", "--device", "cpu", *argv])
    return sweep_config(args, create_workload("mnist-mlp"), resolve_device("cpu"), tmp_path)


def test_the_flag_picks_the_ladder_and_the_sizes(tmp_path):
    short = _sweep_config([], tmp_path)
    assert [r.label for r in short.rungs] == list(SHORT_CPU_LADDER)
    assert short.batch_sizes == (100,)
    full = _sweep_config([FULL], tmp_path)
    assert [r.label for r in full.rungs] == [r.label for r in cpu_ladder()]
    assert full.batch_sizes == (12, 25, 100)
    with pytest.raises(SystemExit):  # the whole ladder or rungs of one's own, not both
        build_parser().parse_args(["bench", "mnist-mlp", FULL, "--config", "+fused"])
