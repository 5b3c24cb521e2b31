"""This node's AMD (ROCm) and Intel (``xpu``) GPUs without torch: how many a worker would see.

torchrun counts devices through torch (``torch.cuda.device_count()``, which a ROCm build answers
with AMD GPUs, and ``torch.xpu.device_count()``); the agent never imports torch, so it reads the
same answer from the kernel, as ``devices.py`` does for NVIDIA.

**AMD** (what ROCr's thunk, libhsakmt, enumerates): the nodes of the KFD topology,
``/sys/class/kfd/kfd/topology/nodes/N``, in node order. A node is a GPU when its ``gpu_id`` is
not 0 and its ``properties`` give ``simd_count > 0``; it is usable only when this process may
open ``/dev/kfd`` and the node's render device ``/dev/dri/renderD<drm_render_minor>`` (a device
cgroup, as Kubernetes' device plugin or Slurm set, denies the others, and the kernel answers
EPERM for their ``gpu_id``). APUs count, as ROCm counts them (an MI300A node has four), and a
partitioned GPU (MI300X in CPX mode) is a KFD node, so a device, per partition. The
environment is then applied as the runtimes apply it: ``ROCR_VISIBLE_DEVICES`` first (indices
or ``GPU-<unique id>`` UUIDs into that list; our reading: the list ends at the first entry that
names no GPU, and a GPU named twice counts once), then ``HIP_VISIBLE_DEVICES``, or when unset
``CUDA_VISIBLE_DEVICES``, over what ROCr left, read as CUDA reads a list (``devices.py``).

**Intel** (what torch 2.13's ``torch.xpu.device_count()`` counts through Level Zero Sysman):
the DRM cards ``/sys/class/drm/cardN`` whose PCI device has vendor ``0x8086`` and is driven by
``i915`` or ``xe``, whose render device this process may open, in PCI order. A card is
integrated when it sits on PCI bus 0 (Intel's integrated GPUs are ``0000:00:02.0``; discrete
ones sit behind a PCIe port). A discrete card with several tiles (Data Center GPU Max 1550: 2)
is one device per tile unless ``ZE_FLAT_DEVICE_HIERARCHY=COMPOSITE``; tiles are the
``device/tileK`` folders (xe) or ``gt/gtK`` folders (i915). ``ZE_AFFINITY_MASK`` (unless
empty) keeps the devices whose index it lists (integers; negative and repeated entries are
skipped, as torch skips them); COMPOSITE-style ``N.M`` entries count their distinct cards N in
COMPOSITE mode and raise :class:`UnknownMask` otherwise. Integrated GPUs count only when no
discrete one is visible, as torch counts them.

Not covered: ``HSA_OVERRIDE_GFX_VERSION`` and GPUs ROCr's build does not support,
``ONEAPI_DEVICE_SELECTOR``/``SYCL_DEVICE_FILTER``, and whether the installed torch is a ROCm or
XPU build at all (we count what such a build would see).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .devices import read_capped, visible_gpu_count
from .numa import sysfs_pci_address

__all__ = [
    "DEV_DIR",
    "SYS_ROOT",
    "AmdGpu",
    "IntelGpu",
    "UnknownMask",
    "amd_gpus",
    "intel_gpus",
    "visible_amd_count",
    "visible_xpu_count",
]

SYS_ROOT = "/sys"
DEV_DIR = "/dev"
KFD_NODES = "class/kfd/kfd/topology/nodes"  # under SYS_ROOT
DRM_CLASS = "class/drm"  # under SYS_ROOT

INTEL_VENDOR = 0x8086
INTEL_DRIVERS = frozenset({"i915", "xe"})
_MAX_NODES = 1024
_FILE_LIMIT = 64 * 1024  # a KFD properties file is about 1.5 kB


@dataclass(frozen=True)
class AmdGpu:
    """One GPU node of the KFD topology that this process may use."""

    node: int  # KFD topology node id
    uuid: str  # "GPU-<16 hex digits>" as ROCr names it, "" when the kernel gives no unique_id
    render_minor: int  # /dev/dri/renderD<minor>


@dataclass(frozen=True)
class IntelGpu:
    """One Intel GPU driven by i915 or xe that this process may use."""

    pci_bus_id: str  # "0000:3a:00.0"
    tiles: int  # >= 1
    integrated: bool


class UnknownMask(ValueError):
    """ZE_AFFINITY_MASK has a form whose device count we cannot tell."""


# --- AMD ----------------------------------------------------------------------------------------


def amd_gpus(*, sys_root: str | None = None, dev_dir: str | None = None) -> list[AmdGpu]:
    """The AMD GPUs ROCr would enumerate, in KFD node order; [] without KFD or /dev/kfd."""
    sys_root = SYS_ROOT if sys_root is None else sys_root
    dev_dir = DEV_DIR if dev_dir is None else dev_dir
    nodes_dir = os.path.join(sys_root, KFD_NODES)
    if not _may_open(os.path.join(dev_dir, "kfd")):
        return []
    try:
        names = [n for n in os.listdir(nodes_dir) if n.isdigit()]
    except OSError:
        return []
    found: list[AmdGpu] = []
    for name in sorted(names, key=int)[:_MAX_NODES]:
        node_dir = os.path.join(nodes_dir, name)
        gpu_id = _read(os.path.join(node_dir, "gpu_id")).strip()
        if not gpu_id.isdigit() or int(gpu_id) == 0:
            continue  # a CPU node, or one the device cgroup hides (EPERM)
        props = _properties(_read(os.path.join(node_dir, "properties")))
        if props.get("simd_count", 0) <= 0:
            continue
        minor = props.get("drm_render_minor", 0)
        if minor <= 0 or not _may_open(os.path.join(dev_dir, "dri", f"renderD{minor}")):
            continue
        unique = props.get("unique_id", 0)
        found.append(AmdGpu(node=int(name), uuid=f"GPU-{unique:016x}" if unique else "", render_minor=minor))
    return found


def visible_amd_count(environ: Mapping[str, str], gpus: Sequence[AmdGpu]) -> int:
    """How many of ``gpus`` a HIP program started with ``environ`` sees."""
    rocr = _rocr_visible(environ.get("ROCR_VISIBLE_DEVICES"), gpus)
    hip = environ.get("HIP_VISIBLE_DEVICES")
    if hip is None:
        hip = environ.get("CUDA_VISIBLE_DEVICES")
    return visible_gpu_count(hip, [g.uuid for g in rocr])


def _rocr_visible(value: str | None, gpus: Sequence[AmdGpu]) -> list[AmdGpu]:
    if value is None:
        return list(gpus)
    chosen: list[AmdGpu] = []
    for item in value.split(","):
        item = item.strip()
        if item.isdigit() and int(item) < len(gpus):
            gpu: AmdGpu | None = gpus[int(item)]
        elif item.upper().startswith("GPU-"):
            gpu = next((g for g in gpus if g.uuid and g.uuid.lower() == item.lower()), None)
        else:
            gpu = None
        if gpu is None:
            break
        if gpu not in chosen:
            chosen.append(gpu)
    return chosen


def _properties(text: str) -> dict[str, int]:
    """A KFD ``properties`` file: one "name value" pair a line, values decimal."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


