"""--numa-binding's CPU sets, computed from a fake sysfs, are torch's.

Three kinds of test: hand-checked tables on the fake machines of tests/fake_gpu_machine.py;
the same questions put to torch's own ``torch.numa.binding`` with its file reads, its affinity
and its CUDA queries pointed at the same fake tree (every mode x rank x machine x affinity);
and the errors a user sees when a binding cannot be made.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from node_agent.gpu.numa import MODES, BindingError, cpu_sets, format_cpulist, gpu_numa_node, parse_cpulist
from tests.fake_gpu_machine import FakeGpu, FakeMachine, build, single_socket, two_socket_8gpu


def _nodes(machine: FakeMachine, visible: list[FakeGpu] | None = None) -> list[int]:
    return [gpu_numa_node(g.pci, sys_root=machine.sys) for g in (visible or machine.gpus)]


def _table(sets: list[frozenset[int]]) -> list[str]:
    return [format_cpulist(s) for s in sets]


# ---------------------------------------------------------------- hand-checked tables


# two_socket_8gpu: node n holds cores 8n..8n+7 and their SMT siblings 32 higher; GPU k on node k//2;
# an L3 per 4 cores.
TWO_SOCKET = {
    "node": ["0-7,32-39"] * 2 + ["8-15,40-47"] * 2 + ["16-23,48-55"] * 2 + ["24-31,56-63"] * 2,
    "socket": ["0-15,32-47"] * 4 + ["16-31,48-63"] * 4,
    "exclusive": [
        "0-3,32-35", "4-7,36-39", "8-11,40-43", "12-15,44-47",
        "16-19,48-51", "20-23,52-55", "24-27,56-59", "28-31,60-63",
    ],
    # Two equal L3 groups per node: ordered by their lowest CPU, one per GPU.
    "core-complex": [
        "0-3,32-35", "4-7,36-39", "8-11,40-43", "12-15,44-47",
        "16-19,48-51", "20-23,52-55", "24-27,56-59", "28-31,60-63",
    ],
}  # fmt: skip

# single_socket: one node, 8 cores without SMT, one L3, 4 GPUs whose numa_node is -1.
SINGLE_SOCKET = {
    "node": ["0-7"] * 4,
    "socket": ["0-7"] * 4,
    "exclusive": ["0-1", "2-3", "4-5", "6-7"],
    "core-complex": ["0-7"] * 4,
}


@pytest.mark.parametrize("mode", MODES)
def test_two_socket_server_all_cpus(tmp_path: Path, mode: str) -> None:
    machine = two_socket_8gpu(tmp_path)
    nodes = _nodes(machine)
    assert nodes == [0, 0, 1, 1, 2, 2, 3, 3]
    assert _table(cpu_sets(mode, nodes, machine.all_cpus(), sys_root=machine.sys)) == TWO_SOCKET[mode]


@pytest.mark.parametrize("mode", MODES)
def test_single_socket_box_reads_numa_node_minus_one_as_node_0(tmp_path: Path, mode: str) -> None:
    machine = single_socket(tmp_path, ngpus=4)
    nodes = _nodes(machine)
    assert nodes == [0, 0, 0, 0]
    assert _table(cpu_sets(mode, nodes, machine.all_cpus(), sys_root=machine.sys)) == SINGLE_SOCKET[mode]


def test_a_cgroup_that_leaves_some_cores_one_thread(tmp_path: Path) -> None:
    # Node 0 keeps cores 0-6, cores 1-3 with one thread only; core 7 is gone entirely.
    machine = two_socket_8gpu(tmp_path)
    allowed = machine.all_cpus() - {33, 34, 35, 7, 39}
    nodes = _nodes(machine)[:2]

    def sets(mode: str) -> list[str]:
        return _table(cpu_sets(mode, nodes, allowed, sys_root=machine.sys))

    assert sets("node") == ["0-6,32,36-38"] * 2
    # 7 cores for 2 GPUs: the lower index takes the extra one.
    assert sets("exclusive") == ["0-3,32", "4-6,36-38"]
    # The L3 of cores 4-6 now has more allowed CPUs (6) than that of cores 0-3 (5): it comes first.
    assert sets("core-complex") == ["4-6,36-38", "0-3,32"]


def test_core_complexes_wrap_around_when_gpus_outnumber_them(tmp_path: Path) -> None:
    # One node, 8 cores x 2 threads, an L3 per 3 cores (groups of 6, 6 and 4 CPUs), 5 GPUs.
    gpus = [FakeGpu(uuid=f"GPU-{i}", pci=f"0000:{0x10 + i:02x}:00.0", numa_node=0) for i in range(5)]
    machine = build(
        tmp_path,
        sockets=1,
        nodes_per_socket=1,
        cores_per_node=8,
        threads_per_core=2,
        cores_per_l3=3,
        gpus=gpus,
    )
    nodes = _nodes(machine)
    everything = machine.all_cpus()
    assert _table(cpu_sets("core-complex", nodes, everything, sys_root=machine.sys)) == [
        "0-2,8-10", "3-5,11-13", "6-7,14-15", "0-2,8-10", "3-5,11-13",
    ]  # fmt: skip
    # 8 cores, 5 GPUs: 1 each and 3 extra for the three lowest indices.
    assert _table(cpu_sets("exclusive", nodes, everything, sys_root=machine.sys)) == [
        "0-1,8-9", "2-3,10-11", "4-5,12-13", "6,14", "7,15",
    ]  # fmt: skip


def test_socket_mode_skips_nodes_without_cpus(tmp_path: Path) -> None:
    # Grace Hopper lists the GPUs' memory as CPU-less NUMA nodes; a VM may list possible nodes
    # that have no directory at all. torch crashes on both (min() of an empty set).
    machine = two_socket_8gpu(tmp_path)
    node_dir = Path(machine.sys) / "devices/system/node"
    (node_dir / "node4").mkdir()
    (node_dir / "node4/cpulist").write_text("\n")
    (node_dir / "possible").write_text("0-5\n")  # node5: no directory
    got = cpu_sets("socket", _nodes(machine), machine.all_cpus(), sys_root=machine.sys)
    assert _table(got) == TWO_SOCKET["socket"]


def test_socket_mode_when_the_gpus_own_node_has_no_allowed_cpu(tmp_path: Path) -> None:
    # Node 3 is outside our affinity: its GPUs still belong to socket 1, whose allowed CPUs are node 2's.
    machine = two_socket_8gpu(tmp_path)
    allowed = machine.all_cpus() - set(machine.node_cpus[3])
    got = cpu_sets("socket", _nodes(machine), allowed, sys_root=machine.sys)
    assert _table(got) == ["0-15,32-47"] * 4 + ["16-23,48-55"] * 4


def test_only_the_visible_gpus_count(tmp_path: Path) -> None:
    # CUDA_VISIBLE_DEVICES=1,6,7: rank 0 alone on node 0, ranks 1 and 2 share node 3.
    machine = two_socket_8gpu(tmp_path)
    nodes = _nodes(machine, [machine.gpus[i] for i in (1, 6, 7)])
    assert nodes == [0, 3, 3]
    got = cpu_sets("exclusive", nodes, machine.all_cpus(), sys_root=machine.sys)
    assert _table(got) == ["0-7,32-39", "24-27,56-59", "28-31,60-63"]


def test_no_gpus_no_sets(tmp_path: Path) -> None:
    machine = single_socket(tmp_path)
    assert cpu_sets("exclusive", [], machine.all_cpus(), sys_root=machine.sys) == []


def test_each_sysfs_file_is_read_once_per_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    machine = two_socket_8gpu(tmp_path)
    nodes = _nodes(machine)
    opened: list[str] = []
    real_open = os.open

    def counting_open(path: Any, *args: Any, **kwargs: Any) -> int:
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", counting_open)
    for mode in MODES:
        opened.clear()
        cpu_sets(mode, nodes, machine.all_cpus(), sys_root=machine.sys)
        assert opened, mode
        assert len(opened) == len(set(opened)), mode


# ---------------------------------------------------------------- errors a user sees


def test_fewer_cores_than_gpus_is_refused_in_exclusive_mode(tmp_path: Path) -> None:
    machine = two_socket_8gpu(tmp_path)
    allowed = machine.all_cpus() - (set(machine.node_cpus[0]) - {0, 32})  # node 0 keeps core 0
    with pytest.raises(BindingError) as caught:
        cpu_sets("exclusive", _nodes(machine), allowed, sys_root=machine.sys)
    message = str(caught.value)
    assert "--numa-binding=exclusive" in message
    assert "NUMA node 0 has 1 physical core(s)" in message
    assert "(CPUs 0,32) for its 2 GPUs (local ranks 0, 1)" in message
    # The other modes still bind node 0's GPUs, to the one core.
    assert cpu_sets("node", _nodes(machine), allowed, sys_root=machine.sys)[:2] == [frozenset({0, 32})] * 2


def test_node_mode_outside_our_affinity_is_refused(tmp_path: Path) -> None:
    machine = two_socket_8gpu(tmp_path)
    socket1 = set(machine.node_cpus[2]) | set(machine.node_cpus[3])
    with pytest.raises(BindingError) as caught:
        cpu_sets("node", _nodes(machine), socket1, sys_root=machine.sys)
    assert str(caught.value) == (
        "--numa-binding=node: no CPU left for local rank 0: its GPU is on NUMA node 0 (CPUs 0-7,32-39), "
        "and this agent may run only on CPUs 16-31,48-63"
    )


@pytest.mark.parametrize("mode", ["socket", "core-complex"])
def test_other_modes_outside_our_affinity_are_refused(tmp_path: Path, mode: str) -> None:
    machine = two_socket_8gpu(tmp_path)
    socket0 = set(machine.node_cpus[0]) | set(machine.node_cpus[1])
    with pytest.raises(
        BindingError, match=rf"--numa-binding={mode}: no CPU left for local rank 4: .* node 2 "
    ):
        cpu_sets(mode, _nodes(machine), socket0, sys_root=machine.sys)


def test_unknown_mode_and_negative_node(tmp_path: Path) -> None:
    machine = single_socket(tmp_path)
    with pytest.raises(ValueError, match="unknown NUMA binding mode 'nodes'"):
        cpu_sets("nodes", [0], machine.all_cpus(), sys_root=machine.sys)
    with pytest.raises(ValueError, match="negative"):
        cpu_sets("node", [-1], machine.all_cpus(), sys_root=machine.sys)


def test_missing_files_name_their_path(tmp_path: Path) -> None:
    machine = two_socket_8gpu(tmp_path)
    with pytest.raises(BindingError, match=re.escape(f"{machine.sys}/devices/system/node/node9/cpulist")):
        cpu_sets("node", [9], machine.all_cpus(), sys_root=machine.sys)
    with pytest.raises(
        BindingError, match=re.escape(f"{machine.sys}/bus/pci/devices/0000:77:00.0/numa_node")
    ):
        gpu_numa_node("0000:77:00.0", sys_root=machine.sys)
    (Path(machine.sys) / "devices/system/cpu/cpu3/topology/thread_siblings_list").unlink()
    with pytest.raises(BindingError, match="cpu3/topology/thread_siblings_list: No such file"):
        cpu_sets("exclusive", [0], machine.all_cpus(), sys_root=machine.sys)
    for entry in (Path(machine.sys) / "devices/system/cpu/cpu5/cache").iterdir():
        (entry / "type").write_text("Instruction\n")
    with pytest.raises(BindingError, match="cpu5/cache lists no data or unified cache shared by CPU 5"):
        cpu_sets("core-complex", [0], machine.all_cpus(), sys_root=machine.sys)


def test_bad_sysfs_contents_are_refused(tmp_path: Path) -> None:
    machine = two_socket_8gpu(tmp_path)
    cpulist = Path(machine.sys) / "devices/system/node/node0/cpulist"
    cpulist.write_text("0," * 40000)  # larger than any sysfs attribute
    with pytest.raises(BindingError, match="node0/cpulist is larger than 65536 bytes"):
        cpu_sets("node", [0], machine.all_cpus(), sys_root=machine.sys)
    cpulist.write_text("0-7,zz\n")
    with pytest.raises(BindingError, match="node0/cpulist: 'zz' is not a CPU number"):
        cpu_sets("node", [0], machine.all_cpus(), sys_root=machine.sys)
    (Path(machine.sys) / f"bus/pci/devices/{machine.gpus[0].pci}/numa_node").write_text("one\n")
    with pytest.raises(BindingError, match="numa_node: 'one' is not an integer"):
        gpu_numa_node(machine.gpus[0].pci, sys_root=machine.sys)


def test_gpu_numa_node_accepts_nvidia_smi_spelling(tmp_path: Path) -> None:
    machine = two_socket_8gpu(tmp_path)
    gpu = machine.gpus[5]
    assert gpu.smi_bus_id() == "00000000:AA:00.0"
    assert gpu_numa_node(gpu.smi_bus_id(), sys_root=machine.sys) == 2
    assert gpu_numa_node(gpu.pci, sys_root=machine.sys) == 2
    for bad in ("", "aa:00.0", "0000:aa:00", "0000:aa:00.8", "0000:1aa:00.0", "../../../etc:00:00.0"):
        with pytest.raises(BindingError, match="is not a PCI address"):
            gpu_numa_node(bad, sys_root=machine.sys)


# ---------------------------------------------------------------- cpulist text


def test_parse_cpulist() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("5") == {5}
    assert parse_cpulist("") == set()
    assert parse_cpulist("\n") == set()  # a node without CPUs
    assert len(parse_cpulist("0-65535")) == 1 << 16


@pytest.mark.parametrize(
    "text",
    ["a", "1-", "-1", "3-1", "1-2-3", "1,,2", "1,", "+1", "1_0", "0x1", "٣", "1 ,2", "0-65536", "70000"],
)
def test_parse_cpulist_refuses_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cpulist(text)


def test_parse_cpulist_refuses_huge_text() -> None:
    with pytest.raises(ValueError, match="too long"):
        parse_cpulist("0," * (1 << 20))


def test_format_cpulist() -> None:
    assert format_cpulist({0, 1, 2, 3, 8}) == "0-3,8"
    assert format_cpulist([7, 5, 6, 6]) == "5-7"
    assert format_cpulist([]) == ""
    assert format_cpulist([0, 2, 4]) == "0,2,4"
    with pytest.raises(ValueError):
        format_cpulist([-1])


def test_cpulist_round_trips() -> None:
    rng = random.Random(22)
    for _ in range(200):
        cpus = {rng.randrange(300) for _ in range(rng.randrange(60))}
        text = format_cpulist(cpus)
        assert parse_cpulist(text) == cpus
        assert format_cpulist(parse_cpulist(text)) == text


# ---------------------------------------------------------------- torch's own answers


def _odd_machine(root: Path) -> FakeMachine:
    """2 sockets x 1 node, 8 cores x 2 threads, an L3 per 3 cores (uneven groups); 5 GPUs whose
    nodes interleave (1, 0, 1, 1, 0), so a GPU's index on its node is not its index."""
    gpus = [
        FakeGpu(uuid=f"GPU-{i}", pci=f"0000:{0x20 + 0x10 * i:02x}:00.0", numa_node=n)
        for i, n in enumerate((1, 0, 1, 1, 0))
    ]
    return build(
        root, sockets=2, nodes_per_socket=1, cores_per_node=8, threads_per_core=2, cores_per_l3=3, gpus=gpus
    )


