"""This node's NVIDIA GPUs without torch: the physical GPUs, and the CUDA devices a worker sees.

torch asks CUDA, which the agent cannot do without importing it; the same answer comes from
the driver. :func:`physical_gpus` lists the GPUs from ``/proc/driver/nvidia/gpus`` (one
folder per GPU, named by its PCI bus id, whose ``information`` file gives the UUID and the
model; no subprocess) or, where a container lacks that folder, from ``nvidia-smi
--query-gpu``. The list is in PCI bus order, which is NVML's (nvidia-smi's) numbering. A GPU
listed in /proc whose device node this process may not open (a device cgroup denies it) is
left out: CUDA and NVML skip it too, so counting it would shift every ordinal after it.

:func:`visible_gpus` then does what CUDA does with the environment: ``CUDA_DEVICE_ORDER``
picks the order of the devices (``PCI_BUS_ID``; anything else is CUDA's default
``FASTEST_FIRST``) and ``CUDA_VISIBLE_DEVICES`` picks and reorders them (ordinals into that
order, ``GPU-`` UUIDs or unique prefixes, ``MIG-`` UUIDs). Logical CUDA index k is the k-th
device of the result: never simply NVML index k, the mistake that made other launchers bind
workers to the wrong NUMA node. ``FASTEST_FIRST`` puts CUDA's guess of the fastest device
first and documents no order for the rest; on a node of one GPU model that is PCI order, and
on a mixed node we cannot know it, so ordinals there raise :class:`GpuOrderUnknown` (UUIDs
are exact in any order).

The list is read as CUDA reads it (and as torch's ``_parse_visible_devices`` mimics): ordinals
parsed like ``strtoul``, the list ends at the first invalid entry, a repeated entry empties
it, ordinals are cut at the first one past the last device, and a UUID list ends at an
unknown or ambiguous prefix.

nvidia-smi may hang on a wedged driver, in uninterruptible sleep that even SIGKILL does not
end at once: each call has a deadline, after which it is killed and waited for one more second
at most, then abandoned. A failing or hanging nvidia-smi gives an empty list; the caller says
what that means to it.

Not covered: how CUDA enumerates a MIG-enabled GPU chosen by ordinal or left implicit (only
``MIG-`` UUIDs map to MIG slices), AMD and Intel devices.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from ..executables import which
from .numa import sysfs_pci_address

__all__ = [
    "NVIDIA_PROC_DIR",
    "SMI_TIMEOUT",
    "Gpu",
    "GpuOrderUnknown",
    "VisibleGpu",
    "physical_gpus",
    "visible_gpu_count",
    "visible_gpus",
]

NVIDIA_PROC_DIR = "/proc/driver/nvidia/gpus"
SMI_TIMEOUT = 10.0  # seconds for one nvidia-smi call

_MAX_GPUS = 1024  # bound on the entries read; NVSwitch nodes have 16
_INFO_LIMIT = 64 * 1024  # a driver's `information` file is about 500 bytes
_SMI_OUTPUT_LIMIT = 1 << 20  # more than this from nvidia-smi is not an answer
_KILL_GRACE = 1.0  # seconds to wait for a killed nvidia-smi before abandoning it
_QUERY = ("--query-gpu=index,uuid,pci.bus_id,name", "--format=csv,noheader")


@dataclass(frozen=True)
class Gpu:
    """One physical NVIDIA GPU."""

    index: int  # NVML / nvidia-smi index
    uuid: str  # "GPU-…", "" when unknown
    pci_bus_id: str  # sysfs form "0000:1b:00.0", lower case ("" when unknown)
    name: str = ""  # model ("NVIDIA H100 80GB HBM3")
    migs: tuple[str, ...] = ()  # its MIG device UUIDs (only known from nvidia-smi -L)


@dataclass(frozen=True)
class VisibleGpu:
    """One CUDA device as a worker sees it."""

    cuda_index: int  # torch.device(f"cuda:{cuda_index}")
    gpu: Gpu  # the physical GPU (a MIG slice's parent)
    mig: str = ""  # the MIG UUID when the device is a MIG slice


class GpuOrderUnknown(Exception):
    """Which physical GPU a CUDA device is cannot be known from the driver; the message says
    what the user can set to make it exact."""


# --- physical GPUs ----------------------------------------------------------------------------


def physical_gpus(
    *,
    proc_dir: str = NVIDIA_PROC_DIR,
    smi: str | None = None,
    with_migs: bool = False,
    timeout: float = SMI_TIMEOUT,
    dev_dir: str = "/dev",
) -> list[Gpu]:
    """The NVIDIA GPUs of this machine in PCI bus order; [] without GPUs, driver or a working
    nvidia-smi. ``smi``: the nvidia-smi to run (default: the one on PATH). ``with_migs`` also
    runs ``nvidia-smi -L`` for each GPU's MIG UUIDs (needed only for ``MIG-`` entries in
    ``CUDA_VISIBLE_DEVICES``). ``timeout`` bounds each nvidia-smi call. ``dev_dir`` holds the
    GPUs' device nodes: a GPU this process may not open is left out, as CUDA leaves it out."""
    proc_dir = os.fspath(proc_dir)
    if os.path.isdir(proc_dir):
        gpus = _from_proc(proc_dir, dev_dir)
        if not gpus or not with_migs:
            return gpus
    else:
        gpus = []
    if smi is None:
        smi = which("nvidia-smi")
        if smi is None:
            return gpus
    if not gpus:
        gpus = _from_smi(smi, timeout)
    if with_migs and gpus:
        gpus = _with_migs(gpus, smi, timeout)
    return gpus


