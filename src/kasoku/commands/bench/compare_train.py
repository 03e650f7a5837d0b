"""``kasoku compare WORKLOAD --epochs N``: seed 001's time-to-accuracy comparison. The workload
trains on each device in turn with ``kasoku train``'s machinery (one ``kasoku.run.RunConfig``
per device, resolved and checked, then ``commands.train.train_run``: the same trainer, log and
run folder), each device with its stated settings
(``TRAIN_SETTINGS``, or the rung a ``--cpu-config``/``--gpu-config`` names); then the logs
side by side, the total time per device and the ratio.

One ``kasoku.compare/1`` line (``form: "time-to-accuracy"``) goes to ``OUT/results.jsonl``;
each device's run folder is ``OUT/train-WORKLOAD-DEVICE-DATE-TIME``.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import sys
from pathlib import Path

import torch

from kasoku.commands.bench.compare import RESULTS_FILE, SCHEMA
from kasoku.commands.bench.compare_report import side_by_side, totals_line
from kasoku.commands.bench.results import append_result
from kasoku.commands.bench.rungs import reference_rung, rung_from_spec
from kasoku.commands.train import train_run
from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag
from kasoku.data.config import DataConfig
from kasoku.run import resolve
from kasoku.train.config import TrainConfig
from kasoku.train.run_dir import default_out
from kasoku.workloads import create_workload

TRAIN_SETTINGS = {"cpu": ("+fused", "serial"),
                  "cuda": ("precision=tf32,optimizer_impl=fused,cuda_graph", "device")}
"""Device type -> (the levers, as a rung label or a spec; the loader) of each device's run:
on a CPU the fused weight update (the CPU ladder's best rung for the MLP), on a GPU the
dataset resident on the device and the whole step as one CUDA graph."""


@dataclasses.dataclass(frozen=True)
class DeviceRun:
    device: str
    label: str
    """The levers as given (a rung label or a spec)."""
    config: dict
    loader: str
    out: Path
    log: list[dict]

    @property
    def elapsed_s(self) -> float:
        return float(self.log[-1]["elapsed_time"]) if self.log else 0.0


def train_settings(device_type: str, spec: str | None):
    """``(label, AccelConfig, loader)`` of a device's run: ``spec`` (a ladder label or lever
    settings) or the device's ``TRAIN_SETTINGS``."""
    label, loader = TRAIN_SETTINGS[device_type]
    rung = rung_from_spec(spec or label, device_type)
    config = rung.config if rung.config is not None else reference_rung(device_type).config
    return spec or label, config, loader


def train_on_devices(workload: str, devices: tuple[str, ...], data: DataConfig, epochs: float,
                     out: Path, specs: dict | None = None, threads: int | None = None,
                     seed: int = 0, stream=None) -> list[DeviceRun]:
    """Train ``workload`` for ``epochs`` on each device in turn (the trainer prints its log as
    it goes), then print the logs side by side and the totals, and append the compare line.
    Returns each device's run."""
    stream = stream or sys.stdout
    wl = create_workload(workload)
    if len(set(torch.device(d).type for d in devices)) != len(devices):
        raise ConfigError(f"{flag('compare.devices')} {','.join(devices)}: name each device once")
    runs = []
    for device in devices:
        dtype = torch.device(device).type
        label, accel, loader = train_settings(dtype, (specs or {}).get(dtype))
        run_out = default_out(f"{wl.name}-{dtype}", root=out, kind="train")
        print(f"# {wl.name} on {device}: {label}, {loader} loader, {epochs:g} "
              f"epoch{'' if epochs == 1 else 's'}", file=stream, flush=True)
        train = TrainConfig(epochs=epochs, device=device, out=run_out, loader=loader,
                            threads=threads if dtype == "cpu" else None, seed=seed,
                            progress=False)
        run = resolve(wl, data, train, accel)
        run.check()
        trainer = train_run(run)
        log = [dict(e) for e in trainer.get_extension("LogReport").entries]
        runs.append(DeviceRun(device, label, {"kind": "kasoku", **dataclasses.asdict(accel)},
                              loader, run_out, log))
    print_runs(wl.name, runs, stream)
    append_result(out, record(wl.name, epochs, data, runs), RESULTS_FILE)
    return runs


def print_runs(workload: str, runs: list[DeviceRun], stream=None) -> None:
    """The logs side by side, each device's settings, and the totals."""
    stream = stream or sys.stdout
    print(f"\n{workload}: the logs side by side", file=stream)
    for line in side_by_side({r.device: r.log for r in runs}):
        print(line, file=stream)
    for r in runs:
        print(f"{r.device}: {r.label}, {r.loader} loader (run folder {r.out})", file=stream)
    print(totals_line({r.device: r.elapsed_s for r in runs}), file=stream, flush=True)


def record(workload: str, epochs: float, data: DataConfig, runs: list[DeviceRun]) -> dict:
    """The ``kasoku.compare/1`` line of a time-to-accuracy comparison."""
    first = runs[0].elapsed_s if runs else 0.0
    return {"schema": SCHEMA, "form": "time-to-accuracy",
            "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "workload": workload, "epochs": epochs,
            "data": "synthetic" if data.synthetic else str(data.root),
            "devices": {r.device: {"label": r.label, "config": r.config, "loader": r.loader,
                                   "out": str(r.out), "elapsed_s": r.elapsed_s,
                                   "final": r.log[-1] if r.log else None, "log": r.log}
                        for r in runs},
            "speedup_over_first": {r.device: first / r.elapsed_s for r in runs
                                   if r.elapsed_s > 0}}
