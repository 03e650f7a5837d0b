"""``accelerate``: the one function that applies an ``AccelConfig`` (the bench and ``kasoku
train`` call it), composing the ``apply_*`` transforms in the order they need."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from kasoku.accel.attention import apply_sdpa_backend
from kasoku.accel.checkpointing import apply_activation_checkpointing, checkpointable_blocks
from kasoku.accel.compile import GRAPHING_MODES, apply_compile, compile_fn
from kasoku.accel.config import AccelConfig, check_choices
from kasoku.accel.conv_matmul import apply_matmul_1x1
from kasoku.accel.cross_entropy import apply_fused_loss
from kasoku.accel.cudnn import apply_cudnn_benchmark
from kasoku.accel.float8 import apply_float8
from kasoku.accel.fused_bn import apply_fused_bn
from kasoku.accel.graph import WARMUP_STEPS, apply_cuda_graph
from kasoku.accel.host_memory import apply_keep_memory
from kasoku.accel.memory_format import ChannelsLastInputs, apply_channels_last, has_conv2d
from kasoku.accel.multistep import ShortChunkCheck, apply_multistep
from kasoku.accel.precision import apply_precision
from kasoku.accel.stem import apply_fast_stem
from kasoku.accel.triton_adam import compile_early
from kasoku.accel.wgrad_stream import apply_wgrad_stream, wgrad_side_stream
from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag
from kasoku.distributed.fsdp import Distribute
from kasoku.train.step import ClippedUpdate, Step

DDP_WARMUP_STEPS = 11
"""Eager DDP steps before a step is captured, as PyTorch's CUDA-graph notes ask: DDP rebuilds
its buckets and records its runtime statistics during its first iterations, which a graph
must not hold."""


@dataclass
class Accelerated:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step_fn: Step
    """step(model, batch, optimizer) -> observations (the trainer's contract); converts the
    inputs itself (channels_last in the step, float16 by the model's own hooks). With
    ``steps_per_call`` K > 1 it takes a chunk ``(inputs [k, B, ...], targets [k, B, ...])``
    from a loader built with ``batches_per_call=K`` and runs k steps (``MultiStep``)."""
    notes: list[str]
    """One line per lever skipped or adjusted on this device, and why."""
    extensions: list = field(default_factory=list)
    """Trainer extensions to register (``trainer.extend``): the loss scaler's state and
    fp16-pure's fp32 master weights in snapshots, for an exact resume; the check that
    ``steps_per_call`` divides an epoch's batches under a CUDA graph."""
    batches_per_call: int = 1
    """Batches the step takes per call: build the loader with ``batches_per_call`` (a chunk
    of K batches for K > 1, see ``kasoku.data.device_loader.ChunkedLoader``)."""


def check_config(cfg: AccelConfig) -> None:
    """Refuse unknown values and combinations that cannot work on any device, saying what to
    use instead. (Combinations that depend on the optimizer are checked in ``accelerate``.)"""
    check_choices(cfg)
    if cfg.float8 != "none" and cfg.precision in ("fp16", "fp16-pure"):
        raise ConfigError(f"{flag('accel.float8')} with precision {cfg.precision}: torchao's "
                          "float8 layers take fp32 or bf16 activations; use "
                          f"{flag('accel.precision')} bf16")
    if cfg.combo_kernels and not (cfg.compile and cfg.compile_mode == "default"):
        raise ConfigError(f"{flag('accel.combo_kernels')} is an option of torch.compile's default "
                          f"mode; add {flag('accel.compile')} (mode default)")
    if cfg.fused_bn and not cfg.channels_last:
        raise ConfigError(f"{flag('accel.fused_bn')}'s kernels read channels_last activations; add "
                          f"{flag('accel.channels_last')}")
    if cfg.matmul_1x1 and not cfg.channels_last:
        raise ConfigError(f"{flag('accel.matmul_1x1')} computes 1x1 convolutions on channels_last "
                          "activations (in NCHW the product would need a transpose copy each "
                          f"way); add {flag('accel.channels_last')}")
    if cfg.wgrad_stream and cfg.compile and cfg.compile_mode in GRAPHING_MODES:
        raise ConfigError(
            f"{flag('accel.wgrad_stream')} with compile mode {cfg.compile_mode!r}: that mode "
            "records inductor's own CUDA graphs, which assume one stream; use compile mode "
            f"default or max-autotune-no-cudagraphs (and {flag('accel.cuda_graph')} to capture the "
            "whole step)")
    if cfg.cuda_graph and cfg.compile and cfg.compile_mode in GRAPHING_MODES:
        raise ConfigError(
            f"{flag('accel.cuda_graph')} with compile mode {cfg.compile_mode!r} would nest two "
            f"layers of CUDA graphs (that mode captures its own); use {flag('accel.cuda_graph')} "
            "with compile mode default or max-autotune-no-cudagraphs, or compile mode "
            f"{cfg.compile_mode!r} without {flag('accel.cuda_graph')}")
    if not (isinstance(cfg.loss_scale_init, (int, float))
            and 0 < cfg.loss_scale_init < math.inf):
        raise ConfigError(f"loss_scale_init must be a positive, finite number, got "
                          f"{cfg.loss_scale_init!r}")
    if isinstance(cfg.steps_per_call, bool) or not isinstance(cfg.steps_per_call, int) \
            or cfg.steps_per_call < 1:
        raise ConfigError(f"steps_per_call must be a whole number >= 1 (1: one step per call), "
                          f"got {cfg.steps_per_call!r}")


def check_sharding(cfg: AccelConfig, optimizer: str) -> None:
    """Refuse, one line each, what a sharded model (``--shard``, FSDP2) cannot take here: its
    parameters are DTensor shards whose all-gathers and reduce-scatters run in hooks."""
    if optimizer == "kfac":
        raise ConfigError(f"{flag('dist.shard')} with optimizer kfac: K-FAC's factors need every "
                          "layer's whole inputs and gradients, which sharding splits; use "
                          f"{flag('train.optimizer')} adamw (or sgd), or DDP (no "
                          f"{flag('dist.shard')})")
    if optimizer in ("lars", "lamb"):
        raise ConfigError(f"{flag('dist.shard')} with optimizer {optimizer}: its trust ratio needs "
                          "each tensor's whole norm, and a worker holds a shard; use "
                          f"{flag('train.optimizer')} adamw or sgd, or DDP (no "
                          f"{flag('dist.shard')})")
    if cfg.cuda_graph:
        raise ConfigError(f"{flag('dist.shard')} with {flag('accel.cuda_graph')}: FSDP2's "
                          "all-gathers allocate and free memory per step, which a captured graph "
                          "cannot; drop one of them")
    if cfg.wgrad_stream:
        raise ConfigError(f"{flag('dist.shard')} with {flag('accel.wgrad_stream')}: FSDP2 "
                          "reduce-scatters a block's gradients when its backward ends, on the "
                          "main stream's order, before the second stream has made them; drop "
                          f"{flag('accel.wgrad_stream')} (or use DDP: no {flag('dist.shard')})")
    if cfg.compile and cfg.compile_mode in GRAPHING_MODES:
        raise ConfigError(f"{flag('dist.shard')} with compile mode {cfg.compile_mode}: that mode "
                          "captures CUDA graphs, and FSDP2's all-gathers allocate and free memory "
                          "per step; use compile mode default")
    if cfg.precision in ("fp16", "fp16-pure"):
        raise ConfigError(f"{flag('dist.shard')} with precision {cfg.precision}: the loss scaler "
                          "would judge each worker's shard of the gradients alone; use "
                          f"{flag('accel.precision')} bf16 (FSDP2's parameters in bf16, its "
                          "reduction in fp32) or fp32")
    if cfg.optimizer_impl in ("triton", "compiled"):
        raise ConfigError(f"{flag('dist.shard')} with {flag('accel.optimizer_impl')} "
                          f"{cfg.optimizer_impl}: that update works on whole tensors, not DTensor "
                          "shards; use foreach or fused")


def prewarm(optimizer_impl: str | None, device, optimizer: str, weight_decay: float) -> None:
    """Start now what a lever can prepare before the model and data exist, so it overlaps with
    loading the data: with ``optimizer_impl`` triton and Adam on CUDA, Triton's start-up and
    the update kernel's compilation (on a background thread)."""
    device = torch.device(device)
    if optimizer_impl == "triton" and optimizer == "adam" and device.type == "cuda":
        compile_early(device, weight_decay=weight_decay != 0)


def accelerate(model: torch.nn.Module, loss_fn: Callable, metric_fn: Callable | None,
               cfg: AccelConfig, device,
               make_optimizer: Callable[[list, str | None], torch.optim.Optimizer],
               distribute: Distribute | None = None,
               grad_clip: float | None = None, checked: bool = False) -> Accelerated:
    """Apply ``cfg`` to ``model``: returns the model (moved to ``device``, changed in place),
    the optimizer built by ``make_optimizer(params, cfg.optimizer_impl)`` over the parameters
    it must update (fp32 masters for fp16-pure), the step function, the notes, and the
    extensions to register. Invalid combinations raise ``ConfigError``; a lever that cannot
    apply on this device or model is skipped with one warning and a note.

    ``distribute``: wraps the model for data-parallel training (a ``Distribute``: DDP's wrap
    or FSDP2's, ``kasoku.distributed.fsdp``), applied after the layout, dtype and kasoku's
    layers and before compilation, which then sees DDP's buckets (PyTorch's order: DDP first,
    then ``torch.compile``).

    ``grad_clip``: the gradients' global norm clipped to it before each update
    (``kasoku.train.step.ClippedUpdate``, around the precision's update); None: no clipping.
    ``checked``: ``cfg`` was checked already (``kasoku.run.RunConfig.check``), not again here.

    This is the one place that reads ``cfg``: each lever gets only its own settings."""
    if not checked:
        check_config(cfg)
    device = torch.device(device)
    notes: list[str] = []
    model = model.to(device)
    apply_cudnn_benchmark(cfg.cudnn_benchmark, device, notes)  # a global flag: set either way
    if cfg.keep_memory:  # process-wide, before the first step allocates
        apply_keep_memory(device, notes)
    # Weight layout and dtype first: the compiled code specializes on both, and fp16-pure
    # decides which tensors the optimizer holds (fp32 masters copied from the final weights).
    if cfg.channels_last:
        model = apply_channels_last(model, notes)
    precision = apply_precision(model, cfg.precision, device, notes,
                                loss_scale_init=cfg.loss_scale_init)
    # kasoku's layers before compilation, which then calls their kernels whole.
    if cfg.fused_bn:
        model = apply_fused_bn(model, device, notes)
    if cfg.fast_stem:
        model = apply_fast_stem(model, device, notes)
    if cfg.matmul_1x1:
        model = apply_matmul_1x1(model, notes)
    if cfg.wgrad_stream:  # after matmul_1x1, whose layers it routes to the second stream too
        model = apply_wgrad_stream(model, device, notes)
    # float8 swaps the Linear layers for torchao's; then checkpointing recasts the blocks that
    # hold them. Both before the data-parallel wrap and compilation (torchtitan's order:
    # float8, checkpointing, compile, FSDP), which then trace the layers as they will run.
    if cfg.float8 != "none":
        model = apply_float8(model, cfg.float8, device)
    model = apply_activation_checkpointing(model, cfg.activation_checkpointing)
    graph_stream, params = None, precision.params
    # FSDP2 (fsdp.sharder): each block compiled before the wrap, its hooks outside the code.
    per_block = cfg.compile and distribute is not None and distribute.compiles_blocks
    # Static shapes (model and objective) where the step is a CUDA graph or makes weight
    # gradients on the second stream: after a first build at another batch size in the
    # process, the builds for a symbolic batch size of the graphed DDP step with and without
    # the second stream disagreed on a 1x1 weight gradient (87% of its elements, on an H200;
    # research/probes/wgrad_ddp_order.py). A new shape (an epoch's last, shorter batch; the
    # evaluation's) compiles once more for that shape.
    static = cfg.cuda_graph or cfg.wgrad_stream
    compile_options = {"mode": cfg.compile_mode, "combo_kernels": cfg.combo_kernels,
                       "buffer_reuse": not cfg.wgrad_stream, "static": static}
    if per_block:
        blocks = checkpointable_blocks(model)
        if blocks is None:
            raise ConfigError(f"{flag('dist.shard')} with {flag('accel.compile')}: kasoku compiles "
                              f"each block of a sharded model, and {type(model).__name__} has no "
                              f"`blocks` ModuleList; drop {flag('accel.compile')}")
        for block in blocks:
            apply_compile(block, device, notes, **compile_options)
    if distribute is not None:
        if cfg.cuda_graph and device.type == "cuda":
            # PyTorch's notes for DDP in a captured backward: the step warms up and is
            # captured on a side stream, DDP is built on a stream other than the default one
            # (the gradient accumulators its reducer hooks keep the stream they were made
            # on), and the step runs DDP_WARMUP_STEPS eagerly first.
            graph_stream = torch.cuda.Stream(device)
        model = _distributed(model, distribute, device, graph_stream)
        if precision.mode != "fp16-pure":
            # A sharded model's parameters are new objects (FSDP2's DTensor shards), so the
            # optimizer is built on the parameters as they are now (DDP's are the same ones).
            params = list(model.parameters())
    # Compile after dtype and layout; before the optimizer is fine (in-place compile keeps
    # the Parameter objects).
    if cfg.compile and not per_block:
        model = apply_compile(model, device, notes, **compile_options)
    optimizer = make_optimizer(params, cfg.optimizer_impl)
    if cfg.fused_loss:
        loss_fn = apply_fused_loss(loss_fn, device, notes)
    step_fn = precision.make_step(loss_fn, metric_fn)
    if cfg.compile:  # the loss and the metric too, one graph: both read the whole output
        step_fn.objective = compile_fn(step_fn.objective, device, static=static)
    if grad_clip is not None:
        step_fn.update = ClippedUpdate(step_fn.update, grad_clip)
    if cfg.channels_last and has_conv2d(model):
        step_fn = ChannelsLastInputs(step_fn)
    # Inside the graph and the multi-step loop: the pinned kernels are the ones captured.
    step_fn = apply_sdpa_backend(step_fn, cfg.sdpa_backend, device)
    graphed = cfg.cuda_graph and device.type == "cuda"
    if graphed and precision.scaler is not None \
            and not getattr(optimizer, "_step_supports_amp_scaling", False):
        raise ConfigError(
            f"{flag('accel.cuda_graph')} with precision {precision.mode}: "
            f"{type(optimizer).__name__} in this implementation decides on the host whether to "
            f"skip an overflowing step, which a graph cannot; use {flag('accel.optimizer_impl')} "
            "fused (or optimizer lars/lamb)")
    extensions = list(precision.extensions)
    # Several steps per call: outside the per-batch input conversion, inside the graph, so
    # that one replay runs all of them.
    step_fn = apply_multistep(step_fn, cfg.steps_per_call)
    # The graph last: it must hold the whole step, input conversion and loss scaling included.
    if cfg.cuda_graph:
        step_fn = apply_cuda_graph(step_fn, device, optimizer, notes,
                                   steps_per_call=cfg.steps_per_call, stream=graph_stream,
                                   warmup_steps=DDP_WARMUP_STEPS if distribute is not None
                                   else WARMUP_STEPS)
    if graphed and cfg.steps_per_call > 1:
        extensions.append(ShortChunkCheck(cfg.steps_per_call))
    return Accelerated(model, optimizer, step_fn, notes, extensions, cfg.steps_per_call)


def _distributed(model, distribute: Distribute, device: torch.device, graph_stream):
    """``distribute(model)``, built on the stream its gradient accumulators must run on.

    Autograd runs each parameter's accumulator, and the data-parallel hooks on it (DDP's copy
    into its bucket, the bucket's all-reduce), on the stream the accumulator was made on. With
    ``wgrad_stream`` a convolution's weight gradient is made on the second stream, and the
    hooks must run there, after it: built on the default stream they read the gradient before
    it was written (the previous step's, under a CUDA graph). Otherwise ``graph_stream`` (the
    step's capture stream) when the step is captured."""
    stream = wgrad_side_stream(model, device) or graph_stream
    if stream is None:
        return distribute(model)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        model = distribute(model)
    torch.cuda.current_stream(device).wait_stream(stream)
    return model
