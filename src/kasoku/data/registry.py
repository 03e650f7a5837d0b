"""Loader registry: ``@register_loader``, ``create_loader``, ``list_loaders``, the way workloads
are registered.

A loader is named by a spec, ``KIND`` or ``KIND:N`` (``threads:8``: N threads), as
``--loader`` takes it. Every registered kind is ``SerialLoader`` with the fetching moved
elsewhere, so all of them yield the same samples and resume from the same state; the tests
sweep the registry. This module imports no torch: a kind's builder imports its module when it
is first used, so listing the kinds or parsing a spec (the command line's help and its checks
of ``--loader``) loads nothing heavy, and the GPU decoders stay unimported on a CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag

DEFAULT_LOADER = "serial"
"""The loader of a run that names none (``TrainConfig.loader``'s default, ``kasoku scale
--data``'s)."""


@dataclass(frozen=True)
class LoaderKind:
    name: str
    build: Callable
    """``build(dataset, batch_size, device, count, **kwargs) -> loader``; ``count`` is the N of
    ``KIND:N`` or None; ``kwargs`` are ``SerialLoader``'s (``seed``, ``shuffle``, ``drop_last``,
    ``repeat``, ``rank``, ``world_size``) plus ``prefetch_batches`` and ``batches_per_call``
    where the kind takes them."""
    help: str
    """One line for the command line's help."""
    count: str | None = None
    """What N counts (``threads``, ``processes``...), or None when the kind takes no N."""
    prefetching: bool = False
    """Whether it makes batches ahead (takes ``prefetch_batches``, ``--prefetch``)."""
    chunks: bool = False
    """Whether it hands out several batches per call (``batches_per_call``)."""
    needs: str | None = None
    """What datasets it takes: None (any), ``"in-memory"`` (``inputs``/``targets`` tensors)
    or ``"image-folder"`` (``kasoku.data.imagefolder.ImageFolder``)."""
    host_workers: Callable[[int | None], int] | None = None
    """For a kind whose worker processes or threads run on the host's cores and can be pinned
    there (it takes ``worker_cpus``): how many it runs for the ``N`` of ``KIND:N`` (None: the
    kind's default); None for the other kinds."""


_REGISTRY: dict[str, LoaderKind] = {}


def register_loader(name: str, help: str, count: str | None = None, prefetching: bool = False,
                    chunks: bool = False, needs: str | None = None,
                    host_workers: Callable[[int | None], int] | None = None):
    """Decorator of a builder ``build(dataset, batch_size, device, count, **kwargs)``:
    registers the loader kind ``name`` (see ``LoaderKind``)."""
    def deco(build: Callable) -> Callable:
        if name in _REGISTRY:
            raise ValueError(f"loader {name!r} is registered twice")
        _REGISTRY[name] = LoaderKind(name, build, help, count, prefetching, chunks, needs,
                                     host_workers)
        return build
    return deco


def list_loaders() -> list[str]:
    """The registered kinds, in registration order (the built-in ones first)."""
    return list(_REGISTRY)


def loader_kind(name: str) -> LoaderKind:
    if name not in _REGISTRY:
        raise ConfigError(f"unknown loader {name!r}; use {spec_forms()}")
    return _REGISTRY[name]


def spec_forms() -> str:
    """``serial, device, threads[:N], ...``: every kind as a spec is written."""
    forms = [k.name + ("[:N]" if k.count else "") for k in _REGISTRY.values()]
    return ", ".join(forms[:-1]) + " or " + forms[-1] if len(forms) > 1 else forms[0]


def parse_loader_spec(spec: str) -> tuple[LoaderKind, int | None]:
    """``"threads:8" -> (the threads kind, 8)``; ``ConfigError`` for an unknown kind, an N the
    kind does not take, or an N that is not a whole number >= 1."""
    name, _, count = str(spec).strip().partition(":")
    if name not in _REGISTRY:
        raise ConfigError(f"unknown loader {spec!r}; use {spec_forms()}")
    kind = _REGISTRY[name]
    if not count:
        return kind, None
    if kind.count is None:
        raise ConfigError(f"loader {spec!r}: the {name} loader takes no :N; use {spec_forms()}")
    if not count.isdigit() or int(count) < 1:
        raise ConfigError(f"loader {spec!r}: N ({kind.count}) must be a whole number >= 1, "
                          f"got {count!r}")
    return kind, int(count)


def expand_loaders(text: str) -> list[str]:
    """``"serial,multiprocess:1,2,4"`` -> ``["serial", "multiprocess:1", "multiprocess:2",
    "multiprocess:4"]``: a bare number continues the kind before it. Each spec is checked as
    ``--loader`` checks it (``ConfigError``)."""
    specs: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item.isdigit():
            if not specs:
                raise ConfigError(f"{flag('train.loader')} {text}: {item} continues no loader "
                                  "kind; write the kind first, e.g. multiprocess:1,2,4")
            item = f"{specs[-1].partition(':')[0]}:{item}"
        parse_loader_spec(item)
        specs.append(item)
    if not specs:
        raise ConfigError(f"{flag('train.loader')} names no loader; e.g. serial,multiprocess:1,2,4")
    return specs


def check_loader_settings(spec: str, batches_per_call: int = 1, prefetch: int | None = None
                          ) -> tuple[LoaderKind, int | None]:
    """``parse_loader_spec(spec)``, and a ``ConfigError`` for settings the kind cannot take:
    ``prefetch`` for a kind that makes no batch ahead, ``batches_per_call`` > 1 for one that
    hands out one batch per call."""
    kind, count = parse_loader_spec(spec)
    if prefetch is not None:
        if not kind.prefetching:
            ahead = ", ".join(k.name for k in _REGISTRY.values() if k.prefetching)
            raise ConfigError(f"{flag('train.prefetch')} {prefetch}: the {kind.name} loader makes "
                              "each batch when it is asked for one and keeps none in flight; it "
                              f"applies to {ahead}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ConfigError(f"{flag('train.prefetch')} must be a whole number >= 1, got "
                              f"{prefetch!r}")
    if batches_per_call > 1 and not kind.chunks:
        loader = flag("train.loader")
        able = " or ".join(f"{loader} {k.name}" for k in _REGISTRY.values() if k.chunks)
        raise ConfigError(f"{flag('accel.steps_per_call')} {batches_per_call} needs a loader that "
                          f"hands out several batches per call; use {able}, or drop "
                          f"{flag('accel.steps_per_call')}")
    return kind, count


def host_workers(spec: str) -> int:
    """How many worker processes or threads a ``spec`` loader runs on the host's cores (0 for
    a kind that runs none there, or whose workers cannot be pinned: ``LoaderKind.host_workers``
    is None)."""
    kind, count = parse_loader_spec(spec)
    return kind.host_workers(count) if kind.host_workers is not None else 0


def create_loader(spec: str, dataset, batch_size: int, device="cpu", *,
                  batches_per_call: int = 1, prefetch: int | None = None,
                  worker_cpus=None, **kwargs):
    """The loader ``spec`` names over ``dataset`` (``--loader``). ``batches_per_call`` > 1:
    chunks of that many batches (for ``--steps-per-call``); ``prefetch``: batches kept in
    flight by the kinds that make them ahead (None: the kind's default); ``worker_cpus``: the
    CPUs its workers are pinned to (kinds with ``host_workers`` only); ``kwargs``:
    ``SerialLoader``'s. Settings the kind cannot take, and datasets it cannot read, are a
    ``ConfigError`` that says what to use."""
    kind, count = check_loader_settings(spec, batches_per_call, prefetch)
    if worker_cpus is not None:
        if kind.host_workers is None:
            raise ConfigError(f"the {kind.name} loader runs no workers on the host's cores "
                              f"to pin to CPUs {list(worker_cpus)}")
        kwargs["worker_cpus"] = worker_cpus
    if prefetch is not None:
        kwargs["prefetch_batches"] = prefetch
    if batches_per_call > 1:
        kwargs["batches_per_call"] = batches_per_call
    _check_dataset(kind, dataset)
    import torch  # deferred: this module loads without torch (see above)
    try:
        return kind.build(dataset, batch_size, torch.device(device), count, **kwargs)
    except ConfigError:
        raise
    except ValueError as exc:  # the loaders' checks of their settings (batch size, workers)
        raise ConfigError(f"{flag('train.loader')} {spec}: {exc}") from None


def accepts(kind: LoaderKind, dataset) -> bool:
    """Whether ``kind`` can read ``dataset`` (see ``LoaderKind.needs``)."""
    if kind.needs == "in-memory":
        if hasattr(dataset, "in_memory"):  # synthetic sets, held whole when small enough
            return bool(getattr(dataset, "held_in_memory", False))
        import torch  # deferred: this module loads without torch (see above)
        return isinstance(getattr(dataset, "inputs", None), torch.Tensor) \
            and isinstance(getattr(dataset, "targets", None), torch.Tensor) \
            and hasattr(dataset, "get_batch")
    if kind.needs == "image-folder":
        from kasoku.data.imagefolder import ImageFolder  # deferred: torch (module doc)
        return isinstance(dataset, ImageFolder)
    return True


def dataset_kind(dataset) -> str | None:
    """``"in-memory"``, ``"image-folder"`` or None: which of the ``needs`` ``dataset`` meets."""
    for needs in ("in-memory", "image-folder"):
        if accepts(LoaderKind("", None, "", needs=needs), dataset):
            return needs
    return None


def _check_dataset(kind: LoaderKind, dataset) -> None:
    if accepts(kind, dataset):
        return
    others = ", ".join(k.name for k in _REGISTRY.values() if accepts(k, dataset))
    what = {"in-memory": "in-memory datasets holding `inputs` and `targets` tensors (like "
                         "kasoku's MNIST and CIFAR-10 sets)",
            "image-folder": "JPEG folders (ImageFolder)"}[kind.needs]
    raise ConfigError(f"the {kind.name} loader reads {what}; this dataset "
                      f"({type(dataset).__name__}) is not one: use {flag('train.loader')} "
                      f"{others or 'serial'}")


# The built-in kinds. Builders import their module on first use (torch with it).

@register_loader("serial", "batches made in the training process", chunks=True)
def _serial(dataset, batch_size, device, count, batches_per_call=1, **kwargs):
    from kasoku.data.device_loader import ChunkedLoader  # deferred: torch, on first use
    from kasoku.data.loader import SerialLoader  # deferred: torch, on first use
    if batches_per_call > 1:
        return ChunkedLoader(dataset, batch_size, batches_per_call=batches_per_call, **kwargs)
    return SerialLoader(dataset, batch_size, **kwargs)


@register_loader("device", "the whole dataset resident on the training device; in-memory "
                 "datasets (MNIST, CIFAR-10)", chunks=True, needs="in-memory")
def _device(dataset, batch_size, device, count, **kwargs):
    from kasoku.data.device_loader import DeviceLoader  # deferred: torch, on first use
    return DeviceLoader(dataset, batch_size, device=device, **kwargs)


def _thread_count(count: int | None) -> int:
    from kasoku.data.parallel_loader import ThreadLoader  # deferred: torch, on first use
    return count or ThreadLoader.default_threads()


def _process_count(count: int | None) -> int:
    from kasoku.data.parallel_loader import ProcessLoader  # deferred: torch, on first use
    return count or ProcessLoader.default_workers()


@register_loader("threads", "samples decoded by N threads", count="threads", prefetching=True,
                 host_workers=_thread_count)
def _threads(dataset, batch_size, device, count, **kwargs):
    from kasoku.data.parallel_loader import ThreadLoader  # deferred: torch, on first use
    return ThreadLoader(dataset, batch_size, num_threads=count, **kwargs)


@register_loader("multiprocess", "batches made by N worker processes", count="processes",
                 prefetching=True, host_workers=_process_count)
def _multiprocess(dataset, batch_size, device, count, **kwargs):
    from kasoku.data.parallel_loader import ProcessLoader  # deferred: torch, on first use
    return ProcessLoader(dataset, batch_size, num_workers=count,
                         pin_memory=device.type == "cuda", **kwargs)


@register_loader("gpu-jpeg", "JPEG folders read by N threads, decoded, cropped and normalized "
                 "in batches on the GPU (decoder: torchvision, else nvImageCodec; "
                 "KASOKU_GPU_JPEG_DECODER=torchvision|nvimgcodec|pillow chooses)",
                 count="reading threads", prefetching=True, needs="image-folder")
def _gpu_jpeg(dataset, batch_size, device, count, **kwargs):
    from kasoku.data.gpu_jpeg import GpuJpegLoader  # deferred: torch, on first use
    return GpuJpegLoader(dataset, batch_size, device=device, num_threads=count, **kwargs)


@register_loader("gpu-jpeg-procs", "gpu-jpeg's work in N worker processes (default 8, at most "
                 "half the cores), batches handed over in GPU memory",
                 count="decoding processes", prefetching=True, needs="image-folder")
def _gpu_jpeg_procs(dataset, batch_size, device, count, **kwargs):
    from kasoku.data.gpu_jpeg_procs import GpuJpegProcessLoader  # deferred: torch, on first use
    return GpuJpegProcessLoader(dataset, batch_size, device=device, num_workers=count,
                                **kwargs)
