"""The MNIST MLP's Adam update (1.8M weights in 6 tensors) several ways, each captured in a CUDA
graph and replayed: torch's fused kernel, the foreach update compiled by inductor, eager ops on
one flat buffer, one Triton kernel on one flat buffer, and kasoku's ``--optimizer-impl triton``
(one Triton kernel over the six tensors where they lie) at several block sizes and warps. Prints the update's time per step
(CUDA events over 1,000 replays, median of 5) and its one-time cost (first call + capture).

    python research/probes/adam_update_probe.py
"""
from __future__ import annotations

import torch

from kasoku.commands.bench.timing import graph_replay_ms

SHAPES = [(1000, 784), (1000,), (1000, 1000), (1000,), (10, 1000), (10,)]


def params():
    torch.manual_seed(0)
    ps = [torch.randn(s, device="cuda", requires_grad=True) for s in SHAPES]
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


def timed_graph(fn, label):
    ms, once = graph_replay_ms(fn, replays=1000)
    print(f"{label:40s} {ms * 1e3:7.1f} us/update   one-time {once:6.2f} s", flush=True)


def main() -> None:
    ps = params()
    opt = torch.optim.Adam(ps, lr=torch.tensor(1e-3, device="cuda"), fused=True, capturable=True)
    timed_graph(opt.step, "torch fused Adam")

    from kasoku.optim import compile_step
    ps = params()
    opt = compile_step(torch.optim.Adam(ps, lr=torch.tensor(1e-3, device="cuda"), foreach=True,
                                        capturable=True))
    timed_graph(opt.step, "foreach Adam compiled by inductor")

    n = sum(p.numel() for p in params())
    flat_p, flat_g = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    m, v = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    step = torch.zeros((), device="cuda")
    lr, b1, b2, eps = 1e-3, 0.9, 0.999, 1e-8

    def eager_flat():
        step.add_(1)
        bc1 = 1 - torch.pow(b1, step)
        bc2_sqrt = (1 - torch.pow(b2, step)).sqrt_()
        m.lerp_(flat_g, 1 - b1)
        v.mul_(b2).addcmul_(flat_g, flat_g, value=1 - b2)
        denom = (v.sqrt() / bc2_sqrt).add_(eps)
        flat_p.sub_((m / denom).mul_(lr / bc1))

    timed_graph(eager_flat, "eager ops on one flat buffer")

    import triton
    import triton.language as tl

    @triton.jit
    def adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, step_ptr, n, lr, beta1, beta2, eps,
                    BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        t = tl.load(step_ptr)
        g = tl.load(g_ptr + offs, mask=mask)
        mm = beta1 * tl.load(m_ptr + offs, mask=mask) + (1 - beta1) * g
        vv = beta2 * tl.load(v_ptr + offs, mask=mask) + (1 - beta2) * g * g
        bc1 = 1 - tl.exp(t * tl.log(beta1))
        bc2 = 1 - tl.exp(t * tl.log(beta2))
        p = tl.load(p_ptr + offs, mask=mask) - (lr / bc1) * mm / (tl.sqrt(vv) / tl.sqrt(bc2) + eps)
        tl.store(m_ptr + offs, mm, mask=mask)
        tl.store(v_ptr + offs, vv, mask=mask)
        tl.store(p_ptr + offs, p, mask=mask)

    def triton_flat():
        step.add_(1)
        adam_kernel[(triton.cdiv(n, 2048),)](flat_p, flat_g, m, v, step, n, lr, b1, b2, eps,
                                             BLOCK=2048)

    timed_graph(triton_flat, "one Triton kernel on one flat buffer")

    from kasoku.accel.triton_adam import TritonAdam
    for block in (512, 1024, 2048, 4096):
        for warps in (4, 8):
            ps = params()
            opt = TritonAdam(ps, lr=torch.tensor(1e-3, device="cuda"), block=block,
                             num_warps=warps)
            timed_graph(opt.step, f"kasoku triton, block {block}, {warps} warps")


if __name__ == "__main__":
    main()
