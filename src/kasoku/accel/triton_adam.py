"""Seed 004's batched weight update as one Triton kernel: Adam for every weight of a parameter
group in a single launch that covers all their elements with a full grid.

torch's fused Adam gives each 65,536-element chunk of its multi-tensor kernel one thread block:
the MNIST MLP's 1.8M weights make ~28 blocks on a GPU of 132 multiprocessors (32.9 us per
update in a CUDA graph on an H200). The inductor-compiled update fills the GPU (11.9 us) but
costs seconds of tracing and compilation in every new process. This kernel fills the GPU
(11.6 us) and is compiled by Triton once per machine (its cache), a fraction of a second.

How one launch reaches tensors that live anywhere in memory: the kernel gets one of them as a
real pointer (the base, so Triton knows its alignment) and, for every tensor, the distance of
its parameter, gradient, ``exp_avg``, ``exp_avg_sq`` and step counter from that base, in
float32 elements (a small int64 table on the device). A second table maps each program (block
of ``BLOCK`` elements) to its tensor and its offset inside it. The step counters are bumped by
one multi-tensor add before the kernel, as torch's capturable Adam does.

The optimizer is ``torch.optim.Adam`` in everything else: the same hyper-parameters, param
groups, state (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter) and ``state_dict``, so a
snapshot moves between implementations. It is always capturable: the learning rate may be a
device tensor (``kasoku.accel.graph`` makes it one) and nothing in ``step`` reads the device.
The tables are cached and rebuilt when a tensor moves (a new gradient each step when gradients
are set to None); under CUDA graph capture the rebuild is a copy from pinned memory recorded in
the graph, so a replay sees the captured gradients' addresses.

Compilation starts ahead of the first step, in a background thread: ``compile_early`` (which
``kasoku train`` calls before it loads the data) and the optimizer's construction start it for
the launch the first step will make. Triton's per-process start (it hashes its own sources and
libraries to key its cache, ~0.3 s on an H200 host) and, on a machine without a warm cache,
the compilation itself overlap with the rest of start-up instead of stalling the first step,
which waits for the thread only if it is still running.

Needs float32 parameters on a CUDA device and Triton (torch's CUDA builds ship it); elsewhere
``kasoku.optim.make_optimizer`` gives torch's fused update instead, warned once. With
``TRITON_INTERPRET=1`` Triton runs the kernel on the CPU (slowly: for tests).
"""
from __future__ import annotations

import math
import threading

import torch

from kasoku.core.errors import ConfigError, warn_once
from kasoku.core.flags import flag
from kasoku.core.lazy_kernel import LazyKernel, interpreting

# With 8 warps the fastest of 512..4096 x 4/8 on an H200 (research/probes/adam_update_probe.py).
BLOCK = 512
NUM_WARPS = 8
_ALIGN = 16  # bytes: four float32, one vectorized load


