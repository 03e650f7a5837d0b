"""A synthetic ImageNet-style JPEG folder, for loader benchmarks on machines without ImageNet.

Decode cost depends on resolution and on how much detail the JPEG holds, so the images are
built like photographs rather than flat noise or flat colour: a smooth colour gradient, soft
shapes, and texture at several scales. A 500x375 image at quality 90 comes out near ImageNet's
average file size (~110 KB). Each image depends only on ``(seed, index)``.
"""
from __future__ import annotations

import contextlib
import functools
import json
import multiprocessing as mp
import os
import re
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag
from kasoku.core.status_line import StatusLine

MARKER = ".kasoku-make-jpeg.json"
# (grid cells across the image's longer side, amplitude in 8-bit levels): coarse lighting down
# to pixel grain; the fine octaves set the file size, as sensor noise and texture do in photos.
_OCTAVES = ((4, 40.0), (32, 24.0), (160, 24.0), (0, 17.0))


def make_jpeg_folder(out: str | Path, num_images: int, width: int, height: int,
                     num_classes: int = 10, quality: int = 90, seed: int = 0,
                     progress: bool = True, workers: int | None = None) -> dict:
    """Write ``num_images`` JPEGs as ``out/class_XXX/img_XXXXXX.jpg`` (image ``i`` in class
    ``i % num_classes``) and return stats: ``num_images``, ``num_classes``, ``width``,
    ``height``, ``quality``, ``seed``, ``total_bytes``, ``mean_bytes``, ``elapsed_s``, ``out``.

    Refuses (``ConfigError``) a non-empty ``out`` that is not a previous make-jpeg output; a
    previous output is replaced. ``workers`` processes write the images (default: one per
    core; 1 writes them here); the files are the same whatever the count.
    """
    out = Path(out)
    _check_args(num_images, width, height, num_classes, quality)
    _prepare(out)
    # The marker goes first, so an interrupted run's folder is still recognised and replaced.
    (out / MARKER).write_text(json.dumps({"complete": False}) + "\n")
    start, total_bytes = time.perf_counter(), 0
    for c in range(num_classes):
        (out / f"class_{c:03d}").mkdir(parents=True, exist_ok=True)
    workers = min(workers or os.cpu_count() or 1, num_images)
    job = functools.partial(_write_image, out, width, height, num_classes, quality, seed)
    with contextlib.ExitStack() as stack:
        if workers > 1:
            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            pool = stack.enter_context(mp.get_context(method).Pool(workers))
            sizes = pool.imap(job, range(num_images), chunksize=16)
        else:
            sizes = map(job, range(num_images))
        line = stack.enter_context(StatusLine()) if progress else None
        for i, size in enumerate(sizes):
            total_bytes += size
            if line and (i + 1 == num_images or (i + 1) % 100 == 0):
                line.update(f"make-jpeg: {i + 1}/{num_images} images")
    stats = {"num_images": num_images, "num_classes": num_classes, "width": width,
             "height": height, "quality": quality, "seed": seed, "total_bytes": total_bytes,
             "mean_bytes": total_bytes / num_images,
             "elapsed_s": time.perf_counter() - start, "out": str(out)}
    (out / MARKER).write_text(json.dumps(dict(stats, complete=True), indent=1) + "\n")
    return stats


def _write_image(out: Path, width: int, height: int, num_classes: int, quality: int, seed: int,
                 i: int) -> int:
    c = i % num_classes
    path = out / f"class_{c:03d}" / f"img_{i:06d}.jpg"
    synth_image(width, height, c, num_classes, seed, i).save(path, "JPEG", quality=quality)
    return path.stat().st_size


def _check_args(num_images, width, height, num_classes, quality) -> None:
    if num_images < 1 or num_classes < 1:
        raise ConfigError(f"need num_images >= 1 and num_classes >= 1, got {num_images} and "
                          f"{num_classes}")
    if num_images < num_classes:
        raise ConfigError(f"{num_images} images cannot fill {num_classes} class folders (an image "
                          f"folder needs an image in each); give {flag('make_jpeg.count')} >= "
                          f"{flag('make_jpeg.classes')}, or fewer {flag('make_jpeg.classes')}")
    if width < 8 or height < 8:
        raise ConfigError(f"images must be at least 8x8 pixels, got {width}x{height}")
    if not 1 <= quality <= 100:
        raise ConfigError(f"JPEG quality must be in 1..100 (90 is ImageNet-like), got {quality}")


