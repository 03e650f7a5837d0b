"""``DevicePrefetcher``: the next batch's host-to-device copy runs while the current step does.

A host loader (``SerialLoader``, ``ThreadLoader``, ``ProcessLoader``) hands out CPU tensors
and the Updater copies each batch to the GPU just before its step: the step waits for its own
copy, and from pageable memory the copy also holds up the host. ``DevicePrefetcher`` hands
out batch ``n`` and at once starts copying batch ``n + 1`` from pinned memory on a side CUDA
stream, so the copy overlaps step ``n`` and step ``n + 1`` finds its batch on the device (the
apex ``data_prefetcher`` pattern); the Updater's own ``.to(device)`` then does nothing.

Pulling one batch ahead moves the inner loader one batch ahead of the trainer. The wrapper
reports the loader as the trainer has consumed it -- ``epoch``, ``position``,
``is_new_epoch``, ``epoch_detail``, ``last_chunk_batches`` and ``state_dict()`` as they were
right after the batch it last handed out was pulled -- so triggers, schedules and snapshots
(exact resume) see what they see with the bare loader.
"""
from __future__ import annotations

import torch

from kasoku.core.queues import check_queues
from kasoku.data.base import Loader
from kasoku.data.device_loader import DeviceLoader

_VIEW = ("epoch", "position", "is_new_epoch", "epoch_detail", "last_chunk_batches")
"""The loader attributes that describe where the consumer is (recorded with each batch)."""


def wrap_for_device(loader, device: torch.device):
    """``loader`` in a ``DevicePrefetcher`` when ``device`` is a CUDA device and the loader
    hands out host batches; otherwise ``loader`` itself (CPU training, ``DeviceLoader``, and
    loaders that say ``yields_device_batches = True``)."""
    device = torch.device(device)
    if device.type != "cuda" or isinstance(loader, DeviceLoader) \
            or getattr(loader, "yields_device_batches", False):
        return loader
    return DevicePrefetcher(loader, device)


class DevicePrefetcher:
    """``loader``'s batches, already on ``device``, the next one's copy started as this one is
    handed out (see the module docstring).

    On CUDA the copy runs on a side stream, from pinned memory (a batch not pinned yet is
    pinned first); the consumer's stream waits for it when the batch is handed out. On any
    other device the batch is moved with a plain ``.to(device)`` (no overlap: for tests).
    The first batch is pulled on the first ``next()``; ``load_state_dict`` and ``reset``
    drop the batch pulled ahead and pull again lazily. A non-repeating loader's
    ``StopIteration`` comes after the last batch has been handed out, and an error pulling
    the batch ahead is raised by the ``next()`` that would have handed it out.

    Any other attribute (``batches_per_epoch``, ``dataset``, ``batch_size``, ``skipped``,
    ``close`` ...) is the inner loader's.
    """

    yields_device_batches = True

    def __init__(self, loader: Loader, device):
        self.loader = loader
        device = torch.device(device)
        if device.type == "cuda":
            check_queues("DevicePrefetcher")  # before CUDA starts, where it has not yet
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._view_names = tuple(name for name in _VIEW if hasattr(loader, name))
        self._pending = None  # (batch on the device or on its way, copy-done event, view)
        self._error: Exception | None = None
        self._view: dict | None = None  # None: nothing handed out yet, the loader's own

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self.loader)

    def __next__(self):
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if self._pending is None:
            self._pending = self._pull()  # StopIteration here: nothing left to hand out
        batch, done, self._view = self._pending
        self._pending = None
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            for x in batch:
                if isinstance(x, torch.Tensor) and x.is_cuda:
                    # Allocated on the side stream: not reusable before `current` is done too.
                    x.record_stream(current)
        try:
            self._pending = self._pull()
        except StopIteration:
            pass
        except Exception as exc:
            self._error = exc
        return batch

    def _pull(self):
        host = next(self.loader)
        view = {name: getattr(self.loader, name) for name in self._view_names}
        view["state"] = self.loader.state_dict()
        if self._stream is None:
            return tuple(_move(x, self.device) for x in host), None, view
        with torch.cuda.stream(self._stream):
            batch = tuple(_copy_async(x, self.device) for x in host)
            done = torch.cuda.Event()
            done.record(self._stream)
        return batch, done, view

    def _seen(self, name: str):
        return self._view[name] if self._view is not None else getattr(self.loader, name)

    epoch = property(lambda self: self._seen("epoch"))
    position = property(lambda self: self._seen("position"))
    is_new_epoch = property(lambda self: self._seen("is_new_epoch"))
    epoch_detail = property(lambda self: self._seen("epoch_detail"))

    def __getattr__(self, name: str):
        # Only reached for names not found on the wrapper: a viewed one (last_chunk_batches)
        # or the inner loader's.
        if name.startswith("__") or "_view" not in self.__dict__:
            raise AttributeError(name)
        view = self._view
        if view is not None and name in view and name != "state":
            return view[name]
        return getattr(self.loader, name)

    def state_dict(self) -> dict:
        """The inner loader's state as of the batch last handed out."""
        return dict(self._view["state"]) if self._view is not None else self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
        self._drop()

    def reset(self) -> None:
        self.loader.reset()
        self._drop()

    def _drop(self) -> None:
        self._pending = self._error = self._view = None

    def close(self) -> None:
        self._drop()
        self.loader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DevicePrefetcher({self.loader!r}, device={self.device})"


def _move(x, device: torch.device):
    return x.to(device) if isinstance(x, torch.Tensor) else x


def _copy_async(x, device: torch.device):
    if not isinstance(x, torch.Tensor):
        return x
    if x.device.type == "cpu" and not x.is_pinned():
        x = x.pin_memory()  # from pageable memory a non_blocking copy is synchronous
    return x.to(device, non_blocking=True)
