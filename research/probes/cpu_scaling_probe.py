"""How much of one core's speed N busy processes each keep on this machine, without kasoku.

    python research/probes/cpu_scaling_probe.py [--procs 1,2,4,8,12,16] [--seconds 3]

`kasoku data bench --loader multiprocess:N` measures a loader's scaling against N times its
one-worker rate. This probe says what the machine itself allows: N processes start together
(a barrier) and each repeats, for ``--seconds``, either

- ``python``: a pure-Python integer loop (no memory traffic: only the core's clock and
  sharing of the core count), or
- ``jpeg``: Pillow decoding a 500x375 JPEG (quality 90, made here) and resizing it to 224x224,
  a loader worker's main work without kasoku, queues or shared memory,

and reports the total rate and the share of N x the one-process rate. A share well below 100%
for the pure-Python loop means the cores run slower when more of them are busy (a clock that
drops with load, shared physical cores), which caps any loader's scaling measured this way.
"""
import argparse
import io
import multiprocessing as mp
import time


def _jpeg() -> bytes:
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(0)
    # Smooth gradients plus noise: about the size of an ImageNet JPEG at quality 90.
    y, x = np.mgrid[0:375, 0:500]
    base = np.stack([x * 0.5, y * 0.6, (x + y) * 0.3], -1)
    pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def _work(kind: str, data: bytes, seconds: float, barrier, results) -> None:
    from PIL import Image
    barrier.wait()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if kind == "python":
            total = 0
            for i in range(20000):
                total += i * i % 7
        else:
            with Image.open(io.BytesIO(data)) as img:
                img.convert("RGB").resize((224, 224), Image.BILINEAR)
        n += 1
    results.put(n / (time.perf_counter() - t0))


def rate(kind: str, procs: int, seconds: float, data: bytes) -> float:
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_work, args=(kind, data, seconds, barrier, results))
               for _ in range(procs)]
    for w in workers:
        w.start()
    total = sum(results.get() for _ in workers)
    for w in workers:
        w.join()
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", default="1,2,4,8,12,16")
    p.add_argument("--seconds", type=float, default=3.0)
    a = p.parse_args()
    data = _jpeg()
    print(f"cpus: {mp.cpu_count()}; JPEG {len(data) / 1e3:.0f} KB", flush=True)
    for kind in ("python", "jpeg"):
        one = None
        for procs in [int(k) for k in a.procs.split(",")]:
            total = rate(kind, procs, a.seconds, data)
            one = one or total / procs
            print(f"{kind:6s} {procs:2d} processes: {total:9.1f} /s, "
                  f"{100 * total / (procs * one):5.1f}% of {procs} x one process", flush=True)


if __name__ == "__main__":
    main()
