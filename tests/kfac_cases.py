"""What the K-FAC tests share: a torch optimizer of K-FAC over a base one, a training step,
and the tiny model most tests precondition. Each file runs on one thread with fresh warnings
(conftest's ``one_thread_fresh_lever_warnings``)."""
import torch
import torch.nn.functional as F
from torch import nn

from kasoku.kfac import KFAC, KFACConfig

EXACT = KFACConfig(factor_decay=0.0, kl_clip=None, factor_update_freq=1, inv_update_freq=1)
"""Factors = this batch's, eigenbases of them, no clipping: what the direct computations give."""


def kfac_of(model, cfg=EXACT, lr=0.1, base="sgd"):
    if base == "adam":
        return KFAC(model, torch.optim.Adam(model.parameters(), lr=lr), cfg)
    momentum = 0.9 if base == "momentum" else 0.0
    return KFAC(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum), cfg)


def train_step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def with_ones(a):
    return torch.cat([a, torch.ones(len(a), 1)], dim=1)


def tiny():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2, bias=False))
    return model, torch.randn(32, 3), torch.randint(0, 2, (32,))
