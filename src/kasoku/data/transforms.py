"""Shared augmentation pieces whose randomness comes from ``(seed, epoch, index)`` only.

Global RNG state differs between worker processes and is lost on resume; a counter-based hash
of the sample's identity is the same everywhere. So every random choice here is a pure
function of ``(seed, epoch, index, salt)``, where ``salt`` separates independent draws (crop
offset vs. flip) for the same sample.

Two flavours: vectorized (``index_hash``/``uniform`` on int64 tensors, for in-memory batches on
any device) and per-sample (``hash_int``, ``sample_rng`` -> ``random.Random``), with twins that
give the same numbers both ways (``crop_flip_params`` and ``crop_flip_params_batch``).
"""
from __future__ import annotations

import math
import random
from typing import Sequence

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _signed(x: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits (torch has no uint64 math)."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _mix64(x: int) -> int:
    """splitmix64's finalizer on a Python int (the scalar twin of ``_mix64_tensor``)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _MUL1) & _MASK64
    x = ((x ^ (x >> 27)) * _MUL2) & _MASK64
    return x ^ (x >> 31)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic; masking off the copied sign bits makes it logical.
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix64_tensor(x: torch.Tensor) -> torch.Tensor:
    # int64 multiplication wraps modulo 2**64 on CPU and CUDA, which is exactly uint64 math.
    x = (x ^ _shr(x, 30)) * _signed(_MUL1)
    x = (x ^ _shr(x, 27)) * _signed(_MUL2)
    return x ^ _shr(x, 31)


def _key(seed: int, epoch: int, salt: int) -> int:
    return _mix64(_mix64(_mix64(seed + _GOLDEN) + epoch + _GOLDEN) + salt + _GOLDEN)


def index_hash(seed: int, epoch: int, indices: torch.Tensor | Sequence[int],
               salt: int = 0) -> torch.Tensor:
    """64 well-mixed bits per index, as an int64 tensor of ``indices``' shape and device.

    A pure function of ``(seed, epoch, index, salt)``: the same sample gets the same bits
    whatever batch it is in, in whatever process. Distinct salts give independent streams.
    """
    idx = torch.as_tensor(indices, dtype=torch.int64)
    key = _key(int(seed), int(epoch), int(salt))
    # splitmix64 state for element i of stream `key` is key + (i + 1) * golden.
    return _mix64_tensor(_signed(key) + (idx + 1) * _signed(_GOLDEN))


def hash_int(seed: int, epoch: int, index: int, salt: int = 0) -> int:
    """``index_hash`` for one index, as a non-negative Python int (same bits)."""
    return _mix64(_key(int(seed), int(epoch), int(salt)) + (int(index) + 1) * _GOLDEN)


def uniform(seed: int, epoch: int, indices: torch.Tensor | Sequence[int],
            salt: int = 0) -> torch.Tensor:
    """Floats in ``[0, 1)`` (float32, 24 random bits, so exactly representable and never 1.0)."""
    return _shr(index_hash(seed, epoch, indices, salt), 40).to(torch.float32) * 2.0 ** -24


def sample_rng(seed: int, epoch: int, index: int, salt: int = 0) -> random.Random:
    """A ``random.Random`` for one sample's augmentation draws."""
    return random.Random(hash_int(seed, epoch, index, salt))


def normalize(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """``(x - mean) / std`` per channel; channels are dim -3 (``[C,H,W]`` or ``[N,C,H,W]``)."""
    m = torch.as_tensor(mean, dtype=x.dtype, device=x.device).view(-1, 1, 1)
    s = torch.as_tensor(std, dtype=x.dtype, device=x.device).view(-1, 1, 1)
    return (x - m) / s


class ToUnitFloat:
    """Batch transform: uint8 pixels -> float32 in ``[0, 1]``, then optionally per-channel
    normalized. A class (not a lambda) so datasets holding it pickle to worker processes."""

    def __init__(self, mean: Sequence[float] | None = None, std: Sequence[float] | None = None):
        if (mean is None) != (std is None):
            raise ValueError("give both mean and std, or neither")
        self.mean = tuple(mean) if mean is not None else None
        self.std = tuple(std) if std is not None else None
        self._coefficients: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.mean is None:
            return x.to(torch.float32) / 255.0
        # (x/255 - mean)/std folded into one multiply-add: this runs on every batch. The
        # coefficients are made once per device: building them per batch would be a
        # host-to-device copy (and a sync) on every GPU batch.
        if x.device not in self._coefficients:
            std = torch.as_tensor(self.std, dtype=torch.float32).view(-1, 1, 1)
            mean = torch.as_tensor(self.mean, dtype=torch.float32).view(-1, 1, 1)
            self._coefficients[x.device] = ((-mean / std).to(x.device),
                                            (1.0 / (255.0 * std)).to(x.device))
        offset, scale = self._coefficients[x.device]
        return torch.addcmul(offset, x.to(torch.float32), scale)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_coefficients": {}}

    def __repr__(self) -> str:
        return f"ToUnitFloat(mean={self.mean}, std={self.std})"


RRC_SCALE = (0.08, 1.0)
RRC_RATIO = (3 / 4, 4 / 3)
_RRC_TRIES = 10
_SALT_TOP, _SALT_LEFT, _SALT_FLIP = 2 * _RRC_TRIES, 2 * _RRC_TRIES + 1, 2 * _RRC_TRIES + 2
"""Draw ``2t`` / ``2t + 1`` is try ``t``'s area / log-aspect; then the offsets and the flip."""


def _unit(seed: int, epoch: int, index: int, salt: int) -> float:
    """``uniform`` for one index, as a Python float (the same value)."""
    return (hash_int(seed, epoch, index, salt) >> 40) * 2.0 ** -24


def crop_flip_params(seed: int, epoch: int, index: int, height: int, width: int,
                     scale: tuple[float, float] = RRC_SCALE,
                     ratio: tuple[float, float] = RRC_RATIO) -> tuple[int, int, int, int, bool]:
    """``(top, left, crop_height, crop_width, flip)`` of sample ``index``'s random-resized-crop
    (a crop covering ``scale`` of the area, aspect ratio log-uniform in ``ratio``; after 10
    failed tries the largest central crop with the ratio clamped into ``ratio``, the usual
    ImageNet recipe) and horizontal flip, every draw a function of ``(seed, epoch, index)``.

    ``crop_flip_params_batch`` computes the same integers for a whole batch at once (the GPU
    JPEG loader); this scalar twin is for images decoded one at a time (``ImageFolder``).
    """
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    flip = _unit(seed, epoch, index, _SALT_FLIP) < 0.5
    for t in range(_RRC_TRIES):
        target_area = area * (scale[0] + (scale[1] - scale[0]) * _unit(seed, epoch, index, 2 * t))
        aspect = math.exp(log_lo + (log_hi - log_lo) * _unit(seed, epoch, index, 2 * t + 1))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(_unit(seed, epoch, index, _SALT_TOP) * (height - h + 1))
            left = int(_unit(seed, epoch, index, _SALT_LEFT) * (width - w + 1))
            return top, left, h, w, flip
    top, left, h, w = _central_crop(height, width, ratio)
    return top, left, h, w, flip


def _central_crop(height: int, width: int, ratio) -> tuple[int, int, int, int]:
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def crop_flip_params_batch(seed: int, epoch: int, indices: Sequence[int],
                           heights: Sequence[int], widths: Sequence[int],
                           scale: tuple[float, float] = RRC_SCALE,
                           ratio: tuple[float, float] = RRC_RATIO
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``crop_flip_params`` for a batch, as tensor ops (float64 on the CPU, so every integer
    equals the scalar twin's): returns ``boxes`` (int64 ``[B, 4]``: top, left, height, width)
    and ``flips`` (bool ``[B]``)."""
    idx = torch.as_tensor(indices, dtype=torch.int64)
    height = torch.as_tensor(heights, dtype=torch.float64)
    width = torch.as_tensor(widths, dtype=torch.float64)
    n = len(idx)

    # Every draw of every sample in one pass: uniform()'s bits for salts 0.._SALT_FLIP.
    keys = torch.tensor([_signed(_key(int(seed), int(epoch), salt))
                         for salt in range(_SALT_FLIP + 1)])
    bits = _mix64_tensor(keys.view(1, -1) + (idx.view(n, 1) + 1) * _signed(_GOLDEN))
    draws = (_shr(bits, 40).to(torch.float32) * 2.0 ** -24).double()  # [B, salts]

    def unit(salts) -> torch.Tensor:  # [B, len(salts)]
        return draws[:, salts]

    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    area = (height * width).view(n, 1)
    target_area = area * (scale[0] + (scale[1] - scale[0])
                          * unit(slice(0, 2 * _RRC_TRIES, 2)))
    aspect = torch.exp(log_lo + (log_hi - log_lo) * unit(slice(1, 2 * _RRC_TRIES, 2)))
    w = torch.round(torch.sqrt(target_area * aspect))
    h = torch.round(torch.sqrt(target_area / aspect))
    fits = (w > 0) & (w <= width.view(n, 1)) & (h > 0) & (h <= height.view(n, 1))
    first = fits.int().argmax(1, keepdim=True)  # the first try that fits
    w, h = w.gather(1, first).view(n), h.gather(1, first).view(n)
    top = torch.floor(unit([_SALT_TOP]).view(n) * (height - h + 1))
    left = torch.floor(unit([_SALT_LEFT]).view(n) * (width - w + 1))
    boxes = torch.stack([top, left, h, w], 1).long()
    for k in torch.nonzero(~fits.any(1)).view(-1).tolist():  # rare: no try fit
        boxes[k] = torch.tensor(_central_crop(int(heights[k]), int(widths[k]), ratio))
    return boxes, unit([_SALT_FLIP]).view(n) < 0.5


def center_crop_box(height: int, width: int, size: int) -> tuple[int, int, int, int]:
    """``(left, top, right, bottom)`` of the central ``size`` x ``size`` square (PIL box)."""
    top = int(round((height - size) / 2.0))
    left = int(round((width - size) / 2.0))
    return left, top, left + size, top + size


def resize_shorter_to(height: int, width: int, size: int) -> tuple[int, int]:
    """``(new_width, new_height)`` with the shorter side ``size`` and the aspect ratio kept."""
    if height <= width:
        return max(size, int(round(width * size / height))), size
    return size, max(size, int(round(height * size / width)))


def crop_flip_batch(x: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, flip: torch.Tensor,
                    pad: int) -> torch.Tensor:
    """Crop each image of ``x`` ``[N,C,H,W]`` from its reflect-padded version at offset
    ``(dy, dx)`` in ``[0, 2*pad]``, mirrored where ``flip`` is true; same shape and dtype.

    One gather, no padded copy and no per-sample loop, so it works on uint8 and on any device.
    Reflection covers offsets up to ``H - 1``; ``pad`` must be smaller than H and W.
    """
    n, c, h, w = x.shape
    dev = x.device
    rows = _reflect(torch.arange(h, device=dev) + (dy.to(dev) - pad).view(-1, 1), h)
    cols = torch.arange(w, device=dev).expand(n, w)
    cols = torch.where(flip.to(dev).view(-1, 1), w - 1 - cols, cols)
    cols = _reflect(cols + (dx.to(dev) - pad).view(-1, 1), w)
    src = (rows.view(n, h, 1) * w + cols.view(n, 1, w)).view(n, 1, h * w)
    return x.reshape(n, c, h * w).gather(2, src.expand(n, c, h * w)).view(n, c, h, w)


def _reflect(i: torch.Tensor, size: int) -> torch.Tensor:
    """Index ``i`` in ``[-size+1, 2*size-2]`` mirrored into ``[0, size)`` without repeating the
    edge (numpy/torch 'reflect' padding)."""
    i = torch.where(i < 0, -i, i)
    return torch.where(i >= size, 2 * size - 2 - i, i)


def random_crop_flip(x: torch.Tensor, seed: int, epoch: int, indices: torch.Tensor,
                     pad: int = 4) -> torch.Tensor:
    """Random crop (reflect pad ``pad``) + horizontal flip of a batch, each sample's choice a
    function of ``(seed, epoch, its dataset index)`` only. ``pad`` must be < H and W."""
    span = 2 * pad + 1
    dy = (uniform(seed, epoch, indices, salt=1) * span).long()
    dx = (uniform(seed, epoch, indices, salt=2) * span).long()
    flip = uniform(seed, epoch, indices, salt=3) < 0.5
    return crop_flip_batch(x, dy, dx, flip, pad)
