"""``GpuJpegLoader``: JPEG folders decoded in batches on the GPU (seed 004's DALI step).

Once Tensor Cores make the model fast, decoding JPEGs on the CPU becomes the bottleneck. Here
CPU threads only read the files; each batch is decoded on the GPU in one call (torchvision's
batched nvJPEG ``decode_jpeg(device="cuda")``, or nvImageCodec; on an H200 both reach the
rate of its hardware JPEG decoder, ~21,000 images/s of 500x375), and random-resized-crop,
flip and normalization run over all the decoded images at once, whatever their sizes: one
Triton kernel (``kasoku.data.crop_kernel``) on a GPU, else the same arithmetic as PyTorch ops
(``crop_resize_normalize``).
The next batches are prepared on a side CUDA stream by a background thread while the current
one trains; the training stream waits on an event, never on the host. The side streams need
hardware queues of their own (``kasoku.core.queues``), and the next epoch's first batches are
started before this epoch ends.

The order, sharding and ``(epoch, position)`` resume state are ``SerialLoader``'s, and each
sample's crop and flip are drawn exactly as ``ImageFolder`` draws them (the same counter-based
draws keyed on ``(seed, epoch, index)``, computed for the whole batch at once), so a batch
holds the same samples, labels, crop boxes and flips as the serial loader's. The pixels
differ slightly: the resize is bilinear without antialiasing from the full decode, where
Pillow filters (and may decode at reduced scale first).

Bad files: every file passes the rule all loaders share (``kasoku.data.bad_files``: a truncated
JPEG is skipped, though nvJPEG would decode it) before a decoder sees it; a file the GPU decoder
rejects is tried with Pillow (PNGs, CMYK JPEGs); one nothing can decode is skipped as
``ImageFolder`` skips it (recorded with its reason in ``bad_files``, replaced by the next good
index), or is an error with ``strict``.

Without CUDA (or with ``decoder="pillow"``) the files are decoded by Pillow in the reading
threads and the same batched crop runs on the CPU; that path is what the CPU tests exercise.
"""
from __future__ import annotations

import collections
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from kasoku.core.errors import DataError
from kasoku.core.queues import check_queues
from kasoku.data import crop_kernel
from kasoku.data.bad_files import BadFile
from kasoku.data.imagefolder import VAL_CROP_FRACTION, ImageFolder
from kasoku.data.jpeg_decoders import HWC, CpuImage, make_decoder, pillow_decode, read_bytes
from kasoku.data.parallel_loader import _PrefetchLoader
from kasoku.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    center_crop_box,
    crop_flip_params_batch,
    resize_shorter_to,
)


