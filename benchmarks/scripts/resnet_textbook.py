"""A user's plain PyTorch script, written without kasoku: torchvision's ResNet-50 trained in
fp32 (PyTorch's defaults: no autocast, no TF32, no cuDNN autotuning) on synthetic images
made on the GPU, batch 64, SGD with momentum. What ``kasoku profile -- python SCRIPT.py``
says of a step that is all the GPU's.

    python benchmarks/scripts/resnet_textbook.py --steps 200

``--autocast``: bf16 written into it as a person would (``torch.autocast`` around the forward
and the loss), the reference for ``kasoku profile --with bf16`` on the script as given.
``--print-losses N``: the first N steps' losses, one line each.
"""
import argparse
import contextlib
import json
import time

import torch
import torchvision
from torch import nn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--time-from", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--autocast", action="store_true")
    ap.add_argument("--print-losses", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(0)  # the same weights and batch in every run: their losses compare
    model = torchvision.models.resnet50().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    x = torch.randn(args.batch_size, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (args.batch_size,), device="cuda")
    bf16 = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if args.autocast \
        else contextlib.nullcontext
    t0 = None
    for step in range(1, args.steps + 1):
        opt.zero_grad()
        with bf16():
            loss = loss_fn(model(x), y)
        if step <= args.print_losses:
            print(f"loss {step} {loss.item():.7f}", flush=True)
        loss.backward()
        opt.step()
        if step == args.time_from:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    print(json.dumps({"script": "resnet_textbook", "steps": args.steps - args.time_from,
                      "samples_per_s": args.batch_size * (args.steps - args.time_from) / seconds}),
          flush=True)


if __name__ == "__main__":
    main()
