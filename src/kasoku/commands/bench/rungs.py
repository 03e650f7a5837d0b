"""The rungs of the acceleration ladder (seed 004): a label and either an ``AccelConfig``
applied by ``kasoku.accel.compose.accelerate`` or ``None`` for the hand-written plain loop.

GPU ladder, each rung adding one lever to the one before:
    plain -> fp32 -> tf32 -> amp (bf16 autocast) -> +channels_last -> +fused -> +compile
    -> +cuda-graph (whole step captured, on top of compile) -> +fused-bn (batch norm, residual
    add and ReLU as kasoku's Triton kernels) -> +fast-stem (the stem convolution folded
    space-to-depth, its max-pool as Triton kernels) -> +combo-kernels (inductor combines
    independent kernels, such as autocast's weight casts, into fewer launches) -> +matmul-1x1
    (1x1 convolutions as cuBLAS matrix products) -> +wgrad-stream (convolutions' weight
    gradients on a second CUDA stream, joined at the end of the backward pass)
GPU ladder of a transformer (a workload whose ``ladder`` is "transformer", gpt): plain -> fp32
-> tf32 -> amp (bf16 autocast) -> +fused -> +compile -> +cuda-graph -> +float8 (torchao's
float8 matrix products with tensorwise scales; skipped where torchao is not installed). Attention is
the model's own (sdpa: PyTorch's fused kernel, plain: the textbook one, a workload setting), so
plain against sdpa is two ladders; activation checkpointing trades time for memory and is a
``--config`` of its own (``bf16,fused,compile,activation_checkpointing=full``), not a rung.
CPU ladder: plain -> fp32 -> +fused -> +keep-memory (glibc's malloc keeps freed memory: no
page faults per step, ``kasoku.accel.host_memory``) -> +bf16 (autocast) -> +channels_last ->
+compile, made for the CPU it runs on (``kasoku.perf.cpuinfo``): without bf16 hardware (AMX-BF16 or
AVX512-BF16) autocast converts to bf16 and computes in fp32, slower than fp32 with nothing to
learn, so ``+bf16`` is skipped (the table says why; ``--config +bf16`` measures it anyway) and
the rungs above it stay in fp32. ``+compile`` on a CPU is inductor's C++ backend
(``kasoku.accel.compile``).

``plain`` and ``fp32`` use the optimizer implementation PyTorch picks by default on that device
(multi-tensor "foreach" on CUDA, the per-tensor loop on CPU), so the pair shows what kasoku's
step itself costs. cuDNN autotuning is on from ``tf32`` up. fp16 with dynamic loss scaling is
one ``--config precision=fp16`` away.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

from kasoku.accel.attention import CUDA_ONLY
from kasoku.accel.compose import check_config
from kasoku.accel.config import AccelConfig
from kasoku.accel.float8 import has_torchao
from kasoku.commands.bench.rung_spec import SHORT_CPU_LADDER, parse_spec
from kasoku.core.flags import flag
from kasoku.perf.cpuinfo import CpuInfo, cpu_info

REFERENCE_LABEL = "fp32"
"""The rung every other rung's loss is compared against (``kasoku.commands.bench.numerics``)."""


@dataclass(frozen=True)
class Rung:
    label: str
    config: AccelConfig | None
    """None: the plain PyTorch loop of ``kasoku.commands.bench.plain``."""
    loader: str | None = None
    """A loader spec (``--loader``) or "fastest": the steps are fed by that loader from the
    workload's dataset (``kasoku.commands.bench.fed``) instead of synthetic batches on the
    device."""
    skip: str | None = None
    """Why the ladder does not measure this rung on this machine (the table shows it); None:
    measured. A rung named with ``--config`` is always measured."""

    @property
    def is_plain(self) -> bool:
        return self.config is None

    def config_dict(self) -> dict:
        """The resolved config as recorded in results: ``{"kind": "plain"}`` or
        ``{"kind": "kasoku", <every AccelConfig field>}``."""
        if self.config is None:
            return {"kind": "plain", "precision": "fp32", "channels_last": False,
                    "cudnn_benchmark": False, "optimizer_impl": "default"}
        return {"kind": "kasoku", **dataclasses.asdict(self.config)}


PLAIN = Rung("plain", None)


def default_optimizer_impl(device_type: str) -> str:
    """The implementation ``torch.optim`` picks when given none: foreach on CUDA, else loop."""
    return "foreach" if device_type == "cuda" else "loop"


def reference_rung(device_type: str) -> Rung:
    return Rung(REFERENCE_LABEL, AccelConfig(precision="fp32",
                                             optimizer_impl=default_optimizer_impl(device_type)))