def crop_resize_normalize(flat: torch.Tensor, offsets: torch.Tensor, shapes: torch.Tensor,
                          strides: torch.Tensor, boxes: torch.Tensor, flips: torch.Tensor,
                          size: int, mean, std) -> torch.Tensor:
    """Crop, resize, flip and normalize a batch of differently sized uint8 images at once.

    ``flat``: every image's pixels, concatenated (uint8, 1-D). Per image ``b``: ``offsets[b]``
    (where it starts in ``flat``), ``shapes[b] = (H, W)``, ``strides[b] = (row, column,
    channel)`` in elements (``(3W, 3, 1)`` for HWC, ``(W, 1, HW)`` for CHW), ``boxes[b] =
    (top, left, height, width)`` of the crop in its pixels (floats allowed) and ``flips[b]``.
    Returns float32 ``[B, 3, size, size]``: the crops resized bilinearly (pixel centres aligned,
    as Pillow's ``resize(box=...)``; no antialiasing), mirrored where flipped, then
    ``(x / 255 - mean) / std``. One gather per bilinear tap: no per-image kernels.
    """
    dev, n = flat.device, len(offsets)
    j = torch.arange(size, device=dev, dtype=torch.float32) + 0.5
    boxes = boxes.to(dev, torch.float32)
    heights, widths = shapes[:, 0].to(dev), shapes[:, 1].to(dev)
    ys = boxes[:, 0:1] + j * (boxes[:, 2:3] / size) - 0.5                  # [B, S]
    cols = torch.where(flips.to(dev).view(-1, 1), size - j, j)              # mirrored centres
    xs = boxes[:, 1:2] + cols * (boxes[:, 3:4] / size) - 0.5

    def taps(coord, extent):
        coord = coord.clamp(min=0.0)
        lo = coord.floor()
        frac = coord - lo
        lo = torch.minimum(lo.long(), (extent - 1).view(-1, 1))
        hi = torch.minimum(lo + 1, (extent - 1).view(-1, 1))
        return lo, hi, frac

    y0, y1, wy = taps(ys, heights)
    x0, x1, wx = taps(xs, widths)
    strides = strides.to(dev)
    row, col, chan = (strides[:, k].view(n, 1, 1, 1) for k in range(3))
    base = offsets.to(dev).view(n, 1, 1, 1) + torch.arange(3, device=dev).view(1, 3, 1, 1) * chan
    r0, r1 = base + y0.view(n, 1, size, 1) * row, base + y1.view(n, 1, size, 1) * row
    c0, c1 = x0.view(n, 1, 1, size) * col, x1.view(n, 1, 1, size) * col
    wx = wx.view(n, 1, 1, size)
    top = torch.lerp(flat[r0 + c0].float(), flat[r0 + c1].float(), wx)
    bottom = torch.lerp(flat[r1 + c0].float(), flat[r1 + c1].float(), wx)
    x = torch.lerp(top, bottom, wy.view(n, 1, size, 1))
    m = torch.as_tensor(mean, dtype=torch.float32, device=dev).view(1, 3, 1, 1)
    s = torch.as_tensor(std, dtype=torch.float32, device=dev).view(1, 3, 1, 1)
    return torch.addcmul(-m / s, x, 1.0 / (255.0 * s))


def val_box(height: int, width: int, size: int) -> tuple[float, float, float, float]:
    """``ImageFolder``'s evaluation view (resize the shorter side to ``size / 0.875``, centre
    crop ``size``) as a crop box ``(top, left, height, width)`` of the original image."""
    resize_to = int(round(size / VAL_CROP_FRACTION))
    new_w, new_h = resize_shorter_to(height, width, resize_to)
    left, top, _, _ = center_crop_box(new_h, new_w, size)
    sy, sx = height / new_h, width / new_w
    return top * sy, left * sx, size * sy, size * sx


