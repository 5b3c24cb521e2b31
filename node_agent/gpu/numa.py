"""``--numa-binding`` without torch: the CPUs each worker is bound to, read from sysfs.

torchrun 2.13 binds the worker of local rank k to CPUs near CUDA device k
(``torch.numa.binding``), asking CUDA for the device's PCI address. The agent never imports
torch, so the caller finds each visible device's PCI address itself (the r-th visible CUDA
device, honouring ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``), turns it into a NUMA node
with :func:`gpu_numa_node`, and asks :func:`cpu_sets` for every rank's CPUs at once. The
answers are torch's, mode by mode:

``node``
    the CPUs of the GPU's NUMA node (``node<N>/cpulist``).
``socket``
    the CPUs of every NUMA node in the GPU node's package; a node's package is the
    ``physical_package_id`` of its lowest allowed CPU.
``exclusive``
    the node's physical cores (CPUs keyed by the lowest of their ``thread_siblings_list``),
    sorted and split evenly among the node's GPUs in logical order, the lowest indices taking one
    extra core each when the split is uneven; fewer cores than GPUs is an error.
``core-complex``
    the node's CPUs grouped by the highest-level data or unified cache they share (keyed by the
    lowest CPU of its ``shared_cpu_list``), groups ordered largest first, then by key; the i-th
    GPU on the node takes group ``i mod groups``.

Every set is intersected with ``allowed``, the agent's own ``sched_getaffinity(0)``, so cgroup,
cpuset and Slurm limits hold, as in torch. We differ from torch only where it crashes or reports
a bare exception: a ``possible`` NUMA node that has no allowed CPUs (a memory-only node, such as
GPU memory exposed as NUMA on Grace Hopper, or an offline node without a sysfs directory) is
skipped in ``socket`` mode, where torch fails on ``min()`` of an empty set; a GPU node without
allowed CPUs finds its package from its lowest CPU instead; and every failure is a
:class:`BindingError` naming the mode, the rank, the node and the CPUs, raised for the whole
machine before any worker starts (torch fails the one worker, which ends the job anyway).

Each sysfs file is read at most once per call, and each read is capped, so a call costs a few
hundred small reads on a large server and never more.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet

__all__ = [
    "MODES",
    "BindingError",
    "cpu_sets",
    "format_cpulist",
    "gpu_numa_node",
    "parse_cpulist",
    "sysfs_pci_address",
]

MODES: tuple[str, ...] = ("node", "socket", "exclusive", "core-complex")

MAX_CPUS = 1 << 16  # a CPU number at or above this is not a real CPU (Linux's NR_CPUS is <= 8192)
_MAX_CPULIST_CHARS = 1 << 20  # the longest possible list of MAX_CPUS CPUs is ~400 KB
_READ_CAP = 64 * 1024  # bytes; a sysfs attribute is at most a page or two
_MAX_DIR_ENTRIES = 256  # a CPU's cache/ directory holds a handful of index<N> entries


class BindingError(Exception):
    """The CPUs for a worker cannot be worked out; the message is meant for the user."""


def parse_cpulist(text: str) -> set[int]:
    """The CPUs in a sysfs/numactl list: ``"0-3,8,10-11\\n"`` -> {0, 1, 2, 3, 8, 10, 11}.

    An empty (or blank) list is the empty set, as sysfs writes it for a node without CPUs.
    Raises ValueError on anything else that is not ``N`` or ``N-M`` items joined by commas,
    and on CPU numbers of :data:`MAX_CPUS` or more.
    """
    if len(text) > _MAX_CPULIST_CHARS:
        raise ValueError(f"CPU list of {len(text)} characters is too long")
    body = text.strip()
    cpus: set[int] = set()
    if not body:
        return cpus
    for item in body.split(","):
        first, dash, last = item.partition("-")
        start = _cpu_number(first, item)
        end = _cpu_number(last, item) if dash else start
        if end < start:
            raise ValueError(f"CPU range {item!r} runs backwards")
        cpus.update(range(start, end + 1))
    return cpus


def _cpu_number(text: str, item: str) -> int:
    # str.isdigit alone would let "٣" through, and int() accepts "+1", " 1" and "1_0".
    if not _is_decimal(text):
        raise ValueError(f"{item!r} is not a CPU number or range")
    number = int(text)
    if number >= MAX_CPUS:
        raise ValueError(f"CPU {number} in {item!r} is beyond {MAX_CPUS - 1}")
    return number


def format_cpulist(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 3, 8} -> ``"0-3,8"``, as sysfs and ``numactl --physcpubind`` write CPU lists."""
    ranges: list[str] = []
    start = prev = -2
    for cpu in sorted(set(cpus)):
        if cpu < 0:
            raise ValueError(f"CPU numbers are not negative: {cpu}")
        if cpu != prev + 1:
            if prev >= 0:
                ranges.append(_span(start, prev))
            start = cpu
        prev = cpu
    if prev >= 0:
        ranges.append(_span(start, prev))
    return ",".join(ranges)