# --- Intel --------------------------------------------------------------------------------------


def intel_gpus(*, sys_root: str | None = None, dev_dir: str | None = None) -> list[IntelGpu]:
    """The Intel GPUs (i915 or xe) Level Zero would enumerate, in PCI order."""
    sys_root = SYS_ROOT if sys_root is None else sys_root
    dev_dir = DEV_DIR if dev_dir is None else dev_dir
    drm = os.path.join(sys_root, DRM_CLASS)
    try:
        cards = [n for n in os.listdir(drm) if re.fullmatch(r"card\d+", n)]
    except OSError:
        return []
    found: dict[str, IntelGpu] = {}
    for card in sorted(cards, key=lambda n: int(n[4:]))[:_MAX_NODES]:
        card_dir = os.path.join(drm, card)
        device = os.path.join(card_dir, "device")
        vendor = _read(os.path.join(device, "vendor")).strip()
        try:
            if int(vendor, 16) != INTEL_VENDOR:
                continue
        except ValueError:
            continue
        driver = os.path.basename(os.path.realpath(os.path.join(device, "driver")))
        if driver not in INTEL_DRIVERS:
            continue
        if not _render_node_usable(device, dev_dir):
            continue
        bus = sysfs_pci_address(os.path.basename(os.path.realpath(device)))
        if bus is None or bus in found:
            continue
        integrated = bus.split(":")[1] == "00"
        tiles = 1 if integrated else _tiles(card_dir, device, driver)
        found[bus] = IntelGpu(pci_bus_id=bus, tiles=tiles, integrated=integrated)
    return [found[b] for b in sorted(found, key=_bus_key)]


