"""Configs of the acceleration levers. Each lever is an ``apply_*`` transform in its own module
of ``kasoku.accel`` that takes only its own settings; ``kasoku.accel.compose.accelerate`` reads
an ``AccelConfig`` and applies the levers in the order they need. The field docstrings are the
command line's help texts (``kasoku train --help``) and the bench's ``--config`` keys."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from kasoku.core.errors import ConfigError

# The closed choices of the levers: each a Literal (the field's type) and the tuple of its
# values made from it, which the checks and the command line's choices read.
Precision = Literal["fp32", "tf32", "fp16", "bf16", "fp16-pure"]
OptimizerImpl = Literal["loop", "foreach", "fused", "compiled", "triton"]
CheckpointingMode = Literal["none", "full", "selective"]
SdpaBackend = Literal["auto", "flash", "efficient", "cudnn", "math"]
Float8 = Literal["none", "tensorwise", "rowwise"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]

PRECISIONS: tuple[str, ...] = get_args(Precision)
OPTIMIZER_IMPLS: tuple[str, ...] = get_args(OptimizerImpl)
CHECKPOINTING_MODES: tuple[str, ...] = get_args(CheckpointingMode)
SDPA_BACKENDS: tuple[str, ...] = get_args(SdpaBackend)
FLOAT8_RECIPES: tuple[str, ...] = get_args(Float8)[1:]
"""torchao's float8 scalings (``Float8`` less none)."""
COMPILE_MODES: tuple[str, ...] = get_args(CompileMode)


@dataclass(frozen=True)
class AccelConfig:
    precision: Precision = "fp32"
    """fp32 (true fp32: TF32 off) | tf32 (TF32 tensor cores) | fp16 (autocast with dynamic
    loss scaling, fp32 weights) | bf16 (autocast) | fp16-pure (fp16 weights and activations,
    fp32 master weights in the optimizer, dynamic loss scaling). fp16 and tf32 need CUDA."""
    channels_last: bool = False
    """NHWC memory format for conv nets, what tensor-core convolutions read (warns once when
    the model has no 2-d convolutions)."""
    cudnn_benchmark: bool = False
    """cuDNN autotuning: the fastest convolution algorithm for each shape, timed in the first
    steps."""
    optimizer_impl: OptimizerImpl | None = None
    """How the optimizer updates the weights: loop (one kernel per tensor per op) | foreach
    (multi-tensor kernels) | fused (one kernel for all weights, the batched weight update) |
    compiled (the foreach update compiled by torch.compile; SGD, momentum and Adam) | triton
    (Adam as one Triton kernel over all weights; CUDA, float32). Default: fused where PyTorch
    has it, else foreach."""
    fused_bn: bool = False
    """Batch norm, residual add and ReLU of each layer as one Triton kernel pair forward and
    one backward (kasoku's ResNets, in training; CUDA; needs channels_last)."""
    fast_stem: bool = False
    """The stem of a conv net: its stride-2 convolution on 3 channels computed space-to-depth
    (a 4x4 stride-1 convolution on 16 channels: the same result, faster cuDNN kernels) and its
    max-pool as Triton kernels; CUDA."""
    matmul_1x1: bool = False
    """1x1 convolutions as matrix products on channels_last activations (cuBLAS instead of
    cuDNN: faster for ResNet-50's shapes at small batches on an H200); needs channels_last."""
    wgrad_stream: bool = False
    """The weight gradients of convolutions on a second CUDA stream, joined at the end of the
    backward pass, so they run beside the rest of backward; CUDA."""
    keep_memory: bool = False
    """CPU: glibc's malloc keeps freed memory in the process (no heap trimming, no mmap'd
    blocks), so each step's temporaries stop page-faulting (process-wide)."""
    activation_checkpointing: CheckpointingMode = "none"
    """none | full (each block's forward recomputed in the backward pass: the least memory,
    about a third more compute) | selective (the matrix products' and attention's outputs
    kept, the element-wise operators recomputed); for a model with a `blocks` ModuleList
    (gpt)."""
    sdpa_backend: SdpaBackend = "auto"
    """The kernel of scaled_dot_product_attention: auto (PyTorch's choice) | flash |
    efficient (memory-efficient; CUDA) | cudnn (cuDNN's; CUDA, 8.0+) | math (the unfused
    reference)."""
    float8: Float8 = "none"
    """float8 matrix products of the Linear layers through torchao (pip install torchao): none
    | tensorwise | rowwise scaling; CUDA, compute capability 8.9+ (Ada, Hopper). Faster than
    bf16 only for wide matrices (measured on an H100: from about 2,048 wide; 1.4x at 4,096)."""
    fused_loss: bool = False
    """The cross-entropy as kasoku's two Triton kernels: the forward pass keeps each row's
    log-sum-exp, the backward pass writes the gradient in one pass over the logits (a
    language model's 50,304-token head); workloads whose loss is a cross-entropy; CUDA."""
    compile: bool = False
    """torch.compile the model (fuses batch norm, ReLU, residual adds and other elementwise
    chains into fewer kernels); compilation happens in the first steps."""
    compile_mode: CompileMode = "default"
    """torch.compile mode: default | reduce-overhead | max-autotune(-no-cudagraphs)."""
    combo_kernels: bool = False
    """With compile (mode default): inductor's combo kernels, independent kernels (such as
    autocast's per-layer weight casts) combined into fewer launches; experimental in torch."""
    cuda_graph: bool = False
    """Capture the whole step (forward, backward, update) as one CUDA graph and replay it."""
    loss_scale_init: float = 2.0 ** 16
    """The first dynamic loss scale of precision fp16 and fp16-pure."""
    steps_per_call: int = 1
    """Optimizer steps per trainer iteration (Keras' steps_per_execution): the loader hands out
    K batches at once and one call (one CUDA graph replay under --cuda-graph) runs K steps, so
    the per-iteration host cost is paid once per K steps. Extensions and LR schedules run once
    per call; the iteration count still counts steps. With --cuda-graph choose K dividing the
    batches per epoch (MNIST at batch 100: 600 batches -> 50), else each epoch's last, shorter
    chunk runs outside the graph. Needs --loader serial or device."""


def check_choices(cfg: AccelConfig) -> None:
    """Refuse a value outside its field's closed choices (``ConfigError`` naming them), without
    torch: the first of ``kasoku.accel.compose.check_config``'s checks, which adds the
    combinations that cannot work."""
    if cfg.precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {cfg.precision!r}; choose one of "
                          f"{', '.join(PRECISIONS)}")
    if cfg.optimizer_impl is not None and cfg.optimizer_impl not in OPTIMIZER_IMPLS:
        raise ConfigError(f"unknown optimizer implementation {cfg.optimizer_impl!r}; choose one "
                          f"of {', '.join(OPTIMIZER_IMPLS)}")
    if cfg.compile_mode not in COMPILE_MODES:
        raise ConfigError(f"unknown compile mode {cfg.compile_mode!r}; choose one of "
                          f"{', '.join(COMPILE_MODES)}")
    for name, allowed in (("activation_checkpointing", CHECKPOINTING_MODES),
                          ("sdpa_backend", SDPA_BACKENDS), ("float8", get_args(Float8))):
        if getattr(cfg, name) not in allowed:
            raise ConfigError(f"unknown {name} {getattr(cfg, name)!r}; choose one of "
                              f"{', '.join(allowed)}")