class JpegBatchMaker:
    """Reads, decodes and crops batches of an ``ImageFolder`` on ``device``: the work of one
    gpu-jpeg batch, shared by ``GpuJpegLoader`` (threads of the training process) and the
    worker processes of ``GpuJpegProcessLoader``. ``decoder`` and ``own_process``: as
    ``make_decoder`` takes them."""

    def __init__(self, dataset: ImageFolder, device, decoder: str = "auto",
                 own_process: bool = False):
        self.dataset, self.device = dataset, torch.device(device)
        self.decoder = make_decoder(decoder, self.device, own_process)
        self._labels = torch.tensor([label for _, label in dataset.samples], dtype=torch.int64)

    def read_many(self, indices: list[int]) -> list:
        return [self.read(i) for i in indices]

    def read(self, index: int):
        """The file as the decoder takes it (``decoder.load``: a parsed code stream, a byte
        tensor, or for Pillow the decoded image); None for a file that cannot be read or breaks
        the shared rule (``replacement`` finds why, as every loader does)."""
        try:
            return self.decoder.load(self.dataset.samples[index][0])
        except Exception:  # noqa: BLE001 - bad, unreadable or unparseable: replacement decides
            return None

    def assemble(self, epoch, idx, prepared, host_labels: bool = False):
        """``(x, y, buffers)`` for the samples ``idx`` of ``epoch`` from their ``read``
        results, on the current stream; ``buffers`` must live until the stream is done.
        ``host_labels``: ``y`` in host memory instead of on the device."""
        images, buffers = self.decoder.decode(prepared, self.device)
        final = list(idx)
        for k, image in enumerate(images):
            if image is None:
                final[k], images[k] = self.replacement(idx[k])
        ds = self.dataset
        layout = [self.decoder.layout if not isinstance(im, CpuImage) else HWC
                  for im in images]
        tensors = [im.tensor.to(self.device, non_blocking=True) if isinstance(im, CpuImage)
                   else im for im in images]
        shapes = [(t.shape[0], t.shape[1]) if lay == HWC else (t.shape[1], t.shape[2])
                  for t, lay in zip(tensors, layout)]
        heights, widths = zip(*shapes)
        kernel = crop_kernel.usable(self.device)
        if kernel:  # the images stay where they are: the kernel reads them from one base
            base = tensors[0]
            starts = torch.tensor([t.data_ptr() - base.data_ptr() for t in tensors],
                                  dtype=torch.float64)
            strides = [(t.stride(0), t.stride(1), t.stride(2)) if lay == HWC
                       else (t.stride(1), t.stride(2), t.stride(0))
                       for t, lay in zip(tensors, layout)]
        else:  # one flat copy of them all, each image contiguous
            sizes = torch.tensor([t.numel() for t in tensors], dtype=torch.float64)
            flat = torch.cat([t.reshape(-1) for t in tensors])
            starts = sizes.cumsum(0) - sizes
            strides = [(3 * w, 3, 1) if lay == HWC else (w, 1, h * w)
                       for (h, w), lay in zip(shapes, layout)]
        if ds.train:
            boxes, flips = crop_flip_params_batch(ds.seed, epoch, final, heights, widths)
            boxes = boxes.float()
        else:
            boxes = torch.tensor([val_box(h, w, ds.image_size) for h, w in shapes])
            flips = torch.zeros(len(shapes), dtype=torch.bool)
        # Every per-image number in one table (exact in float64): one copy to the device.
        table = torch.cat([starts.view(-1, 1),
                           torch.tensor(shapes, dtype=torch.float64),
                           torch.tensor(strides, dtype=torch.float64), boxes.double(),
                           flips.double().view(-1, 1),
                           self._labels[torch.tensor(final)].double().view(-1, 1)], 1)
        if self.device.type == "cuda":
            table = table.pin_memory().to(self.device, non_blocking=True)
        if kernel:
            x = crop_kernel.crop_resize_normalize_kernel(base, table, ds.image_size,
                                                         IMAGENET_MEAN, IMAGENET_STD)
        else:
            offsets, shapes_t, strides_t = table[:, 0].long(), table[:, 1:3].long(), \
                table[:, 3:6].long()
            x = crop_resize_normalize(flat, offsets, shapes_t, strides_t,
                                      table[:, 6:10].float(), table[:, 10] > 0,
                                      ds.image_size, IMAGENET_MEAN, IMAGENET_STD)
        y = self._labels[torch.tensor(final)] if host_labels else table[:, 11].long()
        return x, y, buffers

    def replacement(self, index: int):
        """The image for a sample the batch decoder could not decode: the file through Pillow
        (PNG, CMYK and other JPEGs a GPU decoder refuses), else, as ``ImageFolder`` does, the
        next good index. Returns ``(index used, CpuImage)``."""
        ds, n = self.dataset, len(self.dataset.samples)
        for candidate in range(index, index + n):
            i = candidate % n
            path = ds.samples[i][0]
            try:
                return i, CpuImage(pillow_decode(read_bytes(path), path))
            except BadFile as bad:
                if ds.strict:
                    raise
                ds.note_bad(bad)
        raise DataError(f"{ds.root}: none of its {n} images can be decoded; check the folder.")


