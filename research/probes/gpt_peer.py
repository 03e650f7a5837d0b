"""Where kasoku's GPT-2 small step loses to nanoGPT's (issue 44), in one process: each variant
is the same training loop (bf16 autocast, fused AdamW, torch.compile, synthetic tokens on the
device, no host sync in the timed steps) around a different model, timed with CUDA events over
windows after a warm-up that includes compilation; one step of each profiled with shapes and
inductor's per-kernel bytes and FLOPs (``benchmark_kernel``), the kernel time grouped by class.

    PYTHONPATH=src python research/probes/gpt_peer.py --nanogpt .peers/nanogpt --out OUT \
        --batch 16 --variants nano,kasoku,kasoku-nobias,kasoku-nobias-cudnn

nano: nanoGPT's ``model.py`` (bias=False, as its bench.py); kasoku: ``kasoku.models.gpt.GPT``
small with biases, its loss (cross-entropy) and metric (argmax accuracy) as kasoku's step
computes them; -nobias: its linear and norm biases removed; -nometric: no accuracy;
-cudnn: attention pinned to cuDNN's kernel; -exactgelu: erf GELU as nanoGPT; -closs: the loss
and the metric compiled, each a graph of its own (kasoku's ``--compile`` since); -inloss: the
loss inside the model's compiled graph (nanoGPT's way), no metric; -cobj: the loss and the
metric one compiled graph (kasoku's ``--compile`` since).
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

V, T = 50304, 1024


def build(variant: str, nanogpt: Path):
    if variant.startswith("nano"):
        sys.path.insert(0, str(nanogpt))
        from model import GPT as NanoGPT  # the peer's code, carried, not committed
        from model import GPTConfig
        model = NanoGPT(GPTConfig(block_size=T, n_layer=12, n_head=12, n_embd=768, dropout=0.0,
                                  bias=False))

        def loss_of(model, x, y):
            _, loss = model(x, y)
            return loss, None
        return model, loss_of
    from kasoku.models.gpt import GPT, GPT_SHAPES
    model = GPT(GPT_SHAPES["small"])
    if "nobias" in variant:
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.LayerNorm)) and m.bias is not None:
                m.bias = None
    if "exactgelu" in variant:
        import kasoku.models.gpt as g
        g.MLP.forward = lambda self, x: self.proj(F.gelu(self.fc(x)))
    metric = "nometric" not in variant

    def ce(out, y):
        return F.cross_entropy(out.flatten(0, 1), y.flatten())

    def accuracy(out, y):
        return (out.argmax(dim=-1) == y).float().mean()

    if "closs" in variant:  # each a compiled graph of its own, as kasoku's --compile now
        ce, accuracy = torch.compile(ce), torch.compile(accuracy)
    if "cobj" in variant:  # loss and metric one compiled graph (kasoku's Objective, --compile)
        def objective(out, y):
            loss = ce(out, y)
            with torch.no_grad():
                return loss, accuracy(out.detach(), y)
        objective = torch.compile(objective)

        def loss_of(model, x, y):
            return objective(model(x), y)
        return model, loss_of
    if "inloss" in variant:  # the loss inside the model's compiled graph, as nanoGPT
        def loss_of(model, x, y):
            return model.loss_in_graph(x, y), None
        model.loss_in_graph = torch.compile(lambda x, y: ce(model(x), y))
        return model, loss_of

    def loss_of(model, x, y):
        out = model(x)
        loss = ce(out, y)
        with torch.no_grad():
            acc = accuracy(out.detach(), y) if metric else None
        return loss, acc
    return model, loss_of


def classify(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ("flash", "fmha", "sdpa", "attention", "cudnn_generated")):
        return "attention"
    if any(k in low for k in ("nvjet", "gemm", "sm90_xmma", "cutlass", "cublas", "sm80")):
        return "matmul"
    if any(k in low for k in ("multi_tensor", "fused_adam", "adam")):
        return "optimizer"
    if any(k in low for k in ("memcpy", "memset")):
        return "copy"
    if any(k in low for k in ("log_softmax", "nll_loss", "cross_entropy", "argmax", "max_")):
        return "loss/softmax"
    if any(k in low for k in ("layer_norm", "native_layer_norm")):
        return "norm"
    return "elementwise/other"


def run(variant: str, args) -> dict:
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    import torch._inductor.config as ic
    ic.benchmark_kernel = True  # kernel_num_gb / kernel_flop in the profiler's records
    model, loss_of = build(variant, args.nanogpt)
    model.cuda()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": other, "weight_decay": 0.0}], lr=1e-4,
                            betas=(0.9, 0.95), fused=True)
    cmodel = model if "inloss" in variant else torch.compile(model)
    b = args.batch
    x = torch.randint(V, (b, T), device="cuda")
    y = torch.randint(V, (b, T), device="cuda")
    attn = None
    if "cudnn" in variant:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        attn = sdpa_kernel(SDPBackend.CUDNN_ATTENTION)
        attn.__enter__()

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            loss, acc = loss_of(cmodel, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        loss = step()
    first_loss = float(loss)
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    ms = []
    for _ in range(args.windows):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.steps):
            step()
        end.record()
        end.synchronize()
        ms.append(start.elapsed_time(end) / args.steps)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 record_shapes=True, with_flops=True) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    trace = args.out / f"trace-{variant}-b{b}.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    with gzip.open(str(trace) + ".gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    trace.unlink()
    by_class = collections.defaultdict(float)
    top = collections.defaultdict(float)
    for e in events:
        if e.get("cat") == "kernel":
            by_class[classify(e["name"])] += e["dur"] / 3 / 1e3
            top[e["name"][:90]] += e["dur"] / 3 / 1e3
    gb = collections.defaultdict(float)
    flop = collections.defaultdict(float)
    for e in events:
        a = e.get("args") or {}
        if "kernel_num_gb" in a:
            gb[classify(e["name"])] += float(a["kernel_num_gb"]) / 3
        if "kernel_flop" in a:
            flop[classify(e["name"])] += float(a["kernel_flop"]) / 3
    if attn is not None:
        attn.__exit__(None, None, None)
    med = statistics.median(ms)
    return {"variant": variant, "batch": b, "ms_per_step": med, "windows_ms": ms,
            "tokens_per_s": b * T / med * 1e3, "warmup_s": warm_s, "first_loss": first_loss,
            "kernel_ms_by_class": dict(by_class), "triton_gb_by_class": dict(gb),
            "triton_flop_by_class": dict(flop),
            "top_kernels": sorted(top.items(), key=lambda kv: -kv[1])[:25],
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nanogpt", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--variants", default="nano,kasoku")
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--windows", type=int, default=5)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    variant = args.variants  # one per process: compile caches and sys.modules stay apart
    r = run(variant, args)
    with (args.out / "results.jsonl").open("a") as f:
        f.write(json.dumps(r) + "\n")
    print(f"{variant:28s} b{args.batch}: {r['ms_per_step']:.2f} ms/step "
          f"({min(r['windows_ms']):.2f}-{max(r['windows_ms']):.2f}), "
          f"{r['tokens_per_s']:,.0f} tok/s, warm-up {r['warmup_s']:.0f} s, "
          f"peak {r['peak_gib']:.1f} GiB", flush=True)
    print("   kernel ms/step by class: " + ", ".join(
        f"{k} {v:.2f}" for k, v in sorted(r["kernel_ms_by_class"].items(), key=lambda kv: -kv[1])),
        flush=True)


if __name__ == "__main__":
    main()
