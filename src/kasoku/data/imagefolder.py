"""An ImageNet-style folder of JPEG/PNG files, ``root/<class>/<image>``, decoded with Pillow.

Training samples get the usual ImageNet recipe (random-resized-crop + horizontal flip),
validation samples resize-shorter-side + center-crop; both are normalized with the ImageNet
mean/std. Randomness comes from ``(seed, epoch, index)`` (``set_epoch``), so any worker
process produces the same sample, and so does a resumed run.

Bad files (empty, truncated, not an image, corrupt, unreadable: the rule every loader shares,
``kasoku.data.bad_files``): with ``strict=True`` the first one raises ``BadFile`` (a
``DataError``) naming it and why. Otherwise (the default) it is recorded in
``dataset.bad_files`` (a ``BadFileList``: path and reason, the first one warned about), and the
sample is replaced by the next good index searching forward, ``(i + 1) % n``, ... --
deterministic, so batches stay full and every loader (and a resumed run) sees the same
replacement. Loaders whose workers hold their own copy of the dataset collect these records
(``loader.skipped``, ``loader.skipped_files``, ``loader.skipped_records``).
"""
from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from kasoku.core.errors import DataError
from kasoku.data.bad_files import BadFile, BadFileList, decode_failure, read_checked
from kasoku.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    center_crop_box,
    crop_flip_params,
    resize_shorter_to,
)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
_MEAN = np.array(IMAGENET_MEAN, dtype=np.float32)
_STD = np.array(IMAGENET_STD, dtype=np.float32)
VAL_CROP_FRACTION = 0.875  # resize to 256 then crop 224, the standard ImageNet evaluation
_LAYOUT = ("expected an ImageNet-style layout: ROOT/<class name>/<image>.jpg (or .jpeg/.png), "
           "one folder per class; `kasoku data make-jpeg` makes a synthetic one")


