"""What ``kasoku data bench`` measures loaders on: image folders (made with make-jpeg at the
asked resolutions, or given), or a workload's training set, each with the bytes per sample
that MB/s counts."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag
from kasoku.data.base import ArrayDataset
from kasoku.data.imagefolder import imagefolder_datasets
from kasoku.data.jpeg_synth import MARKER, make_jpeg_folder
from kasoku.workloads import create_workload, list_workloads

GENERATED_CLASSES = 10


@dataclass
class Source:
    name: str
    label: str
    kind: str
    resolution: str | None
    dataset: object
    sample_bytes: np.ndarray | int
    """Bytes per sample index (file sizes), or one size for every sample."""
    bytes_basis: str
    unit: str = "images"
    """What a sample is called in rates (a workload's ``sample_unit``)."""



def prepare_jpeg_folders(holder: Path, resolutions, images: int, seed: int = 0,
                         say=print) -> list[Path]:
    """``holder/WxH`` for each resolution: a make-jpeg folder of at least ``images`` images,
    reused when one is there, made (with a progress line) otherwise."""
    folders = []
    for w, h in resolutions:
        folder = Path(holder) / f"{w}x{h}"
        made = _make_jpeg_stats(folder)
        if made.get("complete") and made.get("num_images", 0) >= images \
                and (made.get("width"), made.get("height")) == (w, h):
            say(f"reusing {folder} ({made['num_images']} images)")
        else:
            say(f"making {images} JPEG images of {w}x{h} in {folder} ...")
            try:
                make_jpeg_folder(folder, images, w, h, seed=seed,
                                 num_classes=min(GENERATED_CLASSES, images))
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        folders.append(folder)
    return folders


def _make_jpeg_stats(folder: Path) -> dict:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return {}


def resolve_sources(req, image_size: int, say=print) -> list[Source]:
    """The datasets to measure (``req``: the ``DataBenchRequest``): generated folders, image
    folders or workloads' training sets."""
    if req.resolutions:
        if len(req.sources) > 1:
            raise ConfigError(f"with {flag('data_bench.resolution')} give at most one SOURCE: the "
                              "folder that holds the generated JPEG folders (default OUT/jpeg)")
        holder = Path(req.sources[0]) if req.sources else Path(req.out) / "jpeg"
        if req.sources and not holder.is_dir() and req.sources[0] in list_workloads():
            raise ConfigError(f"with {flag('data_bench.resolution')}, SOURCE is the folder to hold "
                              f"the generated JPEG folders; {req.sources[0]} is a workload")
        folders = prepare_jpeg_folders(holder, req.resolutions, req.images, req.seed, say)
        return [_folder_source(f, image_size, req, "generated") for f in folders]
    if not req.sources:
        raise ConfigError("give a SOURCE (an image folder or a workload) or "
                          f"{flag('data_bench.resolution')} WxH to measure generated JPEG "
                          "folders")
    sources = []
    for name in req.sources:
        if Path(name).is_dir():
            sources.append(_folder_source(Path(name), image_size, req, "folder"))
        elif name in list_workloads():
            sources.append(_workload_source(name, req))
        else:
            raise ConfigError(f"SOURCE {name!r} is neither a folder nor a workload: give an "
                              f"ImageNet-style image folder (ROOT/<class>/*.jpg; `kasoku data "
                              f"make-jpeg` makes one) or one of {', '.join(list_workloads())}")
    return sources


def _folder_source(root: Path, image_size: int, req, kind: str) -> Source:
    train, _ = imagefolder_datasets(root, image_size=image_size, seed=req.seed,
                                    strict=req.data.strict)
    made = _make_jpeg_stats(train.root)
    resolution = f"{made['width']}x{made['height']}" if made.get("complete") else None
    label = resolution if kind == "generated" else \
        f"{root.name} ({resolution})" if resolution else root.name
    return Source(str(root), label, kind, resolution, train, *_sample_bytes(train))


def _workload_source(name: str, req) -> Source:
    workload = create_workload(name)
    train, _ = workload.build_datasets(req.data, seed=req.seed)
    label = f"{name} ({'synthetic' if req.data.synthetic else 'data'})"
    return Source(name, label, "workload", None, train, *_sample_bytes(train),
                  unit=sample_word(workload))


def sample_word(workload) -> str:
    """What the data bench counts: a workload's samples, by its ``sample_unit`` where a sample
    is one of them (images), else as sequences of them (gpt: "64-token sequences"; a loader
    hands out whole sequences, so its rate is not tokens/s)."""
    n = workload.units_per_sample
    return workload.sample_unit if n == 1 else f"{n}-{workload.sample_unit.rstrip('s')} sequences"


def _sample_bytes(dataset) -> tuple[np.ndarray | int, str]:
    samples = getattr(dataset, "samples", None)
    if samples is not None:  # computed once per source: one stat per file
        return np.array([os.stat(path).st_size for path, _ in samples], np.int64), "file"
    inputs = getattr(dataset, "inputs", None)
    if isinstance(inputs, torch.Tensor):
        return inputs[0].numel() * inputs.element_size(), "stored sample"
    base = getattr(dataset, "base", None)  # a workload's synthetic split of stored bytes
    if base is not None and hasattr(base, "input_shape") and hasattr(base, "dtype"):
        return int(np.prod(base.input_shape)) * base.dtype.itemsize, "stored sample"
    x = torch.as_tensor(dataset[0][0])
    return x.numel() * x.element_size(), "delivered sample"


def in_memory(dataset):
    """``dataset`` in the form ``DeviceLoader`` takes (``inputs``/``targets`` tensors): a
    workload's synthetic split is gathered once, keeping its uint8 images and leaving its
    transform to run per batch, as the real MNIST and CIFAR-10 sets do."""
    base = getattr(dataset, "base", None)
    if hasattr(dataset, "inputs") or base is None or not hasattr(dataset, "start"):
        return dataset
    x, t = base.get_batch(torch.arange(dataset.start, dataset.start + len(dataset)))
    return ArrayDataset(x, t, transform=dataset.transform, name=dataset.name)