class GpuJpegLoader(_PrefetchLoader):
    """``SerialLoader`` over an ``ImageFolder`` whose batches are decoded on ``device``.

    ``num_threads`` threads read the files (and decode them, for the Pillow decoder), a batch
    split into one task per thread; ``decode_threads`` threads decode and augment whole
    batches, up to ``prefetch_batches`` ahead, each on its own CUDA stream (two, so that one
    batch's Python work overlaps another's decode on the GPU). ``decoder``: ``auto``
    (torchvision's GPU decoder, else nvImageCodec, else Pillow), or one of ``torchvision``,
    ``nvimgcodec``, ``pillow``. Batches are ``(float32 [B, 3, S, S], int64 [B])`` already on
    ``device``. Takes ``SerialLoader``'s keyword arguments (``shuffle``, ``seed``,
    ``drop_last``, ``repeat``, ``rank``, ``world_size``); ``seed`` is the loader's order,
    augmentation uses ``dataset.seed`` as ``ImageFolder`` does.
    """

    yields_device_batches = True
    crosses_epochs = True  # each batch's crops are drawn for the epoch it is submitted with

    def __init__(self, dataset: ImageFolder, batch_size: int, device="cuda",
                 num_threads: int | None = None, decoder: str = "auto",
                 prefetch_batches: int = 3, decode_threads: int = 2, **kwargs):
        if not isinstance(dataset, ImageFolder):
            raise TypeError(f"the gpu-jpeg loader reads JPEG folders (ImageFolder); {dataset!r} "
                            f"is not one: use the device, serial, threads or multiprocess loader")
        self.device = torch.device(device)
        if self.device.type == "cuda":
            check_queues("gpu-jpeg")  # its side streams must not share the training's queue
        self.num_threads = num_threads or min(8, os.cpu_count() or 1)
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads!r}")
        if decode_threads < 1:
            raise ValueError(f"decode_threads must be >= 1, got {decode_threads!r}")
        self._maker = JpegBatchMaker(dataset, self.device, decoder)
        self._io = ThreadPoolExecutor(self.num_threads, thread_name_prefix="kasoku-jpeg-read")
        self._worker = ThreadPoolExecutor(decode_threads, thread_name_prefix="kasoku-jpeg-decode")
        self._streams = threading.local()  # one side stream per decoding thread
        self._held: collections.deque = collections.deque()  # (event, buffers) still in use
        super().__init__(dataset, batch_size, prefetch_batches=prefetch_batches, **kwargs)

    def _submit(self, epoch, position, indices):
        idx = indices.tolist()
        step = -(-len(idx) // self.num_threads)
        reads = [self._io.submit(self._maker.read_many, idx[k:k + step])
                 for k in range(0, len(idx), step)]
        return self._worker.submit(self._make_batch, epoch, idx, reads)

    def _collect(self, position, indices, future):
        x, y, event, buffers = future.result()  # re-raises DataError (strict) and decode errors
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            x.record_stream(current)
            y.record_stream(current)
            self._hold(event, buffers)
        return x, y

    decoder = property(lambda self: self._maker.decoder)

    def _drop(self, future) -> None:
        future.cancel()  # one already running finishes and is ignored

    def _hold(self, event, buffers) -> None:
        """Keep the decoder's own buffers (freed outside PyTorch's allocator) alive until the
        side stream has read them."""
        self._held.append((event, buffers))
        while self._held and self._held[0][0].query():
            self._held.popleft()

    # -- in the decoding thread ---------------------------------------------------------------
    def _make_batch(self, epoch: int, idx: list[int], reads):
        prepared = [item for f in reads for item in f.result()]
        if self.device.type != "cuda":
            x, y, _ = self._maker.assemble(epoch, idx, prepared)
            return x, y, None, None
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            # The highest priority: the next batch's few small kernels (and the decoder's) are
            # scheduled ahead of the training step's, instead of waiting behind a whole step
            # while this thread holds the decoder call, and the GIL, open.
            stream = self._streams.stream = torch.cuda.Stream(self.device, priority=-100)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            x, y, buffers = self._maker.assemble(epoch, idx, prepared)
            event = torch.cuda.Event()
            event.record(stream)
        return x, y, event, buffers

    def close(self) -> None:
        super().close()
        for pool in (getattr(self, "_io", None), getattr(self, "_worker", None)):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    def __repr__(self) -> str:
        return (f"GpuJpegLoader({self.dataset!r}, batch_size={self.batch_size}, "
                f"decoder={self.decoder.name}, threads={self.num_threads}, device={self.device}, "
                f"rank={self.rank}/{self.world_size})")
