"""A data-parallel step's exchange in the words of ``kasoku scale``'s lines
(``kasoku.commands.scale``): its wrapper and what its workers exchange, the CPUs each worker
was bound to, and what would shorten an exposed exchange (a bigger per-worker batch, bf16 on
the wire, a CUDA-graph step). Kept apart from ``scale`` for its size.

bf16 on the wire halves the bytes, which shortens an all-reduce only where its bytes set its
time: buckets of ``BANDWIDTH_MB`` or more each. Below that an all-reduce between GPUs takes
its calls' latency (NCCL's and DDP's per bucket; gloo's on a CPU is not judged so), and
fewer bytes leave it as it was: the MNIST MLP's
7.2 MB of gradients in one bucket took 0.13 ms to all-reduce on 2 H200s in fp32 and in bf16
(docs/benchmarks.md, "The MLP's exchange on 2 GPUs")."""
from __future__ import annotations

from kasoku.core.flags import flag

BANDWIDTH_MB = 16.0
"""Buckets of this many MB or more move their bytes at the links' bandwidth; smaller ones are
their calls' latency."""


def exchange_help(r: dict, wrapper: str, what: str) -> list[str]:
    """For a record ``r`` whose ``what`` (all-reduce, ...) is exposed, through ``wrapper``
    (DDP, FSDP2): what would shorten it."""
    out = [f"a bigger per-worker batch (more compute per {what})"]
    buckets = r.get("allreduce_buckets") or 1
    per_bucket = (r.get("grad_mb") or 0.0) / buckets
    if r["allreduce_dtype"] == "fp32" and wrapper == "DDP":
        if per_bucket >= BANDWIDTH_MB or not r.get("grad_mb") or r["device_type"] != "cuda":
            out.append(f"{flag('dist.allreduce_dtype')} bf16 (half the bytes)")
    if r["device_type"] == "cuda" and not r["config"].get("cuda_graph") and wrapper == "DDP":
        out.append("a CUDA-graph step (less host time per step)")
    return out


def latency_words(r: dict) -> str:
    """``; N bucket(s) of X MB: its time is the calls' latency, not the bytes`` for DDP's
    all-reduce in small buckets, or ""."""
    buckets, mb = r.get("allreduce_buckets") or 1, r.get("grad_mb") or 0.0
    if not mb or mb / buckets >= BANDWIDTH_MB or wrapper_of(r) != "DDP" \
            or r["device_type"] != "cuda":
        return ""
    return (f"; {buckets} bucket{'s' * (buckets != 1)} of {mb / buckets:.1f} MB: its time is "
            f"the calls' latency, not the bytes")


def wrapper_of(r: dict) -> str:
    """The data-parallel wrapper of a record: DDP, or FSDP2 (``--shard``)."""
    return "FSDP2" if r.get("strategy") == "fsdp2" else "DDP"


def comm_of(r: dict) -> str:
    """What its workers exchange: all-reduce (DDP), all-gather + reduce-scatter (FSDP2)."""
    return r.get("comm", "all-reduce")


def bound_words(r: dict) -> str:
    """``; each worker bound to 16 CPUs (--numa-binding exclusive)`` where the launcher bound
    the workers, or ""."""
    if not r.get("numa_binding"):
        return ""
    cpus = (r.get("env") or {}).get("cpu_affinity")
    return (f"; each worker bound to {cpus} CPUs ({flag('dist.numa_binding')} "
            f"{r['numa_binding']})")
