"""Plain PyTorch data-parallel baselines (no kasoku), for ``kasoku scale`` and
``kasoku allreduce-bench`` on the same machine: the code a user writes from PyTorch's DDP
tutorial, started by torchrun.

    torchrun --nproc-per-node 2 benchmarks/plain_ddp.py resnet50 --batch-size 256
    torchrun --nproc-per-node 4 benchmarks/plain_ddp.py resnet50 --batch-size 256 --data JPEGS
    torchrun --nproc-per-node 2 benchmarks/plain_ddp.py mlp --batch-size 100
    torchrun --nproc-per-node 2 benchmarks/plain_ddp.py allreduce --max-size 1G

resnet50: torchvision's ResNet-50, bf16 autocast, channels_last, SGD (momentum 0.9), DDP's
defaults, synthetic images made on each GPU, or with ``--data`` the tutorial's torchvision
pipeline from a JPEG folder (``file_batches``; its windows include waiting for batches).
mlp: the MNIST MLP of ``kasoku train mnist-mlp`` (784-1000-1000-10, ReLU), Adam 1e-3,
synthetic on-device batches. Both: ``--warmup`` steps (cuDNN's choices, NCCL's set-up), then
``--windows`` windows of ``--steps`` steps, each between CUDA events and a synchronize; the
median window's rate over all GPUs (samples/s), with min and max. allreduce:
``dist.all_reduce`` of fp32 tensors 4K..``--max-size`` (x4), ``--warmup`` then
``--iters`` per timed batch, the median of ``--reps`` batches; busbw = bytes/time x 2(n-1)/n
(nccl-tests'). Rank 0 prints one JSON line per figure.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def timed_windows(step, windows: int, steps: int) -> list[float]:
    seconds = []
    for _ in range(windows):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
        seconds.append(start.elapsed_time(end) / 1000)
    return seconds


def train_rate(args, model, next_batch, loss_of, optimizer) -> dict:
    world = dist.get_world_size()

    def step():
        x, y = next_batch()
        optimizer.zero_grad(set_to_none=True)
        loss_of(model, x, y).backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    seconds = timed_windows(step, args.windows, args.steps)
    rates = sorted(args.batch_size * args.steps * world / s for s in seconds)
    return {"samples_per_s": statistics.median(rates), "min": rates[0], "max": rates[-1],
            "world_size": world, "batch_per_gpu": args.batch_size}


def resnet50(args, device) -> dict:
    import torchvision
    model = torchvision.models.resnet50().to(device, memory_format=torch.channels_last)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    torch.backends.cudnn.benchmark = True

    if args.data:
        next_batch = file_batches(args, device)
    else:
        x = torch.randn(args.batch_size, 3, 224, 224, device=device)
        batch = (x.to(memory_format=torch.channels_last),
                 torch.randint(0, 1000, (args.batch_size,), device=device))
        next_batch = lambda: batch  # noqa: E731 - the same batch every step

    def loss_of(m, x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return F.cross_entropy(m(x), y)

    return train_rate(args, model, next_batch, loss_of, optimizer)


def file_batches(args, device):
    """The tutorial's input pipeline from a JPEG folder (``ROOT/<class>/*.jpg``, or
    ``ROOT/train/...``): torchvision's ``ImageFolder`` with random-resized-crop 224, flip and
    normalization in ``--workers`` DataLoader processes per GPU, a ``DistributedSampler``,
    pinned batches copied to the GPU. Returns the next batch's ``(x, y)`` on ``device``, epoch
    after epoch."""
    from pathlib import Path

    from torch.utils.data import DataLoader, DistributedSampler
    from torchvision import datasets, transforms
    root = Path(args.data)
    root = root / "train" if (root / "train").is_dir() else root
    dataset = datasets.ImageFolder(str(root), transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]))
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    workers = args.workers or max(1, (os.cpu_count() or 1) // dist.get_world_size())
    loader = DataLoader(dataset, args.batch_size, sampler=sampler, num_workers=workers,
                        pin_memory=True, drop_last=True, persistent_workers=True,
                        prefetch_factor=4)

    def batches():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            for x, y in loader:
                yield (x.to(device, non_blocking=True).contiguous(
                    memory_format=torch.channels_last), y.to(device, non_blocking=True))
            epoch += 1

    it = batches()
    return lambda: next(it)


def mlp(args, device) -> dict:
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 1000), nn.ReLU(), nn.Linear(1000, 1000),
                          nn.ReLU(), nn.Linear(1000, 10)).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    batch = (torch.rand(args.batch_size, 1, 28, 28, device=device),
             torch.randint(0, 10, (args.batch_size,), device=device))
    return train_rate(args, model, lambda: batch, lambda m, x, y: F.cross_entropy(m(x), y),
                      optimizer)


def allreduce(args, device) -> list[dict]:
    world, rows, size = dist.get_world_size(), [], 4096
    while size <= args.max_size:
        t = torch.ones(size // 4, device=device)
        for _ in range(args.warmup):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        per = []
        for _ in range(args.reps):
            per.append(timed_windows(lambda: dist.all_reduce(t), 1, args.iters)[0] / args.iters)
        time_s = statistics.median(per)
        rows.append({"bytes": size, "time_us": time_s * 1e6,
                     "busbw_GBps": size / time_s / 1e9 * 2 * (world - 1) / world,
                     "world_size": world})
        size *= 4
    return rows


def size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["resnet50", "mlp", "allreduce"])
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--max-size", type=size, default=1 << 30)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--data", help="resnet50: train from this JPEG folder instead of synthetic "
                   "images on the GPU")
    p.add_argument("--workers", type=int, help="--data: DataLoader processes per GPU "
                   "(default: the cores over the GPUs)")
    args = p.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    try:
        result = {"resnet50": resnet50, "mlp": mlp, "allreduce": allreduce}[args.what](args,
                                                                                   device)
        if dist.get_rank() == 0:
            for row in result if isinstance(result, list) else [result]:
                print(json.dumps({"plain": args.what, **row}), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
