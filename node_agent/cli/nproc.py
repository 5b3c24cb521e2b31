"""``--nproc-per-node`` without torch: an integer, ``cpu``, ``gpu``, ``xpu`` or ``auto``.

torchrun asks torch (``torch.cuda.device_count()``, ``torch.xpu.device_count()``,
``torch.accelerator``); importing torch costs the agent seconds, so we count the devices from
the kernel instead. NVIDIA GPUs (``devices.py``: the entries of ``/proc/driver/nvidia/gpus`` or,
where that is absent, ``nvidia-smi``) under ``CUDA_VISIBLE_DEVICES``; AMD GPUs, which a ROCm
build of torch reports as ``cuda`` devices (``gpu/amd_intel.py``: the KFD topology) under
``ROCR_VISIBLE_DEVICES`` then ``HIP_VISIBLE_DEVICES`` or ``CUDA_VISIBLE_DEVICES``; Intel GPUs
(``gpu/amd_intel.py``: i915/xe DRM cards, a device per tile) under ``ZE_AFFINITY_MASK`` and
``ZE_FLAT_DEVICE_HIERARCHY``. So a job restricted to two of eight GPUs starts two workers, as
torchrun would. A count never depends on the order of the devices.

- ``gpu``: the visible NVIDIA GPUs, else the visible AMD GPUs; an error when there are none
  (torchrun: ``Cuda is not available.``).
- ``xpu``: the visible Intel GPUs (integrated ones only when no discrete one is visible, as
  torch counts them); an error when there are none (torchrun: ``Xpu is not available.``).
- ``auto``: the ``gpu`` count, else the discrete Intel GPUs, else the CPUs. torchrun's ``auto``
  asks whichever accelerator its torch build has; we do not know the build, so an integrated
  Intel GPU (a laptop's) is left out of ``auto`` rather than turn N CPU workers into one:
  ask for it with ``xpu``.

Not covered: torch's privateuse1 backends (``--nproc-per-node <backend name>``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from ..config import ConfigError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..gpu.amd_intel import AmdGpu, IntelGpu
# The GPU modules are imported only where devices are counted (--nproc-per-node gpu, auto, xpu):
# a launch with a number never pays for them (gpu/devices.py 1.5 ms, gpu/amd_intel.py 1 ms).

__all__ = [
    "count_visible_gpus",
    "count_visible_xpus",
    "cpu_count",
    "physical_amd_gpus",
    "physical_gpu_uuids",
    "physical_intel_gpus",
    "resolve_nproc",
    "visible_gpu_count",
]


def resolve_nproc(
    value: str, *, environ: Mapping[str, str] | None = None, origin: str = "--nproc-per-node"
) -> int:
    """Turn a ``--nproc-per-node`` value into a worker count, or raise ConfigError.

    ``environ`` supplies the device variables (``CUDA_VISIBLE_DEVICES``, ``HIP_VISIBLE_DEVICES``,
    ``ROCR_VISIBLE_DEVICES``, ``ZE_AFFINITY_MASK``, ``ZE_FLAT_DEVICE_HIERARCHY``; default: this
    process's environment).
    """
    env = os.environ if environ is None else environ
    text = value.strip()
    accepted = "a positive integer, 'auto', 'cpu', 'gpu' or 'xpu'"
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
            shown = ", ".join(
                f"{name}={env[name]!r}"
                for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
                if name in env
            )
            raise ConfigError(
                f"{origin}=gpu: no NVIDIA GPU is visible (torchrun: 'Cuda is not available.'), "
                f"nor an AMD (ROCm) one{'; ' + shown if shown else ''}; give a number instead"
            )
        return gpus
    if keyword == "xpu":
        xpus = _xpus(env, origin, integrated=True)
        if xpus == 0:
            shown = ", ".join(
                f"{name}={env[name]!r}"
                for name in ("ZE_AFFINITY_MASK", "ZE_FLAT_DEVICE_HIERARCHY")
                if name in env
            )
            raise ConfigError(
                f"{origin}=xpu is not supported on this node: no Intel GPU is visible (torchrun: "
                f"'Xpu is not available.'){'; ' + shown if shown else ''}; give a number instead"
            )
        return xpus
    if keyword == "auto":
        # torchrun: the accelerator's device count when there is one, else the CPU count.
        gpus = count_visible_gpus(env)
        if gpus > 0:
            return gpus
        xpus = _xpus(env, origin, integrated=False)
        return xpus if xpus > 0 else cpu_count()
    raise ConfigError(f"{origin}={value!r} is not valid: use {accepted}")


def cpu_count() -> int:
    """The CPUs this process may run on, as torch._utils.cpu_count (affinity, then os.cpu_count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def count_visible_gpus(environ: Mapping[str, str]) -> int:
    """How many GPUs torch.cuda counts in a worker started with ``environ``: its NVIDIA GPUs,
    or where it has none, its AMD GPUs (a ROCm build's ``cuda`` devices)."""
    nvidia = visible_gpu_count(environ.get("CUDA_VISIBLE_DEVICES"), physical_gpu_uuids())
    if nvidia > 0:
        return nvidia
    from ..gpu.amd_intel import visible_amd_count

    return visible_amd_count(environ, physical_amd_gpus())


def count_visible_xpus(environ: Mapping[str, str], *, integrated: bool = True) -> int:
    """How many devices torch.xpu counts in a worker started with ``environ`` (``integrated``:
    whether an integrated GPU may count); UnknownMask for a ZE_AFFINITY_MASK we cannot read."""
    from ..gpu.amd_intel import visible_xpu_count

    return visible_xpu_count(environ, physical_intel_gpus(), integrated=integrated)


def _xpus(environ: Mapping[str, str], origin: str, *, integrated: bool) -> int:
    from ..gpu.amd_intel import UnknownMask

    try:
        return count_visible_xpus(environ, integrated=integrated)
    except UnknownMask as e:
        raise ConfigError(f"{origin}: {e}; give a number instead") from None


def physical_amd_gpus() -> list[AmdGpu]:
    """The AMD GPUs ROCm would use (gpu.amd_intel.amd_gpus; the seam tests replace)."""
    from ..gpu.amd_intel import amd_gpus

    return amd_gpus()


def physical_intel_gpus() -> list[IntelGpu]:
    """The Intel GPUs Level Zero would use (gpu.amd_intel.intel_gpus; the seam tests replace)."""
    from ..gpu.amd_intel import intel_gpus

    return intel_gpus()


def physical_gpu_uuids(proc_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """One entry per NVIDIA GPU on this machine, in PCI order: its UUID, or "" when the driver
    does not say (gpu.devices.physical_gpus, in ``proc_dir``, by default the driver's
    NVIDIA_PROC_DIR; the seam tests replace)."""
    from ..gpu.devices import NVIDIA_PROC_DIR, physical_gpus

    where = NVIDIA_PROC_DIR if proc_dir is None else os.fspath(proc_dir)
    return [gpu.uuid for gpu in physical_gpus(proc_dir=where)]


def visible_gpu_count(cuda_visible_devices: str | None, physical: Sequence[str]) -> int:
    """How many of the ``physical`` GPUs (their UUIDs) a worker sees under CUDA_VISIBLE_DEVICES
    (gpu.devices.visible_gpu_count)."""
    from ..gpu.devices import visible_gpu_count as count

    return count(cuda_visible_devices, physical)
