"""Can cuDNN's graph API fuse ResNet-50's batch norms into its convolutions here? Each
convolution of ResNet-50 at one batch size (NHWC), timed alone and as the fused graphs that
would replace a convolution and its batch-norm passes:

- ``conv``: the convolution alone (``F.conv2d``, cuDNN autotuned);
- ``sbr+conv+stats``: scale, bias and ReLU of the input (the previous batch norm's normalize)
  in the convolution's prologue, per-channel sum and sum of squares of the output (the next
  batch norm's statistics) in its epilogue;
- ``conv+stats``: the convolution with the statistics epilogue only;
- ``wgrad``: the weight gradient alone; ``sbr+wgrad``: with the scale-bias-ReLU prologue
  (what the backward pass needs if the forward never writes the normalized activation).

    pip install nvidia-cudnn-frontend     # the graph API's Python binding (not a kasoku need)
    python research/probes/cudnn_fusion_probe.py [--batch-size 32] [--dtype fp16|bf16]

Times: median of 7 replays of a CUDA graph of 20 calls, per call; each fused graph runs the
fastest of its execution plans. A graph cuDNN cannot run on this device is reported as
unsupported. The last line sums each column over ResNet-50's 52 convolutions after the stem.
"""
import argparse
import collections

import torch
import torch.nn.functional as F
from torch import nn

from kasoku.commands.bench.timing import graph_replay_ms
from kasoku.workloads import create_workload

try:
    import cudnn
except ImportError:
    raise SystemExit("needs cuDNN's Python frontend: pip install nvidia-cudnn-frontend")

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def conv_shapes(batch_size: int, device) -> collections.Counter:
    """(N, C, H, W, K, R, stride, padding) -> how many of ResNet-50's convolutions have it."""
    model = create_workload("imagenet-resnet50").build_model().to(device)
    shapes = collections.Counter()

    def hook(mod, inputs, out):
        x = inputs[0]
        shapes[(*x.shape[:1], mod.in_channels, *x.shape[2:], mod.out_channels,
                mod.kernel_size[0], mod.stride[0], mod.padding[0])] += 1
    hooks = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Conv2d)]
    with torch.no_grad():
        model(torch.randn(batch_size, 3, 224, 224, device=device))
    for h in hooks:
        h.remove()
    return shapes


def per_call_us(fn) -> float:
    """Median of 7 replays of a CUDA graph of 20 calls of ``fn``, in µs per call."""
    return graph_replay_ms(fn, replays=1, windows=7, calls=20)[0] * 1e3


class Probe:
    def __init__(self, dtype: torch.dtype):
        self.dtype, self.handle = dtype, cudnn.create_handle()

    def graph(self):
        io = cudnn.data_type.HALF if self.dtype == torch.float16 else cudnn.data_type.BFLOAT16
        return cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                             compute_data_type=cudnn.data_type.FLOAT, handle=self.handle)

    def fastest(self, g, tensors) -> float:
        """Time each execution plan of the built graph ``g``; the fastest plan's time (us)."""
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans(cudnn.build_plan_policy.ALL)
        best = float("inf")
        for i in range(int(g.get_execution_plan_count())):
            size = max(1, int(g.get_workspace_size_plan_at_index(i)))
            workspace = torch.empty(size, device="cuda", dtype=torch.uint8)

            def run(i=i, workspace=workspace):
                cudnn.set_stream(handle=self.handle,
                                 stream=torch.cuda.current_stream().cuda_stream)
                g.execute_plan_at_index(tensors, workspace, index=i, handle=self.handle)
            try:
                best = min(best, per_call_us(run))
            except Exception:  # a plan that does not run here is skipped
                continue
        return best if best < float("inf") else float("nan")

    def prologue(self, g, x, scale, bias):
        X = g.tensor(name="X", dim=x.size(), stride=x.stride(), data_type=x.dtype)
        S = g.tensor(name="S", dim=scale.size(), stride=scale.stride(), data_type=scale.dtype)
        B = g.tensor(name="B", dim=bias.size(), stride=bias.stride(), data_type=bias.dtype)
        out = g.relu(name="relu", input=g.bias(name="bias", input=g.scale(
            name="scale", input=X, scale=S), bias=B))
        return out, {X: x, S: scale, B: bias}

    def forward(self, x, w, scale, bias, stride, pad, with_prologue: bool) -> float:
        g = self.graph()
        if with_prologue:
            inp, tensors = self.prologue(g, x, scale, bias)
        else:
            inp = g.tensor(name="X", dim=x.size(), stride=x.stride(), data_type=x.dtype)
            tensors = {inp: x}
        W = g.tensor(name="W", dim=w.size(), stride=w.stride(), data_type=w.dtype)
        Y = g.conv_fprop(image=inp, weight=W, padding=[pad, pad], stride=[stride, stride],
                         dilation=[1, 1])
        Y.set_output(True)
        total, squares = g.genstats(name="genstats", input=Y)
        total.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        squares.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        y = F.conv2d(x, w, None, stride, pad)
        k = w.shape[0]
        tensors.update({W: w, Y: torch.empty_like(y),
                        total: torch.empty(1, k, 1, 1, device="cuda"),
                        squares: torch.empty(1, k, 1, 1, device="cuda")})
        return self.fastest(g, tensors)

    def wgrad(self, x, dy, w, scale, bias, stride, pad) -> float:
        g = self.graph()
        inp, tensors = self.prologue(g, x, scale, bias)
        DY = g.tensor(name="DY", dim=dy.size(), stride=dy.stride(), data_type=dy.dtype)
        DW = g.conv_wgrad(name="wgrad", image=inp, loss=DY, padding=[pad, pad],
                          stride=[stride, stride], dilation=[1, 1])
        DW.set_output(True).set_dim(list(w.shape)).set_data_type(cudnn.data_type.FLOAT)
        tensors.update({DY: dy, DW: torch.empty(w.shape, device="cuda").to(
            memory_format=torch.channels_last)})
        return self.fastest(g, tensors)


