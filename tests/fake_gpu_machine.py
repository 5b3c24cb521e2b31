"""A fake GPU server on disk, for tests of what the agent reads from the machine.

:func:`build` writes, under one root folder, the parts of sysfs and procfs that NUMA binding
and GPU enumeration read (NUMA nodes and their CPU lists, each CPU's package, SMT siblings and
caches, each PCI device's ``numa_node``, the NVIDIA driver's ``/proc/driver/nvidia/gpus``), and
a ``bin/nvidia-smi`` that answers the queries the agent makes from a JSON description beside
it (``bin/nvidia-smi.json``), which a test may rewrite between calls.

CPUs are numbered as Linux numbers them on x86 servers: first thread of every core, socket
by socket, then the SMT siblings in the same order (cpu k and cpu k + cores are one core).

Presets: :func:`two_socket_8gpu` (2 sockets x 2 NUMA nodes, 8 cores x 2 threads per node,
an L3 per 4 cores, 2 GPUs per node), :func:`single_socket` (one node whose GPUs report
``numa_node`` -1, no SMT, one L3), and any shape through :func:`build`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["FakeGpu", "FakeMachine", "build", "cpulist", "single_socket", "two_socket_8gpu"]

H100 = "NVIDIA H100 80GB HBM3"


def cpulist(cpus: Iterable[int]) -> str:
    """ "0-3,8" for {0, 1, 2, 3, 8}: how sysfs writes a CPU list."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


@dataclass
class FakeGpu:
    """One physical GPU. ``pci`` in sysfs form ("0000:1b:00.0"); ``numa_node`` as the PCI
    device reports it (-1: unknown); ``memory_used`` is a list of MiB values, one per
    nvidia-smi call that asks for memory.used (the last one stays); ``lost``: nvidia-smi cannot reach it."""

    uuid: str
    pci: str
    numa_node: int
    name: str = H100
    memory_used: list[int] = field(default_factory=lambda: [0])
    memory_total: int = 81559
    ecc_uncorrected: int | str = 0  # "[N/A]" where ECC is off
    migs: list[str] = field(default_factory=list)  # MIG device UUIDs, "MIG-..."
    lost: bool = False

    def smi_bus_id(self) -> str:
        """nvidia-smi's spelling of the bus id: 8-digit domain, upper case."""
        domain, rest = self.pci.split(":", 1)
        return f"{int(domain, 16):08X}:{rest.upper()}"