def triton_unavailable_reason(params: list[torch.Tensor]) -> str | None:
    """Why the Triton update cannot run on ``params`` here, or None when it can."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (torch's CUDA builds ship it: pip install triton)"
    bad_dtype = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
    if bad_dtype:
        return f"it updates float32 parameters only, and these include {', '.join(bad_dtype)}"
    devices = {p.device.type for p in params}
    allowed = {"cpu", "cuda"} if interpreting() else {"cuda"}
    if not devices <= allowed:
        return f"it needs CUDA parameters, and these are on {', '.join(sorted(devices))}"
    if len({p.device for p in params}) > 1:
        return "its parameters must all be on one device"
    return None


_AHEAD: list[threading.Thread] = []  # compilations started ahead of the first step
AHEAD_FAILURES: list[str] = []
"""Why compilations started ahead failed, if any did (each also warned)."""


def _define_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def adam_kernel(base, table, block_tensor, block_start, numels, lr_ptr, n_tensors,
                    beta1, beta2, eps, weight_decay, BLOCK: tl.constexpr,
                    ALIGNED: tl.constexpr, WEIGHT_DECAY: tl.constexpr):
        pid = tl.program_id(0)
        i = tl.load(block_tensor + pid)
        offs = tl.load(block_start + pid) + tl.arange(0, BLOCK)
        mask = offs < tl.load(numels + i)
        p_at = tl.load(table + i) + offs
        g_at = tl.load(table + n_tensors + i) + offs
        m_at = tl.load(table + 2 * n_tensors + i) + offs
        v_at = tl.load(table + 3 * n_tensors + i) + offs
        if ALIGNED:  # the base is 16-byte aligned and every distance a multiple of 16 bytes
            p_at = tl.max_contiguous(tl.multiple_of(p_at, 4), BLOCK)
            g_at = tl.max_contiguous(tl.multiple_of(g_at, 4), BLOCK)
            m_at = tl.max_contiguous(tl.multiple_of(m_at, 4), BLOCK)
            v_at = tl.max_contiguous(tl.multiple_of(v_at, 4), BLOCK)
        step = tl.load(base + tl.load(table + 4 * n_tensors + i))
        lr = tl.load(lr_ptr)
        p = tl.load(base + p_at, mask=mask)
        g = tl.load(base + g_at, mask=mask)
        if WEIGHT_DECAY:
            g = g + weight_decay * p
        m = tl.load(base + m_at, mask=mask)
        v = tl.load(base + v_at, mask=mask)
        m = m + (1.0 - beta1) * (g - m)  # exp_avg.lerp_(grad, 1 - beta1)
        v = beta2 * v + (1.0 - beta2) * g * g
        bias1 = 1.0 - tl.exp(step * tl.log(beta1))
        bias2 = 1.0 - tl.exp(step * tl.log(beta2))
        p = p - (lr / bias1) * (m / (tl.sqrt(v) / tl.sqrt(bias2) + eps))
        tl.store(base + m_at, m, mask=mask)
        tl.store(base + v_at, v, mask=mask)
        tl.store(base + p_at, p, mask=mask)

    return adam_kernel


_kernel = LazyKernel(_define_kernel)


def compile_ahead(launches: list[tuple[tuple, dict]], device) -> None:
    """Compile (or load from Triton's cache) and load the kernel for each ``(args, kwargs)``
    of ``launches`` on a background thread, without running it; the first step waits for
    it (``wait_for_compilation``). Best effort: on any failure the step compiles itself, and
    reports what fails."""
    if interpreting() or not launches:
        return

    def work(after: list[threading.Thread]) -> None:
        for thread in after:  # one compilation at a time: Triton's JIT is not thread-safe
            thread.join()
        try:
            torch.cuda.set_device(device)  # the thread's CUDA context, for loading the module
            for args, kwargs in launches:
                compiled = _kernel().warmup(*args, grid=(1,), **kwargs)
                if hasattr(compiled, "_init_handles"):
                    compiled._init_handles()
        except Exception as exc:  # noqa: BLE001 - the first step compiles instead
            AHEAD_FAILURES.append(f"{type(exc).__name__}: {exc}")
            warn_once(f"optimizer_impl triton: compiling ahead of the first step failed "
                      f"({AHEAD_FAILURES[-1]}); the first step compiles instead")

    thread = threading.Thread(target=work, args=(list(_AHEAD),), daemon=True,
                              name="kasoku-triton-adam-compile")
    _AHEAD.append(thread)
    thread.start()


def compile_early(device, weight_decay: bool, block: int = BLOCK,
                  num_warps: int = NUM_WARPS) -> None:
    """Start compiling the kernel for a typical first step (several tensors, aligned) before
    the model and optimizer exist, so that Triton's start-up (~0.3 s: it hashes its own
    sources and libraries to key its cache) and any compilation overlap with loading the
    data. ``kasoku train`` calls it as soon as it knows the update will be Triton's."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        import triton  # noqa: F401
    except ImportError:
        return
    # Stand-ins with the types and alignment of the real arguments; the tensor count (2)
    # specializes like any count other than 1 or a multiple of 16.
    with torch.cuda.device(device):
        ints = torch.zeros(2, dtype=torch.int64, device=device)
        floats = torch.zeros(4, dtype=torch.float32, device=device)
        args = (floats, ints, torch.zeros(1, dtype=torch.int32, device=device), ints, ints,
                floats[0], 2, 0.9, 0.999, 1e-8, 0.0)
    compile_ahead([(args, {"BLOCK": block, "ALIGNED": True, "WEIGHT_DECAY": weight_decay,
                           "num_warps": num_warps})], device)


