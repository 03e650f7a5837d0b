"""The levers a bound can be pulled with: for each rule of ``kasoku.advisor.verdict``,
the candidates that apply to this run (a lever already on, or one this device or model cannot
use, is left out), best first by what is known of them beforehand.

A lever is a change of the run's fields (``{"accel.compile": True}``); its text names the flags
of that change and the A/B runner (``kasoku.commands.ab``) runs it with their arguments, both
from ``kasoku.core.flags``, the one map of them.

A lever's ``expect`` and ``speedup`` before it is measured are estimates, and say so; ``kasoku
profile`` measures the candidates (``kasoku.advisor.advice``) and advises the best one
measured.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from kasoku.accel.config import AccelConfig
from kasoku.core.flags import args_text, change_args, change_of, flag, setting_flag
from kasoku.perf.profile.figures import StepFigures

Change = tuple[tuple[str, object], ...]
"""A change of a run's fields as pairs (``(("accel.compile", True),)``): immutable."""


SAYS_NOTHING = ("unknown", "estimate: unknown", "(unknown)", "(estimate: unknown)")
"""Expectations that are none (a profile saved before every lever said what to expect holds
"unknown"): kept as saved, said as nothing (``Verdict.line`` has no parenthesis then)."""


class Changes:
    """What a lever and an experiment share: the run's fields they set, held as ``Change``
    pairs, and the command-line arguments that set them (the A/B runs'; () when none can)."""
    change: Change

    def __post_init__(self):
        object.__setattr__(self, "change", tuple(dict(self.change).items()))

    @property
    def args(self) -> tuple[str, ...]:
        return change_args(dict(self.change))


@dataclass(frozen=True)
class Lever(Changes):
    text: str
    """What to do, as the flags to add (``--cuda-graph``) or a sentence."""
    expect: str
    """The expected effect: an estimate (``estimate ~2x``) until measured, then the measure."""
    change: Mapping[str, object] | Change = ()
    """The run's fields it sets, ``"section.field"`` -> value (``{"accel.compile": True}``,
    ``kasoku.core.flags``; ``with.`` keys: a script's levers); held as ``Change`` pairs;
    () when no setting applies it."""
    speedup: float | None = None
    """The expected (estimated) or measured throughput ratio."""
    caveat: str = ""
    """What else it changes (a larger batch changes the training, not only its speed)."""
    measured: dict | None = None
    """Its A/B runs (``advice.Outcome.to_dict``) once measured; None: an estimate."""

    def to_dict(self) -> dict:
        """The lever as ``profile.json`` holds it (``from_dict`` reads it back): ``args`` as
        before levers were changes (the report and saved profiles read them), and the
        change."""
        return {"text": self.text, "expect": self.expect, "args": list(self.args),
                "speedup": self.speedup, "caveat": self.caveat, "measured": self.measured,
                "change": dict(self.change)}

    @classmethod
    def from_dict(cls, d: dict) -> "Lever":
        """``to_dict`` read back; a ``profile.json`` with only ``args`` (written before
        levers were changes) gives the change they make."""
        return cls(d["text"], d["expect"], read_change(d), d.get("speedup"),
                   d.get("caveat") or "", d.get("measured"))

    def measured_as(self, outcome: dict) -> "Lever":
        return replace(self, measured=outcome, speedup=outcome.get("ratio"),
                       expect=outcome.get("text", self.expect))


def read_change(d: dict) -> dict:
    """The change of a saved lever or experiment: its ``change``, else its ``args``'."""
    return d["change"] if "change" in d else change_of(d.get("args") or ())


def estimate(ratio: float | None, words: str = "") -> str:
    """``estimate ~1.3x`` (or the words): the label of a figure not measured; with neither,
    that it has none."""
    if ratio is None:
        return f"estimate: {words}" if words else "estimate: none before it is measured"
    return f"estimate ~{ratio:.1f}x" + (f", {words}" if words else "")


def given(value, default):
    """``value``, or ``default`` where the figure was not measured (None)."""
    return default if value is None else value


