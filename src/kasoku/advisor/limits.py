"""Advice from each kernel class's distance to its measured limit
(``kasoku.perf.profile.roofline``), for the device-bound rules of ``kasoku.advisor.verdict``:
what they say of the time above the limits (``roofline_reason``), the levers kasoku can set
that act on the class with most to gain, measured first (``roofline_candidates``,
``first_the_roofline``), and the fallback once none is left: the class and what acts on it,
or "no cheap lever left" only where the classes' gaps add up to under
``NO_CHEAP_LEVER_PCT`` of the step (``roofline_fallback``).
"""
from __future__ import annotations

from kasoku.accel.config import AccelConfig
from kasoku.advisor.levers import Lever, _said, estimate, nothing_left
from kasoku.core.flags import flag
from kasoku.perf.profile.figures import StepFigures
from kasoku.perf.profile.roofline import NO_CHEAP_LEVER_PCT, UNJUDGED, gap_pct, largest_gap


def attention_backend(f: StepFigures) -> str | None:
    """The fused attention kernel the step ran (``cudnn``, ``flash``, ``efficient``), from its
    top kernels' names; None where none is among them."""
    names = [k["name"].lower() for k in f.rest.get("top_kernels") or []]
    for backend, parts in (("cudnn", ("cudnn_generated", "native_sdpa")), ("flash", ("flash",)),
                           ("efficient", ("fmha", "efficient_attention"))):
        if any(p in n for n in names for p in parts):
            return backend
    return None


def class_levers(f: StepFigures, cls: str) -> str:
    """What acts on ``cls``'s time above its limit, less what the run has set already (its
    levers as ``profile.json`` saved them: ``config``)."""
    config = f.rest.get("config") or {}
    if cls == "matmul/conv":
        parts = ([f"products in bf16 ({flag('accel.precision')} bf16)"]
                 if config.get("precision", "fp32") in ("fp32", "tf32") else [])
        if config.get("float8", "none") == "none" and f.has_conv is False:
            parts.append(f"float8 products on wide layers ({flag('accel.float8')})")
        if config.get("compile") and config.get("compile_mode", "default") == "default":
            parts.append(f"max-autotune's product templates ({flag('accel.compile_mode')} "
                         f"max-autotune)")
        return ", ".join(parts + ["shapes in multiples of 64"])
    if cls == "attention":
        others = [b for b in ("cudnn", "flash") if b != attention_backend(f)]
        return (f"another fused attention kernel ({flag('accel.sdpa_backend')} "
                f"{' or '.join(others)}), FlexAttention")
    if cls == "norm/element-wise":
        fuse = ([f"fused element-wise kernels ({flag('accel.compile')})"]
                if not config.get("compile") else [])
        return ", ".join(fuse + ["fewer fp32 tensors between kernels", "each kernel nearer "
                                 "the copy bandwidth (its blocks, its passes over the data)"])
    return {
        "loss/softmax": ("a fused or chunked linear + cross-entropy that never writes the fp32 "
                         "logits"),
        "optimizer": "a fused optimizer; bf16 parameters with fp32 master weights",
        "copies": "fewer dtype casts and copies; pinned memory for copies from the host",
    }.get(cls, "see the top kernels")


def roofline_fallback(f: StepFigures, otherwise: Lever, levers=class_levers) -> Lever:
    """Where a device-bound step's levers are spent: the kernel class with most time above
    its limit and what acts on it (``levers(f, cls)``: kasoku's flags, or a script's edits),
    or "no cheap lever left" where the classes' gaps add up to under ``NO_CHEAP_LEVER_PCT``
    of the step; ``otherwise`` without a roofline, or where most of the kernels' time has no
    known work (a CUDA graph's kernels)."""
    table = f.roofline
    if not table or not f.step_ms:
        return otherwise
    pct, top = gap_pct(table, f.step_ms), largest_gap(table)
    known_ms = sum(r["ms"] * r.get("known_pct", 100.0) / 100 for r in table["classes"]
                   if r.get("gap_ms") is not None)
    if unjudged_ms(table) > known_ms:
        return otherwise  # most kernels' work unknown (a CUDA graph's): no distance to say
    if top is None or pct < NO_CHEAP_LEVER_PCT:
        return nothing_left(f"every kernel class is near its measured limit: their gaps add up "
                            f"to {table['gap_ms']:.2f} ms, {pct:.0f}% of the step")
    gain = f.step_ms / (f.step_ms - top["gap_ms"])
    return Lever(f"the time above the limits is most in {top['class']}: "
                 f"{top['gap_ms']:.2f} ms of its {top['ms']:.2f} ms per step; "
                 f"{levers(f, top['class'])}",
                 estimate(gain, f"{top['class']} at its roof"), (), gain)


