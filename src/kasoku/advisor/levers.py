"""The levers a bound can be pulled with: for each rule of ``kasoku.advisor.verdict``,
the candidates that apply to this run (a lever already on, or one this device or model cannot
use, is left out), best first by what is known of them beforehand.

A lever's ``expect`` and ``speedup`` before it is measured are estimates, and say so; ``kasoku
profile`` measures the candidates (``kasoku.advisor.advice``) and advises the best one
measured.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from kasoku.accel.config import AccelConfig
from kasoku.perf.profile.figures import StepFigures


@dataclass(frozen=True)
class Lever:
    text: str
    """What to do, as the flags to add (``--cuda-graph``) or a sentence."""
    expect: str
    """The expected effect: an estimate (``estimate ~2x``) until measured, then the measure."""
    args: tuple[str, ...] = ()
    """Command-line arguments that apply it (for the A/B runs); () when none can."""
    speedup: float | None = None
    """The expected (estimated) or measured throughput ratio."""
    caveat: str = ""
    """What else it changes (a larger batch changes the training, not only its speed)."""
    measured: dict | None = None
    """Its A/B runs (``advice.Outcome.to_dict``) once measured; None: an estimate."""

    def to_dict(self) -> dict:
        """The lever as ``profile.json`` holds it (``from_dict`` reads it back)."""
        return {"text": self.text, "expect": self.expect, "args": list(self.args),
                "speedup": self.speedup, "caveat": self.caveat, "measured": self.measured}

    @classmethod
    def from_dict(cls, d: dict) -> "Lever":
        return cls(d["text"], d["expect"], tuple(d.get("args") or ()), d.get("speedup"),
                   d.get("caveat") or "", d.get("measured"))

    def measured_as(self, outcome: dict) -> "Lever":
        return replace(self, measured=outcome, speedup=outcome.get("ratio"),
                       expect=outcome.get("text", self.expect))


def estimate(ratio: float | None, words: str = "") -> str:
    """``estimate ~1.3x`` (or the words): the label of a figure not measured."""
    if ratio is None:
        return f"estimate: {words}" if words else "estimate: unknown"
    return f"estimate ~{ratio:.1f}x" + (f", {words}" if words else "")


def given(value, default):
    """``value``, or ``default`` where the figure was not measured (None)."""
    return default if value is None else value


def synthetic(f: StepFigures) -> tuple[str, ...]:
    """Arguments that feed the step synthetic batches from the device (no loading, no copy):
    a set small enough to be held whole, of whole batches (at least two and 512 samples: an
    epoch's last, partial batch would run outside a CUDA graph, measured 2x slower on a
    0.26 ms MNIST step)."""
    batch = int(f.batch_size or 1)
    size = batch * max(2, -(-512 // batch))
    return ("--synthetic", "--synthetic-size", str(size), "--loader", "device")


def batch_x2(f: StepFigures) -> tuple[str, ...]:
    return ("--batch-size", str(2 * int(f.batch_size or 1)))


def idle_speedup(idle_pct: float, cap: float = 4.0) -> float:
    """The most a step can gain by removing ``idle_pct`` of it."""
    return min(cap, 100.0 / max(1.0, 100.0 - idle_pct))


BATCH_CAVEAT = "changes the training: twice the samples per step (scale the learning rate)"


def _bigger_batch(f: StepFigures, why: str) -> Lever:
    return Lever(f"more work per {why}: {' '.join(batch_x2(f))}",
                 estimate(None, "more samples per second at the same overhead per step"),
                 batch_x2(f), None, BATCH_CAVEAT)


def _compile(accel: AccelConfig, gain: float, why: str) -> list[Lever]:
    if accel.compile:
        return []
    return [Lever(f"{why}: --compile", estimate(gain), ("--compile",), gain)]


def _bf16(f: StepFigures, accel: AccelConfig, gain: float, why: str) -> list[Lever]:
    if accel.precision not in ("fp32", "tf32"):
        return []
    if f.device == "cpu" and not f.cpu_bf16:
        return []  # no bf16 units: autocast would convert to bf16 and compute in fp32
    return [Lever(f"{why}: --precision bf16", estimate(gain), ("--precision", "bf16"), gain)]


def _channels_last(f: StepFigures, accel: AccelConfig, gain: float) -> list[Lever]:
    if not f.has_conv or accel.channels_last:
        return []
    return [Lever("NHWC convolutions: --channels-last", estimate(gain), ("--channels-last",),
                  gain)]


def input_candidates(f: StepFigures, accel: AccelConfig | None = None) -> list[Lever]:
    gain = idle_speedup(given(f.data_pct, 0.0))
    loader = (f.loader or "serial").split(":")[0]
    kind = f.data_kind
    out = []
    if f.device == "cuda" and kind == "in-memory" and loader != "device":
        out.append(Lever("the dataset resident on the GPU: --loader device",
                         estimate(gain, "up to"), ("--loader", "device"), gain))
    if f.device == "cuda" and kind == "image-folder" and loader != "gpu-jpeg":
        out.append(Lever("decode the JPEGs on the GPU: --loader gpu-jpeg",
                         estimate(gain, "up to"), ("--loader", "gpu-jpeg"), gain))
    if loader in ("serial", "threads"):
        out.append(Lever("load in worker processes: --loader multiprocess",
                         estimate(gain, "up to"), ("--loader", "multiprocess"), gain))
    return out


def input_fallback(f: StepFigures) -> Lever:
    return Lever("more loader workers (--loader KIND:N), smaller images, or faster storage",
                 estimate(idle_speedup(given(f.data_pct, 0.0)), "up to"))


def communication_candidates(f: StepFigures, accel: AccelConfig | None = None) -> list[Lever]:
    out = [_bigger_batch(f, "exchange (the same all-reduce over twice the samples)")]
    # DDP's bf16 compression hook: NCCL's; gloo's all-reduce refused it on a CPU.
    if f.device == "cuda" and (f.allreduce_dtype or "fp32") == "fp32":
        out.append(Lever("all-reduce the gradients in bf16: --allreduce-dtype bf16",
                         estimate(None, "half the bytes on the wire"),
                         ("--allreduce-dtype", "bf16"), None,
                         "the averaged gradients are rounded to bf16"))
    return out


def _graphable(f: StepFigures, accel: AccelConfig) -> bool:
    """Whether the step could be captured as a CUDA graph: on CUDA, not captured yet, not
    sharded (FSDP2's all-gathers allocate and free memory each step: ``--shard`` refuses
    ``--cuda-graph``)."""
    return f.device == "cuda" and not accel.cuda_graph and not f.sharded


def host_candidates(f: StepFigures, accel: AccelConfig) -> list[Lever]:
    gain = idle_speedup(given(f.idle_host_pct, 0.0) + given(f.idle_other_pct, 0.0))
    if f.sharded:  # FSDP2's host work is per unit and step: more samples per step
        return [_bigger_batch(f, "launch")] + _compile(accel, min(gain, 1.3), "fewer kernels "
                                                       "to launch per block")
    out = []
    if _graphable(f, accel):
        out.append(Lever("capture the step as a CUDA graph: --cuda-graph", estimate(gain),
                         ("--cuda-graph",), gain))
    out += _compile(accel, min(gain, 1.3), "fewer, fused kernels to launch")
    return out + [_bigger_batch(f, "launch")]


def latency_candidates(f: StepFigures, accel: AccelConfig) -> list[Lever]:
    out = [_bigger_batch(f, "kernel")]
    if _graphable(f, accel):
        out.append(Lever("capture the step as a CUDA graph: --cuda-graph", estimate(None),
                         ("--cuda-graph",), None))
    return out + _compile(accel, 1.2, "fused kernels")


def gpu_compute_candidates(f: StepFigures, accel: AccelConfig) -> list[Lever]:
    return (_bf16(f, accel, 2.0, "tensor cores in bf16") + _channels_last(f, accel, 1.3))


def gpu_memory_candidates(f: StepFigures, accel: AccelConfig) -> list[Lever]:
    out = _compile(accel, 1.3, "fuse the element-wise kernels")
    if f.has_conv and accel.channels_last and not accel.fused_bn:
        out.append(Lever("batch norm + ReLU as kasoku's fused kernels: --fused-bn",
                         estimate(1.1), ("--fused-bn",), 1.1))
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
        out.append(Lever("one thread (small operators spend their time synchronizing "
                         "threads): --threads 1", estimate(None), ("--threads", "1"), None))
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
        out.append(Lever("keep freed memory instead of returning it to the OS: --keep-memory",
                         estimate(None), ("--keep-memory",), None))
    return out


def kfac_lever(f: StepFigures, accel: AccelConfig | None = None) -> Lever:
    """Half as many of K-FAC's costliest steps: the inverse steps or the factor steps (each
    step's share of that phase halves), else, for the preconditioning (every step), the
    inverse method's two products per layer. Fewer curvature updates may slow the loss's
    fall: compare the runs' accuracy over time, not only their speed."""
    k = f.kfac
    top = max(k["phases_pct"], key=k["phases_pct"].get)
    gain = 100.0 / max(1.0, 100.0 - k["phases_pct"][top] / 2)
    method = " (or --kfac-method inverse: Cholesky inverses)" if k["method"] == "eigen" else ""
    caveat = "fewer curvature updates: compare the accuracy over time too"
    if top in ("kfac_inverse", "kfac_factors"):
        what, key = (("inverses", "inv_update_freq") if top == "kfac_inverse"
                     else ("factors", "factor_update_freq"))
        flag = f"--kfac-{key.replace('_', '-')}"
        args = (flag, str(2 * k[key]))
        return Lever(f"update K-FAC's {what} half as often: {' '.join(args)}"
                     + (method if top == "kfac_inverse" else ""),
                     estimate(gain), args, gain, caveat)
    if k["method"] == "eigen":
        return Lever("precondition with the factors' inverses: --kfac-method inverse",
                     estimate(None, "faster preconditioning"), ("--kfac-method", "inverse"),
                     None, "damping that grows with the factors")
    return nothing_left("K-FAC's preconditioning runs every step")


