"""``--nproc-per-node`` without torch: an integer, ``cpu``, ``gpu`` or ``auto``.

torchrun asks torch (``torch.cuda.device_count()``, ``torch.accelerator``); importing torch
costs the agent seconds, so we count NVIDIA GPUs from the driver instead: the entries of
``/proc/driver/nvidia/gpus`` or, where that is absent, the lines of ``nvidia-smi -L``. Like
torch we then apply ``CUDA_VISIBLE_DEVICES``, so a job restricted to two of eight GPUs starts
two workers with ``gpu``/``auto``, as torchrun would.

Not covered: AMD (ROCm) and Intel (``xpu``) devices, and torch's privateuse1 backends.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

from .config import ConfigError
from .executables import which

__all__ = ["count_visible_gpus", "cpu_count", "physical_gpu_uuids", "resolve_nproc", "visible_gpu_count"]

NVIDIA_PROC_DIR = "/proc/driver/nvidia/gpus"
_NVIDIA_SMI_TIMEOUT = 10.0  # seconds; nvidia-smi can hang on a wedged driver
# Patterns, not compiled at import: most launches give a number and never look for GPUs.
_UUID_LINE = r"GPU UUID:\s*(\S+)"
_SMI_GPU_LINE = r"^GPU \d+:.*?(?:\(UUID:\s*([^)\s]+)\))?\s*$"


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
    physical = physical_gpu_uuids()
    return visible_gpu_count(environ.get("CUDA_VISIBLE_DEVICES"), physical)


def physical_gpu_uuids(proc_dir: str | os.PathLike[str] = NVIDIA_PROC_DIR) -> list[str]:
    """One entry per NVIDIA GPU on this machine: its UUID, or "" when the driver does not say."""
    if os.path.isdir(proc_dir):
        from pathlib import Path  # here: 5 ms to import, for machines with NVIDIA GPUs only

        uuids = []
        for entry in sorted(Path(proc_dir).iterdir()):
            try:
                match = re.search(_UUID_LINE, (entry / "information").read_text(errors="replace"))
            except OSError:
                match = None
            uuids.append(match.group(1) if match else "")
        return uuids
    return _nvidia_smi_uuids()


def _nvidia_smi_uuids() -> list[str]:
    smi = which("nvidia-smi")
    if smi is None:
        return []
    import subprocess  # only here: most machines never get this far

    try:
        out = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=_NVIDIA_SMI_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    uuids = []
    for line in out.stdout.splitlines():
        match = re.match(_SMI_GPU_LINE, line)
        if match:  # "GPU 0: NAME (UUID: GPU-...)"; MIG lines are indented and skipped
            uuids.append(match.group(1) or "")
    return uuids


def visible_gpu_count(cuda_visible_devices: str | None, physical: Sequence[str]) -> int:
    """How many of ``physical`` GPUs CUDA exposes under ``CUDA_VISIBLE_DEVICES``.

    Follows CUDA's (and torch's) reading of the variable: a comma list of ordinals parsed like
    strtoul, or of GPU-/MIG- UUID prefixes; the list ends at the first invalid entry; a repeated
    entry makes the whole set empty; ordinals are cut at the first one past the last device.
    """
    if cuda_visible_devices is None:
        return len(physical)
    text = cuda_visible_devices.strip()
    if text.startswith(("GPU-", "MIG-")):
        prefix = text[:4]
        chosen: list[str] = []
        for item in text.split(","):
            item = item.strip()
            if not item.startswith(prefix):
                break
            if item in chosen:
                return 0
            chosen.append(item)
        if prefix == "MIG-" or not any(physical):
            # MIG slices and unknown UUIDs cannot be matched without NVML; trust the list.
            return len(chosen) if physical else 0
        ordinals: list[int] = []
        for candidate in chosen:
            matches = [i for i, uuid in enumerate(physical) if uuid.startswith(candidate)]
            if len(matches) != 1:  # unknown or ambiguous: CUDA stops here
                break
            if matches[0] in ordinals:
                return 0
            ordinals.append(matches[0])
        return len(ordinals)

    ordinals = []
    for item in text.split(","):
        digits = re.match(r"\s*\+?(\d+)", item)
        if digits is None:  # empty, negative or garbage: the list ends here
            break
        ordinal = int(digits.group(1))
        if ordinal in ordinals:
            return 0
        ordinals.append(ordinal)
    count = 0
    for ordinal in ordinals:
        if ordinal >= len(physical):
            break
        count += 1
    return count
