"""Does GPU JPEG decoding slow a training step down, or wait for it? (issue: input pipelines)

    python research/probes/decode_interference.py DIR [--decoders torchvision,nv-default,nv-hw,...]
        [--train-stream 0|1] [--green-decode N] [--ahead K,...] [--single-thread] [--probe]

The process asks for CUDA's 32 hardware queues as kasoku does; run it with
``CUDA_DEVICE_MAX_CONNECTIONS=8`` (CUDA's default) to see what that changes.

DIR: a folder of JPEGs (>= 256; ``kasoku data make-jpeg DIR --count 512 --resolution
500x375``). Needs CUDA; the nv-* decoders need nvImageCodec.

1. Each decoder alone: one batch of 256 files, already in memory, decoded 8 times per window
   (3 windows). torchvision = ``decode_jpeg(list, device="cuda")``; nv-default =
   nvImageCodec's default backends; nv-hw / nv-gpu / nv-hybrid = only its HW_GPU_ONLY /
   GPU_ONLY / HYBRID_CPU_GPU backend; kasoku-tv / kasoku-nv = the gpu-jpeg loader's whole
   batch (``JpegBatchMaker.assemble``: decode with torchvision / nvImageCodec, crop, flip,
   normalize), from files read into memory once.
2. ImageNet ResNet-50, batch 256, whole step captured as a CUDA graph (bf16, channels_last,
   fused SGD, cuDNN autotune; ``--compile 1`` adds torch.compile): the training rate alone,
   then with a second thread decoding one batch per training step on a high-priority side
   stream (the host launches step i once step i-K is done, K from ``--ahead``, default 2,
   several values measured in turn). Reported: the
   rate until both are done (what a loader feeding this step would allow), and the training
   stream's own rate (whether decoding slowed the step).
   ``--train-stream 1`` trains on a stream of its own instead of the default stream;
   ``--green-decode N`` decodes in a CUDA green context of N SMs.
3. ``--single-thread``: one thread enqueues 30 training steps, then decodes 30 batches: when
   the decoding ends says whether it waited for the queued steps.
4. ``--probe``: which work the decoding waits for. Each decoder decodes one batch on a
   high-priority side stream while another stream is busy with ~100 ms of (a) a spin kernel
   on a single SM, (b) back-to-back matrix products that fill every SM, (c) two training
   steps. Printed: when the decode call returned to the host, when its stream was done and
   when the busy stream was done. A decode that ends just when the other stream's work ends
   waits on that stream itself, not for SMs (certainly so beside the spin, which leaves all
   other SMs idle): an implicit synchronization, or the two streams sharing a hardware queue.
   On an H200 the decoding ended with the matmuls and the training steps under
   ``CUDA_DEVICE_MAX_CONNECTIONS=8`` and ran beside them with 32 (research/notebook.md).
"""
import argparse
import sys
import threading
import time
from pathlib import Path

import torch

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("dir")
p.add_argument("--decoders", default="torchvision,nv-default,nv-hw,nv-gpu,nv-hybrid")
p.add_argument("--compile", type=int, default=0)
p.add_argument("--steps", type=int, default=30)
p.add_argument("--train-stream", type=int, default=1)
p.add_argument("--green-decode", type=int, default=0)
p.add_argument("--single-thread", action="store_true")
p.add_argument("--probe", action="store_true")
p.add_argument("--ahead", default="2",
               help="steps queued on the GPU at most (>= 1), comma-separated values")
a = p.parse_args()
from kasoku.core.queues import queues, request_queues  # noqa: E402
request_queues()  # as kasoku's command line does; a value set outside is kept
print(f"CUDA_DEVICE_MAX_CONNECTIONS: {queues()}", flush=True)
dev = torch.device("cuda")
files = sorted(Path(a.dir).rglob("*.jpg"))[:256]
if len(files) < 256:
    sys.exit(f"{a.dir} holds {len(files)} JPEGs; 256 are needed")
BATCH = 256


