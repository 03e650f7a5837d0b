"""A user's plain PyTorch script, written without kasoku (what ``kasoku profile -- python
SCRIPT.py`` is for): the textbook MNIST MLP loop, on the GPU where there is one, else on
the CPU. Seeded. The images live in a TensorDataset on the host, a DataLoader (batch 100,
shuffled, ``num_workers`` left at its default) collates each batch, the step copies it to
the device; Adam 1e-3.

It times itself: the steps from ``--time-from`` to ``--steps``, synchronized at both ends,
printed as one JSON line (samples/s), so its rate can be compared with and without kasoku
around it.

    python benchmarks/scripts/mnist_textbook.py --data .data/mnist --steps 3000
"""
import argparse
import gzip
import json
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def read_idx(path: Path) -> np.ndarray:
    raw = gzip.open(path).read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--time-from", type=int, default=500)
    args = ap.parse_args()
    torch.manual_seed(0)  # the same weights and batches in every run: their losses compare
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    x = torch.from_numpy(read_idx(args.data / "train-images-idx3-ubyte.gz").copy())
    y = torch.from_numpy(read_idx(args.data / "train-labels-idx1-ubyte.gz").astype(np.int64))
    train = DataLoader(TensorDataset(x.float().div_(255).view(-1, 784), y), batch_size=100,
                       shuffle=True)
    model = nn.Sequential(nn.Linear(784, 1000), nn.ReLU(), nn.Linear(1000, 1000), nn.ReLU(),
                          nn.Linear(1000, 10)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    step, t0 = 0, None
    while step < args.steps:
        for xb, yb in train:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            opt.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            step += 1
            if step == args.time_from:
                sync()
                t0 = time.perf_counter()
            if step == args.steps:
                break
    sync()
    seconds = time.perf_counter() - t0
    print(json.dumps({"script": "mnist_textbook", "steps": args.steps - args.time_from,
                      "samples_per_s": 100 * (args.steps - args.time_from) / seconds,
                      "loss": loss.item()}), flush=True)


if __name__ == "__main__":
    main()