def guarded(fn) -> float:
    try:
        return fn()
    except cudnn.cudnnGraphNotSupportedError:
        return float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    args = ap.parse_args()
    dtype, cl = DTYPES[args.dtype], torch.channels_last
    torch.backends.cudnn.benchmark = True
    print(f"cuDNN {cudnn.backend_version()}, frontend {cudnn.__version__}, {args.dtype}, "
          f"bs {args.batch_size}; us per call, nan: cuDNN has no engine for the graph here")
    probe = Probe(dtype)
    cols = ["conv", "sbr+conv+stats", "conv+stats", "wgrad", "sbr+wgrad"]
    totals = collections.Counter()
    print(f"{'N':>3} {'C':>5} {'HxW':>4} {'K':>5} R s  n | " + " ".join(f"{c:>14}" for c in cols))
    shapes = conv_shapes(args.batch_size, "cuda")
    for (n, c, h, w_, k, r, stride, pad), count in sorted(shapes.items(),
                                                         key=lambda kv: (-kv[0][2], kv[0][1])):
        if c == 3:
            continue  # the stem (kasoku folds it: --fast-stem)
        x = torch.randn(n, c, h, w_, device="cuda", dtype=dtype).to(memory_format=cl)
        w = (torch.randn(k, c, r, r, device="cuda", dtype=dtype) * 0.05).to(memory_format=cl)
        scale = (torch.rand(1, c, 1, 1, device="cuda") + 0.5).to(dtype).to(memory_format=cl)
        bias = (torch.randn(1, c, 1, 1, device="cuda") * 0.1).to(dtype).to(memory_format=cl)
        dy = torch.randn_like(F.conv2d(x, w, None, stride, pad))
        times = {
            "conv": per_call_us(lambda: F.conv2d(x, w, None, stride, pad)),
            "sbr+conv+stats": guarded(lambda: probe.forward(x, w, scale, bias, stride, pad, True)),
            "conv+stats": guarded(lambda: probe.forward(x, w, scale, bias, stride, pad, False)),
            "wgrad": per_call_us(lambda: torch.ops.aten.convolution_backward.default(
                dy, x, w, None, [stride] * 2, [pad] * 2, [1, 1], False, [0, 0], 1,
                [False, True, False])),
            "sbr+wgrad": guarded(lambda: probe.wgrad(x, dy, w, scale, bias, stride, pad)),
        }
        for col, t in times.items():
            totals[col] += t * count
        print(f"{n:3d} {c:5d} {h:4d} {k:5d} {r} {stride} {count:2d} | "
              + " ".join(f"{times[c]:14.1f}" for c in cols), flush=True)
    print("sum over the layers:", {c: round(totals[c], 1) for c in cols})


if __name__ == "__main__":
    main()
