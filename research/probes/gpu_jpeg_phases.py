"""Where a gpu-jpeg batch's time goes: each phase of ``GpuJpegLoader`` timed alone on one batch
of a JPEG folder (host phases with perf_counter, GPU phases with a synchronize), median of
several repeats.

    python research/probes/gpu_jpeg_phases.py /tmp/kasoku-jpeg/500x375 --batch-size 256
"""
from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from kasoku.data.gpu_jpeg import GpuJpegLoader
from kasoku.data.jpeg_decoders import _TorchvisionDecoder, read_bytes
from kasoku.data.imagefolder import ImageFolder
from kasoku.data.transforms import crop_flip_params_batch


def timed(fn, repeats=5, sync=True):
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--batch-size", type=int, default=256)
    args = p.parse_args()
    b = args.batch_size
    ds = ImageFolder(args.folder, train=True, image_size=224)
    paths = [ds.samples[i][0] for i in range(b)]
    dev = torch.device("cuda")
    rows = []

    def report(name, seconds):
        rows.append((name, seconds))
        print(f"{name:55s} {1e3 * seconds:8.2f} ms/batch  {b / seconds:10,.0f} img/s", flush=True)

    pool = ThreadPoolExecutor(8)
    datas, s = timed(lambda: [f.result() for f in [pool.submit(read_bytes, q) for q in paths]],
                     sync=False)
    report("read files, 8 threads, one future per file", s)
    _, s = timed(lambda: list(pool.map(lambda chunk: [read_bytes(q) for q in chunk],
                                       [paths[i::8] for i in range(8)])), sync=False)
    report("read files, 8 threads, one task per 1/8 batch", s)

    from nvidia import nvimgcodec
    streams, s = timed(lambda: [nvimgcodec.CodeStream(d) for d in datas], sync=False)
    report("nvimgcodec.CodeStream(bytes) x batch", s)
    _, s = timed(lambda: [nvimgcodec.CodeStream(str(q)) for q in paths], sync=False)
    report("nvimgcodec.CodeStream(path) x batch, one thread", s)
    _, s = timed(lambda: list(pool.map(lambda chunk: [nvimgcodec.CodeStream(str(q)) for q in chunk],
                                       [paths[i::8] for i in range(8)])), sync=False)
    report("nvimgcodec.CodeStream(path) x batch, 8 threads", s)
    for label, backends in [("default backends", None),
                            ("HW_GPU_ONLY", [nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY)]),
                            ("GPU_ONLY", [nvimgcodec.Backend(nvimgcodec.BackendKind.GPU_ONLY)]),
                            ("HYBRID_CPU_GPU", [nvimgcodec.Backend(nvimgcodec.BackendKind.HYBRID_CPU_GPU)])]:
        try:
            dec = nvimgcodec.Decoder(backends=backends) if backends else nvimgcodec.Decoder()
            images, s = timed(lambda: dec.decode(streams, cuda_stream=torch.cuda.current_stream().cuda_stream))
            ok = sum(im is not None for im in images)
            report(f"nvimgcodec decode, {label} ({ok}/{b} ok)", s)
        except Exception as exc:  # noqa: BLE001
            print(f"nvimgcodec {label}: {type(exc).__name__}: {exc}")
    dec = nvimgcodec.Decoder()
    images = dec.decode(streams)
    _, s = timed(lambda: [torch.as_tensor(im, device=dev) for im in images], sync=False)
    report("torch.as_tensor(nvimgcodec image) x batch", s)
    _, s = timed(lambda: [torch.from_dlpack(im) for im in images], sync=False)
    report("torch.from_dlpack(nvimgcodec image) x batch", s)
    tensors = [torch.as_tensor(im, device=dev) for im in images]
    _, s = timed(lambda: torch.cat([t.reshape(-1) for t in tensors]))
    report("cat of the decoded images", s)

    tv = _TorchvisionDecoder(dev)
    prepared, s = timed(lambda: [tv.load(q) for q in paths], sync=False)
    report("torchvision.io.read_file x batch, one thread", s)
    _, s = timed(lambda: tv.decode(prepared, dev))
    report("torchvision decode_jpeg(device=cuda), batch", s)

    _, s = timed(lambda: crop_flip_params_batch(0, 0, range(b), [375] * b, [500] * b),
                 sync=False)
    report("crop/flip draws, batched", s)

    loader = GpuJpegLoader(ds, b, device=dev, num_threads=8, decoder="nvimgcodec")
    _, s = timed(lambda: loader._maker.assemble(0, list(range(b)), streams))
    report("whole _assemble (decode + tables + crop), nvimgcodec", s)
    loader._maker.decoder = tv
    _, s = timed(lambda: loader._maker.assemble(0, list(range(b)), prepared))
    report("whole _assemble, torchvision", s)
    loader.close()
    for decoder in ("nvimgcodec", "torchvision"):
        for threads in (1, 2, 3):
            with GpuJpegLoader(ds, b, device=dev, num_threads=8, decoder=decoder,
                               decode_threads=threads) as loader:
                for _ in range(4):
                    next(loader)
                _, s = timed(lambda: [next(loader) for _ in range(12)], repeats=3)
                report(f"loader, {decoder}, {threads} decode threads (per batch)", s / 12)

if __name__ == "__main__":
    main()