def kfac_candidates(f: StepFigures, accel: AccelConfig) -> list[Lever]:
    lever = kfac_lever(f)
    return [lever] if lever.args else []


RECOMPUTE_CAVEAT = ("recomputes activations in the backward pass: slower at this batch; the "
                    "memory it frees takes a larger batch or model")


def memory_full_candidates(f: StepFigures, accel: AccelConfig) -> list[Lever]:
    """Activation checkpointing, for a model whose ``blocks`` it can wrap: selective first
    (recomputes only element-wise operators), then full."""
    done = accel.activation_checkpointing
    if not f.has_blocks or done == "full":
        return []
    modes = ("selective", "full") if done == "none" else ("full",)
    return [Lever(f"keep fewer activations: --activation-checkpointing {mode}",
                  estimate(None, "less activation memory for more compute"),
                  ("--activation-checkpointing", mode), None, RECOMPUTE_CAVEAT)
            for mode in modes]


def memory_full_fallback(f: StepFigures) -> Lever:
    return Lever("shard the weights, gradients and optimizer state over several GPUs (FSDP2: "
                 "--gpus N --shard), or a smaller batch", estimate(None, "less memory per GPU"))


def attention_candidates(f: StepFigures, accel: AccelConfig) -> list[Lever]:
    if accel.sdpa_backend != "math":
        return []
    return [Lever("a fused attention kernel: --sdpa-backend auto", estimate(None),
                  ("--sdpa-backend", "auto"), None)]


def attention_fallback(f: StepFigures) -> Lever:
    return Lever("attention through scaled_dot_product_attention (gpt: --attention sdpa), "
                 "its flash or memory-efficient kernel (--sdpa-backend auto)",
                 estimate(None, "no [T, T] scores in memory"))


def nothing_left(why: str) -> Lever:
    return Lever(f"no cheap lever left: {why}", "none")
