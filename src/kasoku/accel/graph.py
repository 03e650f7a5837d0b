"""Whole-step CUDA graph (seed 004's static graph): forward, loss, backward, loss scaling and
the optimizer update recorded once as one ``torch.cuda.CUDAGraph`` and replayed for every
batch, so a step costs one launch on the host instead of hundreds.

What a step must satisfy to be captured, and how this module arranges it:

- Static memory. Each call copies the batch into static input buffers (``copy_``) and
  replays; gradients are allocated during capture from the graph's private pool (grads are
  None when capture starts, as in PyTorch's whole-network example), so every replay writes
  them in place. The observations the step returns are static too: the caller gets clones,
  because the reporter keeps references across iterations and would otherwise log the last
  value for every iteration.
- No host syncs, no host-side decisions. The optimizer must be capturable: torch's fused
  SGD/Adam/AdamW, Adam/AdamW with ``capturable=True`` (set here), or an optimizer that says
  ``graph_safe`` (kasoku's LARS and LAMB). torch's loop/foreach SGD reads a tensor learning
  rate on the host and is refused (``ConfigError``: use the fused implementation). Loss
  scaling must skip on the device (``kasoku.accel.loss_scale``); ``compose`` checks that.
- The learning rate is read by the graph, not baked into it. Every group's ``lr`` becomes a
  0-dim float32 tensor on the device, and kasoku's schedules write it in place
  (``lr.fill_(value)``), so a schedule keeps working under replay. A float lr would be
  frozen at its value at capture time, silently.
- Same shapes. A batch whose shapes, dtypes or device differ from the captured ones (the last
  partial batch of an epoch) runs eagerly, with one warning; loaders with ``drop_last`` keep
  every step in the graph.
- Warm-up before capture. The first ``warmup_steps`` steps run eagerly on a side stream (lazy
  initialization of cuBLAS/cuDNN handles, autotuning, optimizer state, compilation), then the
  next call captures and replays; with ``steps_per_call`` K a call counts as K steps. Warm-up
  steps are real training steps on real batches.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from kasoku.accel.notes import skip, warn_once
from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag
from kasoku.train.step import Step, StepWrapper, steps_of

WARMUP_STEPS = 3


def apply_cuda_graph(step_fn: Step, device, optimizer=None,
                     notes: list[str] | None = None, warmup_steps: int = WARMUP_STEPS,
                     steps_per_call: int = 1, stream: torch.cuda.Stream | None = None
                     ) -> Step:
    """Wrap ``step_fn`` in a ``CudaGraphStep`` (apply last: the graph holds everything the
    step does). With ``optimizer``, prepare it now (tensor learning rates, ``capturable``) so
    schedules registered afterwards see tensor rates from their first call; a non-capturable
    optimizer raises ``ConfigError``. ``steps_per_call``: optimizer steps per call of
    ``step_fn`` (``MultiStep``), so that warm-up counts steps. ``stream``: the side stream to
    warm up and capture on (one the caller already used, e.g. to build DDP; default: a new
    one). On a device other than CUDA the lever is warned about once, noted, and the step
    returned unchanged."""
    device = torch.device(device)
    if device.type != "cuda":
        skip(notes, f"cuda_graph: CUDA graphs need a CUDA device; the step runs eagerly on "
                    f"{device.type}")
        return step_fn
    if optimizer is not None:
        prepare_optimizer_for_graph(optimizer, device)
    # A call of a multi-step chunk is already that many eager steps: warm up in steps, not
    # calls (3 chunks of 50 would be 150 eager steps before the first replay).
    per_call = max(1, int(steps_per_call))
    return CudaGraphStep(step_fn, device, -(-warmup_steps // per_call), stream=stream)


def _indexed(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def prepare_optimizer_for_graph(optimizer: torch.optim.Optimizer, device) -> None:
    """Make ``optimizer`` capturable in place: ``capturable=True`` where torch has the flag,
    every learning rate a 0-dim float32 tensor on ``device`` (value kept), step counters of
    state created without ``capturable`` moved to the parameters' device. Refuses (with
    ``ConfigError``) an optimizer whose update needs the host."""
    device = _indexed(torch.device(device))
    graph_safe = getattr(optimizer, "graph_safe", False)
    for group in optimizer.param_groups:
        if "capturable" in group:
            # torch checks this flag during capture even for fused Adam.
            group["capturable"] = True
        elif not (graph_safe or group.get("fused")):
            raise ConfigError(
                f"{type(optimizer).__name__} in its loop/foreach implementation cannot be "
                f"captured in a CUDA graph (it reads the learning rate on the host); use "
                f"{flag('accel.optimizer_impl')} fused, or drop {flag('accel.cuda_graph')}")
        lr = group["lr"]
        if not (isinstance(lr, torch.Tensor) and lr.device == device
                and lr.dtype == torch.float32 and lr.dim() == 0):
            group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=device)
    for p, state in optimizer.state.items():
        step = state.get("step") if isinstance(state, dict) else None
        if isinstance(step, torch.Tensor) and step.device != p.device:
            state["step"] = step.to(p.device)


@contextlib.contextmanager
def _capturable_warning_off():
    # Eager steps (warm-up, odd-shaped batches) of an optimizer made capturable are expected.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This instance was constructed with "
                                                  "capturable=True")
        yield


def _signature(batch) -> tuple:
    return tuple((x.shape, x.dtype, x.device) for x in batch)


class CudaGraphStep(StepWrapper):
    """``step(model, batch, optimizer) -> observations`` that replays a CUDA graph of
    ``step_fn``; see the module docstring for the warm-up, the static buffers and the
    eager fallback. ``replays`` and ``eager_steps`` count what ran. A replay runs no Python:
    phase marks do not reach the inner step (``passes_marks``)."""
    passes_marks = False

    def __init__(self, step_fn: Step, device, warmup_steps: int = WARMUP_STEPS,
                 stream: torch.cuda.Stream | None = None):
        if warmup_steps < 1:
            raise ValueError(f"a CUDA graph needs at least one warm-up step, got {warmup_steps}")
        super().__init__(step_fn)
        self.device = _indexed(torch.device(device))
        self.warmup_steps = warmup_steps
        self.graph: torch.cuda.CUDAGraph | None = None
        self.replays = self.eager_steps = 0
        self.eager = False
        """Run the captured step eagerly (its operators seen by a profiler: ``eagerly``)."""
        self._stream: torch.cuda.Stream | None = stream
        self._last_signature = None
        self._static_batch: tuple = ()
        self._static_obs: dict = {}
        self._static_grads: list = []

    def __call__(self, model, batch, optimizer) -> dict:
        signature = _signature(batch)
        if self.graph is None:
            # Capture only a batch shaped like the warm-up batch before it, so that a short
            # batch arriving right after warm-up cannot become the captured shape.
            if self.eager_steps < self.warmup_steps or signature != self._last_signature:
                self._last_signature = signature
                return self._warm_up(model, batch, optimizer)
            return self._capture(model, batch, optimizer)
        if self.eager:
            return self._eager(model, batch, optimizer)
        if signature != self._last_signature:
            warn_once(f"cuda_graph: a batch of shapes {[tuple(s[0]) for s in signature]} "
                      f"differs from the captured {[tuple(s[0]) for s in self._last_signature]}"
                      f"; such batches run eagerly (use a loader with drop_last to avoid it)")
            return self._eager(model, batch, optimizer)
        for static, x in zip(self._static_batch, batch):
            static.copy_(x, non_blocking=True)
        self.graph.replay()
        self.replays += 1
        return self._observation()

    def _observation(self) -> dict:
        return {k: v.clone() if isinstance(v, torch.Tensor) else v
                for k, v in self._static_obs.items()}

    def _warm_up(self, model, batch, optimizer) -> dict:
        # A resume (optimizer.load_state_dict) replaces the param groups, and with them the
        # device learning rates, after apply_cuda_graph ran: restore them before any step.
        prepare_optimizer_for_graph(optimizer, self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream), _capturable_warning_off():
            obs = self.inner(model, batch, optimizer)
        current.wait_stream(self._stream)
        self.eager_steps += 1
        return obs

    def _capture(self, model, batch, optimizer) -> dict:
        prepare_optimizer_for_graph(optimizer, self.device)
        self._static_batch = tuple(x.clone() for x in batch)
        # Gradients allocated during capture come from the graph's pool: that makes them
        # static, and the captured backward writes instead of accumulating.
        model.zero_grad(set_to_none=True)
        optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread (a prefetching loader) may allocate during capture.
        # Captured on the warm-up stream, as make_graphed_callables does: the handles and
        # workspaces the warm-up created there are the ones the captured kernels use.
        with torch.cuda.graph(graph, stream=self._stream, capture_error_mode="thread_local"):
            self._static_obs = self.inner(model, self._static_batch, optimizer)
        self._static_grads = [(p, p.grad) for p in model.parameters()]
        self.graph = graph
        graph.replay()  # capture records without running: this trains on the capture batch
        self.replays += 1
        return self._observation()

    def _eager(self, model, batch, optimizer) -> dict:
        with _capturable_warning_off():
            obs = self.inner(model, batch, optimizer)
        # The eager step allocated fresh gradients; point .grad back at the graph's buffers.
        for p, grad in self._static_grads:
            p.grad = grad
        self.eager_steps += 1
        return obs

    def release(self) -> None:
        """Free the captured graph and its static buffers (the next call warms up and captures
        again). Before a data-parallel worker leaves its process group: a graph that captured
        its collectives must not outlive the communicator (``kasoku.accel.teardown``)."""
        if self.graph is not None:
            self.graph.reset()
        self.graph = None
        self._static_batch, self._static_obs, self._static_grads = (), {}, []
        self._last_signature = None
        self.eager_steps = 0

    def __repr__(self) -> str:
        return f"CudaGraphStep({self.inner!r}, captured={self.graph is not None})"


@contextlib.contextmanager
def eagerly(step_fn: Step):
    """Inside, every CUDA graph in ``step_fn``'s chain runs its step eagerly, the kernels the
    replays run launched one by one (a profiled work step sees their operators and shapes);
    real training steps, the gradients left in the graph's buffers."""
    graphs = [s for s in steps_of(step_fn) if isinstance(s, CudaGraphStep)]
    for g in graphs:
        g.eager = True
    try:
        yield
    finally:
        for g in graphs:
            g.eager = False
