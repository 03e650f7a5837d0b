"""A verdict's words for a user's own script (``kasoku profile -- python train.py``): the
levers that need the script edited, the rules' fallbacks and the ``--confirm`` experiments said
as the script's own edits, at its lines where the profile saw them. A script takes none of the
flags of kasoku's own workloads (``WORKLOAD_FLAGS``: ``--loader``, ``--batch-size``,
``--compile``...): what kasoku sets from outside a script is a ``--with`` lever
(``kasoku.commands.script_levers``), anything else is an edit, said here.

A batch kasoku did not see come from a DataLoader has no size kasoku knows (a script that
slices its own tensors, a policy's one episode per step): its larger batch is "more work per
step" where the script makes its batches, never a number of samples.
"""
from __future__ import annotations

import re

from kasoku.advisor.levers import Lever, estimate, given, idle_speedup, nothing_left
from kasoku.advisor.limits import attention_backend, class_levers, roofline_fallback
from kasoku.advisor.verdict import Experiment, Verdict
from kasoku.core.flags import FLAGS, OPTIONS, args_text
from kasoku.perf.profile.figures import StepFigures

WORKLOAD_FLAGS = frozenset(FLAGS.values()) | frozenset(
    name for key, name in OPTIONS.items() if key.startswith("workload."))
"""The flags of kasoku's own workloads (a run's fields, a workload's settings): never said to
a script."""

_FLAG = re.compile(r"(?<![\w-])-{2}[a-z][a-z0-9-]*")  # a flag: two dashes, then its name


def workload_flags(text: str) -> list[str]:
    """The flags of ``WORKLOAD_FLAGS`` that ``text`` names, in order (``--with`` is a
    script's own and is not one of them)."""
    return [name for name in _FLAG.findall(text) if name in WORKLOAD_FLAGS]


def at(site: str | None) -> str:
    """`` at train.py:12``, or "" where the line is unknown."""
    return f" at {site}" if site else ""


EDITS = {
    ("train.loader", "device"): "keep the dataset on the GPU and index its batches there "
                                "instead of a DataLoader",
    ("train.loader", "gpu-jpeg"): "decode the JPEGs on the GPU: torchvision.io.decode_jpeg("
                                  "..., device='cuda')",
    ("accel.compile", True): "torch.compile the model",
    ("accel.compile_mode", "max-autotune"): "torch.compile(model, mode='max-autotune')",
    ("accel.compile_mode", "max-autotune-no-cudagraphs"):
        "torch.compile(model, mode='max-autotune-no-cudagraphs')",
    ("accel.channels_last", True): "the model and its inputs in torch.channels_last",
    ("accel.cuda_graph", True): "capture the step as a CUDA graph (torch.cuda.graph, or "
                                "torch.compile with mode='reduce-overhead')",
    ("accel.keep_memory", True): "keep freed memory: a memory allocator such as jemalloc or "
                                 "tcmalloc (LD_PRELOAD)",
    ("accel.optimizer_impl", "fused"): "a fused optimizer: fused=True where the script makes "
                                       "it (torch.optim.Adam, AdamW, SGD)",
    ("accel.sdpa_backend", "auto"): "a fused attention kernel: torch.nn.functional."
                                    "scaled_dot_product_attention for the attention",
    ("accel.sdpa_backend", "flash"): "the flash attention kernel: torch.nn.attention."
                                     "sdpa_kernel(SDPBackend.FLASH_ATTENTION) around the forward",
    ("accel.sdpa_backend", "cudnn"): "cuDNN's attention kernel: torch.nn.attention.sdpa_kernel("
                                     "SDPBackend.CUDNN_ATTENTION) around the forward",
    ("accel.activation_checkpointing", "full"):
        "keep fewer activations: torch.utils.checkpoint.checkpoint around each block of the "
        "model",
    ("accel.activation_checkpointing", "selective"):
        "keep fewer activations, recomputing only the element-wise operators: torch.utils."
        "checkpoint with create_selective_checkpoint_contexts around each block of the model",
    ("dist.allreduce_dtype", "bf16"): "all-reduce the gradients in bf16: ddp_model."
                                      "register_comm_hook(None, default_hooks."
                                      "bf16_compress_hook)",
    ("kfac.method", "inverse"): "precondition with the factors' inverses (Cholesky) instead of "
                                "their eigendecompositions, in the script's K-FAC",
}
"""The change of a lever that needs the script edited (its one field and value), as the
edit. A change not here (kasoku's own kernels: ``--fused-bn``) is no lever for a script."""


