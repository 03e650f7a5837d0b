"""The fused_loss lever's cross-entropy kernels (``kasoku.accel.cross_entropy``), run by
Triton's interpreter on the CPU: the loss and the gradient PyTorch's cross-entropy gives, in
fp32 and bf16, over rows wider than a block, for a language model's [B, T, V] logits too; the
lever stands in only for a workload's cross-entropy, and only on a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kasoku.accel import cross_entropy as ce
from kasoku.workloads import create_workload


@pytest.fixture
def interpreted(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2 ** -8)])
@pytest.mark.parametrize("rows, width", [(3, 50), (4, ce.BLOCK + 904)])
def test_loss_and_gradient_are_pytorch_s(interpreted, dtype, tol, rows, width):
    torch.manual_seed(0)
    x = (4 * torch.randn(rows, width)).to(dtype).requires_grad_()
    target = torch.randint(width, (rows,))
    target[0] = width - 1  # the last column, in the last (partial) block
    loss = ce.cross_entropy(x, target)
    (2.5 * loss).backward()  # a gradient other than 1 (a loss scale) reaches the kernel
    grad, x.grad = x.grad.clone(), None
    expected = F.cross_entropy(x.float(), target)
    (2.5 * expected).backward()
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    # bf16: the same fp32 gradient, rounded once to the logits' dtype (within one unit)
    scale = grad.float().abs().max().item()
    assert (grad.float() - x.grad.float()).abs().max().item() <= tol * max(scale, 1.0)


def test_a_language_model_s_logits(interpreted):
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 300, requires_grad=True)
    target = torch.randint(300, (2, 5))
    ce.fused_loss(logits, target).backward()
    grad, logits.grad = logits.grad.clone(), None
    gpt = create_workload("gpt")
    gpt.loss_fn(logits, target).backward()
    assert torch.allclose(grad, logits.grad, atol=1e-7)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"\[N, V\] logits and \[N\] targets"):
        ce.cross_entropy(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long))


def test_the_lever_stands_in_for_a_cross_entropy_on_a_gpu_only():
    notes: list[str] = []
    gpt, sine = create_workload("gpt"), create_workload("sine-lstm")
    assert ce.apply_fused_loss(gpt.loss_fn, "cpu", notes) == gpt.loss_fn
    assert notes == ["fused_loss: no effect on cpu (its kernels run on CUDA)"]
    assert ce.apply_fused_loss(gpt.loss_fn, "cuda", notes) is ce.fused_loss
    assert ce.apply_fused_loss(create_workload("mnist-mlp").loss_fn, "cuda", notes) \
        is ce.fused_loss
    assert ce.apply_fused_loss(sine.loss_fn, "cuda", notes) == sine.loss_fn  # a regression
    assert notes[-1] == "fused_loss: the workload's loss is not a cross-entropy; nothing changed"


def test_without_the_kernels_it_is_pytorch_s():
    # A CPU tensor outside the interpreter: PyTorch's cross-entropy itself.
    x, t = torch.randn(3, 7), torch.tensor([0, 6, 3])
    assert ce.cross_entropy(x, t).item() == F.cross_entropy(x, t).item()