def wait_for_compilation() -> None:
    """Join the compilations started ahead (a no-op once they are done)."""
    while _AHEAD:
        _AHEAD.pop(0).join()


class _Plan:
    """A group's launch: the block tables (fixed by the shapes) and the offset table (fixed
    by the addresses, rebuilt when one changes)."""

    def __init__(self, params: list[torch.Tensor], block: int):
        device = params[0].device
        blocks = [math.ceil(p.numel() / block) for p in params]
        self.shapes = [p.shape for p in params]
        self.n_blocks = sum(blocks)
        self.block_tensor = torch.repeat_interleave(
            torch.arange(len(params), dtype=torch.int32), torch.tensor(blocks)).to(device)
        self.block_start = torch.cat([torch.arange(n, dtype=torch.int64) * block
                                      for n in blocks]).to(device)
        self.numels = torch.tensor([p.numel() for p in params], dtype=torch.int64).to(device)
        self.addresses: tuple = ()
        self.table: torch.Tensor | None = None
        self.aligned = False
        # Host sides of the copies recorded in CUDA graphs: every replay reads them again,
        # so they must outlive this table (freed, the host allocator would hand them out).
        self._recorded: list[torch.Tensor] = []

    def offsets(self, tensors: list[list[torch.Tensor]]) -> torch.Tensor:
        """The table for ``tensors`` = [params, grads, exp_avgs, exp_avg_sqs, steps]: each
        tensor's distance from the first parameter, in float32 elements."""
        addresses = tuple(t.data_ptr() for field in tensors for t in field)
        if addresses == self.addresses:
            return self.table
        base = addresses[0]
        if any((a - base) % 4 for a in addresses):
            raise RuntimeError("a Triton Adam tensor is not float32-aligned to the others")
        host = torch.tensor([(a - base) // 4 for a in addresses], dtype=torch.int64)
        device = tensors[0][0].device
        if device.type == "cuda":
            # Pinned and non_blocking: a host-to-device copy that a CUDA graph can record.
            host = host.pin_memory()
            if torch.cuda.is_current_stream_capturing():
                self._recorded.append(host)
        self.table = host.to(device, non_blocking=True)
        self.addresses = addresses
        self.aligned = all((a - base) % _ALIGN == 0 for a in addresses) and base % _ALIGN == 0
        return self.table


class TritonAdam(torch.optim.Adam):
    """``torch.optim.Adam`` (L2 weight decay added to the gradient, no amsgrad, no maximize)
    whose step is one Triton kernel per parameter group; see the module docstring."""

    graph_safe = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 block: int = BLOCK, num_warps: int = NUM_WARPS):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         foreach=False, fused=False, capturable=True)
        tensors = [p for g in self.param_groups for p in g["params"]]
        reason = triton_unavailable_reason(tensors)
        if reason is not None:
            raise ConfigError(f"{flag('accel.optimizer_impl')} triton: {reason}; use "
                              f"{flag('accel.optimizer_impl')} fused or compiled")
        if block < 16 or block & (block - 1):
            raise ValueError(f"block must be a power of two >= 16, got {block}")
        self.block, self.num_warps = block, num_warps
        self._plans: dict[int, _Plan] = {}
        self._lr_tensors: dict[int, tuple[float, torch.Tensor]] = {}
        _kernel()  # the import and definition are start-up work, not the first step's
        if not interpreting():
            compile_ahead(*self._first_launches())

    def _first_launches(self) -> tuple[list, torch.device]:
        """The kernel arguments of each group's first step, as far as they are known before
        it (every parameter with a gradient, aligned), with their tables built now."""
        launches = []
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.numel()]
            if not params:
                continue
            plan = self._plans[index] = _Plan(params, self.block)
            lr = self._lr(index, group["lr"], params[0].device)
            launches.append(self._arguments(plan, group, params[0], plan.numels, lr, True))
        return launches, launches[0][0][0].device if launches else None

    def _arguments(self, plan: "_Plan", group: dict, base: torch.Tensor, table: torch.Tensor,
                   lr: torch.Tensor, aligned: bool) -> tuple[tuple, dict]:
        beta1, beta2 = group["betas"]
        return ((base, table, plan.block_tensor, plan.block_start, plan.numels, lr,
                 len(plan.shapes), float(beta1), float(beta2), float(group["eps"]),
                 float(group["weight_decay"])),
                {"BLOCK": self.block, "ALIGNED": aligned,
                 "WEIGHT_DECAY": group["weight_decay"] != 0, "num_warps": self.num_warps})

    def __getstate__(self) -> dict:  # copies and pickles: torch keeps only the state
        return {**super().__getstate__(), "block": self.block, "num_warps": self.num_warps}

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        self.block = state.pop("block", BLOCK)
        self.num_warps = state.pop("num_warps", NUM_WARPS)
        super().__setstate__(state)
        self._plans, self._lr_tensors = {}, {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            if group.get("amsgrad") or group.get("maximize") or group.get("decoupled_weight_decay"):
                raise ConfigError("TritonAdam implements plain Adam only (no amsgrad, maximize or "
                                  f"decoupled weight decay); use {flag('accel.optimizer_impl')} "
                                  "fused")
            params = [p for p in group["params"] if p.grad is not None and p.numel()]
            if params:
                self._update(index, group, params)
        return loss

    def _update(self, index: int, group: dict, params: list[torch.Tensor]) -> None:
        wait_for_compilation()
        grads = [p.grad for p in params]
        for p, g in zip(params, grads):
            if g.is_sparse or g.stride() != p.stride() or not _dense(p):
                raise RuntimeError(
                    f"TritonAdam: a parameter of shape {tuple(p.shape)} and its gradient are "
                    f"not laid out alike in dense memory (strides {p.stride()} and "
                    f"{g.stride()}); use {flag('accel.optimizer_impl')} fused")
        states = [self._state(p) for p in params]
        steps = [s["step"] for s in states]
        plan = self._plans.get(index)
        if plan is None or plan.shapes != [p.shape for p in params]:
            plan = self._plans[index] = _Plan(params, self.block)
        table = plan.offsets([params, grads, [s["exp_avg"] for s in states],
                              [s["exp_avg_sq"] for s in states], steps])
        torch._foreach_add_(steps, 1)
        args, kwargs = self._arguments(plan, group, params[0], table,
                                       self._lr(index, group["lr"], params[0].device),
                                       plan.aligned)
        _kernel()[(plan.n_blocks,)](*args, **kwargs)

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif state["step"].device != p.device or state["step"].dtype != torch.float32:
            # A state_dict saved by a non-capturable Adam keeps its step on the host.
            state["step"] = state["step"].to(p.device, torch.float32)
        return state

    def _lr(self, index: int, lr, device) -> torch.Tensor:
        """The learning rate as a float32 device tensor (the kernel reads it there): a tensor
        lr is used as it is; a float is written into a cached tensor when it changes."""
        if isinstance(lr, torch.Tensor):
            if lr.device == device and lr.dtype == torch.float32:
                return lr
            return lr.to(device, torch.float32)
        cached = self._lr_tensors.get(index)
        if cached is None or cached[0] != lr:
            tensor = cached[1] if cached is not None else \
                torch.empty((), dtype=torch.float32, device=device)
            tensor.fill_(float(lr))
            self._lr_tensors[index] = cached = (lr, tensor)
        return cached[1]


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one block of memory without gaps or overlap."""
    if t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last):
        return True
    return t.numel() == 1
