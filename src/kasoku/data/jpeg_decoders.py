"""The JPEG decoders behind ``GpuJpegLoader``: torchvision's batched nvJPEG decode,
nvImageCodec, and Pillow on the host (the fallback, and the CPU path of the tests).

A decoder has ``name``, ``layout`` (``hwc`` or ``chw``: how its images lie in memory),
``load(path)`` (in a reading thread: the file as the decoder takes it) and ``decode(loaded,
device) -> (images, buffers)``: one image tensor per file, None where it failed, and whatever
must stay alive until the device has read the images. ``make_decoder`` picks one.

Every ``load`` applies the rule all loaders share (``kasoku.data.bad_files``) before the file
reaches a decoder, raising ``BadFile``: nvJPEG would decode a truncated JPEG that Pillow
refuses, so without the rule the loaders would skip different files.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import torch

from kasoku.core.errors import warn_once
from kasoku.data.bad_files import (
    BadFile,
    check_file,
    decode_failure,
    read_checked,
    truncation,
)

DECODERS = ("auto", "nvimgcodec", "torchvision", "pillow")
DECODER_ENV = "KASOKU_GPU_JPEG_DECODER"
"""Environment variable choosing the decoder of ``--loader gpu-jpeg`` (default ``auto``)."""

HWC, CHW = "hwc", "chw"


class CpuImage:
    """An HWC uint8 image decoded on the host (by Pillow) inside a GPU-decoded batch."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def read_bytes(path: Path) -> bytes:
    """The file's bytes, checked by the shared rule (``BadFile``: empty, truncated,
    unreadable)."""
    return read_checked(path)


def pillow_decode(data: bytes, path) -> torch.Tensor:
    """HWC uint8 RGB pixels of the image ``data`` (``BadFile``: not an image, corrupt)."""
    import io

    from PIL import Image
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            rgb = img.convert("RGB") if img.mode != "RGB" else img
            return torch.from_numpy(np.asarray(rgb, dtype=np.uint8).copy())
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as exc:
        raise decode_failure(path, exc) from exc


class _PillowDecoder:
    """Decodes in the reading threads (``load``); ``decode`` only hands the images on."""
    name, layout = "pillow", HWC

    def load(self, path: Path):
        return CpuImage(pillow_decode(read_bytes(path), path))

    def decode(self, prepared, device):
        if device.type == "cuda":  # one host-to-device copy per batch, not per image
            good = [p for p in prepared if p is not None]
            if good:
                flat = torch.cat([p.tensor.reshape(-1) for p in good]).pin_memory()
                flat = flat.to(device, non_blocking=True)
                out, start = [], 0
                for p in prepared:
                    if p is None:
                        out.append(None)
                        continue
                    n = p.tensor.numel()
                    out.append(flat[start:start + n].view(p.tensor.shape))
                    start += n
                return out, None
        return [p.tensor if p is not None else None for p in prepared], None


class _NvImgCodecDecoder:
    """nvImageCodec: the GPU's hardware JPEG decoder where it has one, else CUDA nvJPEG."""
    name, layout = "nvimgcodec", HWC

    def __init__(self, device: torch.device):
        from nvidia import nvimgcodec
        self._nv, self._device_id = nvimgcodec, device.index or 0
        self._local = threading.local()  # one Decoder per decoding thread
        self._decoder()  # fails here, not in a loader thread, when the library cannot load

    def _decoder(self):
        decoder = getattr(self._local, "decoder", None)
        if decoder is None:
            decoder = self._local.decoder = self._nv.Decoder(device_id=self._device_id)
        return decoder

    def load(self, path: Path):
        check_file(path)  # its first and last bytes only: the rule before the library reads it
        # Read and parsed by the library (no Python bytes objects per file).
        return self._nv.CodeStream(str(path))

    def decode(self, prepared, device):
        where = [k for k, p in enumerate(prepared) if p is not None]
        streams = [prepared[k] for k in where]
        out = [None] * len(prepared)
        stream = torch.cuda.current_stream(device).cuda_stream
        decoded = self._decoder().decode(streams, cuda_stream=stream) if streams else []
        for k, image in zip(where, decoded):
            if image is not None and image.shape[2] == 3:
                out[k] = torch.as_tensor(image, device=device)
        return out, decoded  # the Images own the pixels: keep them until the stream is done