def make(name):
    if name.startswith("kasoku-"):  # the gpu-jpeg loader's whole batch: decode, crop, normalize
        from kasoku.data.gpu_jpeg import JpegBatchMaker
        from kasoku.data.imagefolder import ImageFolder
        maker = JpegBatchMaker(ImageFolder(a.dir, train=True), dev,
                               {"kasoku-tv": "torchvision", "kasoku-nv": "nvimgcodec"}[name])
        idx = list(range(BATCH))
        prepared = maker.read_many(idx)
        return lambda: maker.assemble(0, idx, prepared)
    if name == "torchvision":
        from torchvision.io import ImageReadMode, decode_jpeg, read_file
        data = [read_file(str(f)) for f in files]
        return lambda: decode_jpeg(data, mode=ImageReadMode.RGB, device=dev)
    from nvidia import nvimgcodec as nv
    kinds = {"nv-hw": "HW_GPU_ONLY", "nv-gpu": "GPU_ONLY", "nv-hybrid": "HYBRID_CPU_GPU"}
    if name == "nv-default":
        dec = nv.Decoder(device_id=0)
    else:
        dec = nv.Decoder(device_id=0, backends=[nv.Backend(getattr(nv.BackendKind, kinds[name]))])
    streams = [nv.CodeStream(f.read_bytes()) for f in files]

    def run():
        out = dec.decode(streams, cuda_stream=torch.cuda.current_stream(dev).cuda_stream)
        bad = sum(1 for o in out if o is None)
        if bad:
            raise RuntimeError(f"{name}: {bad} images failed")
        return out
    return run


decoders = {}
for name in a.decoders.split(","):
    try:
        fn = make(name)
        fn()
        torch.cuda.synchronize()
        decoders[name] = fn
    except Exception as exc:  # noqa: BLE001 - reported, the others go on
        print(f"{name}: unusable: {type(exc).__name__}: {exc}", flush=True)

for name, fn in decoders.items():
    rates = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(8):
            keep = fn()
        torch.cuda.synchronize()
        rates.append(8 * BATCH / (time.perf_counter() - t0))
    del keep
    print(f"ALONE {name}: {sorted(round(r) for r in rates)} img/s", flush=True)

from kasoku.accel.config import AccelConfig  # noqa: E402
from kasoku.commands.bench.pool import batch_spec, cycle, make_pool  # noqa: E402
from kasoku.commands.bench.rungs import Rung  # noqa: E402
from kasoku.commands.bench.timing import timed  # noqa: E402
from kasoku.commands.bench.runner import make_runner  # noqa: E402
from kasoku.workloads import create_workload  # noqa: E402

cfg = AccelConfig(precision="bf16", channels_last=True, cudnn_benchmark=True,
                  optimizer_impl="fused", compile=bool(a.compile), cuda_graph=True)
wl = create_workload("imagenet-resnet50")
torch.manual_seed(0)
model = wl.build_model().to(dev)
pool = make_pool(batch_spec(wl, model), BATCH, dev, 4, seed=0)
runner = make_runner(Rung("decode-interference", cfg), wl, model, dev, wl.recipe.lr, [])
timed(dev, lambda: runner(cycle(pool, 12, 0)))
side = torch.cuda.Stream(dev, priority=-5)
train_stream = torch.cuda.Stream(dev) if a.train_stream else torch.cuda.current_stream(dev)
green = None
if a.green_decode:
    from torch.cuda.green_contexts import GreenContext
    green = GreenContext.create(num_sms=a.green_decode, device_id=0)
print(f"training on {'a stream of its own' if a.train_stream else 'the default stream'}; "
      f"decoding {'in a green context of %d SMs' % a.green_decode if green else 'on all SMs'}")


