"""``gpt``: a decoder-only transformer in GPT-2's shapes learning the next token of text.

The text: a folder of UTF-8 files (``--data DIR``), or without it the Python standard
library's own sources, which every machine with Python has offline; tokenized once into a
cached file (``kasoku.data.text``) read as windows of one block (``kasoku.data.tokens``):
byte-level (``tokenizer=byte``, the default), or with a byte-level BPE tokenizer trained on the
corpus, as GPT-2 is trained (``tokenizer=bpe``, ``vocab=N``: ``kasoku.data.bpe``, Hugging Face
``tokenizers``; the model's vocabulary is the tokenizer's padded to a multiple of 64).
``--synthetic``: generated token sequences with a learnable rule.

The loss is the cross-entropy of the next token in nats per token (a byte with ``byte``, a BPE
token, ~3.6 bytes of the standard library at 8,192, with ``bpe``: compare the two per byte).
The log counts the tokens trained on (``tokens``).

Settings (``gpt:model_size=small`` or ``--model-size small``): the model size, and the
attention (PyTorch's fused ``scaled_dot_product_attention`` or the plain one), so one ladder
can be measured with each. Rates count tokens; MFU divides the transformer FLOP formula
(``kasoku.perf.flops.transformer_flops_per_token``), not a count of the operators.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

from kasoku.core.errors import ConfigError, warn_once
from kasoku.core.flags import flag
from kasoku.data.config import DataConfig
from kasoku.models.gpt_shapes import ATTENTIONS, BIASES, GPT_SHAPES, padded_vocab
from kasoku.workloads.dataset_facts import synthetic_sizes
from kasoku.workloads.registry import Recipe, Workload, register_workload

if TYPE_CHECKING:
    import torch
    from torch import nn

    from kasoku.perf.flops import StepFlops

SYNTHETIC_SIZES = (2048, 64)
"""Default generated (train, val) sequences."""

# AdamW as GPT-2-class models are trained (GPT-3's betas (0.9, 0.95), its gradients clipped at
# a global norm of 1.0, weight decay 0.1 on matrices and embeddings), a linear warm-up and a
# cosine decay over the run. tiny: nanoGPT's small-model rate (1e-3, its Shakespeare
# character model) and 64 sequences of 64 tokens, an epoch of the standard library
# (~28M training tokens) in ~6,900 steps; small and medium: GPT-2's rates (6e-4, 3e-4);
# large and xl: GPT-3's for its models of their size (2.5e-4 at 760M, 2e-4 at 1.3B; Brown et
# al. 2020, table 2.1); each at a batch that fits one 80 GB GPU without gradient accumulation.
_GPT = dict(optimizer="adamw", betas=(0.9, 0.95), weight_decay=0.1, grad_clip=1.0, epochs=1,
            schedule="cosine", warmup_epochs=0.01)
RECIPES = {
    "tiny": Recipe(lr=1e-3, batch_size=64, **_GPT),
    "small": Recipe(lr=6e-4, batch_size=16, **_GPT),
    "medium": Recipe(lr=3e-4, batch_size=8, **_GPT),
    "large": Recipe(lr=2.5e-4, batch_size=8, **_GPT),
    "xl": Recipe(lr=2e-4, batch_size=4, **_GPT),
}
TOKENIZERS = ("byte", "bpe")
BPE_VOCAB = 8192
"""bpe's default vocabulary, for the standard library's ~28 MB of Python: ~3.6 bytes a token,
trained in seconds on two cores. GPT-2's 50,257 is for 40 GB of web text: here most of its
merges would be seen a few times, and the head would be six times wider for them."""
VOCAB_RANGE = (258, 1 << 20)
"""The vocab setting's bounds: the 256 bytes, the end-of-document token and a merge at least;
a head of a million rows at most."""


@dataclass
class GPTConfig:
    model_size: str = "tiny"
    """tiny (2 layers, 2 heads, 64 wide, a block of 64 tokens: a CPU, the tests), small
    (GPT-2's 124M), medium (350M), large (774M) or xl (1.5B)"""
    attention: str = "sdpa"
    """sdpa (torch.nn.functional.scaled_dot_product_attention, fused where the device has a
    kernel) or plain (matrix product, causal mask, softmax, matrix product)"""
    bias: str = "yes"
    """yes (GPT-2's: a bias in every linear layer and layer norm) or no (none, as nanoGPT's
    benchmark and most models since: fewer parameters and kernels)"""
    tokenizer: str = "byte"
    """byte (a token is a byte of the UTF-8 text: 256 ids) or bpe (a byte-level BPE tokenizer
    trained on the corpus's training files once, cached beside its token file; needs Hugging
    Face tokenizers: pip install tokenizers)"""
    vocab: int | None = None
    """bpe's vocabulary, in tokens (default 8192; the model's is this padded to a multiple of
    64); byte has 256"""
    choices: ClassVar[dict] = {"model_size": tuple(GPT_SHAPES), "attention": ATTENTIONS,
                               "bias": BIASES, "tokenizer": TOKENIZERS}

    def __post_init__(self):
        for name, allowed in self.choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"gpt's {name} must be one of {', '.join(allowed)}, got "
                                  f"{getattr(self, name)!r}")
        if self.vocab is None:
            return
        if self.tokenizer != "bpe":
            raise ConfigError("gpt's vocab is the BPE tokenizer's size; byte-level text has "
                              "256 tokens: add tokenizer=bpe, or leave vocab out")
        try:
            self.vocab = int(self.vocab)  # a setting in the workload's name is text
        except ValueError:
            raise ConfigError(f"gpt's vocab must be a whole number, got {self.vocab!r}") \
                from None
        low, high = VOCAB_RANGE
        if not low <= self.vocab <= high:
            raise ConfigError(f"gpt's vocab must be {low:,} to {high:,} tokens (the 256 bytes, "
                              f"the end of a document and the merges), got {self.vocab:,}")


