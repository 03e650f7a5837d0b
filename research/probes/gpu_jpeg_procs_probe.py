"""Can decoding in several processes beat one process's GIL-bound rate? Each of P processes
decodes the same batch of JPEGs (already read into memory) on the GPU in a loop; the aggregate
images/s is P x batch x iterations over the slowest process's time. Also checks whether a
decode call lets another Python thread run (the GIL question).

    python research/probes/gpu_jpeg_procs_probe.py /tmp/kasoku-jpeg/500x375 --batch-size 256
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
import torch.multiprocessing as mp

from kasoku.data.imagefolder import ImageFolder
from kasoku.data.jpeg_decoders import make_decoder


def _batch(folder, batch_size, offset, decoder):
    ds = ImageFolder(folder, train=True, image_size=224)
    paths = [ds.samples[(offset + i) % len(ds)][0] for i in range(batch_size)]
    return [decoder.load(p) for p in paths]


def _worker(rank, folder, batch_size, iters, choice, barrier, results):
    dev = torch.device("cuda")
    decoder = make_decoder(choice, dev)
    loaded = _batch(folder, batch_size, rank * batch_size, decoder)
    for _ in range(3):
        decoder.decode(loaded, dev)
    torch.cuda.synchronize()
    barrier.wait()
    t0 = time.perf_counter()
    for _ in range(iters):
        decoder.decode(loaded, dev)
    torch.cuda.synchronize()
    results.put((rank, time.perf_counter() - t0))


def procs(folder, batch_size, iters, choice, n):
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(n), ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(r, folder, batch_size, iters, choice, barrier, results))
          for r in range(n)]
    for p in ps:
        p.start()
    times = [results.get(timeout=300)[1] for _ in ps]
    for p in ps:
        p.join()
    return n * batch_size * iters / max(times)


def gil_check(folder, batch_size, choice):
    """Counts a pure-Python thread's loop iterations per second, alone and beside decoding."""
    dev = torch.device("cuda")
    decoder = make_decoder(choice, dev)
    loaded = _batch(folder, batch_size, 0, decoder)
    decoder.decode(loaded, dev)
    torch.cuda.synchronize()

    def spin(stop, out):
        n = 0
        t0 = time.perf_counter()
        while not stop.is_set():
            n += 1
        out.append(n / (time.perf_counter() - t0))

    stop, alone = threading.Event(), []
    t = threading.Thread(target=spin, args=(stop, alone))
    t.start()
    time.sleep(0.5)
    stop.set()
    t.join()
    stop, beside = threading.Event(), []
    t = threading.Thread(target=spin, args=(stop, beside))
    t.start()
    t0 = time.perf_counter()
    for _ in range(20):
        decoder.decode(loaded, dev)
    torch.cuda.synchronize()
    decode_s = (time.perf_counter() - t0) / 20
    stop.set()
    t.join()
    print(f"GIL {choice}: spinning thread {alone[0]:,.0f}/s alone, {beside[0]:,.0f}/s beside "
          f"decoding ({beside[0] / alone[0]:.0%}); decode {1e3 * decode_s:.1f} ms/batch with it",
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--procs", default="1,2,3,4")
    p.add_argument("--decoders", default="torchvision,nvimgcodec")
    args = p.parse_args()
    for choice in args.decoders.split(","):
        gil_check(args.folder, args.batch_size, choice)
        for n in map(int, args.procs.split(",")):
            rates = [procs(args.folder, args.batch_size, args.iters, choice, n) for _ in range(2)]
            print(f"{choice}: {n} process(es) decoding: {statistics.median(rates):,.0f} img/s "
                  f"(runs: {', '.join(f'{r:,.0f}' for r in rates)})", flush=True)


if __name__ == "__main__":
    main()