# name -> (build, the visible GPUs' physical indices or None for all)
MACHINES: dict[str, tuple[Callable[[Path], FakeMachine], list[int] | None]] = {
    "two_socket_8gpu": (two_socket_8gpu, None),
    "two_socket_visible_1_6_7": (two_socket_8gpu, [1, 6, 7]),
    "single_socket_4gpu": (lambda root: single_socket(root, ngpus=4), None),
    "odd_l3_interleaved_5gpu": (_odd_machine, None),
}


def _cores(machine: FakeMachine, node: int) -> list[list[int]]:
    """The node's physical cores (each a list of its CPUs), lowest first."""
    cores: dict[int, list[int]] = {}
    for cpu in sorted(machine.node_cpus[node]):
        siblings = (
            Path(machine.sys) / f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        ).read_text()
        cores.setdefault(min(parse_cpulist(siblings)), []).append(cpu)
    return [cores[k] for k in sorted(cores)]


def _cgroup(machine: FakeMachine) -> set[int]:
    """On every node: cores 1-3 keep one thread only, the last core is gone."""
    allowed = machine.all_cpus()
    for node in machine.node_cpus:
        cores = _cores(machine, node)
        for core in cores[1:4]:
            allowed -= set(core[1:])
        allowed -= set(cores[-1])
    return allowed


