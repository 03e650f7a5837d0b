"""The ceiling of the MNIST MLP's share of the fp32 matmul peak on a CPU: the matrix products
of one training step alone (784-1000-1000-10: three forward addmm, three weight-gradient and
two input-gradient products, the FLOPs kasoku counts), timed back to back, against the
2048^3 product the peak probe times. Plain PyTorch.

    python research/probes/mlp_gemm_share.py [THREADS] [BATCH]
"""
import statistics
import sys
import time

import torch

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads())
bs = int(sys.argv[2]) if len(sys.argv) > 2 else 100
dims = [(784, 1000), (1000, 1000), (1000, 10)]
x = [torch.randn(bs, i) for i, o in dims]
w = [torch.randn(o, i) for i, o in dims]
b = [torch.randn(o) for i, o in dims]
g = [torch.randn(bs, o) for i, o in dims]


def products():
    for k in range(3):
        torch.addmm(b[k], x[k], w[k].t())  # forward
    for k in range(3):
        g[k].t().mm(x[k])  # weight gradients
    for k in (1, 2):
        g[k].mm(w[k])  # input gradients (none for the first layer)


flops = 2 * sum(2 * bs * i * o for i, o in dims) + sum(2 * bs * i * o for i, o in dims[1:])
for _ in range(20):
    products()
times = []
for _ in range(15):
    t0 = time.perf_counter()
    for _ in range(50):
        products()
    times.append((time.perf_counter() - t0) / 50)
a, c = torch.randn(2048, 2048), torch.empty(2048, 2048)
for _ in range(3):
    torch.mm(a, a, out=c)
peaks = []
for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(5):
        torch.mm(a, a, out=c)
    peaks.append(5 * 2 * 2048 ** 3 / (time.perf_counter() - t0))
t, peak = statistics.median(times), statistics.median(peaks)
print(f"{torch.get_num_threads()} threads, batch {bs}: the step's products take {t * 1e3:.2f} ms "
      f"({flops / 1e6:.1f} MFLOP, {flops / t / 1e9:.0f} GFLOP/s); fp32 peak (2048^3) "
      f"{peak / 1e9:.0f} GFLOP/s; products alone at {flops / t / peak:.0%} of it")
