"""This node's GPUs, as the agent uses them: which CUDA device each local rank gets, the CPUs
``--numa-binding`` gives it, and the GPU checks around a (re)start.

torchrun asks CUDA through torch; the agent never imports torch, so it finds the same answer
from the driver: the physical GPUs (``devices.py``: the driver's ``/proc`` entries or
``nvidia-smi``), the CUDA devices a worker will see (``CUDA_VISIBLE_DEVICES`` and
``CUDA_DEVICE_ORDER``, as CUDA reads them), each device's PCI bus id, that bus's NUMA node
(sysfs), and torch's four CPU sets (``numa.py``). Local rank k uses CUDA device k, as in
torchrun.

A binding is applied only when the node has exactly one visible GPU per local rank (torch
chose the same for its default binding, PR #160848): with fewer workers a rank may drive
several GPUs, with more some ranks have none, and a wrong guess slows the job down more than
no binding. Otherwise the agent says why once and binds nothing. A machine it cannot read
(a missing sysfs file, fewer cores than GPUs in ``exclusive`` mode, an order CUDA leaves
undefined) is an error before any rendezvous: the user asked for a binding and would
otherwise not get one without knowing.

The bindings are applied to the worker process before it runs anything (procutil.py's
``worker_preexec``, in the child between fork and exec: a cold worker, and a preloaded
interpreter from its own start, so its imports see the rank's CPUs too), which torch does with
``numactl --physcpubind``; the CPU sets are the same.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .devices import VisibleGpu

__all__ = ["Binding", "GpuSetupError", "binding_table", "bindings_for", "visible_gpu_uuids"]


class GpuSetupError(Exception):
    """The GPUs or the CPU topology could not be read as ``--numa-binding`` needs them."""


@dataclass(frozen=True)
class Binding:
    """The CPUs one local rank is bound to, and why."""

    local_rank: int
    cuda_index: int
    device: str  # the GPU's UUID (or MIG UUID), as CUDA_VISIBLE_DEVICES would name it
    pci_bus_id: str
    numa_node: int
    cpus: frozenset[int]

    def line(self, mode: str) -> str:
        from .numa import format_cpulist

        return (
            f"local_rank {self.local_rank}: cuda:{self.cuda_index} {self.device or '?'} "
            f"(PCI {self.pci_bus_id}, NUMA node {self.numa_node}) -> CPUs {format_cpulist(self.cpus)} "
            f"({mode})"
        )


def bindings_for(
    mode: str,
    nproc: int,
    environ: Mapping[str, str],
    *,
    log: Callable[[str, str], None],
    allowed: frozenset[int] | None = None,
    sys_root: str = "/sys",
    proc_dir: str | None = None,
    smi: str | None = None,
) -> list[Binding]:
    """The binding of each local rank for ``--numa-binding mode``; [] (said through ``log``)
    when the node does not have one visible GPU per worker; GpuSetupError when the machine
    cannot be read as the mode needs.  ``allowed``: the agent's own CPUs (default: its
    affinity, which cgroups, cpusets and Slurm's binding restrict)."""
    from .devices import GpuOrderUnknown
    from .numa import BindingError, cpu_sets, gpu_numa_node

    try:
        visible = _visible(environ, proc_dir, smi)
    except GpuOrderUnknown as e:
        raise GpuSetupError(f"--numa-binding {mode}: {e}") from None
    if len(visible) != nproc:
        shown = environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={shown!r})" if shown is not None else ""
        log(
            f"--numa-binding {mode}: not applied: {nproc} worker(s) per node but {len(visible)} visible "
            f"NVIDIA GPU(s){where}; a binding is exact only when local rank k owns GPU k alone",
            "warning",
        )
        return []
    if allowed is None:
        allowed = frozenset(os.sched_getaffinity(0))
    try:
        nodes = [gpu_numa_node(v.gpu.pci_bus_id, sys_root=sys_root) for v in visible]
        sets = cpu_sets(mode, nodes, allowed, sys_root=sys_root)
    except BindingError as e:
        text = str(e)
        raise GpuSetupError(
            text if text.startswith("--numa-binding") else f"--numa-binding {mode}: {text}"
        ) from None
    return [
        Binding(
            local_rank=k,
            cuda_index=v.cuda_index,
            device=v.mig or v.gpu.uuid,
            pci_bus_id=v.gpu.pci_bus_id,
            numa_node=nodes[k],
            cpus=sets[k],
        )
        for k, v in enumerate(visible)
    ]


def binding_table(mode: str, bindings: Sequence[Binding]) -> str:
    """What ``--log-dir`` keeps of the bindings: a line per local rank."""
    return "".join(b.line(mode) + "\n" for b in bindings)


def visible_gpu_uuids(
    environ: Mapping[str, str], *, proc_dir: str | None = None, smi: str | None = None
) -> list[str]:
    """The UUIDs of the physical GPUs this node's workers will see (a MIG slice's parent, once
    each): what the GPU checks watch.  [] when there are none, or when CUDA leaves their order
    undefined and ordinals pick them (then nobody can say which GPUs they are)."""
    from .devices import GpuOrderUnknown

    try:
        visible = _visible(environ, proc_dir, smi)
    except GpuOrderUnknown:
        return []
    return list(dict.fromkeys(v.gpu.uuid for v in visible if v.gpu.uuid))


def _visible(environ: Mapping[str, str], proc_dir: str | None, smi: str | None) -> list[VisibleGpu]:
    """The CUDA devices in a worker's order; MIG slices are looked up only when named."""
    from .devices import NVIDIA_PROC_DIR, physical_gpus, visible_gpus

    names = environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    migs = any(item.strip().startswith("MIG-") for item in names)
    physical = physical_gpus(proc_dir=proc_dir or NVIDIA_PROC_DIR, smi=smi, with_migs=migs)
    return visible_gpus(environ, physical)
