"""What one K-FAC inverse step costs on this GPU for a workload's factors: every factor's
``eigh`` (what kasoku does) beside a Cholesky inverse of the damped factor (kfac-pytorch's
"inverse" method), float32, timed with a synchronize around each, median of 5 after 2 warm-up.

    python research/probes/kfac_inverse_cost.py cifar10-resnet18 cifar10-resnet152
"""
from __future__ import annotations

import statistics
import sys
import time

import torch
from torch import nn


def factor_dims(model: nn.Module) -> list[int]:
    dims = []
    for m in model.modules():
        if isinstance(m, nn.Conv2d) and m.groups == 1:
            k = m.in_channels * m.kernel_size[0] * m.kernel_size[1] + (m.bias is not None)
            dims += [k, m.out_channels]
        elif isinstance(m, nn.Linear):
            dims += [m.in_features + (m.bias is not None), m.out_features]
    return dims


def timed(fn, reps=5) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    from kasoku.workloads import create_workload
    cache = {}
    for name in sys.argv[1:]:
        dims = factor_dims(create_workload(name).build_model())
        total = {"eigh": 0.0, "cholesky": 0.0}
        for n in dims:
            if n not in cache:
                x = torch.randn(n, 4 * n, device="cuda")
                f = x @ x.t() / (4 * n)
                eye = torch.eye(n, device="cuda")
                cache[n] = {"eigh": timed(lambda: torch.linalg.eigh(f)),
                            "cholesky": timed(lambda: torch.cholesky_inverse(
                                torch.linalg.cholesky(f + 0.03 * eye)))}
                print(f"n={n}: eigh {1e3 * cache[n]['eigh']:.2f} ms, cholesky inverse "
                      f"{1e3 * cache[n]['cholesky']:.2f} ms", flush=True)
            for k in total:
                total[k] += cache[n][k]
        print(f"{name}: {len(dims)} factors, largest {max(dims)}; one inverse step: eigh "
              f"{1e3 * total['eigh']:.0f} ms, cholesky inverse {1e3 * total['cholesky']:.0f} ms",
              flush=True)


if __name__ == "__main__":
    main()
