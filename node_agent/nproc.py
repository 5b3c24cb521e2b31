"""``--nproc-per-node`` without torch: an integer, ``cpu``, ``gpu`` or ``auto``.

torchrun asks torch (``torch.cuda.device_count()``, ``torch.accelerator``); importing torch
costs the agent seconds, so we count NVIDIA GPUs from the driver instead (``gpus.py``: the
entries of ``/proc/driver/nvidia/gpus`` or, where that is absent, ``nvidia-smi``). Like torch
we then apply ``CUDA_VISIBLE_DEVICES``, so a job restricted to two of eight GPUs starts two
workers with ``gpu``/``auto``, as torchrun would. A count never depends on the order of the
devices, so ``CUDA_DEVICE_ORDER`` plays no part here.

Not covered: AMD (ROCm) and Intel (``xpu``) devices, and torch's privateuse1 backends.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .config import ConfigError
from .gpus import NVIDIA_PROC_DIR, physical_gpus, visible_gpu_count

__all__ = [
    "NVIDIA_PROC_DIR",
    "count_visible_gpus",
    "cpu_count",
    "physical_gpu_uuids",
    "resolve_nproc",
    "visible_gpu_count",
]


def resolve_nproc(
    value: str, *, environ: Mapping[str, str] | None = None, origin: str = "--nproc-per-node"
) -> int:
    """Turn a ``--nproc-per-node`` value into a worker count, or raise ConfigError.

    ``environ`` supplies ``CUDA_VISIBLE_DEVICES`` (default: this process's environment).
    """
    env = os.environ if environ is None else environ
    text = value.strip()
    accepted = "a positive integer, 'auto', 'cpu' or 'gpu'"
    try:
        count = int(text)
    except ValueError:
        count = None
    if count is not None:
        if count < 1:
            raise ConfigError(f"{origin}={value!r}: the number of workers must be >= 1 (or use {accepted})")
        return count

    keyword = text.lower()
    if keyword == "cpu":
        return cpu_count()
    if keyword == "gpu":
        gpus = count_visible_gpus(env)
        if gpus == 0:
            raise ConfigError(
                f"{origin}=gpu: no NVIDIA GPU is visible (torchrun: 'Cuda is not available.'); "
                f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r}; give a number instead"
            )
        return gpus
    if keyword == "auto":
        # torchrun: the accelerator's device count when there is one, else the CPU count.
        gpus = count_visible_gpus(env)
        return gpus if gpus > 0 else cpu_count()
    if keyword == "xpu":
        raise ConfigError(
            f"{origin}=xpu is not supported by node-agent (it counts NVIDIA GPUs only); give a number"
        )
    raise ConfigError(f"{origin}={value!r} is not valid: use {accepted}")


def cpu_count() -> int:
    """The CPUs this process may run on, as torch._utils.cpu_count (affinity, then os.cpu_count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def count_visible_gpus(environ: Mapping[str, str]) -> int:
    """How many NVIDIA GPUs a worker started with ``environ`` sees (their order does not matter)."""
    return visible_gpu_count(environ.get("CUDA_VISIBLE_DEVICES"), physical_gpu_uuids())


def physical_gpu_uuids(proc_dir: str | os.PathLike[str] = NVIDIA_PROC_DIR) -> list[str]:
    """One entry per NVIDIA GPU on this machine, in PCI order: its UUID, or "" when the driver
    does not say (gpus.physical_gpus; the seam tests replace)."""
    return [gpu.uuid for gpu in physical_gpus(proc_dir=os.fspath(proc_dir))]