def _prepare(out: Path) -> None:
    """Make ``out`` ready: create it, or clear a previous make-jpeg output; refuse anything else."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file; give a folder path for the JPEG folder")
    if not out.exists() or not any(out.iterdir()):
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"{out}: cannot create the folder ({exc.strerror or exc}); "
                              f"choose a folder you can write to") from None
        return
    if not (out / MARKER).is_file():
        raise ConfigError(f"{out} is not empty and was not made by `kasoku data make-jpeg`; "
                         "refusing to write into it. Give a new or empty folder, or delete "
                         "this one first.")
    # Delete only what make-jpeg writes, so a file a user put there by hand survives.
    for folder in out.iterdir():
        if folder.is_dir() and re.fullmatch(r"class_\d{3}", folder.name):
            for f in folder.iterdir():
                if re.fullmatch(r"img_\d{6}\.jpg", f.name):
                    f.unlink()
            if not any(folder.iterdir()):
                folder.rmdir()
    (out / MARKER).unlink()


def synth_image(width: int, height: int, label: int, num_classes: int, seed: int,
                index: int) -> Image.Image:
    """One photograph-like RGB image, a pure function of its arguments. The class sets the
    dominant hue, so a model can learn something from the folder."""
    rng = np.random.default_rng([seed, index, 0x4A5047])
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    yy /= height
    xx /= width
    hue = 2 * np.pi * (label + rng.uniform(-0.3, 0.3)) / num_classes
    base = 128 + 70 * np.cos(hue + np.array([0, 2.1, 4.2], dtype=np.float32))
    corners = base + rng.normal(0, 35, size=(2, 2, 3)).astype(np.float32)
    w00, w01 = (1 - yy) * (1 - xx), (1 - yy) * xx
    w10, w11 = yy * (1 - xx), yy * xx
    img = (corners[0, 0] * w00[..., None] + corners[0, 1] * w01[..., None]
           + corners[1, 0] * w10[..., None] + corners[1, 1] * w11[..., None])
    scene = _draw_shapes(Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB"), rng)
    # Texture goes on last so it covers the shapes too, as lighting and grain would.
    img = np.asarray(scene, dtype=np.float32) + _texture(rng, width, height)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")


def _texture(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    out = np.zeros((height, width, 3), dtype=np.float32)
    longer = max(width, height)
    detail = rng.uniform(0.6, 1.4)  # photos range from smooth to busy, and so do file sizes
    for cells, amplitude in _OCTAVES:
        amplitude *= detail
        if cells == 0 or cells >= longer:  # pixel-level grain needs no upsampling
            out += amplitude * rng.standard_normal(size=out.shape, dtype=np.float32)
            continue
        gw, gh = max(2, cells * width // longer), max(2, cells * height // longer)
        grid = amplitude * rng.standard_normal(size=(gh, gw, 3), dtype=np.float32)
        for ch in range(3):
            layer = Image.fromarray(grid[..., ch], "F").resize((width, height), Image.BICUBIC)
            out[..., ch] += np.asarray(layer)
    return out


def _draw_shapes(picture: Image.Image, rng: np.random.Generator) -> Image.Image:
    """Flat ellipses and rectangles with slightly blurred edges, like out-of-focus objects."""
    width, height = picture.size
    draw = ImageDraw.Draw(picture)
    for _ in range(int(rng.integers(3, 9))):
        cx, cy = rng.uniform(0, width), rng.uniform(0, height)
        rx, ry = rng.uniform(0.05, 0.3) * width, rng.uniform(0.05, 0.3) * height
        color = tuple(int(v) for v in rng.integers(0, 256, size=3))
        box = (cx - rx, cy - ry, cx + rx, cy + ry)
        if rng.random() < 0.5:
            draw.ellipse(box, fill=color)
        else:
            draw.rectangle(box, fill=color)
    return picture.filter(ImageFilter.GaussianBlur(radius=1.5))
