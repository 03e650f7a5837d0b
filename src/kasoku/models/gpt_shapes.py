"""The GPT model's shapes and attentions, by name: what the ``gpt`` workload's settings choose
from (``--model-size``, ``--attention``), in a module of their own that loads without torch
(the command line's flags and ``kasoku list`` read them; ``kasoku.models.gpt`` builds the
model)."""
from __future__ import annotations

from dataclasses import dataclass

ATTENTIONS = ("sdpa", "plain")
BIASES = ("yes", "no")
VOCAB_MULTIPLE = 64
"""A model's vocabulary is its tokenizer's padded to a multiple of this (``padded_vocab``)."""


def padded_vocab(n_tokens: int) -> int:
    """``n_tokens`` rounded up to a multiple of ``VOCAB_MULTIPLE``: the head's matrix product
    runs faster, and the extra logits are only ever pushed down."""
    return -(-n_tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


@dataclass(frozen=True)
class GPTShape:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    """The longest sequence (the position embeddings' count)."""
    vocab_size: int


GPT_SHAPES = {
    "tiny": GPTShape(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=256),
    # GPT-2's vocabulary (50,257) padded to a multiple of 64 as nanoGPT does (padded_vocab).
    "small": GPTShape(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304),
    "medium": GPTShape(n_layer=24, n_head=16, n_embd=1024, block_size=1024, vocab_size=50304),
    "large": GPTShape(n_layer=36, n_head=20, n_embd=1280, block_size=1024, vocab_size=50304),
    "xl": GPTShape(n_layer=48, n_head=25, n_embd=1600, block_size=1024, vocab_size=50304),
}
"""tiny: for a CPU and the tests; small, medium, large and xl: GPT-2's 124M, 350M, 774M and
1.5B (the wider matrices are where float8 and FSDP2 pay)."""
