"""What running through DistributedDataParallel costs on one GPU: the same workload and levers
built twice in one process, plainly and as worker 0 of a world of one (DDP, NCCL, the code
path of ``kasoku train --gpus 1``), stepped in alternating timed spans.

    python benchmarks/ddp_one_gpu.py imagenet-resnet50 --batch-size 256 --synthetic \\
        --synthetic-size 512 --loader device --config precision=bf16,channels_last,...

Warm-up (compilation, autotuning) first and excluded; each span ends with a synchronize.
Prints one JSON line: both sides' medians over ``--rounds`` rounds and DDP's cost in %.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from kasoku.commands.bench.rungs import parse_config
from kasoku.commands.train import build_trainer, loaders_of
from kasoku.data.config import DataConfig
from kasoku.distributed import World, ddp
from kasoku.distributed.config import DistConfig
from kasoku.train.config import TrainConfig
from kasoku.workloads import create_workload


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("workload")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--loader", default="device")
    p.add_argument("--synthetic", action="store_true")
    p.add_argument("--synthetic-size", type=int)
    p.add_argument("--data")
    p.add_argument("--config", default="", help="levers, as kasoku bench --config takes them")
    p.add_argument("--plain-config", help="the plain side's levers (default: --config), e.g. "
                   "the top rung with its CUDA graph, which DDP cannot take yet")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=15)
    args = p.parse_args()
    configs = {"plain": args.plain_config if args.plain_config is not None else args.config,
               "ddp": args.config}
    device = torch.device("cuda", 0)
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29531")
    ddp.join(World(), device, 300.0)
    wl = create_workload(args.workload)
    data = DataConfig(root=args.data, synthetic=args.synthetic,
                      synthetic_train_size=args.synthetic_size)
    trainers = {}
    for name, dist_cfg in (("plain", None), ("ddp", DistConfig(gpus=1))):
        train = TrainConfig(batch_size=args.batch_size, device="cuda", loader=args.loader,
                            progress=False, overwrite=True, out=f"/tmp/kasoku-ddp1-{name}")
        accel = parse_config(configs[name]) if configs[name] else None
        trainers[name] = build_trainer(wl, data, train, accel, world=World(),
                                       dist_cfg=dist_cfg)

    def span(name: str, steps: int) -> float:
        u = trainers[name].updater
        torch.cuda.synchronize()
        t0, before = time.perf_counter(), u.samples
        for _ in range(steps):
            u.update()
        torch.cuda.synchronize()
        return (u.samples - before) / (time.perf_counter() - t0)

    t0 = time.perf_counter()
    for name in trainers:
        span(name, args.warmup)
    warmup_s = time.perf_counter() - t0
    rates = {name: [] for name in trainers}
    for r in range(args.rounds):
        for name in (("plain", "ddp") if r % 2 == 0 else ("ddp", "plain")):
            rates[name].append(span(name, args.steps))
    for trainer in trainers.values():
        for loader in loaders_of(trainer):
            getattr(loader, "close", lambda: None)()
    ddp.leave()
    plain, wrapped = statistics.median(rates["plain"]), statistics.median(rates["ddp"])
    print(json.dumps({"workload": args.workload, "configs": configs,
                      "batch_size": trainers["plain"].run_info["batch_size"],
                      "samples_per_s_plain": plain, "samples_per_s_ddp": wrapped,
                      "ddp_cost_pct": 100 * (plain - wrapped) / plain, "rates": rates,
                      "warmup_s": warmup_s, "gpu": torch.cuda.get_device_name(),
                      "torch": torch.__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
