"""ResNet-50 stem micro-benchmarks at batch 256, bf16 channels_last, cuDNN autotune
(research/notebook.md): the 7x7/2 stem convolution forward and forward + weight gradient with
its 3 input channels zero-padded to 3, 4 and 8, and folded space-to-depth
(kasoku.accel.stem), eager and compiled; and max-pool(ReLU(affine(x))) forward + backward,
eager and compiled, with PyTorch's pooling and with kasoku's kernels (kasoku.accel.max_pool).

    python research/probes/resnet50_stem.py [BATCH]
"""
import sys

import torch
import torch.nn.functional as F

from kasoku.accel.max_pool import max_pool2d
from kasoku.accel import stem
from kasoku.accel.stem import SpaceToDepthConv2d

torch.backends.cudnn.benchmark = True
dev = "cuda"
N = int(sys.argv[1]) if len(sys.argv) > 1 else 256


def bench(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / n)
    return sorted(ts)[2]


x3 = torch.randn(N, 3, 224, 224, device=dev, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
for C in (3, 4, 8):
    x = torch.zeros(N, C, 224, 224, device=dev, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    x[:, :3] = x3
    w = torch.randn(64, C, 7, 7, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w.data = w.data.contiguous(memory_format=torch.channels_last)
    y = F.conv2d(x, w, stride=2, padding=3)
    g = torch.randn_like(y)
    fwd = bench(lambda: F.conv2d(x, w, stride=2, padding=3))

    def fb():
        out = F.conv2d(x, w, stride=2, padding=3)
        (gw,) = torch.autograd.grad(out, w, g)
    both = bench(fb)
    print(f"stem conv C={C}: fwd {fwd:.3f} ms, fwd+wgrad {both:.3f} ms", flush=True)

conv = torch.nn.Conv2d(3, 64, 7, 2, 3, bias=False).to(dev, torch.bfloat16)
conv = conv.to(memory_format=torch.channels_last)
folded = SpaceToDepthConv2d.from_conv(conv)
g = torch.randn(N, 64, 112, 112, device=dev, dtype=torch.bfloat16)
g = g.contiguous(memory_format=torch.channels_last)
for name, module, multiple in (("plain", conv, 4), ("space-to-depth", folded, 4),
                               ("space-to-depth 16 channels", folded, 16)):
    stem.CHANNEL_MULTIPLE = multiple
    for compiled in (False, True):
        torch._dynamo.reset()
        fn = torch.compile(module) if compiled else module

        def fb():
            (gw,) = torch.autograd.grad(fn(x3), conv.weight, g)
        with torch.no_grad():
            fwd = bench(lambda: fn(x3))
        print(f"stem conv {name}{' compiled' if compiled else ''}: fwd {fwd:.3f} ms, "
              f"fwd+wgrad {bench(fb):.3f} ms", flush=True)

# maxpool(relu(affine(x))) fwd + bwd, x the stem conv's output
x = torch.randn(N, 64, 112, 112, device=dev, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last).requires_grad_()
sc = torch.randn(1, 64, 1, 1, device=dev, dtype=torch.bfloat16)


def f(x):
    return F.max_pool2d(torch.relu(x * sc + sc), 3, 2, 1)


gy = torch.randn(N, 64, 56, 56, device=dev, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
gy2 = gy * 0.5


def run(fn):
    def go():
        y = fn(x)
        (gx,) = torch.autograd.grad(y, x, gy + gy2)
    return go


print(f"pool block eager: {bench(run(f)):.3f} ms", flush=True)
cf = torch.compile(f)
print(f"pool block compiled: {bench(run(cf)):.3f} ms", flush=True)


def k(x):
    return max_pool2d(torch.relu(x * sc + sc), 3, 2, 1)


print(f"pool block, kasoku pool, compiled: {bench(run(torch.compile(k))):.3f} ms", flush=True)
y = F.relu(x.detach() * sc + sc)
yk = y.clone().requires_grad_()
yt = y.clone().requires_grad_()
print("pool kernel equals F.max_pool2d:",
      torch.equal(max_pool2d(yk, 3, 2, 1), F.max_pool2d(yt, 3, 2, 1)), flush=True)
for name, fn in (("F.max_pool2d", lambda t: F.max_pool2d(t, 3, 2, 1)),
                 ("compiled F.max_pool2d", torch.compile(lambda t: F.max_pool2d(t, 3, 2, 1))),
                 ("kasoku max_pool2d", lambda t: max_pool2d(t, 3, 2, 1))):
    def go(fn=fn):
        (gx,) = torch.autograd.grad(fn(yk), yk, gy)
    with torch.no_grad():
        fwd = bench(lambda: fn(yk))
    print(f"pool alone, {name}: fwd {fwd:.3f} ms, fwd+bwd {bench(go):.3f} ms", flush=True)
