"""Sharded data parallelism (--shard, FSDP2) on the CPU with real worker processes (gloo): two
sharded workers train as one process on the whole batch, a snapshot two workers wrote (a DCP
folder) resumes on two and on one, and what sharding cannot take is refused in one line."""
from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from test_dist import assert_same, kasoku, workload_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from kasoku.cli import main
from kasoku.distributed import fsdp
from kasoku.train import load_snapshot
from kasoku.workloads import create_workload

# tiny gpt (2 blocks, no dropout) in float64, on 64 generated sequences: an epoch is 8 steps
# of 8 sequences, as 2 workers x 4 or 1 process x 8.
# Its learning rate constant (gpt's cosine schedule spans the run's epochs, so a run of half
# an epoch resumed to one would follow another schedule than a run of one epoch).
GPT64 = textwrap.dedent('''
    import dataclasses

    from kasoku.workloads.gpt import GPTWorkload

    class GPT64(GPTWorkload):
        """gpt tiny in float64, its learning rate constant."""
        def __init__(self, config=None):
            super().__init__(config)
            self.recipe = dataclasses.replace(self.recipe, schedule="none", warmup_epochs=0)

        def build_model(self):
            return super().build_model().double()
    ''')
RUN = ["--synthetic", "--synthetic-size", "64", "--no-progress", "--seed", "3"]

# The float64 argument of test_dist's ATOL_FP64 holds here: 2 sharded workers and 1 process
# take the same 8 samples a step and average the same gradients, summed in another order
# (each worker's GEMMs over 4 samples, then gloo's reduce-scatter adds the two halves; the
# one process over 8 at once), so AdamW's steps differ by last bits of float64 (u = 2^-53),
# amplified where a gradient element is mostly cancellation. Sharding changes no arithmetic:
# each worker updates its slice of every tensor with the same elementwise AdamW. Measured on a
# 2-core EPYC: 6.8e-15 apart in float64 (5.2e-6 in float32) after 8 steps in one go. A wrong
# update (a gradient shard not reduced, a batch taken twice) changes AdamW's step of about
# lr = 1e-3 per weight, orders of magnitude above 1e-11.
ATOL_FP64 = 1e-11


@pytest.fixture(scope="module")
def gpt64(tmp_path_factory) -> str:
    return workload_file(tmp_path_factory, "gpt64", GPT64, "GPT64")


@pytest.fixture(scope="module")
def half(gpt64, tmp_path_factory) -> Path:
    """Half an epoch (4 steps) of 2 sharded workers x 4: its folder, holding a DCP snapshot."""
    out = tmp_path_factory.mktemp("half") / "run"
    done = kasoku("train", gpt64, *RUN, "--procs", "2", "--shard", "--batch-size", "4",
                  "--epochs", "0.5", "--out", out)
    assert "2 processes (gloo), batch 4 per worker, 8 in all" in done.stderr
    assert "keeps the parameters fp32" not in done.stderr  # fp32 asked: nothing to say
    return out


def log_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def full_state(folder: Path, tmp_path: Path) -> dict:
    """A sharded snapshot folder's model and optimizer as whole tensors, by torch's own
    converter (not kasoku's loading)."""
    dcp_to_torch_save(folder, tmp_path / "whole.pt")
    return torch.load(tmp_path / "whole.pt", weights_only=False)


def test_sharded_workers_train_and_resume_as_one_process(tmp_path, gpt64, half):
    one = tmp_path / "one"
    kasoku("train", gpt64, *RUN, "--batch-size", "8", "--epochs", "1", "--out", one)
    two = tmp_path / "two"
    shutil.copytree(half, two)
    kasoku("train", gpt64, *RUN, "--procs", "2", "--shard", "--batch-size", "4", "--epochs",
           "1", "--out", two, "--resume", "auto")
    assert [p.name for p in two.glob("snapshot_*")] == ["snapshot_iter_8.dcp"]  # keep=1
    sharded = full_state(two / "snapshot_iter_8.dcp", tmp_path)["model"]
    whole = load_snapshot(one / "snapshot_latest.pt")["model"]
    assert sharded["blocks.0.attn.qkv.weight"].dtype == torch.float64
    assert_same(sharded, whole, rtol=0, atol=ATOL_FP64)
    last = [log_of(run)[-1] for run in (two, one)]
    assert last[0]["iteration"] == last[1]["iteration"] == 8
    assert last[0]["validation/main/loss"] == pytest.approx(last[1]["validation/main/loss"],
                                                             rel=1e-9)


def test_a_snapshot_of_two_sharded_workers_loads_into_one_process(tmp_path, gpt64, half):
    # Alone, no process group: DCP reads both workers' shards into whole tensors, the same
    # values torch's own converter gives, and AdamW's state under the parameters' names.
    folder = half / "snapshot_iter_4.dcp"
    workload = create_workload(gpt64)
    model = workload.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fsdp.load_sharded(model, optimizer, folder)
    saved = full_state(folder, tmp_path)
    assert_same(model.state_dict(), saved["model"], rtol=0, atol=0)
    state = optimizer.state[model.blocks[1].mlp.fc.weight]
    torch.testing.assert_close(state["exp_avg"],
                               saved["optimizer"]["state"]["blocks.1.mlp.fc.weight"]["exp_avg"],
                               rtol=0, atol=0)
    assert float(state["step"]) == 4


