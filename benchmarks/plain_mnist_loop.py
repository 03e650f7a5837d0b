"""The textbook plain-PyTorch MNIST MLP loop (TensorDataset + DataLoader, Adam, bs 100).

The reference kasoku's trainer is measured against. Prints one JSON line per epoch:
{"epoch", "epoch_time_s" (train + validation), "train_time_s", "val_accuracy"}.
Reads the IDX files with plain gzip/numpy, so it shares no code with kasoku.
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


def load(root: Path, prefix: str):
    x = torch.from_numpy(read_idx(root / f"{prefix}-images-idx3-ubyte.gz").copy())
    y = torch.from_numpy(read_idx(root / f"{prefix}-labels-idx1-ubyte.gz").astype(np.int64))
    return TensorDataset(x.float().div_(255).view(-1, 784), y)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fused", action="store_true", help="Adam(fused=True): one kernel update")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    train = DataLoader(load(args.data, "train"), batch_size=100, shuffle=True)
    val = DataLoader(load(args.data, "t10k"), batch_size=100)
    model = nn.Sequential(nn.Linear(784, 1000), nn.ReLU(), nn.Linear(1000, 1000), nn.ReLU(),
                          nn.Linear(1000, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=args.fused or None)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        model.train()
        for x, y in train:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
        t1 = time.perf_counter()
        model.eval()
        correct = 0
        with torch.no_grad():
            for x, y in val:
                correct += (model(x).argmax(1) == y).sum().item()
        t2 = time.perf_counter()
        print(json.dumps({"epoch": epoch, "epoch_time_s": t2 - t0, "train_time_s": t1 - t0,
                          "val_accuracy": correct / len(val.dataset)}), flush=True)


if __name__ == "__main__":
    main()
