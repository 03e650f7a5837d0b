"""Where one rung's training step spends its time, by kind of kernel (kasoku.perf.profile.kernels),
with the rate beside it; and the experiments tried on ResNet-50's top rung.

    python research/probes/kernel_breakdown.py imagenet-resnet50 --device cuda --batch-size 256 \
        --config +cuda-graph --profile [--cudnn-limit0] [--coordinate-descent] \
        [--autotune-pointwise] [--combo-kernels] [--stem-pad 4]

``--config``: a rung label of the device's ladder or a ``key=value,...`` spec (as ``kasoku
bench --config``). The model is built, accelerated and warmed up as ``kasoku bench`` does
(the first step, holding compilation and capture, is timed apart); the rate is the median of
``--windows`` CUDA-event-timed windows of ``--steps`` steps on synthetic on-device batches.
Prints one JSON line, then (``--profile``) the breakdown of 10 more steps.

Experiments (each changes one thing; the JSON line says which were on):
  --cudnn-limit0         torch.backends.cudnn.benchmark_limit = 0 (autotune tries every
                         cuDNN algorithm, not the 10 its heuristics rank first)
  --coordinate-descent   torch._inductor.config.coordinate_descent_tuning (Triton block sizes
                         tuned per kernel at compile time)
  --autotune-pointwise   torch._inductor.config.max_autotune_pointwise (block sizes of the
                         pointwise and reduction kernels benchmarked at compile time)
  --combo-kernels        torch._inductor.config.combo_kernels (independent kernels, such as
                         autocast's weight casts, combined into fewer launches; experimental)
  --stem-pad C           the first convolution's input and weight zero-padded from 3 to C
                         channels (same outputs; cuDNN's kernels for C=3 are slow)
"""
import argparse
import json
import sys

import torch

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("workload")
p.add_argument("--device", default="cuda")
p.add_argument("--batch-size", type=int, required=True)
p.add_argument("--config", default="+cuda-graph")
p.add_argument("--steps", type=int, default=20)
p.add_argument("--windows", type=int, default=5)
p.add_argument("--profile", action="store_true")
p.add_argument("--cudnn-limit0", action="store_true")
p.add_argument("--coordinate-descent", action="store_true")
p.add_argument("--autotune-pointwise", action="store_true")
p.add_argument("--combo-kernels", action="store_true")
p.add_argument("--stem-pad", type=int, default=0)
a = p.parse_args()

if a.cudnn_limit0:
    torch.backends.cudnn.benchmark_limit = 0
if a.coordinate_descent:
    import torch._inductor.config as inductor_config
    inductor_config.coordinate_descent_tuning = True
if a.combo_kernels:
    import torch._inductor.config as inductor_config
    inductor_config.combo_kernels = True
if a.autotune_pointwise:
    import torch._inductor.config as inductor_config
    inductor_config.max_autotune_pointwise = True

from kasoku.commands.bench.pool import batch_spec, cycle, make_pool  # noqa: E402
from kasoku.commands.bench.rungs import rung_from_spec  # noqa: E402
from kasoku.commands.bench.timing import measure_windows, timed  # noqa: E402
from kasoku.commands.bench.runner import make_runner  # noqa: E402
from kasoku.perf.profile.kernels import format_breakdown, profile_steps  # noqa: E402
from kasoku.workloads import create_workload  # noqa: E402


class PaddedStem(torch.nn.Module):
    """``conv`` on inputs and weights zero-padded to ``channels`` input channels: the same
    outputs and weight gradients, other cuDNN kernels."""

    def __init__(self, conv: torch.nn.Conv2d, channels: int):
        super().__init__()
        self.conv, self.channels = conv, channels

    def forward(self, x):
        n, c, h, w = x.shape
        x = torch.cat([x, x.new_zeros(n, self.channels - c, h, w)], 1)
        wt = self.conv.weight
        wt = torch.cat([wt, wt.new_zeros(wt.shape[0], self.channels - c, *wt.shape[2:])], 1)
        return torch.nn.functional.conv2d(x, wt, None, self.conv.stride, self.conv.padding)


dev = torch.device(a.device)
rung = rung_from_spec(a.config, dev.type)
wl = create_workload(a.workload)
torch.manual_seed(0)
model = wl.build_model().to(dev)
if a.stem_pad:
    model.stem[0] = PaddedStem(model.stem[0], a.stem_pad)
pool = make_pool(batch_spec(wl, model), a.batch_size, dev, 4, seed=0)
notes = []
runner = make_runner(rung, wl, model, dev, wl.recipe.lr, notes)
_, first = timed(dev, lambda: runner(cycle(pool, 1, 0)))
_, warm = timed(dev, lambda: runner(cycle(pool, 10, 1)))
m, loss = measure_windows(runner, pool, dev, a.batch_size, a.steps, a.windows, start=11)
f = m.figures()
print(json.dumps({"workload": a.workload, "config": rung.label, "batch_size": a.batch_size,
                  "experiments": {k: v for k, v in vars(a).items()
                                  if k in ("cudnn_limit0", "coordinate_descent", "autotune_pointwise",
                                           "combo_kernels", "stem_pad")},
                  "first_step_s": round(first, 1), "warmup_s": round(warm, 2),
                  "samples_per_s": round(f["samples_per_s"]["median"]),
                  "windows": sorted(round(r) for r in m.samples_per_s),
                  "loss": float(loss), "notes": notes}), flush=True)
if a.profile:
    n = 10
    b = profile_steps(lambda: runner(cycle(pool, n, 200)), dev, steps=n)
    print(format_breakdown(b, top=25))
sys.exit(0)