def gpu_ladder() -> list[Rung]:
    fp32 = reference_rung("cuda").config
    tf32 = replace(fp32, precision="tf32", cudnn_benchmark=True)
    amp = replace(tf32, precision="bf16")
    nhwc = replace(amp, channels_last=True)
    fused = replace(nhwc, optimizer_impl="fused")
    compiled = replace(fused, compile=True)
    graphed = replace(compiled, cuda_graph=True)
    fused_bn = replace(graphed, fused_bn=True)
    stem = replace(fused_bn, fast_stem=True)
    combo = replace(stem, combo_kernels=True)
    matmul = replace(combo, matmul_1x1=True)
    wgrad = replace(matmul, wgrad_stream=True)
    return [PLAIN, Rung("fp32", fp32), Rung("tf32", tf32), Rung("amp", amp),
            Rung("+channels_last", nhwc), Rung("+fused", fused), Rung("+compile", compiled),
            Rung("+cuda-graph", graphed), Rung("+fused-bn", fused_bn),
            Rung("+fast-stem", stem), Rung("+combo-kernels", combo),
            Rung("+matmul-1x1", matmul), Rung("+wgrad-stream", wgrad)]


NO_TORCHAO = "skipped: torchao is not installed (pip install torchao)"


def transformer_gpu_ladder() -> list[Rung]:
    fp32 = reference_rung("cuda").config
    tf32 = replace(fp32, precision="tf32")
    amp = replace(tf32, precision="bf16")
    fused = replace(amp, optimizer_impl="fused")
    compiled = replace(fused, compile=True)
    graphed = replace(compiled, cuda_graph=True)
    float8 = replace(graphed, float8="tensorwise")
    return [PLAIN, Rung("fp32", fp32), Rung("tf32", tf32), Rung("amp", amp),
            Rung("+fused", fused), Rung("+compile", compiled), Rung("+cuda-graph", graphed),
            Rung("+float8", float8, skip=None if has_torchao() else NO_TORCHAO)]


NO_BF16_HARDWARE = ("skipped: no bf16 hardware on this CPU (AMX-BF16, AVX512-BF16): bf16 is "
                    f"converted and computed in fp32, slower than fp32 ({flag('bench.config')} "
                    "+bf16 measures it anyway)")


def cpu_ladder(info: CpuInfo | None = None) -> list[Rung]:
    """The CPU ladder for ``info`` (default: this machine's CPU)."""
    info = info or cpu_info()
    fp32 = reference_rung("cpu").config
    # The fused update first: on a CPU it is the cheapest lever and often the largest (the
    # MNIST MLP's Adam step takes half the time fused).
    fused = replace(fp32, optimizer_impl="fused")
    # Before bf16: autocast's per-step weight copies page-fault the most without it.
    kept = replace(fused, keep_memory=True)
    bf16 = replace(kept, precision="bf16")
    # Without bf16 hardware the rungs above +bf16 build on fp32, so each still adds one lever
    # to the fastest configuration measured below it.
    nhwc = replace(bf16 if info.bf16_hardware else kept, channels_last=True)
    compiled = replace(nhwc, compile=True)
    return [PLAIN, Rung("fp32", fp32), Rung("+fused", fused), Rung("+keep-memory", kept),
            Rung("+bf16", bf16, skip=None if info.bf16_hardware else NO_BF16_HARDWARE),
            Rung("+channels_last", nhwc), Rung("+compile", compiled)]


def default_ladder(device_type: str, kind: str = "default", full: bool = True) -> list[Rung]:
    """The ladder of a device, for a workload whose ``ladder`` is ``kind``; on a CPU without
    ``full``, its rungs ``SHORT_CPU_LADDER`` names (a GPU's ladder is always whole)."""
    if device_type != "cuda":
        ladder = cpu_ladder()
        return ladder if full else [r for r in ladder if r.label in SHORT_CPU_LADDER]
    return transformer_gpu_ladder() if kind == "transformer" else gpu_ladder()


def parse_config(spec: str) -> AccelConfig:
    """``"precision=bf16,channels_last,compile=max-autotune"`` -> ``AccelConfig``: the spec
    read and its values checked without torch (``rung_spec.parse_spec``: its keys and
    shorthands), then the combinations that cannot work refused (``check_config``, said the
    accel way). Unknown keys and values raise ``ConfigError``."""
    config = parse_spec(spec)
    check_config(config)  # impossible combinations, said the accel way
    return config


def rung_from_spec(spec: str, device_type: str, kind: str = "default") -> Rung:
    """A ``--config`` value: the label of a rung of this device's ladder (``amp``,
    ``+compile``, ``plain``) or a ``key=value,...`` spec (labelled by the spec itself)."""
    spec = spec.strip()
    for rung in default_ladder(device_type, kind):
        if rung.label == spec:
            # Asked for by name: measured here even where the ladder skips it.
            return replace(rung, skip=None) if rung.skip else rung
    return Rung(spec, parse_config(spec))