@register_workload("gpt")
class GPTWorkload(Workload):
    sample_unit = "tokens"
    default_data = "the Python standard library's .py files"
    config_class = GPTConfig
    ladder = "transformer"

    def __init__(self, config: GPTConfig | None = None):
        super().__init__(config)
        self.shape = GPT_SHAPES[self.config.model_size]
        self.bpe = self.config.tokenizer == "bpe"
        if self.bpe:  # until the tokenizer is trained (build_datasets): the size asked for
            self.vocab = self.config.vocab or BPE_VOCAB
            self.shape = replace(self.shape, vocab_size=padded_vocab(self.vocab))
        self.recipe = RECIPES[self.config.model_size]
        self.units_per_sample = self.shape.block_size
        s, plain = self.shape, self.config.attention == "plain"
        self.description = (f"GPT-2-shaped decoder, {self.config.model_size} ({s.n_layer} "
                            f"layers, {s.n_embd} wide, {s.block_size}-token block"
                            f"{', plain attention' if plain else ''}"
                            f"{', no biases' if self.config.bias == 'no' else ''}), next "
                            + (f"BPE token ({self.vocab:,}) of text" if self.bpe else
                               "byte of text"))

    @property
    def epoch_samples(self) -> int | None:
        """Tokens of the standard library corpus's training windows, from its files' sizes
        (a byte is a token; the files not UTF-8, a few, are counted too); with bpe, not known
        before the tokenizer is trained."""
        if self.bpe:
            return None
        from kasoku.data.text import stdlib_files  # deferred: PIL, through bad_files
        from kasoku.data.tokens import MAX_VAL_WINDOWS  # deferred: torch (registry's doc)
        _, files = stdlib_files()
        n = sum(f.stat().st_size + 1 for f in files)
        return n - min(n // 10, MAX_VAL_WINDOWS * self.shape.block_size + 1)

    def build_model(self) -> nn.Module:
        from kasoku.models.gpt import GPT  # deferred: torch (workloads.registry's doc)
        return GPT(self.shape, self.config.attention, bias=self.config.bias == "yes")

    def build_datasets(self, data: DataConfig, seed: int = 0):
        from kasoku.data.text import BYTES, stdlib_files, text_files, tokenize  # deferred: PIL
        from kasoku.data.tokens import synthetic_token_datasets, token_datasets  # deferred
        s = self.shape
        if data.synthetic:
            n_train, n_val = synthetic_sizes(data, SYNTHETIC_SIZES)
            return synthetic_token_datasets(n_train, n_val, s.block_size, s.vocab_size, seed)
        if data.download:
            warn_once(f"{flag('data.download')}: {self.name} reads text already on this machine; "
                      "nothing is downloaded")
        if data.root is not None:
            root, files = data.root, text_files(data.root)
        else:
            root, files = stdlib_files()
        tokenizer = BYTES
        if self.bpe:
            from kasoku.data.bpe import trained  # deferred: tokenizers, optional
            from kasoku.data.tokens import VAL_FRACTION  # deferred: torch
            tokenizer = trained(root, files, self.vocab, cache=data.cache, held_out=VAL_FRACTION,
                                needed_by="gpt:tokenizer=bpe")
            # The model follows the tokenizer (one trained on little text has fewer tokens).
            self.shape = replace(s, vocab_size=padded_vocab(tokenizer.vocab_size))
        corpus = tokenize(root, files, cache=data.cache, strict=data.strict, tokenizer=tokenizer)
        return token_datasets(corpus, s.block_size, seed)

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        import torch  # deferred: torch (registry's doc); as cheap as a global's lookup
        return torch.nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())

    loss_fn.cross_entropy = True  # the fused_loss lever may stand in for it

    def metric_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Next-token accuracy."""
        return (output.argmax(dim=-1) == target).float().mean()

    def step_flops(self, model: nn.Module, make_batch, batch_size: int) -> StepFlops:
        """The transformer formula at the model's block (every sample is a full block)."""
        from kasoku.perf.flops import transformer_step_flops  # deferred: torch
        s = self.shape
        return transformer_step_flops(model.num_params(), s.n_layer, s.n_embd, s.block_size,
                                      batch_size)