def window(fn, ahead=2):
    """(images/s until training and decoding are both done, the training stream's images/s)"""
    n = a.steps
    sem = threading.Semaphore(0)
    done = []

    def decode_loop():
        if green is not None:
            green.set_context()
        stream = torch.cuda.current_stream(dev) if green is not None else side
        with torch.cuda.stream(stream):
            for _ in range(n):
                sem.acquire()
                keep = fn()
                stream.synchronize()
                del keep
        if green is not None:
            green.pop_context()
        done.append(time.perf_counter())

    thread = threading.Thread(target=decode_loop) if fn else None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if thread:
        thread.start()
    events = []
    for i in range(n):
        if i >= ahead:
            events[i - ahead].synchronize()  # step i - ahead is done before step i starts
        with torch.cuda.stream(train_stream):
            runner(cycle(pool, 1, i))
        events.append(torch.cuda.Event())
        events[-1].record(train_stream)
        sem.release()
    torch.cuda.synchronize()
    t_train = time.perf_counter() - t0
    if thread:
        thread.join()
    total = (max(done[0], t0 + t_train) - t0) if thread else t_train
    return BATCH * n / total, BATCH * n / t_train


def single(fn, n=30):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(train_stream):
        for i in range(n):
            runner(cycle(pool, 1, i))
    t_enqueued = time.perf_counter() - t0
    with torch.cuda.stream(side):
        for _ in range(n):
            keep = fn()
            side.synchronize()
    t_decoded = time.perf_counter() - t0
    torch.cuda.synchronize()
    del keep
    return t_enqueued, t_decoded, time.perf_counter() - t0


def probe(fn, busy):
    """ms from the start: (decode call returned, decode stream done, busy stream done)"""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(train_stream):
        busy()
        end = torch.cuda.Event()
        end.record(train_stream)
    with torch.cuda.stream(side):
        keep = fn()
        t_ret = time.perf_counter()
        side.synchronize()
        t_dec = time.perf_counter()
    end.synchronize()
    t_busy = time.perf_counter()
    del keep
    return tuple(round((t - t0) * 1e3, 1) for t in (t_ret, t_dec, t_busy))


def busy_makers():
    """Work of ~100 ms on the current stream: a one-SM spin, SM-filling matmuls, 2 steps."""
    def elapsed(work):
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop)

    elapsed(lambda: torch.cuda._sleep(int(1e7)))  # the first launch loads the kernel
    cycles = int(1e7 * 100 / elapsed(lambda: torch.cuda._sleep(int(1e7))))
    m = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    per = elapsed(lambda: [m @ m for _ in range(10)]) / 10
    n_mm = max(1, int(100 / per))
    return {"spin (1 SM)": lambda: torch.cuda._sleep(cycles),
            f"{n_mm} matmuls (all SMs)": lambda: [m @ m for _ in range(n_mm)],
            "2 training steps": lambda: runner(cycle(pool, 2, 0))}


if a.probe:
    makers = busy_makers()
    for name, fn in decoders.items():
        alone = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(side):
                keep = fn()
                side.synchronize()
            alone.append(round((time.perf_counter() - t0) * 1e3, 1))
        del keep
        print(f"PROBE {name}: one batch alone {sorted(alone)} ms", flush=True)
        for what, busy in makers.items():
            runs = [probe(fn, busy) for _ in range(3)]
            print(f"PROBE {name} beside {what}: (returned, decoded, busy done) ms = {runs}",
                  flush=True)

if a.single_thread:
    for name, fn in decoders.items():
        for _ in range(2):
            e, d, t = single(fn)
            print(f"SINGLE-THREAD {name}: 30 steps enqueued after {e * 1e3:.0f} ms; 30 batches "
                  f"decoded at {d * 1e3:.0f} ms; all done at {t * 1e3:.0f} ms", flush=True)

for ahead in [int(k) for k in a.ahead.split(",") if k]:
    alone = sorted(window(None, ahead)[0] for _ in range(3))
    print(f"host ahead {ahead}: TRAIN alone: {[round(r) for r in alone]} img/s", flush=True)
    for name, fn in decoders.items():
        runs = sorted(window(fn, ahead) for _ in range(3))
        print(f"host ahead {ahead}: TRAIN + {name}: {[round(r[0]) for r in runs]} img/s until "
              f"both are done ({100 * runs[1][0] / alone[1]:.0f}% of alone); the training "
              f"stream's own rate {sorted(round(r[1]) for r in runs)}", flush=True)