def _one_core_on_first_gpu_node(machine: FakeMachine) -> set[int]:
    """The first GPU's node keeps one core: exclusive fails wherever that node has two GPUs."""
    node = max(machine.gpus[0].numa_node, 0)
    cores = _cores(machine, node)
    return machine.all_cpus() - {cpu for core in cores[1:] for cpu in core}


ALLOWED: dict[str, Callable[[FakeMachine], set[int]]] = {
    "all": lambda m: m.all_cpus(),
    "socket0": lambda m: {c for n, cpus in m.node_cpus.items() if m.socket_of_node[n] == 0 for c in cpus},
    "cgroup": _cgroup,
    "one_core_on_first_gpu_node": _one_core_on_first_gpu_node,
}


@pytest.fixture(scope="module")
def machines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[FakeMachine, list[FakeGpu]]]:
    """Each fake machine once for the module, with its visible GPUs in logical order."""
    built: dict[str, tuple[FakeMachine, list[FakeGpu]]] = {}
    for name, (make, visible) in MACHINES.items():
        machine = make(tmp_path_factory.mktemp(name))
        built[name] = (machine, [machine.gpus[i] for i in visible] if visible else machine.gpus)
    return built


class _TorchOnFakeTree:
    """Points torch.numa.binding at a fake machine: its sysfs reads, its affinity, its CUDA."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.binding: Any = pytest.importorskip("torch.numa.binding")
        self.monkeypatch = monkeypatch

    def point_at(self, machine: FakeMachine, visible: list[FakeGpu], allowed: set[int]) -> None:
        import torch

        root = machine.sys

        def rewrite(path: str) -> str:
            return root + path[len("/sys") :] if str(path).startswith("/sys/") else path

        def fake_open(path: str, *args: Any, **kwargs: Any) -> Any:
            return open(rewrite(path), *args, **kwargs)

        class OsShim:
            def listdir(self, path: str) -> list[str]:
                return os.listdir(rewrite(path))

            def sched_getaffinity(self, pid: int) -> set[int]:
                return set(allowed)

            def __getattr__(self, name: str) -> Any:
                return getattr(os, name)

        def properties(index: int) -> SimpleNamespace:
            domain, bus, rest = visible[index].pci.split(":")
            return SimpleNamespace(
                pci_domain_id=int(domain, 16),
                pci_bus_id=int(bus, 16),
                pci_device_id=int(rest.split(".")[0], 16),
            )

        self.monkeypatch.setattr(self.binding, "open", fake_open, raising=False)
        self.monkeypatch.setattr(self.binding, "os", OsShim())
        self.monkeypatch.setattr(torch.cuda, "device_count", lambda: len(visible))
        self.monkeypatch.setattr(torch.cuda, "get_device_properties", properties)

    def cpus(self, mode: str, rank: int) -> frozenset[int] | Exception:
        """torch's CPUs for ``rank``, or the exception it raised."""
        options = self.binding.NumaOptions(affinity_mode=self.binding.AffinityMode(mode))
        try:
            return frozenset(self.binding._get_logical_cpus_to_bind_to(gpu_index=rank, numa_options=options))
        except Exception as e:
            return e


