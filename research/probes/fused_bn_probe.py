"""ResNet-50's batch-norm layers alone: forward + backward of each distinct layer shape, as
inductor compiles ``BatchNormAct2d``'s PyTorch ops and through the fused kernels
(``kasoku.accel.fused_bn``), each captured in a CUDA graph (no host time), times the number
of such layers in the network.

    python research/probes/fused_bn_probe.py [--batch-size 256] [--variant KEY=VALUE,...]...

``--variant``: overrides of ``kasoku.accel.bn_kernels``' tile constants (``BLOCK_M``,
``PROGRAMS_PER_SM``, ``APPLY_ROWS``,
``APPLY_PROGRAMS_PER_SM``, ``NUM_WARPS``, ``BLOCK_C``; 0: the layer's own choice),
each timed as one more column. Prints one JSON line per layer shape, then the totals.
"""
import argparse
import json

import torch

from kasoku.accel import bn_kernels, fused_bn
from kasoku.commands.bench.timing import graph_replay_ms
from kasoku.models.norm import BatchNormAct2d

# (channels, side, relu, residual, layers of this shape in ResNet-50 v1.5 at 224x224)
LAYERS = [
    (64, 112, True, False, 1),                                          # stem
    (64, 56, True, False, 6), (256, 56, True, True, 3), (256, 56, False, False, 1),
    (128, 56, True, False, 1), (128, 28, True, False, 7), (512, 28, True, True, 4),
    (512, 28, False, False, 1),
    (256, 28, True, False, 1), (256, 14, True, False, 11), (1024, 14, True, True, 6),
    (1024, 14, False, False, 1),
    (512, 14, True, False, 1), (512, 7, True, False, 5), (2048, 7, True, True, 3),
    (2048, 7, False, False, 1),
]


def step_fn(module, x, r, dy):
    def fn():
        x.grad = None
        if r is not None:
            r.grad = None
        module.weight.grad = module.bias.grad = None
        module(x, r).backward(dy)
    return fn


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--variant", action="append", default=[])
    a = p.parse_args()
    dev = torch.device("cuda")
    fused_bn.MIN_ELEMENTS = 0  # every layer through the kernels, the small ones too
    defaults = {k: getattr(bn_kernels, k) for k in
                ("BLOCK_M", "PROGRAMS_PER_SM", "APPLY_ROWS", "APPLY_PROGRAMS_PER_SM", "NUM_WARPS",
                 "BLOCK_C")}
    variants = [("fused", {})]
    for spec in a.variant:
        variants.append((spec, {k: int(v) for k, v in
                                (item.split("=") for item in spec.split(","))}))
    totals = {"inductor": 0.0, **{name: 0.0 for name, _ in variants}}
    for c, side, relu, res, count in LAYERS:
        torch._dynamo.reset()
        shape = (a.batch_size, c, side, side)

        def tensor(grad):
            t = torch.randn(shape, device=dev, dtype=torch.bfloat16)
            return t.contiguous(memory_format=torch.channels_last).requires_grad_(grad)
        x, dy = tensor(True), tensor(False)
        r = tensor(True) if res else None
        module = BatchNormAct2d(c, relu=relu).to(dev)
        row = {"channels": c, "side": side, "relu": relu, "residual": res, "count": count}
        compiled = torch.compile(module)
        row["inductor_ms"] = graph_replay_ms(step_fn(compiled, x, r, dy))[0]
        totals["inductor"] += count * row["inductor_ms"]
        module.fused_forward = fused_bn.fused_forward
        for name, overrides in variants:
            for k, v in {**defaults, **overrides}.items():
                setattr(bn_kernels, k, v)
            row[f"{name}_ms"] = graph_replay_ms(step_fn(module, x, r, dy))[0]
            totals[name] += count * row[f"{name}_ms"]
        for k, v in defaults.items():
            setattr(bn_kernels, k, v)
        module.fused_forward = None
        # bytes of the least traffic (x, dy, dx, y: 2 bytes each; + r, dr with a residual)
        passes = 8 + (4 if res else 0)
        row["least_gb"] = round(passes * x.numel() * 2 / 1e9, 3)
        row["fused_tb_per_s"] = round(row["least_gb"] / row["fused_ms"], 2)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                          for k, v in row.items()}), flush=True)
    print(json.dumps({"totals_ms": {k: round(v, 2) for k, v in totals.items()},
                      "batch_size": a.batch_size}), flush=True)


if __name__ == "__main__":
    main()
