"""Plain-PyTorch references for the MNIST MLP on one GPU (no kasoku import).

Two loops over real MNIST already on the GPU, batch 100, Adam lr 1e-3:
  eager  — the textbook loop (Adam's default implementation), data sliced from GPU tensors;
  graph  — the whole step (forward, backward, fused Adam) captured by hand as one CUDA graph.
Prints one JSON line per variant: samples/s (median of windows, CUDA-synchronized), and the
validation accuracy after the timed epochs.

    python benchmarks/mnist_gpu_plain.py --data .data/mnist --epochs 3
"""
import argparse
import gzip
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn


def read_idx(path: Path) -> np.ndarray:
    raw = gzip.open(path).read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load(root: Path, prefix: str, device):
    x = torch.from_numpy(read_idx(root / f"{prefix}-images-idx3-ubyte.gz").copy())
    y = torch.from_numpy(read_idx(root / f"{prefix}-labels-idx1-ubyte.gz").astype(np.int64))
    return x.float().div_(255).view(-1, 784).to(device), y.to(device)


def mlp(device):
    return nn.Sequential(nn.Linear(784, 1000), nn.ReLU(), nn.Linear(1000, 1000), nn.ReLU(),
                         nn.Linear(1000, 10)).to(device)


def accuracy(model, x, y) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def run(variant: str, data: Path, epochs: int, batch: int = 100) -> dict:
    device = torch.device("cuda")
    torch.manual_seed(0)
    x, y = load(data, "train", device)
    vx, vy = load(data, "t10k", device)
    model = mlp(device)
    loss_fn = nn.CrossEntropyLoss()
    steps = len(x) // batch
    if variant == "eager":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)

        def step(i, perm):
            idx = perm[i * batch:(i + 1) * batch]
            opt.zero_grad()
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True, capturable=True)
        sx, sy = x[:batch].clone(), y[:batch].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up before capture, as the CUDA graph docs ask
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                loss_fn(model(sx), sy).backward()
                opt.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            loss = loss_fn(model(sx), sy)
            loss.backward()
            opt.step()

        def step(i, perm):
            idx = perm[i * batch:(i + 1) * batch]
            sx.copy_(x[idx])
            sy.copy_(y[idx])
            graph.replay()
    rates = []
    for epoch in range(epochs + 1):  # epoch 0 warms up (allocator, cuBLAS handles)
        perm = torch.randperm(len(x), device=device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            step(i, perm)
        torch.cuda.synchronize()
        if epoch > 0:
            rates.append(steps * batch / (time.perf_counter() - t0))
    return {"variant": f"plain {variant}", "samples_per_s": statistics.median(rates),
            "min": min(rates), "max": max(rates), "n": len(rates),
            "val_accuracy": accuracy(model, vx, vy), "torch": torch.__version__,
            "device": torch.cuda.get_device_name()}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args()
    for v in ("eager", "graph"):
        print(json.dumps(run(v, args.data, args.epochs)), flush=True)