class ImageFolder:
    """Map-style dataset over ``root/<class>/*.{jpg,jpeg,png}`` (case-insensitive).

    ``classes``: sorted class folder names; ``samples``: ``(path, class_index)`` sorted by class
    then file name. ``ds[i] -> (float32 [3, image_size, image_size], int64 label)``. A bad file
    (``kasoku.data.bad_files``: checked, then decoded by Pillow) raises ``BadFile`` naming it
    when ``strict``; otherwise it is skipped as the module docstring says (``bad_files``: those
    skipped so far, with their reasons).
    """

    def __init__(self, root: str | Path, train: bool, image_size: int = 224, seed: int = 0,
                 strict: bool = False):
        self.root, self.train = Path(root), bool(train)
        self.image_size, self.seed, self.epoch = int(image_size), int(seed), 0
        self.strict = bool(strict)
        self.classes, self.samples = _scan(self.root)
        self.name = f"{self.root} ({'train' if self.train else 'val'})"
        self.bad_files = BadFileList()

    def __len__(self) -> int:
        return len(self.samples)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __getitem__(self, index: int):
        n = len(self.samples)
        if index < 0:
            index += n
        first = None
        for candidate in range(index, index + n):
            try:
                return self._decode(candidate % n)
            except BadFile as bad:
                if self.strict:
                    raise
                self.note_bad(bad)
                first = first or bad
        raise DataError(f"{self.root}: none of its {n} images can be decoded (first: {first}); "
                        f"check the files or the folder.")

    def note_bad(self, bad: BadFile) -> None:
        """Record a skipped file in ``bad_files`` (loaders that decode the files themselves
        report theirs here too)."""
        self.bad_files.add(bad.path, bad.reason)

    def _decode(self, index: int):
        path, label = self.samples[index]
        img = self._load(path, index)
        # numpy, one thread: torch's intra-op pool would spin every core on this small image
        # in the loaders that decode in the training process (serial, threads).
        pixels = np.asarray(img, dtype=np.float32)
        x = np.ascontiguousarray(((pixels / 255.0 - _MEAN) / _STD).transpose(2, 0, 1))
        return torch.from_numpy(x), torch.tensor(label, dtype=torch.int64)

    def _load(self, path: Path, index: int) -> Image.Image:
        data = read_checked(path)  # the shared rule first: Pillow may decode a truncated JPEG
        try:
            with Image.open(io.BytesIO(data)) as img:
                return self._train_view(img, index) if self.train else self._val_view(img)
        except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as e:
            raise decode_failure(path, e) from e

    def _train_view(self, img: Image.Image, index: int) -> Image.Image:
        size = self.image_size
        width, height = img.size
        top, left, h, w, flip = crop_flip_params(self.seed, self.epoch, index, height, width)
        # JPEG can decode at 1/2, 1/4, 1/8 scale for free; only do it while the crop keeps at
        # least `size` pixels per side, so the result is still a downscale.
        scale = _draft(img, min(h, w) // size)
        img = _decoded_rgb(img)
        box = (left / scale, top / scale, (left + w) / scale, (top + h) / scale)
        out = img.resize((size, size), Image.BILINEAR, box=box)
        return out.transpose(Image.FLIP_LEFT_RIGHT) if flip else out

    def _val_view(self, img: Image.Image) -> Image.Image:
        size = self.image_size
        resize_to = int(round(size / VAL_CROP_FRACTION))
        width, height = img.size
        _draft(img, min(width, height) // resize_to)
        img = _decoded_rgb(img)
        new_w, new_h = resize_shorter_to(img.size[1], img.size[0], resize_to)
        img = img.resize((new_w, new_h), Image.BILINEAR)
        return img.crop(center_crop_box(new_h, new_w, size))

    def __repr__(self) -> str:
        return (f"ImageFolder({self.name}, n={len(self)}, classes={len(self.classes)}, "
                f"image_size={self.image_size})")


def _draft(img: Image.Image, reduce: int) -> float:
    """Ask a JPEG decoder for a 1/2, 1/4 or 1/8 scale decode, at most ``reduce`` times smaller;
    returns the scale it chose (original pixels per decoded pixel, 1.0 for a full decode)."""
    if img.format != "JPEG" or reduce < 2:
        return 1.0
    factor = 2 ** min(3, int(math.log2(reduce)))
    width, height = img.size
    chosen = img.draft("RGB", (max(1, width // factor), max(1, height // factor)))
    # draft() reports the area it covers in decoded pixels: (0, 0, width/scale, height/scale).
    return width / chosen[1][2] if chosen else 1.0


def _decoded_rgb(img: Image.Image) -> Image.Image:
    img.load()  # decode everything now, so a truncated file fails here and not half-way later
    return img.convert("RGB") if img.mode != "RGB" else img


def _scan(root: Path) -> tuple[list[str], list[tuple[Path, int]]]:
    if not root.is_dir():
        raise DataError(f"image folder {root} does not exist; {_LAYOUT}.")
    class_dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not class_dirs:
        raise DataError(f"{root} has no class folders; {_LAYOUT}.")
    classes, samples = [], []
    for label, folder in enumerate(class_dirs):
        files = sorted(p for p in folder.iterdir()
                       if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith(".")
                       and p.is_file())
        if not files:
            raise DataError(f"class folder {folder} has no .jpg/.jpeg/.png images; add images or "
                            f"remove the folder ({_LAYOUT}).")
        classes.append(folder.name)
        samples.extend((p, label) for p in files)
    return classes, samples


def imagefolder_datasets(root: str | Path, image_size: int = 224, seed: int = 0,
                         strict: bool = False) -> tuple[ImageFolder, ImageFolder | None]:
    """``(train, val or None)``: ``root/train`` and ``root/val`` when ``root/train`` exists
    (val None without ``root/val``), else ``root`` itself is the training set and val is None.
    Both share the class list of the training set; a val class it lacks is a ``DataError``.
    ``strict``: a bad file is an error instead of a skipped, counted warning."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"image folder {root} does not exist; {_LAYOUT} (optionally split into "
                        "ROOT/train and ROOT/val).")
    if not (root / "train").is_dir():
        return ImageFolder(root, train=True, image_size=image_size, seed=seed,
                           strict=strict), None
    train = ImageFolder(root / "train", train=True, image_size=image_size, seed=seed,
                        strict=strict)
    if not (root / "val").is_dir():
        return train, None
    val = ImageFolder(root / "val", train=False, image_size=image_size, seed=seed,
                      strict=strict)
    if val.classes != train.classes:
        only_val = sorted(set(val.classes) - set(train.classes))
        only_train = sorted(set(train.classes) - set(val.classes))
        raise DataError(f"{root / 'val'} and {root / 'train'} have different class folders "
                        f"(only in val: {only_val[:5]}, only in train: {only_train[:5]}); labels "
                        "would not match. Give both the same class folders.")
    return train, val