def _from_proc(proc_dir: str, dev_dir: str) -> list[Gpu]:
    found: list[tuple[str, str, str]] = []  # (bus id, uuid, model)
    try:
        with os.scandir(proc_dir) as entries:
            for entry in entries:
                if len(found) >= _MAX_GPUS:
                    break
                if not entry.is_dir():
                    continue
                info = read_capped(os.path.join(entry.path, "information"))
                uuid = re.search(r"^GPU UUID:\s*(\S+)", info, re.MULTILINE)
                model = re.search(r"^Model:[ \t]*(.*?)\s*$", info, re.MULTILINE)
                bus = re.search(r"^Bus Location:\s*(\S+)", info, re.MULTILINE)
                minor = re.search(r"^Device Minor:\s*(\d+)", info, re.MULTILINE)
                if minor and not _may_open(os.path.join(dev_dir, f"nvidia{minor.group(1)}")):
                    continue
                found.append(
                    (
                        _sysfs_bus_id(bus.group(1) if bus else entry.name),
                        uuid.group(1) if uuid else "",
                        model.group(1) if model else "",
                    )
                )
    except OSError:
        return []
    found.sort(key=lambda f: _bus_key(f[0]))
    # NVML numbers GPUs in PCI bus order, so the position is the NVML index.
    return [Gpu(index=i, uuid=u, pci_bus_id=b, name=n) for i, (b, u, n) in enumerate(found)]


def _may_open(device: str) -> bool:
    """Whether this process may open a GPU's device node. The driver's /proc lists every GPU
    of the machine, but a device cgroup (Slurm's ConstrainDevices, systemd's DeviceAllow, some
    container runtimes) may deny some: CUDA and NVML skip those and number the rest from 0.
    access(2) asks the device cgroup as open(2) would, without waking the GPU."""
    try:
        os.stat(device)
    except OSError:
        return True  # no node yet: the driver's nvidia-modprobe creates it on first use
    return os.access(device, os.R_OK | os.W_OK)


def read_capped(path: str, limit: int = _INFO_LIMIT) -> str:
    """A small sysfs or /proc text file's first ``limit`` bytes; "" when unreadable (its GPU
    still counts)."""
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode(errors="replace")
    except OSError:
        return ""


def _from_smi(smi: str, timeout: float) -> list[Gpu]:
    result = _run_smi(smi, _QUERY, timeout)
    if result is None or result[0] != 0:
        return []
    gpus = []
    for line in result[1].splitlines()[:_MAX_GPUS]:
        fields = [f.strip() for f in line.split(",", 3)]  # the name last: it may hold commas
        if len(fields) != 4 or not fields[0].isdigit():
            continue
        index, uuid, bus, name = fields
        gpus.append(
            Gpu(
                index=int(index),
                uuid=uuid if uuid.startswith("GPU-") else "",
                pci_bus_id=_sysfs_bus_id(bus) if bus and not bus.startswith("[") else "",
                name="" if name.startswith("[") else name,  # "[N/A]", "[Unknown Error]"
            )
        )
    gpus.sort(key=lambda g: _bus_key(g.pci_bus_id))
    return gpus


def _with_migs(gpus: list[Gpu], smi: str, timeout: float) -> list[Gpu]:
    """``gpus`` with the MIG UUIDs that ``nvidia-smi -L`` lists under each; unchanged when
    it gives none. A partial answer (exit 15: a GPU is lost) is used: lines match by UUID."""
    result = _run_smi(smi, ("-L",), timeout)
    if result is None:
        return gpus
    migs: dict[str, list[str]] = {}
    parent: list[str] | None = None
    for line in result[1].splitlines()[: 64 * _MAX_GPUS]:
        gpu = re.match(r"GPU \d+:.*\(UUID:\s*(GPU-[^)\s]+)\)", line)
        if gpu:
            parent = migs.setdefault(gpu.group(1), [])
            continue
        mig = re.match(r"\s+MIG\b.*\(UUID:\s*(MIG-[^)\s]+)\)", line)
        if mig and parent is not None:
            parent.append(mig.group(1))
    return [replace(g, migs=tuple(migs[g.uuid])) if migs.get(g.uuid) else g for g in gpus]