def _span(start: int, end: int) -> str:
    return str(start) if start == end else f"{start}-{end}"


def gpu_numa_node(pci_bus_id: str, *, sys_root: str = "/sys") -> int:
    """The NUMA node of the PCI device ``pci_bus_id`` (``0000:1b:00.0``; nvidia-smi's
    ``00000000:1B:00.0`` too), from ``bus/pci/devices/<id>/numa_node``.

    -1 (a machine that does not say, usually one with a single node) reads as node 0, as in torch.
    """
    address = sysfs_pci_address(pci_bus_id)
    if address is None:
        raise BindingError(f"{pci_bus_id!r} is not a PCI address (expected DOMAIN:BUS:DEVICE.FUNCTION)")
    return max(_Sysfs(sys_root).integer(f"bus/pci/devices/{address}/numa_node"), 0)


def sysfs_pci_address(bus_id: str) -> str | None:
    """``DOMAIN:BUS:DEVICE.FUNCTION`` in hex, any case and domain width (nvidia-smi's
    ``00000000:1B:00.0``) -> sysfs's and the kernel log's spelling (``0000:1b:00.0``); None
    when it is not one. The one reading of a bus id for gpus.py and health.py too."""
    parts = bus_id.strip().split(":")
    if len(parts) == 3:
        device, dot, function = parts[2].partition(".")
        fields = (parts[0], parts[1], device, function)
        limits = (0xFFFFFFFF, 0xFF, 0x1F, 0x7)
        if dot and all(_is_hex(f) and int(f, 16) <= top for f, top in zip(fields, limits, strict=True)):
            domain, bus, dev, fn = (int(f, 16) for f in fields)
            return f"{domain:04x}:{bus:02x}:{dev:02x}.{fn:x}"
    return None


def _is_hex(text: str) -> bool:
    return 0 < len(text) <= 8 and text.isascii() and all(c in "0123456789abcdefABCDEF" for c in text)


def cpu_sets(
    mode: str, gpu_nodes: Sequence[int], allowed: AbstractSet[int], *, sys_root: str = "/sys"
) -> list[frozenset[int]]:
    """The CPUs of each local rank's worker under ``--numa-binding=mode``.

    Element k is for local rank k, which uses logical CUDA device k, whose NUMA node is
    ``gpu_nodes[k]`` (``len(gpu_nodes)`` is the number of visible CUDA devices). ``allowed`` is
    the agent's own ``os.sched_getaffinity(0)``. Raises ValueError for an unknown mode or a
    negative node, BindingError when any rank cannot be bound (an empty set included).
    """
    if mode not in MODES:
        raise ValueError(f"unknown NUMA binding mode {mode!r}: use one of {', '.join(MODES)}")
    nodes = list(gpu_nodes)
    for node in nodes:
        if node < 0:
            raise ValueError(f"NUMA node {node} is negative; read it with gpu_numa_node()")
    usable = frozenset(allowed)
    sysfs = _Sysfs(sys_root)
    # Ranks on each node in logical order: exclusive and core-complex split a node among them.
    peers: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        peers.setdefault(node, []).append(rank)

    shares: dict[int, list[frozenset[int]]] = {}  # node -> its GPUs' sets, in peer order
    result: list[frozenset[int]] = []
    for rank, node in enumerate(nodes):
        if mode == "node":
            cpus = sysfs.node_cpus(node) & usable
        elif mode == "socket":
            cpus = _socket_cpus(sysfs, node, usable)
        else:
            if node not in shares:
                split = _exclusive_split if mode == "exclusive" else _core_complex_split
                shares[node] = split(sysfs, node, peers[node], usable)
            cpus = shares[node][peers[node].index(rank)]
        if not cpus:
            raise BindingError(
                f"--numa-binding={mode}: no CPU left for local rank {rank}: its GPU is on NUMA node "
                f"{node} (CPUs {format_cpulist(sysfs.node_cpus(node)) or 'none'}), and this agent may "
                f"run only on CPUs {format_cpulist(usable) or 'none'}"
            )
        result.append(cpus)
    return result