def ladder_or_specs(device_type: str, specs, kind: str = "default", full: bool = True
                    ) -> list[Rung]:
    """The device's ladder (of a ``kind`` workload; ``full``: as ``default_ladder`` takes it),
    or plain (the speed-ups are over it) plus the rungs ``specs`` name (``--config`` values,
    each rung once)."""
    if not specs:
        return default_ladder(device_type, kind, full)
    rungs = [PLAIN]
    for spec in specs:
        rung = rung_from_spec(spec, device_type, kind)
        if rung.label not in [r.label for r in rungs]:
            rungs.append(rung)
    return rungs


def resolve(rungs: list[Rung], device_type: str, has_conv: bool, has_blocks: bool = True
            ) -> tuple[list[Rung], list[str]]:
    """Drop levers that do not apply here (each stated once in the returned notes) and skip a
    rung left identical to the measured rung before it. Rungs the ladder skips on this
    machine (``Rung.skip``) pass through unchanged."""
    notes: list[str] = []
    stated: set[str] = set()
    out: list[Rung] = []
    before: set[str] = set()
    for rung in rungs:
        if rung.config is None or rung.skip:
            out.append(rung)
            continue
        config, dropped = _applicable(rung.config, device_type, has_conv, has_blocks)
        for lever, why in dropped:
            if lever not in stated:
                stated.add(lever)
                notes.append(f"{lever} does not apply: {why}")
        levers = {lever for lever, _ in dropped}
        last = next((r for r in reversed(out) if not r.skip), None)
        if dropped and last and config == last.config and rung.loader == last.loader:
            new = sorted(levers - before) or sorted(levers)
            notes.append(f"rung {rung.label} skipped: without {', '.join(new)} it equals "
                         f"rung {last.label}")
        else:
            out.append(replace(rung, config=config))
        before = levers
    return out, notes


def _applicable(config: AccelConfig, device_type: str, has_conv: bool, has_blocks: bool):
    dropped = []
    if device_type != "cuda":
        if config.float8 != "none":
            config = replace(config, float8="none")
            dropped.append(("float8", f"float8 tensor cores (CUDA, 8.9+), not {device_type}"))
        if config.sdpa_backend in CUDA_ONLY:
            dropped.append((f"sdpa_backend {config.sdpa_backend}",
                            f"a CUDA kernel, not on {device_type}"))
            config = replace(config, sdpa_backend="auto")
        if config.precision == "tf32":
            config = replace(config, precision="fp32")
            dropped.append(("tf32", f"a CUDA tensor-core mode, not on {device_type}"))
        if config.cudnn_benchmark:
            config = replace(config, cudnn_benchmark=False)
            dropped.append(("cudnn_benchmark", f"cuDNN autotuning needs CUDA, not {device_type}"))
        if config.cuda_graph:
            config = replace(config, cuda_graph=False)
            dropped.append(("cuda_graph", f"CUDA graphs need CUDA, not {device_type}"))
        if config.wgrad_stream:
            config = replace(config, wgrad_stream=False)
            dropped.append(("wgrad_stream", f"a second CUDA stream, not on {device_type}"))
    elif config.keep_memory:
        config = replace(config, keep_memory=False)
        dropped.append(("keep_memory", "host malloc settings for CPU tensors, not CUDA's"))
    if config.activation_checkpointing != "none" and not has_blocks:
        config = replace(config, activation_checkpointing="none")
        dropped.append(("activation_checkpointing", "the model has no `blocks` ModuleList"))
    if config.matmul_1x1 and not has_conv:
        config = replace(config, matmul_1x1=False)
        dropped.append(("matmul_1x1", "the model has no 2-d convolutions"))
    if config.wgrad_stream and not has_conv:
        config = replace(config, wgrad_stream=False)
        dropped.append(("wgrad_stream", "the model has no 2-d convolutions"))
    if config.fused_bn and not has_conv:
        config = replace(config, fused_bn=False)
        dropped.append(("fused_bn", "the model has no 2-d convolutions (no batch norm + ReLU "
                                    "on their activations)"))
    if config.fast_stem and not has_conv:
        config = replace(config, fast_stem=False)
        dropped.append(("fast_stem", "the model has no 2-d convolutions"))
    if config.channels_last and not has_conv:
        config = replace(config, channels_last=False)
        dropped.append(("channels_last", "the model has no 2-d convolutions"))
    return config, dropped


def compute_dtype(rung: Rung) -> str:
    """The dtype of the rung's matrix products: the peak its MFU is measured against
    (see ``kasoku.perf.mfu``)."""
    precision = "fp32" if rung.config is None else rung.config.precision
    return {"fp16-pure": "fp16"}.get(precision, precision)
