"""``kasoku scale WORKLOAD --data DIR [--loader KIND[:N]]``: every worker reads its shard of
the workload's training split from DIR through a loader of ``kasoku.data.registry``, as a
data-parallel ``kasoku train`` does (``create_loader(rank=, world_size=)``: the same seed on
every worker, so one permutation per epoch and each worker every ``world_size``-th sample of
it), instead of synthetic batches already on the device.

Each step then pulls its batch inside the timed window: reading, decoding and (on a GPU) the
copy to the device, as in training. The time a step waits for its batch is measured beside
the step: on a CPU the host time inside ``next(loader)`` (the step cannot start before it
returns); on a GPU the device time between events recorded before and after it (what the GPU
sat idle for the batch, not the host time a queue of launched steps hides). Batches are
dropped at each epoch's end when incomplete, so every step has one shape (a captured CUDA
graph replays only that shape).

The launching process checks the request first (``check_data``), so a missing folder or a
loader that cannot read the dataset is one line, as in ``kasoku train``.

Test hook (environment): ``KASOKU_SCALE_RECORD_SAMPLES=DIR`` makes every worker write the
fingerprints of the samples it read (``sample_fingerprints``) to
``DIR/samples-{world_size}w-rank{rank}.json`` (hashing them runs inside the timed windows).
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import torch

from kasoku.advisor.levers import input_candidates, input_fallback
from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag
from kasoku.data.config import DataConfig
from kasoku.data.prefetch import wrap_for_device
from kasoku.data.registry import (
    DEFAULT_LOADER,
    accepts,
    create_loader,
    dataset_kind,
    host_workers,
    list_loaders,
    loader_kind,
    parse_loader_spec,
)
from kasoku.perf.profile.figures import StepFigures

SAMPLES_ENV = "KASOKU_SCALE_RECORD_SAMPLES"
INPUT_PCT = 15.0
"""A step waiting at least this share of its time for its batch names the loader as a limit
(the threshold of ``kasoku profile``'s input-bound rule)."""


def check_data(workload, root: Path | None, loader: str | None, batch_sizes, world_sizes,
               seed: int = 0) -> None:
    """Refuse, before any worker starts, what ``kasoku train`` would refuse: ``--loader``
    without ``--data``, a folder the workload cannot read (its own ``DataError``), a loader
    that cannot read this dataset (``ConfigError`` naming those that can), and a shard too
    small for one batch on the largest worker count."""
    if root is None:
        if loader is not None:
            raise ConfigError(f"{flag('train.loader')} needs {flag('data.root')} DIR: without it "
                              "every worker steps on synthetic batches already on its device")
        return
    spec = loader or DEFAULT_LOADER
    kind, _ = parse_loader_spec(spec)
    train, _ = workload.build_datasets(DataConfig(root=Path(root)), seed=seed)
    if not accepts(kind, train):
        able = ", ".join(k for k in list_loaders() if accepts(loader_kind(k), train))
        raise ConfigError(f"{flag('train.loader')} {spec}: the {kind.name} loader cannot read this "
                          f"dataset ({type(train).__name__} from {root}); use "
                          f"{flag('train.loader')} {able}")
    most = max(world_sizes)
    per_worker = math.ceil(len(train) / most)
    too_big = [b for b in batch_sizes if b > per_worker]
    if too_big:
        raise ConfigError(f"{flag('data.root')} {root}: {len(train)} training samples give each of "
                          f"{most} workers {per_worker}, fewer than a batch of {max(too_big)}; "
                          f"lower {flag('train.batch_size')}")


class ShardFeed:
    """This worker's shard of ``workload``'s training split under ``root``, batched by the
    ``spec`` loader onto ``device``. ``take(n, start)`` yields the next ``n`` batches, pulled
    as they are consumed (inside the timed window; ``start`` is ignored: the loader keeps its
    own position); ``wait_ms()`` is the time the steps waited for them since the last call
    (call it after the device is synchronized)."""

    def __init__(self, workload, root: Path, spec: str | None, batch_size: int,
                 device: torch.device, rank: int = 0, world_size: int = 1, seed: int = 0,
                 record_samples: bool = False):
        self.root, self.spec = Path(root), spec or DEFAULT_LOADER
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.device = device
        train, _ = workload.build_datasets(DataConfig(root=self.root), seed=seed)
        self.train_samples, self.kind = len(train), dataset_kind(train)
        shard = {"rank": rank, "world_size": world_size} if world_size > 1 else {}
        # The same seed on every worker: one permutation per epoch, split between them.
        self.inner = create_loader(self.spec, train, batch_size, device, seed=seed,
                                   drop_last=True, **shard)
        # On CUDA, host batches are copied ahead on a side stream (DevicePrefetcher).
        self.loader = wrap_for_device(self.inner, device)
        self.samples_read = 0
        self.seen: list[str] | None = [] if record_samples else None
        self._wait_s = 0.0
        self._events: list = []

    def take(self, n: int, start: int = 0):
        cuda = self.device.type == "cuda"
        for _ in range(n):
            if cuda:
                before = torch.cuda.Event(enable_timing=True)
                after = torch.cuda.Event(enable_timing=True)
                before.record()
                batch = next(self.loader)
                after.record()  # after the stream's wait for the batch's copy
                self._events.append((before, after))
            else:
                t0 = time.perf_counter()
                batch = next(self.loader)
                self._wait_s += time.perf_counter() - t0
            self.samples_read += len(batch[0])
            if self.seen is not None:
                self.seen.extend(sample_fingerprints(batch))
            yield batch

    def wait_ms(self) -> float:
        waited = 1e3 * self._wait_s + sum(a.elapsed_time(b) for a, b in self._events)
        self._wait_s, self._events = 0.0, []
        return waited

    def describe(self) -> dict:
        """The record's ``data``: where the batches came from and how much of it was read."""
        per_worker = math.ceil(self.train_samples / self.world_size)
        return {"source": "files", "root": str(self.root), "loader": self.spec,
                "dataset_kind": self.kind, "train_samples": self.train_samples,
                "samples_per_worker": per_worker,
                "loader_workers_per_worker": host_workers(self.spec),
                "samples_read_per_worker": self.samples_read,
                "epochs_read": self.samples_read / per_worker,
                "skipped_files": getattr(self.inner, "skipped", 0),
                "data_wait": ("device time between CUDA events around next(loader)"
                              if self.device.type == "cuda"
                              else "host time inside next(loader)")}

    def save_seen(self, folder: Path) -> Path:
        """The fingerprints read so far (test hook ``SAMPLES_ENV``), as JSON in ``folder``."""
        path = Path(folder) / f"samples-{self.world_size}w-rank{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rank": self.rank, "world_size": self.world_size,
                                    "fingerprints": self.seen or []}))
        return path

    def close(self) -> None:
        for loader in (self.loader, self.inner):
            loader.close()