def _socket_cpus(sysfs: _Sysfs, node: int, allowed: frozenset[int]) -> frozenset[int]:
    package = _package(sysfs, node, allowed)
    if package is None:
        raise BindingError(
            f"--numa-binding=socket: NUMA node {node} has no CPUs "
            f"({sysfs.path(_node_cpulist(node))}), so its socket is unknown"
        )
    cpus: set[int] = set()
    for other in sorted(sysfs.cpus("devices/system/node/possible")):
        # torch takes min() of each node's allowed CPUs here and crashes on a node with none
        # (or without a directory); such a node adds no CPU to the union, so we skip it.
        theirs = sysfs.node_cpus(other, missing_ok=True) & allowed
        if theirs and _package_of_cpu(sysfs, min(theirs)) == package:
            cpus |= theirs
    return frozenset(cpus)


def _package(sysfs: _Sysfs, node: int, allowed: frozenset[int]) -> int | None:
    """The GPU node's package: its lowest allowed CPU's, as torch; else its lowest CPU's."""
    everything = sysfs.node_cpus(node)
    pick = everything & allowed or everything
    return _package_of_cpu(sysfs, min(pick)) if pick else None


def _package_of_cpu(sysfs: _Sysfs, cpu: int) -> int:
    return sysfs.integer(f"devices/system/cpu/cpu{cpu}/topology/physical_package_id")


def _exclusive_split(
    sysfs: _Sysfs, node: int, ranks: list[int], allowed: frozenset[int]
) -> list[frozenset[int]]:
    on_node = sysfs.node_cpus(node) & allowed
    cores: dict[int, set[int]] = {}
    for cpu in on_node:
        path = f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        siblings = sysfs.cpus(path)
        if not siblings:
            raise BindingError(f"{sysfs.path(path)} lists no CPU")
        cores.setdefault(min(siblings), set()).add(cpu)
    if len(cores) < len(ranks):
        raise BindingError(
            f"--numa-binding=exclusive: NUMA node {node} has {len(cores)} physical core(s) this agent "
            f"may use (CPUs {format_cpulist(on_node) or 'none'}) for its {len(ranks)} GPUs (local ranks "
            f"{', '.join(map(str, ranks))}); each GPU needs a core of its own: use --numa-binding=node "
            "or give the job more CPUs"
        )
    ordered = [cores[key] for key in sorted(cores)]
    each, extra = divmod(len(ordered), len(ranks))
    shares: list[frozenset[int]] = []
    start = 0
    for i in range(len(ranks)):
        end = start + each + (1 if i < extra else 0)
        shares.append(frozenset(cpu for core in ordered[start:end] for cpu in core))
        start = end
    return shares


def _core_complex_split(
    sysfs: _Sysfs, node: int, ranks: list[int], allowed: frozenset[int]
) -> list[frozenset[int]]:
    groups: dict[int, set[int]] = {}
    for cpu in sysfs.node_cpus(node) & allowed:
        groups.setdefault(_largest_cache_key(sysfs, cpu), set()).add(cpu)
    if not groups:  # torch: ZeroDivisionError; ours: the empty-set error in cpu_sets
        return [frozenset() for _ in ranks]
    ordered = [frozenset(cpus) for _, cpus in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))]
    return [ordered[i % len(ordered)] for i in range(len(ranks))]


