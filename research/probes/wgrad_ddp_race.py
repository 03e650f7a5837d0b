"""Do DDP's hooks read a weight gradient made on ``wgrad_stream``'s second stream before it is
written? One GPU, a world of one over NCCL (DDP still copies each gradient into its bucket and
all-reduces it), ResNet-50 with channels_last and 1x1 convolutions as matrix products.

``eager``: the same model and two alternating batches, four steps each, bf16 autocast; the
gradients of each variant against DDP without the second stream:
  - ``reference again``: the noise floor (run-to-run nondeterminism of the kernels);
  - ``wgrad, no DDP``;
  - ``wgrad, DDP built on the default stream`` (kasoku before the fix, eager);
  - ``wgrad, DDP built on the second stream`` (the fix).
``trainer``: kasoku's own top rung through DDP (compiled, the whole step a CUDA graph), a
learning rate of 1e-9 so the weights stay put, synthetic batches alternating between two;
each replay's gradients against the replayed batch's gradients computed eagerly without DDP,
before the fix (DDP built on the capture stream, emulated) and as the code builds it now.

    python research/probes/wgrad_ddp_race.py [eager] [trainer]

Prints one JSON line per variant: per step, the largest and the median relative error over
the parameters (||g - g_ref|| / ||g_ref||) and how many exceed 5%.
"""
from __future__ import annotations

import copy
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def compare(name: str, grads, ref) -> dict:
    steps = []
    for got, want in zip(grads, ref):
        errs = [((g - w).norm() / w.norm().clamp_min(1e-30)).item() for g, w in zip(got, want)]
        steps.append({"max": round(max(errs), 4), "median": round(statistics.median(errs), 5),
                      "over_5pct": sum(e > 0.05 for e in errs), "of": len(errs)})
    line = {"variant": name, "steps": steps}
    print(json.dumps(line), flush=True)
    return line


def eager(dev: torch.device) -> None:
    from kasoku.accel.conv_matmul import apply_matmul_1x1
    from kasoku.accel.wgrad_stream import apply_wgrad_stream, side_stream
    from kasoku.models.resnet import resnet50

    torch.manual_seed(0)
    base = apply_matmul_1x1(resnet50(num_classes=1000).to(dev)
                            .to(memory_format=torch.channels_last), [])
    batches = [(torch.randn(128, 3, 224, 224, device=dev)
                .contiguous(memory_format=torch.channels_last),
                torch.randint(0, 1000, (128,), device=dev)) for _ in range(2)]

    def run(wgrad: bool, build_on: str | None):
        model = copy.deepcopy(base)
        if wgrad:
            apply_wgrad_stream(model, dev, [])
        if build_on == "default":
            model = DDP(model, device_ids=[dev.index], gradient_as_bucket_view=True)
        elif build_on == "side":
            side, main = side_stream(dev), torch.cuda.current_stream(dev)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                model = DDP(model, device_ids=[dev.index], gradient_as_bucket_view=True)
            main.wait_stream(side)
        out = []
        for step in range(4):
            x, y = batches[step % 2]
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            torch.cuda.synchronize()
            out.append([p.grad.detach().float().clone() for p in model.parameters()])
        return out

    ref = run(False, "default")
    compare("eager: reference again (noise floor)", run(False, "default"), ref)
    compare("eager: wgrad, no DDP", run(True, None), ref)
    compare("eager: wgrad, DDP built on the default stream (before)", run(True, "default"), ref)
    compare("eager: wgrad, DDP built on the second stream (the fix)", run(True, "side"), ref)


def trainer() -> None:
    from kasoku.accel import compose
    from kasoku.accel.graph import CudaGraphStep
    from kasoku.commands.bench.rungs import parse_config
    from kasoku.commands.train import build_trainer, loaders_of
    from kasoku.data.config import DataConfig
    from kasoku.distributed import World, ddp
    from kasoku.distributed.config import DistConfig
    from kasoku.train.config import TrainConfig
    from kasoku.workloads import create_workload

    top = ("precision=bf16,channels_last,cudnn_benchmark,optimizer_impl=fused,fused_bn,"
           "fast_stem,matmul_1x1,compile,combo_kernels,cuda_graph,wgrad_stream")
    wl = create_workload("imagenet-resnet50")
    data = DataConfig(synthetic=True, synthetic_train_size=512)  # two batches, alternating
    fixed = compose.wgrad_side_stream

    def run(name: str, before: bool) -> None:
        """Each replay's gradients against the same weights' gradients for the replayed
        batch, computed eagerly without DDP (``wgrad, no DDP`` above: correct)."""
        compose.wgrad_side_stream = (lambda model, device: None) if before else fixed
        train = TrainConfig(batch_size=256, device="cuda", loader="device", progress=False,
                            overwrite=True, out=f"/tmp/kasoku-race-{name}", lr=1e-9)
        t = build_trainer(wl, data, train, parse_config(top), world=World(),
                          dist_cfg=DistConfig(gpus=1))
        compose.wgrad_side_stream = fixed
        u = t.updater
        graph, step = None, u.step_fn
        while hasattr(step, "inner"):
            graph = step if isinstance(step, CudaGraphStep) else graph
            step = step.inner
        module = ddp.unwrap(u.model)  # eager: the compiled call is DDP's
        params = [p for p in module.parameters()]
        for _ in range(20):  # eager DDP steps, the capture, and graph replays
            u.update()
        got, want = [], []
        for _ in range(4):
            u.update()
            torch.cuda.synchronize()
            got.append([p.grad.detach().float().clone() for p in params])
            x, y = graph._static_batch
            with step.autocast():
                loss, _ = step.objective(module(x.contiguous(
                    memory_format=torch.channels_last)), y)
            grads = torch.autograd.grad(loss, params)
            torch.cuda.synchronize()
            want.append([g.float() for g in grads])
        for loader in loaders_of(t):
            getattr(loader, "close", lambda: None)()
        compare(f"trainer: {name}", got, want)

    run("top rung +wgrad_stream, DDP on the capture stream (before)", before=True)
    run("top rung +wgrad_stream, as built now (the fix)", before=False)


def main() -> int:
    parts = sys.argv[1:] or ["eager", "trainer"]
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29533")
    from kasoku.distributed import World, ddp
    ddp.join(World(), dev, 300.0)  # NCCL, a world of one
    if "eager" in parts:
        eager(dev)
    if "trainer" in parts:
        trainer()
    ddp.leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