def synthetic(f: StepFigures) -> dict:
    """The change that feeds the step synthetic batches from the device (no loading, no copy):
    a set small enough to be held whole, of whole batches (at least two and 512 samples: an
    epoch's last, partial batch would run outside a CUDA graph, measured 2x slower on a
    0.26 ms MNIST step)."""
    batch = int(f.batch_size or 1)
    size = batch * max(2, -(-512 // batch))
    return {"data.synthetic": True, "data.synthetic_train_size": size, "train.loader": "device"}


def batch_x2(f: StepFigures) -> dict:
    return {"train.batch_size": 2 * int(f.batch_size or 1)}


def _said(words: str, change: dict) -> str:
    """``words: FLAGS``: a lever's text naming the flags of its change."""
    return f"{words}: {args_text(change)}"


def idle_speedup(idle_pct: float, cap: float = 4.0) -> float:
    """The most a step can gain by removing ``idle_pct`` of it."""
    return min(cap, 100.0 / max(1.0, 100.0 - idle_pct))


BATCH_CAVEAT = "changes the training: twice the samples per step (scale the learning rate)"


def _bigger_batch(f: StepFigures, why: str) -> Lever:
    return Lever(_said(f"more work per {why}", batch_x2(f)),
                 estimate(None, "more samples per second at the same overhead per step"),
                 batch_x2(f), None, BATCH_CAVEAT)


def _compile(accel: AccelConfig, gain: float, why: str) -> list[Lever]:
    if accel.compile:
        return []
    change = {"accel.compile": True}
    return [Lever(_said(why, change), estimate(gain), change, gain)]


def _bf16(f: StepFigures, accel: AccelConfig, gain: float, why: str) -> list[Lever]:
    if accel.precision not in ("fp32", "tf32"):
        return []
    if f.device == "cpu" and not f.cpu_bf16:
        return []  # no bf16 units: autocast would convert to bf16 and compute in fp32
    change = {"accel.precision": "bf16"}
    return [Lever(_said(why, change), estimate(gain), change, gain)]


def _channels_last(f: StepFigures, accel: AccelConfig, gain: float) -> list[Lever]:
    if not f.has_conv or accel.channels_last:
        return []
    change = {"accel.channels_last": True}
    return [Lever(_said("NHWC convolutions", change), estimate(gain), change, gain)]


def input_candidates(f: StepFigures, accel: AccelConfig | None = None) -> list[Lever]:
    gain = idle_speedup(given(f.data_pct, 0.0))
    loader = (f.loader or "serial").split(":")[0]
    kind = f.data_kind
    kinds = []
    if f.device == "cuda" and kind == "in-memory" and loader != "device":
        kinds.append(("the dataset resident on the GPU", "device"))
    if f.device == "cuda" and kind == "image-folder" and loader != "gpu-jpeg":
        kinds.append(("decode the JPEGs on the GPU", "gpu-jpeg"))
    if loader in ("serial", "threads"):
        kinds.append(("load in worker processes", "multiprocess"))
    return [Lever(_said(words, {"train.loader": kind}), estimate(gain, "up to"),
                  {"train.loader": kind}, gain) for words, kind in kinds]


def input_fallback(f: StepFigures) -> Lever:
    return Lever(f"more loader workers ({flag('train.loader')} KIND:N), smaller images, or "
                 f"faster storage",
                 estimate(idle_speedup(given(f.data_pct, 0.0)), "up to"))


def communication_candidates(f: StepFigures, accel: AccelConfig | None = None) -> list[Lever]:
    out = [_bigger_batch(f, "exchange (the same all-reduce over twice the samples)")]
    # DDP's bf16 compression hook: NCCL's; gloo's all-reduce refused it on a CPU.
    if f.device == "cuda" and (f.allreduce_dtype or "fp32") == "fp32":
        change = {"dist.allreduce_dtype": "bf16"}
        out.append(Lever(_said("all-reduce the gradients in bf16", change),
                         estimate(None, "half the bytes on the wire"), change, None,
                         "the averaged gradients are rounded to bf16"))
    return out


def _graphable(f: StepFigures, accel: AccelConfig) -> bool:
    """Whether the step could be captured as a CUDA graph: on CUDA, not captured yet, not
    sharded (FSDP2's all-gathers allocate and free memory each step: ``--shard`` refuses
    ``--cuda-graph``)."""
    return f.device == "cuda" and not accel.cuda_graph and not f.sharded


def _cuda_graph(gain: float | None) -> Lever:
    change = {"accel.cuda_graph": True}
    return Lever(_said("capture the step as a CUDA graph", change), estimate(gain), change, gain)


def host_candidates(f: StepFigures, accel: AccelConfig) -> list[Lever]:
    gain = idle_speedup(given(f.idle_host_pct, 0.0) + given(f.idle_other_pct, 0.0))
    if f.sharded:  # FSDP2's host work is per unit and step: more samples per step
        return [_bigger_batch(f, "launch")] + _compile(accel, min(gain, 1.3), "fewer kernels "
                                                       "to launch per block")
    out = []
    if _graphable(f, accel):
        out.append(_cuda_graph(gain))
    out += _compile(accel, min(gain, 1.3), "fewer, fused kernels to launch")
    return out + [_bigger_batch(f, "launch")]


def latency_candidates(f: StepFigures, accel: AccelConfig) -> list[Lever]:
    out = [_bigger_batch(f, "kernel")]
    if _graphable(f, accel):
        out.append(_cuda_graph(None))
    return out + _compile(accel, 1.2, "fused kernels")


def gpu_compute_candidates(f: StepFigures, accel: AccelConfig) -> list[Lever]:
    return (_bf16(f, accel, 2.0, "tensor cores in bf16") + _channels_last(f, accel, 1.3))


def gpu_memory_candidates(f: StepFigures, accel: AccelConfig) -> list[Lever]:
    out = _compile(accel, 1.3, "fuse the element-wise kernels")
    if f.has_conv and accel.channels_last and not accel.fused_bn:
        change = {"accel.fused_bn": True}
        out.append(Lever(_said("batch norm + ReLU as kasoku's fused kernels", change),
                         estimate(1.1), change, 1.1))
    return (out + _bf16(f, accel, 1.5, "half the bytes per activation")
            + _channels_last(f, accel, 1.2))


def gpu_memory_fallback(f: StepFigures) -> Lever:
    kinds = {k: v for k, v in (f.by_kind_ms or {}).items() if k != "conv/matmul"}
    top = max(kinds, key=kinds.get) if kinds else "other"
    return nothing_left(f"the time is in memory-bound kernels ({top}: "
                        f"{kinds.get(top, 0.0):.1f} ms/step)")


def cpu_dispatch_candidates(f: StepFigures, accel: AccelConfig) -> list[Lever]:
    return _compile(accel, 1.3, "fewer operators to dispatch") + [_bigger_batch(f, "operator")]


def cpu_latency_candidates(f: StepFigures, accel: AccelConfig) -> list[Lever]:
    out = _compile(accel, 1.3, "fused operators")
    if (f.threads or 1) > 1:
        change = {"train.threads": 1}
        out.append(Lever(_said("one thread (small operators spend their time synchronizing "
                              "threads)", change),
                         estimate(None, "the threads' synchronization saved"), change, None))
    return out + [_bigger_batch(f, "operator")]


def cpu_compute_candidates(f: StepFigures, accel: AccelConfig) -> list[Lever]:
    isa = f.cpu_bf16_isa or "bf16"
    return (_bf16(f, accel, 1.5, f"the {isa} units of this CPU")
            + _channels_last(f, accel, 1.3)
            + _compile(accel, 1.1, "fused operators around the matrix products"))


def cpu_memory_candidates(f: StepFigures, accel: AccelConfig) -> list[Lever]:
    out = (_compile(accel, 1.3, "fuse the element-wise operators")
           + _channels_last(f, accel, 1.3))
    if not accel.keep_memory:
        change = {"accel.keep_memory": True}
        out.append(Lever(_said("keep freed memory instead of returning it to the OS", change),
                         estimate(None, "the page faults of fresh allocations saved"), change,
                         None))
    return out


def kfac_lever(f: StepFigures, accel: AccelConfig | None = None) -> Lever:
    """Half as many of K-FAC's costliest steps: the inverse steps or the factor steps (each
    step's share of that phase halves), else, for the preconditioning (every step), the
    inverse method's two products per layer. Fewer curvature updates may slow the loss's
    fall: compare the runs' accuracy over time, not only their speed."""
    k = f.kfac
    top = max(k["phases_pct"], key=k["phases_pct"].get)
    gain = 100.0 / max(1.0, 100.0 - k["phases_pct"][top] / 2)
    inverse = {"kfac.method": "inverse"}
    method = (f" (or {args_text(inverse)}: Cholesky inverses)" if k["method"] == "eigen"
              else "")
    caveat = "fewer curvature updates: compare the accuracy over time too"
    if top in ("kfac_inverse", "kfac_factors"):
        what, key = (("inverses", "inv_update_freq") if top == "kfac_inverse"
                     else ("factors", "factor_update_freq"))
        change = {f"kfac.{key}": 2 * k[key]}
        return Lever(_said(f"update K-FAC's {what} half as often", change)
                     + (method if top == "kfac_inverse" else ""),
                     estimate(gain), change, gain, caveat)
    if k["method"] == "eigen":
        return Lever(_said("precondition with the factors' inverses", inverse),
                     estimate(None, "faster preconditioning"), inverse,
                     None, "damping that grows with the factors")
    return nothing_left("K-FAC's preconditioning runs every step")


def kfac_candidates(f: StepFigures, accel: AccelConfig) -> list[Lever]:
    lever = kfac_lever(f)
    return [lever] if lever.change else []


RECOMPUTE_CAVEAT = ("recomputes activations in the backward pass: slower at this batch; the "
                    "memory it frees takes a larger batch or model")


def memory_full_candidates(f: StepFigures, accel: AccelConfig) -> list[Lever]:
    """Activation checkpointing, for a model whose ``blocks`` it can wrap: selective first
    (recomputes only element-wise operators), then full."""
    done = accel.activation_checkpointing
    if not f.has_blocks or done == "full":
        return []
    modes = ("selective", "full") if done == "none" else ("full",)
    changes = [{"accel.activation_checkpointing": mode} for mode in modes]
    return [Lever(_said("keep fewer activations", change),
                  estimate(None, "less activation memory for more compute"),
                  change, None, RECOMPUTE_CAVEAT) for change in changes]


def memory_full_fallback(f: StepFigures) -> Lever:
    return Lever(f"shard the weights, gradients and optimizer state over several GPUs (FSDP2: "
                 f"{flag('dist.gpus')} N {flag('dist.shard')}), or a smaller batch",
                 estimate(None, "less memory per GPU"))


_FUSED_ATTENTION = {"accel.sdpa_backend": "auto"}


def attention_candidates(f: StepFigures, accel: AccelConfig) -> list[Lever]:
    if accel.sdpa_backend != "math":
        return []
    return [Lever(_said("a fused attention kernel", _FUSED_ATTENTION),
                  estimate(None, "the softmax's share at most"), _FUSED_ATTENTION, None)]


def attention_fallback(f: StepFigures) -> Lever:
    return Lever(f"attention through scaled_dot_product_attention (gpt: "
                 f"{setting_flag('attention')} sdpa), its flash or memory-efficient kernel "
                 f"({args_text(_FUSED_ATTENTION)})",
                 estimate(None, "no [T, T] scores in memory"))


def balanced_lever(f: StepFigures) -> Lever:
    """Where no rule holds: the largest kind of the device's kernel time (a CPU's: of its
    operators' time), to start from, and where the report shows more."""
    where = "kernel" if f.device == "cuda" else "operator"
    kinds = {k: v for k, v in (f.by_kind_ms or {}).items() if v}
    if not kinds:
        return Lever(f"no single bottleneck to remove: the report's phases and top {where}s "
                     f"show where the step goes", "no estimate: no one bound")
    top = max(kinds, key=kinds.get)
    return Lever(f"no single bottleneck to remove; start from the largest share, {top}: "
                 f"{100 * kinds[top] / sum(kinds.values()):.0f}% of the {where} time "
                 f"({kinds[top]:.2f} ms per step; the report's top {where}s name them)",
                 "no estimate: no one bound")


def nothing_left(why: str) -> Lever:
    return Lever(f"no cheap lever left: {why}", "none")