def test_a_snapshot_of_two_sharded_workers_resumes_on_one(tmp_path, gpt64, half):
    run = tmp_path / "run"
    shutil.copytree(half, run)
    done = kasoku("train", gpt64, *RUN, "--batch-size", "4", "--epochs", "1", "--out", run,
                  "--resume", "auto")
    assert "snapshot was taken with 2 workers" in done.stderr
    assert "resumed from" in done.stderr and "iteration 4" in done.stderr
    # 32 of the 64 samples were taken by 2 x 4 steps of 4: one process goes on with the
    # other 32 in 8 steps of 4; its AdamW state went on counting from the 4 steps before.
    assert log_of(run)[-1]["iteration"] == 4 + 8
    state = load_snapshot(run / "snapshot_latest.pt")
    assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {12.0}


def test_clipped_sharded_workers_train_as_one_process(tmp_path, gpt64):
    # FSDP2's gradients are shards: the clip must take the norm of the whole, as one process.
    clip = [*RUN, "--grad-clip", "0.05", "--epochs", "0.5", "--log-interval", "1"]
    kasoku("train", gpt64, *clip, "--batch-size", "8", "--out", tmp_path / "one")
    kasoku("train", gpt64, *clip, "--procs", "2", "--shard", "--batch-size", "4", "--out",
           tmp_path / "two")
    norms = [[r["main/grad_norm"] for r in log_of(tmp_path / run) if "main/grad_norm" in r]
             for run in ("two", "one")]
    assert len(norms[1]) == 4 and min(norms[1]) > 0.05  # every step logged and clipped
    assert norms[0] == pytest.approx(norms[1], rel=1e-9)
    sharded = full_state(tmp_path / "two" / "snapshot_iter_4.dcp", tmp_path)["model"]
    assert_same(sharded, load_snapshot(tmp_path / "one" / "snapshot_latest.pt")["model"],
                rtol=0, atol=ATOL_FP64)


def test_the_sharded_parameters_dtype_follows_the_precision():
    # bf16 on CUDA: gathered and computed in bf16, reduced in fp32; fp32 and tf32 asked on
    # CUDA stay fp32 (they were bf16 whatever --precision said); a CPU keeps fp32.
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert fsdp.policy_dtypes("bf16", cuda) == (torch.bfloat16, torch.float32)
    for precision, device in (("fp32", cuda), ("tf32", cuda), ("bf16", cpu), ("fp32", cpu)):
        assert fsdp.policy_dtypes(precision, device) == (None, None), (precision, device)


def test_shard_wraps_each_block_then_the_root_in_the_precisions_policy(monkeypatch):
    # fully_shard recorded, not run (it needs a process group): what shard asks of it.
    import torch.distributed.fsdp as fsdp2
    calls = []

    def fully_shard(module, mp_policy, reshard_after_forward=True):
        calls.append((module, mp_policy.param_dtype, mp_policy.reduce_dtype,
                      reshard_after_forward))
        module.set_modules_to_forward_prefetch = module.set_modules_to_backward_prefetch = \
            lambda modules: None
        return module
    monkeypatch.setattr(fsdp2, "fully_shard", fully_shard)
    model = create_workload("gpt").build_model()  # tiny: 2 blocks
    fsdp.shard(model, torch.device("cuda"), "bf16")  # nothing moves to the device
    assert [(m, p, r, keep) for m, p, r, keep in calls] == [
        (model.blocks[0], torch.bfloat16, torch.float32, True),
        (model.blocks[1], torch.bfloat16, torch.float32, False),  # the last block stays whole
        (model, torch.bfloat16, torch.float32, True)]
    calls.clear()
    fsdp.shard(model, torch.device("cuda"), "fp32")
    assert {(p, r) for _, p, r, _ in calls} == {(None, None)}


def test_what_sharding_cannot_take_is_one_line(capsys, gpt64):
    for argv, words in ((["--optimizer", "kfac"], "kfac"),
                        (["--optimizer", "lars"], "trust ratio"),
                        (["--cuda-graph"], "--cuda-graph"),
                        (["--compile", "reduce-overhead"], "compile mode reduce-overhead"),
                        (["--precision", "fp16"], "loss scaler"),
                        (["--allreduce-dtype", "bf16"], "setting of DDP")):
        assert main(["train", gpt64, *RUN, "--procs", "2", "--shard", *argv]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err and err.count("\n") == 1, err


@pytest.mark.slow  # inductor's C++ build of the block on 2 workers: about 30 s on 2 cores
def test_compiled_blocks_train_as_the_eager_sharded_workers(tmp_path, gpt64, half):
    """--shard --compile compiles each block before the wrap (FSDP2's hooks outside the
    compiled code): 4 steps of 2 workers give the eager sharded run's weights, to float64's
    last bits of inductor's reordered sums."""
    run = tmp_path / "compiled"
    kasoku("train", gpt64, *RUN, "--procs", "2", "--shard", "--compile", "--batch-size", "4",
           "--epochs", "0.5", "--out", run)
    compiled = full_state(run / "snapshot_iter_4.dcp", tmp_path)["model"]
    eager = full_state(half / "snapshot_iter_4.dcp", tmp_path)["model"]
    assert_same(compiled, eager, rtol=0, atol=ATOL_FP64)


def test_a_refused_resume_prints_no_resume_command(tmp_path, gpt64, half):
    """A worker that refuses the settings (exit 2) would refuse them again on resuming: the
    launcher says the refusal, not a command that continues the run."""
    run = tmp_path / "run"
    shutil.copytree(half, run)
    done = kasoku("train", gpt64, *RUN, "--procs", "2", "--shard", "--batch-size", "8",
                  "--epochs", "1", "--out", run, "--resume", "auto", check=False)
    assert done.returncode == 2
    assert "belongs to another run" in done.stderr
    assert "to continue this run" not in done.stderr and "Traceback" not in done.stderr