def roofline_candidates(f: StepFigures, accel: AccelConfig) -> list[Lever]:
    """The levers kasoku can set (on its own workloads) that act on the kernel class with
    most time above its limit, each to be measured; none under ``NO_CHEAP_LEVER_PCT``."""
    top = largest_gap(f.roofline) if f.roofline and f.step_ms else None
    if (top is None or f.has_blocks is None
            or gap_pct(f.roofline, f.step_ms) < NO_CHEAP_LEVER_PCT):
        return []
    cls, why = top["class"], f"{top['class']} {top['gap_ms']:.1f} ms above its limit"
    changes: list[dict] = []
    if cls == "attention" and f.has_blocks:
        running = attention_backend(f)
        changes = [{"accel.sdpa_backend": b} for b in ("cudnn", "flash")
                   if b != accel.sdpa_backend and b != running]
    elif cls == "matmul/conv" and accel.compile and accel.compile_mode == "default":
        mode = "max-autotune-no-cudagraphs" if accel.cuda_graph else "max-autotune"
        changes = [{"accel.compile_mode": mode}]
    elif cls == "norm/element-wise" and not accel.compile:
        changes = [{"accel.compile": True}]
    elif cls == "optimizer" and accel.optimizer_impl != "fused":
        changes = [{"accel.optimizer_impl": "fused"}]
    return [Lever(_said(why, c), estimate(None, f"{cls} nearer its roof"), c) for c in changes]


def unjudged_ms(table: dict) -> float:
    """The kernels' time per step whose work is unknown (a CUDA graph's), less the
    collectives' and the input pipeline's (neither is the model's work, nor judged against a
    roof at all)."""
    return max(0.0, table.get("unknown_ms", 0.0) - classes_ms(table, UNJUDGED))


def classes_ms(table: dict, classes: tuple[str, ...]) -> float:
    """The kernels' time per step in ``classes`` (a roofline table's rows)."""
    return sum(r["ms"] for r in table.get("classes", []) if r["class"] in classes)


def roofline_reason(f: StepFigures) -> str:
    """The step's time above the kernels' limits, for a device-bound verdict's reason, and
    the share of the step whose kernels' work is unknown where it is a tenth or more."""
    table = f.roofline
    if not table or not f.step_ms:
        return ""
    top = largest_gap(table)
    most = (f", most in {top['class']} ({top['gap_ms']:.2f} ms: {top['rate']:,.0f} of a "
            f"{top['roof']:,.0f} {top['unit']} roof)" if top else "")
    unknown = unjudged_ms(table)
    unseen = (f" (the work of {unknown:.2f} ms of kernels is unknown: "
              f"{100 * unknown / f.step_ms:.0f}% of the step not judged)"
              if unknown >= 0.1 * f.step_ms else "")
    fed = classes_ms(table, ("input",))
    feeding = (f"; beside them, the loader's own kernels (decoding, crops) take {fed:.2f} ms "
               f"of the GPU per step" if fed >= INPUT_SHARE * f.step_ms else "")
    return (f"; {table['gap_ms']:.2f} ms ({gap_pct(table, f.step_ms):.0f}%) of the step above "
            f"the kernels' measured limits{most}{unseen}{feeding}")


INPUT_SHARE = 0.05
"""The share of the step from which a GPU loader's own kernels (kernel class ``input``) are
named in a device-bound verdict's reason: they run beside the model's on the same GPU."""


def first_the_roofline(candidates):
    """A device-bound rule's levers: those acting on the kernel class with most time above
    its limit first (``levers.roofline_candidates``), then the rule's own."""
    def both(f: StepFigures, accel: AccelConfig) -> list[Lever]:
        first = roofline_candidates(f, accel)
        seen = [dict(c.change) for c in first]
        return first + [c for c in candidates(f, accel) if dict(c.change) not in seen]
    return both
