"""``kasoku.run.RunConfig``: one resolved, typed run. Its JSON makes the same run again (every
registered workload's default run, and a run with most settings away from their defaults), the
recipe fills what the command left unset, its spec makes the same workload, and ``check`` is the
one place that refuses what no run can use."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import get_args

import pytest

from kasoku.accel.config import AccelConfig, Precision
from kasoku.core.errors import ConfigError
from kasoku.data.config import DataConfig
from kasoku.distributed.config import DistConfig
from kasoku.kfac.config import KFACConfig
from kasoku.run import RunConfig, resolve
from kasoku.train.config import OPTIMIZERS, Optimizer, TrainConfig
from kasoku.workloads import create_workload, list_workloads


@pytest.mark.parametrize("name", list_workloads())
def test_every_workloads_default_run_survives_its_json(name):
    workload = create_workload(name)
    run = resolve(workload)
    again = RunConfig.from_json(run.to_json())
    assert again == run and again.to_json() == run.to_json()
    recipe = workload.recipe
    assert (run.train.epochs, run.train.batch_size, run.train.lr, run.train.grad_clip,
            run.train.optimizer, run.train.seed) == (recipe.epochs, recipe.batch_size, recipe.lr,
                                                     recipe.grad_clip, recipe.optimizer, 0)
    assert run.given == ()
    made = create_workload(run.workload)  # the spec makes the same workload, settings and all
    assert (made.name, made.config, made.recipe) == (workload.name, workload.config, recipe)
    run.check()


def test_a_run_with_many_settings_survives_its_json(tmp_path):
    workload = create_workload("gpt:model_size=small,attention=plain")
    run = resolve(
        workload,
        DataConfig(root=tmp_path / "text", synthetic=True, synthetic_train_size=300,
                   synthetic_val_size=30, cache=tmp_path / "cache", strict=True),
        TrainConfig(epochs=0.25, lr=3e-4, grad_clip=0.5, seed=7, device="cpu",
                    out=tmp_path / "run", overwrite=True, log_interval=5, snapshot_interval=10,
                    loader="threads:2", prefetch=3, loader_cores=False, threads=2,
                    progress=False),
        AccelConfig(precision="bf16", channels_last=True, cudnn_benchmark=True,
                    optimizer_impl="foreach", keep_memory=True,
                    activation_checkpointing="selective", sdpa_backend="math",
                    float8="rowwise", compile=True, compile_mode="max-autotune-no-cudagraphs",
                    loss_scale_init=1024.0, steps_per_call=1),
        DistConfig(procs=2, nnodes=2, node_rank=1, rdzv_endpoint="host:29500",
                   max_restarts=3, dist_timeout=60.5, bucket_mb=12.5, shard=True,
                   scale_lr=True),
        KFACConfig(base="adam", method="inverse", damping=0.01, kl_clip=None,
                   factor_update_freq=2, inv_update_freq=20, factor_precision="bf16",
                   factor_comm_dtype="bf16"))
    text = run.to_json()
    again = RunConfig.from_json(text)
    assert again == run and again.to_json() == text
    assert isinstance(again.data.root, Path) and isinstance(again.train.out, Path)
    assert again.given == ("epochs", "grad_clip", "lr", "seed")
    # the recipe's where the command gave none: gpt small's batch and optimizer
    assert (run.train.batch_size, run.train.optimizer) == (16, "adamw")
    assert run.workload == "gpt:model_size=small,attention=plain,bias=yes,tokenizer=byte"
    assert json.loads(text)["accel"]["precision"] == "bf16"


def test_the_run_with_every_lever_changed_differs_from_the_default_in_each():
    """Every AccelConfig field set away from its default above or here: the round trip is not
    one that a field left at its default would pass by accident."""
    changed = AccelConfig(fused_bn=True, channels_last=True, fast_stem=True, matmul_1x1=True,
                          wgrad_stream=True, combo_kernels=True, compile=True, cuda_graph=True,
                          steps_per_call=4)
    run = resolve(create_workload("mnist-mlp"), accel=changed)
    assert RunConfig.from_json(run.to_json()).accel == changed
    assert run.accel != AccelConfig()


@pytest.mark.parametrize("configs,words", [
    ({"train": TrainConfig(optimizer="rmsprop")}, "unknown optimizer 'rmsprop'"),
    ({"train": TrainConfig(epochs=-1)}, "--epochs must be a positive"),
    ({"accel": AccelConfig(precision="fp8")}, "unknown precision 'fp8'"),
    ({"accel": AccelConfig(fused_bn=True)}, "--fused-bn"),
    ({"train": TrainConfig(optimizer="kfac"), "accel": AccelConfig(compile=True)},
     "--compile with --optimizer kfac"),
    ({"train": TrainConfig(optimizer="kfac"), "kfac": KFACConfig(damping=0)}, "--kfac-damping"),
    ({"train": TrainConfig(optimizer="lamb"), "dist": DistConfig(procs=2, shard=True)},
     "trust ratio"),
    ({"dist": DistConfig(gpus=1, procs=1)}, "exclude each other"),
    ({"train": TrainConfig(prefetch=2)}, "--prefetch 2"),
])
def test_check_refuses_what_no_run_can_use(configs, words):
    run = resolve(create_workload("mnist-mlp"), **configs)
    with pytest.raises(ConfigError, match=words):
        run.check()


def test_the_choices_are_the_literals():
    from kasoku.cli.accel import _FLAGS
    from kasoku.cli.train import TRAIN_FLAGS
    assert _FLAGS["precision"]["type"].choices == get_args(Precision)
    assert TRAIN_FLAGS["optimizer"]["type"].choices == get_args(Optimizer) == OPTIMIZERS
    from kasoku import optim
    assert optim.OPTIMIZERS is OPTIMIZERS


def test_a_given_learning_rate_and_seed_are_told_apart_from_the_recipes():
    wl = create_workload("mnist-mlp")
    run = resolve(wl, train=TrainConfig(lr=wl.recipe.lr, seed=0))
    assert run.given == ("lr", "seed")
    assert dataclasses.replace(run, given=()) != run


def test_the_default_batch_sizes_of_each_command_come_from_the_recipe():
    from kasoku.workloads.registry import default_batch_sizes
    assert default_batch_sizes(100, "bench", "cpu") == (100,)  # the README's CPU row's batch
    assert default_batch_sizes(100, "bench", "cpu", full=True) == (12, 25, 100)
    assert default_batch_sizes(100, "bench", "cuda") == (12, 25, 50, 100)
    assert default_batch_sizes(4, "bench", "cuda") == (1, 2, 4)  # never below 1, no repeats
    assert default_batch_sizes(2048, "compare", "cpu") == (100,)
    assert default_batch_sizes(2048, "compare", "cuda") == (2048,)
    assert default_batch_sizes(2048, "scale", "cpu") == default_batch_sizes(2048, "data") == (2048,)


def test_the_workers_requests_survive_their_json(tmp_path):
    """What the scale and all-reduce workers are started with, typed both ways."""
    from kasoku.commands.allreduce_bench import AllReduceConfig, AllReduceRequest
    from kasoku.commands.scale import ScaleConfig, ScaleRequest
    scale = ScaleConfig(workload="gpt:model_size=tiny,attention=sdpa", label="bf16",
                        config={"precision": "bf16", "compile": True}, batch_size=8, steps=3,
                        threads=2, data=str(tmp_path), loader="threads:2", shard=True)
    for accel in (None, AccelConfig(precision="bf16", compile=True)):
        request = ScaleRequest(scale, accel, DistConfig(bucket_mb=12.5, shard=True), "cpu", 2,
                               tmp_path / "results.jsonl")
        assert ScaleRequest.from_json(request.to_json()) == request
    request = AllReduceRequest(AllReduceConfig(sizes=(1024, 4096), dtype="bf16", reps=3),
                               "gloo", tmp_path / "results.jsonl")
    assert AllReduceRequest.from_json(request.to_json()) == request


def test_a_profiles_request_survives_its_json(tmp_path):
    """What the workers of ``kasoku profile --procs N`` are started with, typed both ways."""
    from kasoku.commands.profile_config import ProfileConfig, ProfileRequest
    run = resolve(create_workload("gpt:model_size=tiny"), DataConfig(synthetic=True),
                  TrainConfig(batch_size=8, progress=False),
                  AccelConfig(precision="bf16", compile=True), DistConfig(procs=2, shard=True))
    cfg = ProfileConfig(steps=4, warmup=1, measure_seconds=0.2, confirm=True, rounds=1)
    for out, measure_only in ((tmp_path / "prof", False), (None, True)):
        request = ProfileRequest(run, cfg, out, measure_only)
        assert ProfileRequest.from_json(request.to_json()) == request