def edit_words(change: dict, loader_site: str | None = None) -> str | None:
    """The edit that makes ``change`` (a lever's one field and its value) in a script, at the
    DataLoader's line for a change of the loader; None where no script can make it."""
    if len(change) != 1:
        return None
    ((key, value),) = change.items()
    if key in ("kfac.factor_update_freq", "kfac.inv_update_freq"):
        what = "factors" if key == "kfac.factor_update_freq" else "inverses"
        return f"update K-FAC's {what} half as often (every {value} steps) in the script's K-FAC"
    words = EDITS.get((key, value))
    return words + at(loader_site) if words and key == "train.loader" else words


UNKNOWN_BATCH_CAVEAT = "changes the training: more samples per step (scale the learning rate)"


def batch_words(batch_size: int | None, loader_site: str | None = None,
                forward_site: str | None = None) -> str:
    """The larger batch as the script's edit: the DataLoader's ``batch_size`` doubled, at its
    line, where the steps take their batches from one of ``batch_size`` samples; else (None)
    more work per step where the script makes its batches, at its forward's line."""
    if batch_size:
        return (f"a batch twice as large: DataLoader(..., batch_size={2 * batch_size})"
                f"{at(loader_site)}; scale the learning rate")
    where = f" (its forward: {forward_site})" if forward_site else ""
    return (f"more work per step: a larger batch where the script makes its batches{where}; "
            f"scale the learning rate")


_SDPA = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION"}


def script_class_levers(f: StepFigures, cls: str) -> str:
    """``limits.class_levers`` for a script: what acts on ``cls``'s time above its limit, as
    the script's edits (the script's settings: ``config``, its precision alone)."""
    config = f.rest.get("config") or {}
    if cls == "matmul/conv":
        parts = (["products in bf16 (torch.autocast with dtype=torch.bfloat16)"]
                 if config.get("precision", "fp32") in ("fp32", "tf32") else [])
        if f.has_conv is False:
            parts.append("float8 products on wide layers (torchao's float8 training)")
        return ", ".join(parts + ["shapes in multiples of 64"])
    if cls == "attention":
        others = [_SDPA[b] for b in _SDPA if b != attention_backend(f)]
        return (f"another fused attention kernel (torch.nn.attention.sdpa_kernel with SDPBackend."
                f"{' or '.join(others)}), FlexAttention")
    if cls == "norm/element-wise":
        return ("fused element-wise kernels (torch.compile), fewer fp32 tensors between "
                "kernels, each kernel nearer the copy bandwidth (its blocks, its passes over the "
                "data)")
    return class_levers(f, cls)  # the other classes' words name no flag


def script_fallback(verdict: Verdict, f: StepFigures, loader_site: str | None = None,
                    workers_not_faster: bool = False) -> Lever | None:
    """The rule's word where no lever applies to the script or none was measured faster
    (``verdict.fallback``), in the script's terms; None where the verdict has none (balanced).
    ``workers_not_faster``: more DataLoader workers were measured, and were not faster."""
    rule = verdict.rule.rsplit("(", 1)[-1].rstrip(")")
    if rule == "input-bound":
        if workers_not_faster:  # the loading is too small to hand off: fewer calls per batch
            where = ("fewer Python calls per batch: a larger batch, or each batch taken from "
                     "the tensors by one index (the DataLoader's sampler a BatchSampler, "
                     f"batch_size=None){at(loader_site)}")
        else:
            where = (f"more DataLoader worker processes (num_workers){at(loader_site)}"
                     if loader_site else "batches loaded ahead of the step (a DataLoader with "
                                         "worker processes)")
        return Lever(f"{where}, smaller inputs, or faster storage",
                     estimate(idle_speedup(given(f.data_pct, 0.0)), "up to"))
    if rule == "memory-full":
        return Lever("shard the weights, gradients and optimizer state over several GPUs "
                     "(FSDP2: torch.distributed.fsdp.fully_shard, under torchrun), or a smaller "
                     "batch", estimate(None, "less memory per GPU"))
    if rule == "attention-unfused":
        return Lever("attention through torch.nn.functional.scaled_dot_product_attention (its "
                     "flash or memory-efficient kernel)",
                     estimate(None, "no [T, T] scores in memory"))
    fallback = verdict.fallback
    if fallback is None:
        return None
    if fallback.change:  # a lever of the rule's own (K-FAC's): its edit
        words = edit_words(dict(fallback.change))
        return (Lever(words + " (needs an edit: not measured)", fallback.expect, (),
                      fallback.speedup, fallback.caveat) if words
                else nothing_left("no lever kasoku knows for this script"))
    if verdict.rule.startswith("device-bound"):
        return roofline_fallback(f, fallback, script_class_levers)
    return fallback


def experiment_words(e: Experiment) -> str:
    """An experiment's label without the flags that make it on kasoku's workloads ("the base
    optimizer alone (--optimizer sgd)": "the base optimizer alone")."""
    run = {k: v for k, v in e.change if not k.startswith("with.")}
    return e.label.replace(f" ({args_text(run)})", "") if run else e.label
