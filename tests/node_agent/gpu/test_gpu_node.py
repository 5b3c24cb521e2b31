"""From the environment to each local rank's CPUs: enumeration (gpu/devices.py) and torch's CPU sets
(numa.py) joined as the agent joins them, on a fake 2-socket 8-GPU server.

The pitfall this guards: local rank k uses the k-th device *CUDA* shows, so with
CUDA_VISIBLE_DEVICES=7,6,... rank 0 sits by physical GPU 7, not by NVML's GPU 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from node_agent.gpu.binding import GpuSetupError, binding_table, bindings_for, visible_gpu_uuids
from node_agent.gpu.numa import format_cpulist
from tests.fake_gpu_machine import FakeGpu, FakeMachine, build, two_socket_8gpu

# two_socket_8gpu: GPU k on NUMA node k // 2; node n holds cores 8n..8n+7 and their siblings +32.
NODE_CPUS = ["0-7,32-39", "8-15,40-47", "16-23,48-55", "24-31,56-63"]


class Said:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def __call__(self, text: str, level: str = "info") -> None:
        self.lines.append((level, text))


def bind(machine: FakeMachine, mode: str, nproc: int, env: dict[str, str], said: Said | None = None):  # type: ignore[no-untyped-def]
    return bindings_for(
        mode, nproc, env, log=said or Said(), allowed=frozenset(machine.all_cpus()),
        sys_root=machine.sys, proc_dir=machine.proc_nvidia, smi=machine.smi,
    )  # fmt: skip


@pytest.fixture(params=["proc", "nvidia-smi"])
def machine(request: pytest.FixtureRequest, tmp_path: Path) -> FakeMachine:
    """The same server seen through the driver's /proc, or (a container) through nvidia-smi."""
    return two_socket_8gpu(tmp_path, proc_driver=request.param == "proc")


def test_every_rank_by_its_own_gpu(machine: FakeMachine) -> None:
    bindings = bind(machine, "node", 8, {})
    assert [b.local_rank for b in bindings] == list(range(8))
    assert [format_cpulist(b.cpus) for b in bindings] == [NODE_CPUS[k // 2] for k in range(8)]
    assert [b.device for b in bindings] == [g.uuid for g in machine.gpus]
    assert bindings[3].line("node") == (
        f"local_rank 3: cuda:3 {machine.gpus[3].uuid} (PCI 0000:4e:00.0, NUMA node 1) "
        "-> CPUs 8-15,40-47 (node)"
    )
    assert binding_table("node", bindings).count("\n") == 8


def test_reversed_visible_devices_bind_rank_0_by_gpu_7(machine: FakeMachine) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "7,6,5,4,3,2,1,0"}
    bindings = bind(machine, "exclusive", 8, env)
    assert [b.pci_bus_id for b in bindings] == [g.pci for g in reversed(machine.gpus)]
    # Node 3 holds logical devices 0 and 1 (physical 7 and 6): the lower index takes the lower half.
    assert format_cpulist(bindings[0].cpus) == "24-27,56-59"
    assert format_cpulist(bindings[1].cpus) == "28-31,60-63"
    assert format_cpulist(bindings[7].cpus) == "4-7,36-39"


def test_uuids_and_pci_order(machine: FakeMachine) -> None:
    gpus = machine.gpus
    env = {"CUDA_VISIBLE_DEVICES": f"{gpus[5].uuid},{gpus[2].uuid[:14]}", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    bindings = bind(machine, "socket", 2, env)
    assert [b.device for b in bindings] == [gpus[5].uuid, gpus[2].uuid]
    assert [format_cpulist(b.cpus) for b in bindings] == ["16-31,48-63", "0-15,32-47"]
    assert visible_gpu_uuids(env, proc_dir=machine.proc_nvidia, smi=machine.smi) == [
        gpus[5].uuid,
        gpus[2].uuid,
    ]


def test_a_mig_slice_binds_by_its_parent(tmp_path: Path) -> None:
    base = two_socket_8gpu(tmp_path / "base")
    gpus = [*base.gpus]
    gpus[5] = FakeGpu(uuid=gpus[5].uuid, pci=gpus[5].pci, numa_node=2, migs=["MIG-aaaa-1", "MIG-aaaa-2"])
    machine = build(
        tmp_path / "mig", sockets=2, nodes_per_socket=2, cores_per_node=8, threads_per_core=2,
        cores_per_l3=4, gpus=gpus,
    )  # fmt: skip
    bindings = bind(machine, "node", 1, {"CUDA_VISIBLE_DEVICES": "MIG-aaaa-2"})
    assert [(b.device, b.pci_bus_id, format_cpulist(b.cpus)) for b in bindings] == [
        ("MIG-aaaa-2", gpus[5].pci, NODE_CPUS[2])
    ]
    uuids = visible_gpu_uuids(
        {"CUDA_VISIBLE_DEVICES": "MIG-aaaa-2"}, proc_dir=machine.proc_nvidia, smi=machine.smi
    )
    assert uuids == [gpus[5].uuid]  # the GPU checks watch the parent


def test_no_binding_unless_one_gpu_per_rank(machine: FakeMachine) -> None:
    said = Said()
    assert bind(machine, "node", 4, {}, said) == []
    assert said.lines == [
        (
            "warning",
            "--numa-binding node: not applied: 4 worker(s) per node but 8 visible NVIDIA GPU(s); "
            "a binding is exact only when local rank k owns GPU k alone",
        )
    ]
    said = Said()
    assert bind(machine, "node", 4, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, said) != []
    assert said.lines == []


def test_what_cannot_be_bound_is_an_error(tmp_path: Path) -> None:
    mixed = [FakeGpu(uuid=f"GPU-{i}0000000", pci=f"0000:{0x1B + i:02x}:00.0", numa_node=0) for i in range(2)]
    mixed[1].name = "NVIDIA A100-SXM4-40GB"
    machine = build(
        tmp_path / "mixed", sockets=1, nodes_per_socket=1, cores_per_node=1, threads_per_core=1,
        cores_per_l3=1, gpus=mixed,
    )  # fmt: skip
    # CUDA's default order on a node of two models is its own guess: refuse to guess with it.
    with pytest.raises(GpuSetupError, match=r"--numa-binding node: .*CUDA_DEVICE_ORDER=PCI_BUS_ID"):
        bind(machine, "node", 2, {})
    assert len(bind(machine, "node", 2, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})) == 2
    # One core for two GPUs: exclusive cannot give each its own.
    with pytest.raises(GpuSetupError, match=r"^--numa-binding.*exclusive.*core"):
        bind(machine, "exclusive", 2, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