def _run_smi(smi: str, args: Sequence[str], timeout: float) -> tuple[int, str] | None:
    """Run nvidia-smi; (exit status, stdout), or None when it cannot start, says too much or
    outlives ``timeout``. A killed nvidia-smi that does not die within a second (a wedged
    driver) is abandoned rather than waited for."""
    import selectors
    import signal
    import subprocess
    import time

    deadline = time.monotonic() + timeout
    try:
        proc = subprocess.Popen(
            [smi, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a kill of its group also ends any helper it started
        )
    except OSError:
        return None
    assert proc.stdout is not None
    chunks: list[bytes] = []
    size = 0
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ)
            while size <= _SMI_OUTPUT_LIMIT:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    break
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:  # end of output: now it only has to exit
                    status = proc.wait(max(deadline - time.monotonic(), 0.0))
                    return status, b"".join(chunks).decode(errors="replace")
                chunks.append(chunk)
                size += len(chunk)
    except subprocess.TimeoutExpired:
        pass
    finally:
        proc.stdout.close()
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                proc.wait(_KILL_GRACE)
            except subprocess.TimeoutExpired:
                pass  # uninterruptible: leave it to the kernel rather than block the agent
    return None


def _sysfs_bus_id(text: str) -> str:
    """A PCI bus id as sysfs spells it (nvidia-smi's "00000000:1B:00.0" is "0000:1b:00.0");
    anything else as given, lower case (it sorts last)."""
    return sysfs_pci_address(text) or text.strip().lower()


def _bus_key(bus_id: str) -> tuple[int, int, str]:
    """Numeric PCI order (a domain may have more than 4 digits); unknown ids last."""
    m = re.fullmatch(r"([0-9a-f]+):([0-9a-f]{2}:[0-9a-f]{2}\.[0-7])", bus_id)
    if m is None:
        return (1, 0, bus_id)
    return (0, int(m.group(1), 16), m.group(2))


# --- CUDA_VISIBLE_DEVICES -----------------------------------------------------------------------


def _parse_visible(value: str | None) -> list[int] | list[str] | None:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: None (unset: every device), ordinals, or
    device ids (all "GPU-…" or all "MIG-…", as the first entry decides)."""
    if value is None:
        return None
    text = value.strip()
    if text.startswith(("GPU-", "MIG-")):
        prefix = text[:4]
        ids: list[str] = []
        for item in text.split(","):
            item = item.strip()
            if not item.startswith(prefix):
                break
            if item in ids:
                return []
            ids.append(item)
        return ids
    ordinals: list[int] = []
    for item in text.split(","):
        digits = re.match(r"\s*\+?(\d+)", item)  # strtoul: "1gpu" is 1
        if digits is None:  # empty, negative or garbage: the list ends here
            break
        ordinal = int(digits.group(1))
        if ordinal in ordinals:
            return []
        ordinals.append(ordinal)
    return ordinals


def _match_prefix(candidate: str, names: Sequence[str]) -> int:
    """The index of the one name starting with ``candidate``; -1 if none or several."""
    found = -1
    for i, name in enumerate(names):
        if name and name.startswith(candidate):
            if found >= 0:
                return -1
            found = i
    return found


def _resolve_uuids(candidates: Sequence[str], uuids: Sequence[str]) -> list[int]:
    """Indices into ``uuids`` for a GPU- list: stops at an unknown or ambiguous prefix; a GPU
    named twice empties the list."""
    chosen: list[int] = []
    for candidate in candidates:
        i = _match_prefix(candidate, uuids)
        if i < 0:
            break
        if i in chosen:
            return []
        chosen.append(i)
    return chosen


def visible_gpu_count(cuda_visible_devices: str | None, physical: Sequence[str]) -> int:
    """How many of ``physical`` GPUs (their UUIDs, "" when unknown) CUDA exposes under
    ``CUDA_VISIBLE_DEVICES``. The order of the devices does not change the count, so this
    never needs ``CUDA_DEVICE_ORDER``; MIG UUIDs are trusted (matching them needs MIG data)."""
    parsed = _parse_visible(cuda_visible_devices)
    if parsed is None:
        return len(physical)
    if not parsed or isinstance(parsed[0], int):
        count = 0
        for ordinal in parsed:
            if not isinstance(ordinal, int) or ordinal >= len(physical):
                break
            count += 1
        return count
    ids = [str(p) for p in parsed]
    if ids[0].startswith("MIG-") or not any(physical):
        return len(ids) if physical else 0
    return len(_resolve_uuids(ids, physical))


def visible_gpus(environ: Mapping[str, str], physical: Sequence[Gpu]) -> list[VisibleGpu]:
    """The CUDA devices a worker started with ``environ`` sees, in CUDA's order: element k is
    ``cuda:k``. ``physical``: :func:`physical_gpus` (``with_migs=True`` when
    CUDA_VISIBLE_DEVICES names ``MIG-`` devices). GpuOrderUnknown when CUDA's choice cannot be
    known: ordinals (or no list) on a node of mixed GPU models without
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, UUIDs the driver did not report, MIG devices without
    ``nvidia-smi -L``'s data."""
    pci_order = sorted(physical, key=lambda g: _bus_key(g.pci_bus_id))
    parsed = _parse_visible(environ.get("CUDA_VISIBLE_DEVICES"))
    if not pci_order or parsed == []:
        return []
    if parsed is None or isinstance(parsed[0], int):
        ordinals = range(len(pci_order)) if parsed is None else parsed
        chosen: list[Gpu] = []
        for ordinal in ordinals:
            if not isinstance(ordinal, int) or ordinal >= len(pci_order):
                break  # CUDA cuts the list at the first ordinal past the last device
            chosen.append(pci_order[ordinal])
        if chosen and environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
            _require_one_model(pci_order, environ)
        return [VisibleGpu(cuda_index=k, gpu=g) for k, g in enumerate(chosen)]
    ids = [str(p) for p in parsed]
    if ids[0].startswith("GPU-"):
        return _visible_by_uuid(ids, pci_order)
    return _visible_migs(ids, pci_order)