def visible_xpu_count(
    environ: Mapping[str, str], gpus: Sequence[IntelGpu], *, integrated: bool = True
) -> int:
    """How many XPU devices torch would count with ``environ``. ``integrated=False`` leaves
    integrated GPUs out (``--nproc-per-node auto`` does). UnknownMask for a ZE_AFFINITY_MASK
    whose count we cannot tell."""
    composite = environ.get("ZE_FLAT_DEVICE_HIERARCHY") == "COMPOSITE"
    slots: list[bool] = []  # one per device, in Level Zero's order: is it integrated
    for gpu in gpus:
        tiles = gpu.tiles if not gpu.integrated and not composite else 1
        slots.extend([gpu.integrated] * max(tiles, 1))
    mask = environ.get("ZE_AFFINITY_MASK")
    if mask is None or not mask.strip():  # Level Zero reads an empty mask as no mask
        visible = slots
    else:
        picked = _mask_indices(mask, composite, gpus)
        visible = [slots[i] for i in picked if i < len(slots)]
    discrete = sum(1 for s in visible if not s)
    if discrete or not integrated:
        return discrete
    return len(visible)


def _mask_indices(mask: str, composite: bool, gpus: Sequence[IntelGpu]) -> list[int]:
    indices: list[int] = []
    for item in mask.split(","):
        text = item.strip()
        whole = re.fullmatch(r"[+-]?\d+", text)
        tile = re.fullmatch(r"(\d+)\.(\d+)", text)
        if whole:
            index = int(text)
        elif tile and composite:
            card, sub = int(tile.group(1)), int(tile.group(2))
            if card >= len(gpus) or sub >= max(gpus[card].tiles, 1):
                continue
            index = card
        else:
            raise UnknownMask(
                f"ZE_AFFINITY_MASK={mask!r}: the entry {text!r} is not a device number "
                "(and N.M entries are counted only with ZE_FLAT_DEVICE_HIERARCHY=COMPOSITE)"
            )
        if index >= 0 and index not in indices:
            indices.append(index)
    return indices


def _tiles(card_dir: str, device: str, driver: str) -> int:
    if driver == "xe":
        folder, pattern = device, r"tile\d+"
    else:
        folder, pattern = os.path.join(card_dir, "gt"), r"gt\d+"
    try:
        return max(1, sum(1 for n in os.listdir(folder) if re.fullmatch(pattern, n)))
    except OSError:
        return 1


def _render_node_usable(device: str, dev_dir: str) -> bool:
    try:
        names = [n for n in os.listdir(os.path.join(device, "drm")) if re.fullmatch(r"renderD\d+", n)]
    except OSError:
        return False
    return any(_may_open(os.path.join(dev_dir, "dri", n)) for n in names)


# --- common -------------------------------------------------------------------------------------


def _may_open(device: str) -> bool:
    """Whether this process may open a device node: it exists and access(2) allows read and
    write (a device cgroup or the node's group may deny it; the runtimes then skip the GPU)."""
    return os.path.exists(device) and os.access(device, os.R_OK | os.W_OK)


def _read(path: str) -> str:
    return read_capped(path, _FILE_LIMIT)


def _bus_key(bus_id: str) -> tuple[int, str]:
    domain, rest = bus_id.split(":", 1)
    return (int(domain, 16), rest)