@dataclass
class FakeMachine:
    root: Path  # sysfs at root/sys, procfs at root/proc
    bin: Path  # holds nvidia-smi
    gpus: list[FakeGpu]
    node_cpus: dict[int, list[int]]  # NUMA node -> its CPUs
    socket_of_node: dict[int, int]

    @property
    def sys(self) -> str:
        return str(self.root / "sys")

    @property
    def proc_nvidia(self) -> str:
        return str(self.root / "proc" / "driver" / "nvidia" / "gpus")

    @property
    def smi(self) -> str:
        return str(self.bin / "nvidia-smi")

    @property
    def calls_file(self) -> Path:
        """One line per nvidia-smi call: its arguments, space-separated."""
        return self.bin / "nvidia-smi.calls"

    def calls(self) -> list[str]:
        return self.calls_file.read_text().splitlines() if self.calls_file.exists() else []

    def path_env(self, path: str) -> str:
        """``PATH`` with the fake nvidia-smi first."""
        return f"{self.bin}:{path}"

    def all_cpus(self) -> set[int]:
        return {c for cpus in self.node_cpus.values() for c in cpus}

    def write_smi(self, *, hang: bool = False, fail: str = "") -> None:
        """(Re)write nvidia-smi's description: the GPUs as they are now; ``hang``: it never
        answers (a wedged driver); ``fail``: it prints this and exits 9."""
        spec: dict[str, Any] = {
            "hang": hang,
            "fail": fail,
            "gpus": [
                {
                    "uuid": g.uuid,
                    "bus_id": g.smi_bus_id(),
                    "name": g.name,
                    "memory_used": g.memory_used,
                    "memory_total": g.memory_total,
                    "ecc_uncorrected": g.ecc_uncorrected,
                    "migs": g.migs,
                    "lost": g.lost,
                }
                for g in self.gpus
            ],
        }
        (self.bin / "nvidia-smi.json").write_text(json.dumps(spec))
        counter = self.bin / "nvidia-smi.count"
        if counter.exists():
            counter.unlink()


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def build(
    root: Path,
    *,
    sockets: int,
    nodes_per_socket: int,
    cores_per_node: int,
    threads_per_core: int,
    cores_per_l3: int,
    gpus: Sequence[FakeGpu],
    proc_driver: bool = True,
) -> FakeMachine:
    """Write the fake machine under ``root``; ``proc_driver=False`` leaves out
    ``/proc/driver/nvidia`` (a container without it: nvidia-smi is the only source)."""
    sysfs = root / "sys"
    nodes = sockets * nodes_per_socket
    cores = nodes * cores_per_node
    node_cpus: dict[int, list[int]] = {}
    socket_of_node: dict[int, int] = {}
    for node in range(nodes):
        first = [node * cores_per_node + i for i in range(cores_per_node)]
        node_cpus[node] = [c + t * cores for t in range(threads_per_core) for c in first]
        socket_of_node[node] = node // nodes_per_socket
        _write(sysfs / f"devices/system/node/node{node}/cpulist", cpulist(node_cpus[node]) + "\n")
    _write(sysfs / "devices/system/node/possible", cpulist(range(nodes)) + "\n")
    _write(sysfs / "devices/system/node/online", cpulist(range(nodes)) + "\n")
    total = cores * threads_per_core
    _write(sysfs / "devices/system/cpu/possible", cpulist(range(total)) + "\n")
    _write(sysfs / "devices/system/cpu/online", cpulist(range(total)) + "\n")
    for cpu in range(total):
        core = cpu % cores
        node = core // cores_per_node
        siblings = [core + t * cores for t in range(threads_per_core)]
        l3_first = core - (core % cores_per_node) % cores_per_l3
        l3_cores = [c for c in range(l3_first, l3_first + cores_per_l3) if c // cores_per_node == node]
        l3 = [c + t * cores for t in range(threads_per_core) for c in l3_cores]
        d = sysfs / f"devices/system/cpu/cpu{cpu}"
        _write(d / "topology/thread_siblings_list", cpulist(siblings) + "\n")
        _write(d / "topology/core_cpus_list", cpulist(siblings) + "\n")
        _write(d / "topology/physical_package_id", f"{socket_of_node[node]}\n")
        _write(d / "topology/core_id", f"{core % cores_per_node}\n")
        caches = [("Data", 1, siblings), ("Instruction", 1, siblings), ("Unified", 2, siblings)]
        caches.append(("Unified", 3, l3))
        for index, (kind, level, shared) in enumerate(caches):
            _write(d / f"cache/index{index}/type", kind + "\n")
            _write(d / f"cache/index{index}/level", f"{level}\n")
            _write(d / f"cache/index{index}/shared_cpu_list", cpulist(shared) + "\n")
    for minor, gpu in enumerate(gpus):
        _write(sysfs / f"bus/pci/devices/{gpu.pci}/numa_node", f"{gpu.numa_node}\n")
        _write(sysfs / f"bus/pci/devices/{gpu.pci}/vendor", "0x10de\n")
        if proc_driver:
            _write(
                root / f"proc/driver/nvidia/gpus/{gpu.pci}/information",
                f"Model: \t\t {gpu.name}\nIRQ:   \t\t 0\nGPU UUID: \t {gpu.uuid}\n"
                f"Video BIOS: \t 96.00.99.00.01\nBus Type: \t PCIe\nDMA Size: \t 52 bits\n"
                f"DMA Mask: \t 0xfffffffffffff\nBus Location: \t {gpu.pci}\nDevice Minor: \t {minor}\n"
                "GPU Excluded:\t No\n",
            )
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!{sys.executable}\n" + _SMI_SCRIPT)
    smi.chmod(0o755)
    machine = FakeMachine(
        root=root, bin=bin_dir, gpus=list(gpus), node_cpus=node_cpus, socket_of_node=socket_of_node
    )
    machine.write_smi()
    return machine


def _uuid(i: int) -> str:
    return f"GPU-{i:08x}-1111-2222-3333-44444444{i:04x}"


def two_socket_8gpu(root: Path, **kw: Any) -> FakeMachine:
    """2 sockets x 2 NUMA nodes x 8 cores x 2 threads (64 CPUs), an L3 per 4 cores; GPU k on
    NUMA node k // 2, bus ids in PCI order."""
    buses = ["1b", "29", "45", "4e", "9c", "aa", "c3", "d1"]
    gpus = [FakeGpu(uuid=_uuid(i), pci=f"0000:{b}:00.0", numa_node=i // 2) for i, b in enumerate(buses)]
    return build(
        root, sockets=2, nodes_per_socket=2, cores_per_node=8, threads_per_core=2, cores_per_l3=4,
        gpus=kw.pop("gpus", gpus), **kw,
    )  # fmt: skip


def single_socket(root: Path, ngpus: int = 4, **kw: Any) -> FakeMachine:
    """One socket, one NUMA node, 8 cores without SMT, one L3; the GPUs' numa_node is -1."""
    gpus = [FakeGpu(uuid=_uuid(i), pci=f"0000:{0x3B + i:02x}:00.0", numa_node=-1) for i in range(ngpus)]
    return build(
        root, sockets=1, nodes_per_socket=1, cores_per_node=8, threads_per_core=1, cores_per_l3=8,
        gpus=kw.pop("gpus", gpus), **kw,
    )  # fmt: skip


# The fake nvidia-smi. Answers: -L; --query-gpu=F1,F2 --format=csv[,noheader][,nounits]
# (F among index, uuid, pci.bus_id, name, memory.used, memory.total,
# ecc.errors.uncorrected.volatile.total). Each call is appended to nvidia-smi.calls.
_SMI_SCRIPT = r"""
import json, os, sys, time
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "nvidia-smi.calls"), "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\n")
spec = json.load(open(os.path.join(here, "nvidia-smi.json")))
# memory.used steps through its list once per call that asks for it
count_path = os.path.join(here, "nvidia-smi.count")
try:
    call = int(open(count_path).read())
except (OSError, ValueError):
    call = 0
if any("memory.used" in a for a in sys.argv[1:]):
    open(count_path, "w").write(str(call + 1))
if spec["hang"]:
    time.sleep(3600)
if spec["fail"]:
    print(spec["fail"])
    sys.exit(9)
gpus = spec["gpus"]
args = sys.argv[1:]
lost = False
if args == ["-L"]:
    for i, g in enumerate(gpus):
        if g["lost"]:
            print(f"Unable to determine the device handle for GPU{g['bus_id']}: GPU is lost.")
            lost = True
            continue
        print(f"GPU {i}: {g['name']} (UUID: {g['uuid']})")
        for k, m in enumerate(g["migs"]):
            print(f"  MIG 1g.10gb     Device  {k}: (UUID: {m})")
    sys.exit(15 if lost else 0)
query = [a for a in args if a.startswith("--query-gpu=")]
fmt = [a for a in args if a.startswith("--format=")]
if not query or not fmt:
    print("fake nvidia-smi: unsupported arguments " + " ".join(args), file=sys.stderr)
    sys.exit(2)
fields = query[0].split("=", 1)[1].split(",")
opts = fmt[0].split("=", 1)[1].split(",")
units = "nounits" not in opts
if "noheader" not in opts:
    print(", ".join(fields))
for i, g in enumerate(gpus):
    if g["lost"]:
        print(f"Unable to determine the device handle for GPU{g['bus_id']}: GPU is lost.", file=sys.stderr)
        lost = True
        continue
    used = g["memory_used"][min(call, len(g["memory_used"]) - 1)]
    values = {
        "index": str(i),
        "uuid": g["uuid"],
        "pci.bus_id": g["bus_id"],
        "name": g["name"],
        "memory.used": f"{used} MiB" if units else str(used),
        "memory.total": f"{g['memory_total']} MiB" if units else str(g["memory_total"]),
        "ecc.errors.uncorrected.volatile.total": str(g["ecc_uncorrected"]),
    }
    try:
        print(", ".join(values[f.strip()] for f in fields))
    except KeyError as e:
        print(f"Field {e} is not a valid field to query.", file=sys.stderr)
        sys.exit(2)
sys.exit(15 if lost else 0)
"""
