"""``kasoku profile -- python SCRIPT.py ARGS``: the verdict for a user's own training script,
run unchanged in this process (``kasoku.commands.script_run``) while kasoku watches its steps
from outside.

Steps are found without help: a step is one ``step()`` of the first optimizer that steps (a
global post-hook on every ``torch.optim.Optimizer``), or, for a script that never calls an
optimizer (a hand-written update), one backward pass (``torch.Tensor.backward`` and
``torch.autograd.backward`` wrapped; a backward is a step once a second one comes with no
optimizer step between). The wait for a batch is the time in the DataLoader iterator's
``__next__``. After ``skip`` steps the profiled window (``kasoku.perf.profile.window.Window``:
``warmup + 1 + steps`` steps) runs with kasoku's phase spans in the trace; a step starts at its
first batch's wait (the ``kasoku/data`` span the analysis cuts steps at), or, for a script whose
steps take no batch from a DataLoader, at the previous step's end (a zero-length data span).
When the window ends the patches are taken off and the script goes on at full speed (the
optimizer hook stays, doing nothing, until the script ends: removing it while it runs would
break the optimizer's loop over its hooks), or it is stopped (``stop_after_window``).

Not yet: the A/B runs that prove the verdict and measure the advice (the verdict is an
estimate, and says so), a script's own DDP under torchrun, the wait for a step's second batch
(gradient accumulation, a second loader: left in ``compute``).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import dataloader as torch_dataloader

from kasoku.commands.profile import ProfileConfig, write_outputs
from kasoku.commands.script_run import ScriptCommand, ScriptStopped, run_script
from kasoku.core.errors import ConfigError
from kasoku.core.phases import PhaseClock
from kasoku.perf.profile.window import Window, machine_facts
from kasoku.train.run_dir import out_or_new

EXIT_USAGE = 2
"""Nothing to profile from a script that ended well: the command asked for what it lacks."""

LOADER_ITER = torch_dataloader._BaseDataLoaderIter
"""The base class of every DataLoader iterator (one process or worker processes). PyTorch
has no public hook on a DataLoader's batches; its ``__next__`` is where PyTorch opens its own
profiler span for the wait (``enumerate(DataLoader)#...``, which HTA reads), so wrapping it
times the same wait for every DataLoader the script makes."""


class StepWatch:
    """The hooks on the script's steps and batches, and the profiled window they drive."""

    def __init__(self, cfg: ProfileConfig, out: Path):
        self.cfg, self.out = cfg, Path(out)
        self.steps = 0
        """Training steps seen (to the window's end)."""
        self.window: Window | None = None
        self.clock = None
        self.done = False
        self.batch_size: int | None = None
        self.num_workers: int | None = None
        self._stepper = None  # the optimizer whose steps are the steps
        self._backwards = 0
        self._in_backward = 0
        self._loader_calls = 0  # this step's
        self._loader_steps = False
        self._pending = False  # the next batch's wait starts a step
        self._in_data = False
        self._saved: list[tuple[object, str, object]] = []
        self._hook = None

    # --- the patches --------------------------------------------------------------------
    def install(self) -> None:
        self._hook = register_optimizer_step_post_hook(self._optimizer_step)
        self._patch(torch.Tensor, "backward", self._wrap_backward(torch.Tensor.backward))
        self._patch(torch.autograd, "backward", self._wrap_backward(torch.autograd.backward))
        self._patch(LOADER_ITER, "__next__", self._wrap_next(LOADER_ITER.__next__))

    def _patch(self, owner, name: str, new) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def unpatch(self) -> None:
        """Put back what ``install`` patched (the optimizer hook stays: ``uninstall``)."""
        while self._saved:
            owner, name, old = self._saved.pop()
            setattr(owner, name, old)

    def uninstall(self) -> None:
        self.unpatch()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._stepper = None

    def _wrap_backward(self, original):
        watch = self

        def backward(*args, **kwargs):
            watch._in_backward += 1
            try:
                return original(*args, **kwargs)
            finally:
                watch._in_backward -= 1
                if not watch._in_backward:  # Tensor.backward calls autograd.backward
                    watch._backward_done()
        return backward

    def _wrap_next(self, original):
        watch = self

        def __next__(it):
            opened = watch._batch_wait(it)
            batch = original(it)  # StopIteration: the wait goes on in the next iterator
            watch._batch_came(batch, opened)
            return batch
        return __next__

    # --- the events ---------------------------------------------------------------------
    def _optimizer_step(self, optimizer, args, kwargs) -> None:
        if self.done:
            return
        if self._stepper is None:
            self._stepper = optimizer
        if optimizer is self._stepper:
            self._step_end()

    def _backward_done(self) -> None:
        self._backwards += 1
        if self._stepper is None and self._backwards >= 2 and not self.done:
            # Two backward passes with no optimizer step between: each is a step.
            self.steps = max(self.steps, self._backwards - 1)
            self._step_end()

    def _batch_wait(self, it) -> bool:
        self._loader_calls += 1
        if self.num_workers is None:
            self.num_workers = getattr(it, "_num_workers", None)
        if self.clock is None or not self._loader_steps:
            return False
        if self._pending:
            self._pending = False
            self._in_data = True
            self.clock.mark("data")
        return self._in_data

    def _batch_came(self, batch, opened: bool) -> None:
        if self.batch_size is None:
            self.batch_size = _batch_size(batch)
        if opened:
            self._in_data = False
            self.clock.mark("compute")

    def _step_end(self) -> None:
        self.steps += 1
        took_batch, self._loader_calls = self._loader_calls > 0, 0
        if self.window is None and self.steps >= self.cfg.skip:
            self._start(took_batch)
        elif self.window is not None:
            if self.window.step():
                self._end()
                return
            self._loader_steps = self._loader_steps and took_batch
        else:
            return
        if self._loader_steps:
            self._pending = True
        else:  # a step that takes no batch starts here, with a wait of none
            self.clock.mark("data")
            self.clock.mark("compute")

    def _start(self, took_batch: bool) -> None:
        device = script_device()
        self.window = Window(device, self.out, self.cfg.steps, self.cfg.warmup)
        self.clock = self.window.start(PhaseClock(device))
        self._loader_steps = took_batch

    def _end(self) -> None:
        self.clock, self.done = None, True
        self.unpatch()
        if self.cfg.stop_after_window:
            raise ScriptStopped

    @property
    def window_steps(self) -> int:
        return self.cfg.skip + self.cfg.warmup + 1 + self.cfg.steps


def script_device() -> torch.device:
    """The device the script trains on: the current GPU if it has started CUDA, else the
    CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _batch_size(batch) -> int | None:
    """The length of the first tensor in a batch (a tensor, or lists, tuples and dicts of
    them)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    items = batch.values() if isinstance(batch, dict) else \
        batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        size = _batch_size(item)
        if size is not None:
            return size
    return None


def profile_script(command: ScriptCommand, cfg: ProfileConfig, out: Path | None = None) -> int:
    """Run ``command`` under the step watch, profile its window, write ``profile.json``,
    ``trace.json``, ``timeline.png`` and ``report.html`` to ``out`` (default: a new folder
    under runs/) and print kasoku's lines (``kasoku: ...``, on stderr). Returns the exit
    code: the script's, else ``EXIT_USAGE`` when it ended well with nothing to profile;
    ``cfg.stop_after_window``: the script is stopped there."""
    if cfg.skip < 1:
        raise ConfigError("a script's window starts after its first step at the earliest "
                          "(its steps show how it trains): give --skip 1 or more")
    out = out_or_new(out, Path(command.name).stem, "profile", "the profile")
    watch = StepWatch(cfg, out)
    watch.install()
    try:
        end = run_script(command, hidden=(__file__,))
    finally:
        watch.uninstall()
        if watch.window is not None and not watch.done:
            watch.window.stop()
    if watch.steps == 0:
        return _say_nothing(end)
    if not watch.done:
        say(f"the script ended after {watch.steps} steps, before the window's end "
            f"(--skip {cfg.skip}, --warmup {cfg.warmup}, --steps {cfg.steps}: "
            f"{watch.window_steps} steps): ask for fewer")
        return end.code or EXIT_USAGE
    try:
        result = _result(command, cfg, watch, end)
    except ValueError as exc:  # a trace without two steps' spans (trace.steps_of)
        say(f"the window's trace could not be analysed: {exc}")
        return end.code or 1
    write_outputs(out, result)
    for line in summary_lines(result):
        say(line)
    if end.code:
        say(f"the script exited with code {end.code} after the window; the profile is kept")
    return end.code


def say(line: str) -> None:
    """One of kasoku's lines, kept apart from the script's output."""
    print(f"kasoku: {line}", file=sys.stderr, flush=True)


def _say_nothing(end) -> int:
    if end.raised:
        say("the script failed before its first step")
    elif end.code:
        say(f"the script exited with code {end.code} before its first step")
    else:
        say("the script ended without a training step (no optimizer step, no backward "
            "pass): nothing to profile")
    return end.code or EXIT_USAGE


def _result(command: ScriptCommand, cfg: ProfileConfig, watch: StepWatch, end) -> dict:
    device = watch.window.device
    loader = None if watch.num_workers is None else \
        "serial" if watch.num_workers == 0 else f"multiprocess:{watch.num_workers}"
    context = {"loader": loader, "batch_size": watch.batch_size, "config": {},
               **machine_facts(device)}
    figures = watch.window.analyse(context, samples_per_step=watch.batch_size)
    verdict = figures.pop("verdict")
    in_script_words(verdict)
    first = cfg.skip + cfg.warmup + 2  # the anchor step is not analysed
    return {"workload": command.name, "script": list(command.argv), "device": str(device),
            "out": str(watch.out), "figures": figures, "verdict": verdict, "phases": None,
            "steps_seen": watch.steps, "profiled_steps": [first, first + cfg.steps - 1],
            "stopped_after_window": end.stopped, "script_exit_code": end.code,
            "estimate_only": "no A/B runs for a script yet: the lever is an estimate",
            "settings": {"skip": cfg.skip, "warmup": cfg.warmup, "steps": cfg.steps,
                         "loader": loader, "batch_size": watch.batch_size,
                         "script": command.text}}


SCRIPT_WORDS = {
    ("--loader", "multiprocess"): "load in worker processes: DataLoader(..., num_workers=N) "
                                  "in the script",
    ("--loader", "device"): "keep the dataset on the GPU and index its batches there",
    ("--compile",): "torch.compile the model",
    ("--precision", "bf16"): "torch.autocast(device_type, dtype=torch.bfloat16) around the "
                             "forward and the loss",
    ("--channels-last",): "the model and its inputs in torch.channels_last",
    ("--cuda-graph",): "capture the step as a CUDA graph (torch.cuda.graph)",
    ("--threads", "1"): "torch.set_num_threads(1)",
}
"""kasoku's flags of a lever (``Lever.args``) as the change to make in a script."""


def in_script_words(verdict: dict) -> None:
    """The verdict's lever as a change to the script rather than kasoku's flags, labelled as
    the estimate it is (nothing is measured for a script yet)."""
    lever = verdict["lever"]
    args = tuple(lever.get("args") or ())
    text = SCRIPT_WORDS.get(args)
    if text is None and args[:1] == ("--batch-size",):
        text = "a batch twice as large (scale the learning rate)"
    if text is None and args:
        text = f"{lever['text']} (kasoku's flag for its workloads: the same change by hand)"
    if text is not None:
        lever["text"] = text
    expect = f" ({lever['expect']})" if lever.get("expect") else ""
    verdict["line"] = f"{verdict['rule']}: {verdict['reason']} -> {lever['text']}{expect}"


def summary_lines(result: dict) -> list[str]:
    """kasoku's lines for a script's profile: what was profiled, the verdict, the files."""
    f, v = result["figures"], result["verdict"]
    first, last = result["profiled_steps"]
    lines = [f"{result['workload']}: steps {first}-{last} profiled on {result['device']}, "
             f"{f['step_ms']:.2f} ms per step"
             + (f", {f['samples_per_s']:.0f} samples/s" if f.get("samples_per_s") else "")
             + ("; the script stopped after the window" if result["stopped_after_window"]
                else ""),
             f"verdict (estimate: no A/B runs for a script yet): {v['line']}"]
    lines += [f"  also: {also}" for also in v.get("secondary") or []]
    lines.append(f"report: {result.get('report')}  trace: {result['out']}/trace.json")
    return lines