@pytest.fixture
def torch_numa(monkeypatch: pytest.MonkeyPatch) -> Iterator[_TorchOnFakeTree]:
    yield _TorchOnFakeTree(monkeypatch)


def _refused(outcome: frozenset[int] | Exception) -> bool:
    """torch refuses on purpose: a RuntimeError, or the empty set its caller then refuses."""
    return isinstance(outcome, RuntimeError) or outcome == frozenset()


@pytest.mark.parametrize("case", ALLOWED)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("machine_name", MACHINES)
def test_same_cpus_as_torch(
    machines: dict[str, tuple[FakeMachine, list[FakeGpu]]],
    torch_numa: _TorchOnFakeTree,
    machine_name: str,
    mode: str,
    case: str,
) -> None:
    """Where we bind, torch gives every rank the same set. Where we refuse (the whole call), the
    rank we name is one torch refuses too (RuntimeError, an empty set) or crashes on (ValueError
    from min() of an empty set in socket mode, ZeroDivisionError in core-complex), and torch
    refuses none before it."""
    machine, visible = machines[machine_name]
    allowed = ALLOWED[case](machine)
    torch_numa.point_at(machine, visible, allowed)
    nodes = _nodes(machine, visible)
    assert nodes == [
        torch_numa.binding._get_numa_node_index_for_gpu_index(gpu_index=k) for k in range(len(nodes))
    ]
    theirs = [torch_numa.cpus(mode, k) for k in range(len(nodes))]

    try:
        ours = cpu_sets(mode, nodes, allowed, sys_root=machine.sys)
    except BindingError as e:
        named = re.search(r"local ranks? (\d+)", str(e))
        assert named, str(e)
        rank = int(named.group(1))
        assert isinstance(theirs[rank], Exception) or theirs[rank] == frozenset(), (rank, theirs[rank])
        assert not any(_refused(t) for t in theirs[:rank]), theirs
        return
    for rank, (mine, torchs) in enumerate(zip(ours, theirs, strict=True)):
        assert mine == torchs, (rank, format_cpulist(mine), torchs)


def test_torch_crashes_where_we_skip_cpuless_nodes(tmp_path: Path, torch_numa: _TorchOnFakeTree) -> None:
    # What test_socket_mode_skips_nodes_without_cpus guards against, shown on torch itself.
    machine = two_socket_8gpu(tmp_path)
    (Path(machine.sys) / "devices/system/node/node4").mkdir()
    (Path(machine.sys) / "devices/system/node/node4/cpulist").write_text("\n")
    (Path(machine.sys) / "devices/system/node/possible").write_text("0-4\n")
    torch_numa.point_at(machine, machine.gpus, machine.all_cpus())
    assert isinstance(torch_numa.cpus("socket", 0), ValueError)
    assert (
        _table(cpu_sets("socket", _nodes(machine), machine.all_cpus(), sys_root=machine.sys))
        == (TWO_SOCKET["socket"])
    )


def test_the_modes_are_torchs() -> None:
    """--numa-binding accepts exactly torch's AffinityMode values (torchrun's choices)."""
    binding = pytest.importorskip("torch.numa.binding")
    assert {m.value for m in binding.AffinityMode} == set(MODES)