def _largest_cache_key(sysfs: _Sysfs, cpu: int) -> int:
    """The lowest CPU sharing ``cpu``'s highest-level data or unified cache."""
    cache_dir = f"devices/system/cpu/cpu{cpu}/cache"
    indices = [e for e in sysfs.listdir(cache_dir) if e[:5] == "index" and _is_decimal(e[5:])]
    best_level = -1
    shared: frozenset[int] = frozenset()
    # torch walks listdir's order and keeps the first cache at the top level; index order is
    # the same answer wherever one cache per level is listed, and is deterministic.
    for entry in sorted(indices, key=lambda e: int(e[5:])):
        if sysfs.text(f"{cache_dir}/{entry}/type").strip() not in ("Data", "Unified"):
            continue  # instruction caches hold no data the threads share
        level = sysfs.integer(f"{cache_dir}/{entry}/level")
        if level > best_level:
            best_level = level
            shared = sysfs.cpus(f"{cache_dir}/{entry}/shared_cpu_list")
    if not shared:
        raise BindingError(
            f"--numa-binding=core-complex: {sysfs.path(cache_dir)} lists no data or unified cache "
            f"shared by CPU {cpu}"
        )
    return min(shared)


def _is_decimal(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _node_cpulist(node: int) -> str:
    return f"devices/system/node/node{node}/cpulist"


class _Sysfs:
    """Reads under one sysfs root: each file once, each read capped, each failure a BindingError
    that names the file."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._texts: dict[str, str | None] = {}
        self._cpus: dict[str, frozenset[int]] = {}

    def path(self, relative: str) -> str:
        return os.path.join(self.root, relative)

    def text(self, relative: str) -> str:
        text = self._load(relative, missing_ok=False)
        if text is None:
            raise BindingError(f"cannot read {self.path(relative)}: No such file or directory")
        return text

    def _load(self, relative: str, *, missing_ok: bool) -> str | None:
        if relative not in self._texts:
            self._texts[relative] = _read_capped(self.path(relative), missing_ok=missing_ok)
        return self._texts[relative]

    def cpus(self, relative: str, *, missing_ok: bool = False) -> frozenset[int]:
        """The CPU list in a file; with ``missing_ok``, a missing file is an empty list."""
        if relative not in self._cpus:
            text = self._load(relative, missing_ok=True) if missing_ok else self.text(relative)
            if text is None:  # not cached as a list: a later strict read must still fail
                return frozenset()
            try:
                self._cpus[relative] = frozenset(parse_cpulist(text))
            except ValueError as e:
                raise BindingError(f"{self.path(relative)}: {e}") from None
        return self._cpus[relative]

    def node_cpus(self, node: int, *, missing_ok: bool = False) -> frozenset[int]:
        return self.cpus(_node_cpulist(node), missing_ok=missing_ok)

    def integer(self, relative: str) -> int:
        text = self.text(relative).strip()
        digits = text[1:] if text.startswith("-") else text
        if not (_is_decimal(digits) and len(digits) <= 9):
            raise BindingError(f"{self.path(relative)}: {text[:40]!r} is not an integer")
        return int(text)

    def listdir(self, relative: str) -> list[str]:
        path = self.path(relative)
        names: list[str] = []
        try:
            with os.scandir(path) as entries:
                for entry in entries:
                    if len(names) >= _MAX_DIR_ENTRIES:
                        raise BindingError(f"{path} holds more than {_MAX_DIR_ENTRIES} entries")
                    names.append(entry.name)
        except OSError as e:
            raise BindingError(f"cannot list {path}: {e.strerror or e}") from None
        return names


def _read_capped(path: str, *, missing_ok: bool) -> str | None:
    """The file's text, or None when it is missing and ``missing_ok``."""
    try:
        # O_NONBLOCK: a FIFO where a file should be must not block the agent.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        if missing_ok:
            return None
        raise BindingError(f"cannot read {path}: No such file or directory") from None
    except OSError as e:
        raise BindingError(f"cannot read {path}: {e.strerror or e}") from None
    chunks: list[bytes] = []
    size = 0
    try:
        while size <= _READ_CAP:  # each pass reads at least a byte, or ends
            chunk = os.read(fd, _READ_CAP + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise BindingError(f"cannot read {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if size > _READ_CAP:
        raise BindingError(f"{path} is larger than {_READ_CAP} bytes; not a sysfs attribute")
    return b"".join(chunks).decode("ascii", errors="replace")