def sample_fingerprints(batch) -> list[str]:
    """One short hash per sample of ``(inputs, targets)``: its input's and target's bytes."""
    x, y = (t.detach().cpu().contiguous() for t in batch[:2])
    return [hashlib.blake2b(_raw(x[i]) + _raw(y[i]), digest_size=8).hexdigest()
            for i in range(len(x))]


def _raw(t: torch.Tensor) -> bytes:
    return t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def data_cause(r: dict) -> tuple[float, str, list[str]] | None:
    """From a record fed by a loader whose steps wait ``INPUT_PCT`` or more of their time for
    their batch: (the share, the cause's words, what would help); else None."""
    data, wait = r.get("data") or {}, r.get("data_wait_ms")
    if data.get("source") != "files" or wait is None or not r["step_ms"]:
        return None
    pct = 100.0 * wait / r["step_ms"]
    if pct < INPUT_PCT:
        return None
    text = (f"{pct:.0f}% of each step ({wait:.2f} ms of {r['step_ms']:.2f}) waits for the "
            f"{data['loader']} loader's batches")
    facts = StepFigures(data_pct=pct, loader=data["loader"], data_kind=data.get("dataset_kind"),
                        device=r["device_type"])
    levers = input_candidates(facts) or [input_fallback(facts)]
    return pct, text, [lever.text for lever in levers]


__all__ = ["DEFAULT_LOADER", "INPUT_PCT", "SAMPLES_ENV", "ShardFeed", "check_data",
           "data_cause", "sample_fingerprints"]