def _require_one_model(gpus: Sequence[Gpu], environ: Mapping[str, str]) -> None:
    """FASTEST_FIRST is PCI order only when no GPU is faster than another: one model."""
    names = {g.name for g in gpus}
    if len(gpus) < 2 or (len(names) == 1 and "" not in names):
        return
    order = environ.get("CUDA_DEVICE_ORDER")
    said = "unset" if order is None else repr(order)
    models = ", ".join(f"{g.pci_bus_id} {g.name or '(model unknown)'}" for g in gpus)
    raise GpuOrderUnknown(
        f"this node mixes GPU models ({models}) and CUDA_DEVICE_ORDER is {said}, so CUDA numbers "
        "its devices fastest first in an order it does not document and the agent cannot tell "
        "which GPU each local rank gets; set CUDA_DEVICE_ORDER=PCI_BUS_ID, or list the GPUs by "
        "UUID in CUDA_VISIBLE_DEVICES (nvidia-smi -L shows them)"
    )


def _visible_by_uuid(ids: Sequence[str], gpus: Sequence[Gpu]) -> list[VisibleGpu]:
    if any(not g.uuid for g in gpus):
        unknown = ", ".join(g.pci_bus_id for g in gpus if not g.uuid)
        raise GpuOrderUnknown(
            f"CUDA_VISIBLE_DEVICES names GPUs by UUID but the driver did not report the UUID of "
            f"the GPU(s) at {unknown}; list them by ordinal with CUDA_DEVICE_ORDER=PCI_BUS_ID instead"
        )
    chosen = _resolve_uuids(ids, [g.uuid for g in gpus])
    return [VisibleGpu(cuda_index=k, gpu=gpus[i]) for k, i in enumerate(chosen)]


def _visible_migs(ids: Sequence[str], gpus: Sequence[Gpu]) -> list[VisibleGpu]:
    """MIG slices: "MIG-GPU-<uuid>/<gi>/<ci>" (drivers before R470) names its parent; a
    "MIG-<uuid>" is found among the slices ``nvidia-smi -L`` listed under each GPU."""
    slices = [(m, g) for g in gpus for m in g.migs]
    uuids = [g.uuid for g in gpus]
    out: list[VisibleGpu] = []
    seen: set[str] = set()
    for item in ids:
        if item.startswith("MIG-GPU-"):
            i = _match_prefix(item[4:].split("/", 1)[0], uuids)
            found = (item, gpus[i]) if i >= 0 else None
        elif not slices:
            raise GpuOrderUnknown(
                f"CUDA_VISIBLE_DEVICES names MIG device {item} but nvidia-smi -L listed no MIG "
                "devices, so the agent cannot tell which GPU it belongs to; make nvidia-smi "
                "available to the agent, or name the parent GPUs by UUID"
            )
        else:
            i = _match_prefix(item, [m for m, _ in slices])
            found = slices[i] if i >= 0 else None
        if found is None:
            break  # unknown or ambiguous: CUDA ends the list here
        if found[0] in seen:
            return []
        seen.add(found[0])
        out.append(VisibleGpu(cuda_index=len(out), gpu=found[1], mig=found[0]))
    return out
