"""The environment a figure was measured in: kasoku's revision, the software stack and the
hardware. Reading the git revision reads ``.git`` files directly (no git process)."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

from kasoku.core import queues
from kasoku.core.version import __version__
from kasoku.perf.cpuinfo import cpu_info


def environment(device: torch.device | str | None = None) -> dict:
    """A JSON-ready dict. With a CUDA ``device`` it names that GPU and the driver (this
    initializes CUDA in the calling process); otherwise it stays on the host side."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    env = {
        "kasoku_version": __version__,
        "kasoku_git": git_revision(Path(__file__).resolve().parents[1]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": _cudnn_version(),
        "platform": platform.platform(),
        "cpu_name": cpu_name(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cpu": cpu_info().to_dict(),
        "cuda_device_max_connections": os.environ.get(queues.ENV),
        "device_type": device.type,
        "device_name": cpu_name(),
        "device_count": 1,
        "driver": None,
    }
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        env.update(device_name=torch.cuda.get_device_name(index),
                   device_count=torch.cuda.device_count(), driver=_nvidia_driver(),
                   compute_capability=".".join(map(str, torch.cuda.get_device_capability(index))))
    return env


def git_revision(start: Path) -> str | None:
    """The commit checked out in the repository holding ``start`` (None outside one)."""
    for folder in [start, *start.parents]:
        dot_git = folder / ".git"
        if dot_git.is_dir():
            return _resolve_head(dot_git, dot_git)
        if dot_git.is_file():  # a worktree: ".git" names the real git folder
            text = dot_git.read_text().strip()
            if text.startswith("gitdir:"):
                gitdir = (folder / text.split(":", 1)[1].strip()).resolve()
                common = gitdir / "commondir"
                common_dir = (gitdir / common.read_text().strip()).resolve() \
                    if common.exists() else gitdir
                return _resolve_head(gitdir, common_dir)
    return None


def _resolve_head(gitdir: Path, common_dir: Path) -> str | None:
    try:
        head = (gitdir / "HEAD").read_text().strip()
    except OSError:
        return None
    if not head.startswith("ref:"):
        return head or None
    ref = head.split(":", 1)[1].strip()
    for base in (gitdir, common_dir):
        path = base / ref
        if path.is_file():
            return path.read_text().strip()
    packed = common_dir / "packed-refs"
    if packed.is_file():
        for line in packed.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == ref:
                return parts[0]
    return None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cudnn_version() -> int | None:
    try:
        return torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except RuntimeError:
        return None


def _nvidia_driver() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:  # the CUDA driver API version, e.g. 13000, when nvidia-smi is missing
        return f"cuda-driver-api-{torch._C._cuda_getDriverVersion()}"
    except (AttributeError, RuntimeError):
        return None