class _TorchvisionDecoder:
    """torchvision's batched ``decode_jpeg(device="cuda")`` (nvJPEG on the CUDA cores)."""
    name, layout = "torchvision", CHW

    def __init__(self, device: torch.device):
        from torchvision.io import ImageReadMode, decode_jpeg, read_file
        self._decode, self._mode, self._read = decode_jpeg, ImageReadMode.RGB, read_file

    def load(self, path: Path):
        try:
            data = self._read(str(path))  # a torch op: the file is read without the GIL
        except RuntimeError as exc:
            raise BadFile(path, f"unreadable: {exc}") from exc
        truncation(data.numpy(), path)  # nvJPEG would decode a truncated JPEG: the rule first
        return data

    def decode(self, prepared, device):
        out = [None] * len(prepared)
        where = [k for k, p in enumerate(prepared) if p is not None]
        try:
            images = self._decode([prepared[k] for k in where], mode=self._mode, device=device)
            for k, image in zip(where, images):
                out[k] = image
        except RuntimeError:  # one bad file fails the batch: find it one by one
            for k in where:
                try:
                    out[k] = self._decode(prepared[k], mode=self._mode, device=device)
                except RuntimeError:
                    pass
        return out, None




def make_decoder(choice: str, device: torch.device, own_process: bool = False):
    """The decoder ``choice`` names (``KASOKU_GPU_JPEG_DECODER`` overrides it). ``auto``
    takes torchvision's, else nvImageCodec's, else Pillow; ``own_process`` (a decoding
    worker process, whose GIL nothing else needs) puts nvImageCodec first."""
    choice = os.environ.get(DECODER_ENV, "") or choice
    if choice not in DECODERS:
        raise ValueError(f"unknown JPEG decoder {choice!r} ({DECODER_ENV}); use one of "
                         f"{', '.join(DECODERS)}")
    if device.type != "cuda":
        if choice in ("nvimgcodec", "torchvision"):
            raise ValueError(f"the {choice} decoder needs a CUDA device; {device} has none")
        _say_once(f"gpu-jpeg on {device}: JPEGs are decoded by Pillow in the reading threads "
                  f"and cropped as one batch on the CPU (there is no GPU to decode on)")
        return _PillowDecoder()
    # torchvision first: on an H200 both decode a batch in the same time (the hardware
    # decoder), but nvImageCodec's Python call holds the GIL while it decodes, so a second
    # decoding thread and the training thread stall behind it (research/notebook.md).
    # In a worker process of its own, nvImageCodec's hardware decoder was the faster on
    # 2026-11-21 (gpu-jpeg-procs:6 on an H200, bs 256: 20,968 images/s, torchvision's 18,563)
    # and the slower on 2026-11-29 (gpu-jpeg-procs:4 on another, bs 512: 17,577, torchvision's
    # 20,960): kept until a like-for-like measurement decides (docs/benchmarks.md).
    order = ([["torchvision", "nvimgcodec"], ["nvimgcodec", "torchvision"]][own_process]
             if choice == "auto" else [choice])
    failures = []
    for name in order:
        if name == "pillow":
            return _PillowDecoder()
        try:
            return (_NvImgCodecDecoder if name == "nvimgcodec" else _TorchvisionDecoder)(device)
        except Exception as exc:  # noqa: BLE001 - missing package or library: try the next
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    if choice != "auto":
        raise ValueError(f"the {choice} JPEG decoder is not usable here ({failures[0]})")
    _say_once("gpu-jpeg: neither nvImageCodec (pip install nvidia-nvimgcodec-cu13 "
              "nvidia-nvjpeg) nor torchvision's GPU decoder is usable here ("
              + "; ".join(failures) + "); decoding with Pillow on the CPU threads instead, "
              "crop and normalization still on the GPU")
    return _PillowDecoder()


def _say_once(message: str) -> None:
    warn_once(message)
