"""A decoder-only transformer in GPT-2's shapes (Radford et al. 2019; nanoGPT's ``model.py``):
token and position embeddings, ``blocks`` of pre-norm attention and MLP, a final norm, and a
head that shares its weight with the token embedding.

The blocks are one ``nn.ModuleList`` of ``Block``s, each a whole residual unit, so that a
transform can wrap them one by one (activation checkpointing, FSDP2's per-block sharding).
No dropout: pretraining at these sizes uses none (nanoGPT's default), and a model without it
draws no random numbers in its step.

``bias=False`` leaves out every linear layer's and layer norm's bias (GPT-2 has them;
nanoGPT's benchmark, and most models trained since, do not): fewer parameters, and fewer
kernels in the backward pass (each bias's gradient is a sum over every token).

``attention`` picks how a block attends, with the same weights and the same state dict:
``sdpa`` is ``torch.nn.functional.scaled_dot_product_attention`` with ``is_causal`` (a fused
kernel where the device has one); ``plain`` is the textbook's matrix product, causal mask,
softmax and matrix product, which materializes the ``[T, T]`` scores of every head.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kasoku.models.gpt_shapes import ATTENTIONS, GPT_SHAPES, GPTShape  # noqa: F401  (GPT_SHAPES)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    t = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return F.softmax(scores, dim=-1) @ v


class CausalSelfAttention(nn.Module):
    def __init__(self, shape: GPTShape, attention: str = "sdpa", bias: bool = True):
        super().__init__()
        if shape.n_embd % shape.n_head:
            raise ValueError(f"n_embd {shape.n_embd} is not a multiple of n_head {shape.n_head}")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got "
                             f"{attention!r}")
        self.n_head = shape.n_head
        self.qkv = nn.Linear(shape.n_embd, 3 * shape.n_embd, bias=bias)
        self.proj = nn.Linear(shape.n_embd, shape.n_embd, bias=bias)
        self.attend = sdpa_attention if attention == "sdpa" else plain_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        y = self.attend(q, k, v)  # [B, heads, T, head size]
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, n_embd: int, bias: bool = True):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))  # GPT-2's GELU


class Block(nn.Module):
    """One residual unit: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, shape: GPTShape, attention: str = "sdpa", bias: bool = True):
        super().__init__()
        self.ln_1 = nn.LayerNorm(shape.n_embd, bias=bias)
        self.attn = CausalSelfAttention(shape, attention, bias)
        self.ln_2 = nn.LayerNorm(shape.n_embd, bias=bias)
        self.mlp = MLP(shape.n_embd, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token ids ``[B, T]`` (int64, ``T <= block_size``) -> next-token logits
    ``[B, T, vocab_size]``."""

    def __init__(self, shape: GPTShape, attention: str = "sdpa", bias: bool = True):
        super().__init__()
        self.shape = shape
        self.wte = nn.Embedding(shape.vocab_size, shape.n_embd)
        self.wpe = nn.Embedding(shape.block_size, shape.n_embd)
        self.blocks = nn.ModuleList(Block(shape, attention, bias) for _ in range(shape.n_layer))
        self.ln_f = nn.LayerNorm(shape.n_embd, bias=bias)
        self.head = nn.Linear(shape.n_embd, shape.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied, as GPT-2
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2's: N(0, 0.02) for matrices and embeddings, zero biases, and the projections
        that add to the residual stream scaled by 1/sqrt(2 n_layer) (two per block)."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp.proj):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * self.shape.n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.shape.block_size:
            raise ValueError(f"a sequence of {t} tokens is longer than the model's block of "
                             f"{self.shape.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters, each tied tensor once; ``non_embedding``: less the position embeddings
        (the token embedding stays: as the head's weight it is a matrix product's), as
        nanoGPT counts the N of its FLOP estimate."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n
