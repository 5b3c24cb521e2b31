"""Which physical GPU each CUDA device is, read from the driver on a fake machine: the GPU list
(driver /proc or nvidia-smi, in PCI order), CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER read as
CUDA reads them, and an nvidia-smi that fails or hangs."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from node_agent.cli.nproc import physical_gpu_uuids, resolve_nproc
from node_agent.gpu import devices as gpus_mod
from node_agent.gpu.devices import Gpu, GpuOrderUnknown, VisibleGpu, physical_gpus, visible_gpus
from tests.fake_gpu_machine import H100, FakeGpu, FakeMachine, build, single_socket, two_socket_8gpu

BUSES = ["0000:1b:00.0", "0000:29:00.0", "0000:45:00.0", "0000:4e:00.0"]
BUSES += ["0000:9c:00.0", "0000:aa:00.0", "0000:c3:00.0", "0000:d1:00.0"]
L4 = "NVIDIA L4"


def uuid(i: int) -> str:
    return f"GPU-{i:08x}-1111-2222-3333-44444444{i:04x}"


def read(machine: FakeMachine, **kw: object) -> list[Gpu]:
    return physical_gpus(proc_dir=machine.proc_nvidia, smi=machine.smi, **kw)  # type: ignore[arg-type]


@pytest.fixture(params=["proc", "nvidia-smi"])
def source(request: pytest.FixtureRequest) -> str:
    """Each test that takes it runs against both sources of the GPU list."""
    return str(request.param)


SHUFFLED = (6, 0, 3, 7, 1, 5, 2, 4)  # the order the sources list the GPUs of a "shuffled" machine
GpusOf = Callable[..., list[Gpu]]


@pytest.fixture(scope="module")
def gpus_of(tmp_path_factory: pytest.TempPathFactory) -> GpusOf:
    """``gpus_of(kind, source, with_migs=False)``: the GPU list of a fake machine of that kind
    ("eight", "shuffled", "mig", "mixed"), read once per module: the tests only read it."""
    cache: dict[tuple[str, str, bool], list[Gpu]] = {}

    def get(kind: str, source: str, with_migs: bool = False) -> list[Gpu]:
        key = (kind, source, with_migs)
        if key not in cache:
            root = tmp_path_factory.mktemp(f"{kind}-{source}")
            machine = {"eight": machine_for, "shuffled": shuffled_machine, "mig": mig_machine}.get(
                kind, mixed_machine
            )(root, source)
            cache[key] = read(machine, with_migs=with_migs)
        return cache[key]

    return get


def shuffled_machine(tmp_path: Path, source: str) -> FakeMachine:
    return machine_for(
        tmp_path, source, [FakeGpu(uuid=uuid(i), pci=BUSES[i], numa_node=i // 2) for i in SHUFFLED]
    )


def machine_for(tmp_path: Path, source: str, gpus: list[FakeGpu] | None = None) -> FakeMachine:
    kw: dict[str, object] = {"proc_driver": source == "proc"}
    if gpus is not None:
        kw["gpus"] = gpus
    return two_socket_8gpu(tmp_path, **kw)


def buses(visible: list[VisibleGpu]) -> list[str]:
    assert [v.cuda_index for v in visible] == list(range(len(visible)))
    return [v.gpu.pci_bus_id for v in visible]


# --- the physical GPUs ----------------------------------------------------------------------------


def test_the_driver_and_nvidia_smi_give_the_same_list(tmp_path: Path) -> None:
    from_proc = two_socket_8gpu(tmp_path / "proc")
    from_smi = two_socket_8gpu(tmp_path / "smi", proc_driver=False)
    expected = [Gpu(index=i, uuid=uuid(i), pci_bus_id=BUSES[i], name=H100) for i in range(8)]
    assert read(from_proc) == expected
    assert from_proc.calls() == []  # the driver's /proc needs no subprocess
    assert read(from_smi) == expected
    assert from_smi.calls() == ["--query-gpu=index,uuid,pci.bus_id,name --format=csv,noheader"]


def test_gpus_come_in_pci_order_whatever_order_the_sources_list_them(tmp_path: Path, source: str) -> None:
    machine = shuffled_machine(tmp_path, source)
    found = read(machine)
    assert [(g.uuid, g.pci_bus_id) for g in found] == [(uuid(i), BUSES[i]) for i in range(8)]


def test_a_gpu_whose_details_cannot_be_read_still_counts(tmp_path: Path) -> None:
    machine = single_socket(tmp_path, ngpus=2)
    (Path(machine.proc_nvidia) / BUSES[0]).mkdir()  # a folder without `information`
    assert [(g.uuid, g.pci_bus_id, g.name) for g in read(machine)] == [
        ("", BUSES[0], ""),
        (uuid(0), "0000:3b:00.0", H100),
        (uuid(1), "0000:3c:00.0", H100),
    ]


def test_gpus_a_device_cgroup_denies_are_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A Slurm job given GPUs 2 and 5 of 8 (ConstrainDevices): /proc lists all eight, CUDA sees
    # two, as cuda:0 and cuda:1. access(2) is what asks the device cgroup; it is stood in for
    # here, since a test cannot deny itself a device.
    machine = two_socket_8gpu(tmp_path)
    dev = tmp_path / "dev"
    dev.mkdir()
    for minor in range(8):
        (dev / f"nvidia{minor}").touch()
    allowed = {str(dev / "nvidia2"), str(dev / "nvidia5")}
    with monkeypatch.context() as m:
        m.setattr(gpus_mod.os, "access", lambda path, mode: os.fspath(path) in allowed)
        found = physical_gpus(proc_dir=machine.proc_nvidia, smi=machine.smi, dev_dir=str(dev))
    assert found == [
        Gpu(index=0, uuid=uuid(2), pci_bus_id=BUSES[2], name=H100),
        Gpu(index=1, uuid=uuid(5), pci_bus_id=BUSES[5], name=H100),
    ]
    assert buses(visible_gpus({}, found)) == [BUSES[2], BUSES[5]]
    assert buses(visible_gpus({"CUDA_VISIBLE_DEVICES": "1"}, found)) == [BUSES[5]]
    # Device nodes this process may open, or not made yet (nvidia-modprobe makes them on first
    # use), leave the list whole.
    (dev / "nvidia7").unlink()
    assert len(physical_gpus(proc_dir=machine.proc_nvidia, dev_dir=str(dev))) == 8


def test_nvidia_smi_bus_ids_are_written_as_sysfs_writes_them(tmp_path: Path) -> None:
    gpus = [FakeGpu(uuid=uuid(0), pci="0000:1b:00.0", numa_node=0)]
    gpus.append(FakeGpu(uuid=uuid(1), pci="10000:01:00.0", numa_node=0))  # a VMD domain
    machine = build(
        tmp_path, sockets=1, nodes_per_socket=1, cores_per_node=2, threads_per_core=1, cores_per_l3=2,
        gpus=gpus, proc_driver=False,
    )  # fmt: skip
    assert [g.pci_bus_id for g in read(machine)] == ["0000:1b:00.0", "10000:01:00.0"]


def test_mig_devices_are_listed_under_their_gpu_only_when_asked(tmp_path: Path, source: str) -> None:
    machine = mig_machine(tmp_path, source)
    assert all(g.migs == () for g in read(machine))
    assert "-L" not in machine.calls()
    found = read(machine, with_migs=True)
    assert found[1].migs == ("MIG-aaaa1111-0000", "MIG-aaaa2222-0000")
    assert found[6].migs == ("MIG-bbbb1111-0000",)
    assert [g.migs for i, g in enumerate(found) if i not in (1, 6)] == [()] * 6


# --- an nvidia-smi that fails or hangs, or none at all -------------------------------------------


def test_a_failing_nvidia_smi_gives_no_gpus(tmp_path: Path) -> None:
    machine = two_socket_8gpu(tmp_path, proc_driver=False)
    machine.write_smi(fail="NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver")
    assert read(machine) == []


def test_a_lost_gpu_makes_nvidia_smi_fail_and_gives_no_gpus(tmp_path: Path) -> None:
    machine = two_socket_8gpu(tmp_path, proc_driver=False)
    machine.gpus[2].lost = True
    machine.write_smi()
    assert read(machine) == []


def test_a_hanging_nvidia_smi_gives_no_gpus_within_the_timeout(tmp_path: Path) -> None:
    machine = two_socket_8gpu(tmp_path, proc_driver=False)
    machine.write_smi(hang=True)
    start = time.monotonic()
    assert read(machine, timeout=0.5) == []
    assert time.monotonic() - start < 0.5 + 1.0 + 2.0  # the timeout, the kill's grace, slack
    assert len(machine.calls()) == 1
    assert smi_processes(machine.smi) == []  # killed and reaped


def test_a_helper_holding_nvidia_smis_output_open_is_killed_too(tmp_path: Path) -> None:
    # nvidia-smi answers and exits, but a helper it started keeps its stdout open: the answer
    # never ends, and the kill at the deadline must reach the helper too.
    smi = tmp_path / "nvidia-smi"
    helper_pid = tmp_path / "helper.pid"
    smi.write_text(
        f"#!{sys.executable}\n"
        "import os, subprocess, sys, time\n"
        "if sys.argv[1:2] == ['helper']:\n"
        "    os.write(int(sys.argv[2]), b'%d' % os.getpid())\n"
        "    time.sleep(3600)\n"
        "r, w = os.pipe()\n"
        "subprocess.Popen([sys.argv[0], 'helper', str(w)], pass_fds=[w])\n"
        "os.close(w)\n"
        f"open({str(helper_pid)!r}, 'wb').write(os.read(r, 32))  # the helper is up\n"
        "print('0, GPU-1, 00000000:1B:00.0, X')\n"
    )
    smi.chmod(0o755)
    start = time.monotonic()
    assert physical_gpus(proc_dir=str(tmp_path / "none"), smi=str(smi), timeout=2.0) == []
    assert time.monotonic() - start < 2.0 + 1.0 + 2.0
    assert helper_pid.exists(), "the fake nvidia-smi did not start its helper within the timeout"
    assert exits_within(int(helper_pid.read_text()), 10.0)


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # the abandoned nvidia-smi is still running
def test_an_nvidia_smi_that_survives_its_kill_is_abandoned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A wedged driver leaves nvidia-smi in uninterruptible sleep, where SIGKILL waits: here the
    # kill is simply not sent, and the agent must still get its answer a second later.
    machine = two_socket_8gpu(tmp_path, proc_driver=False)
    machine.write_smi(hang=True)
    spared: list[int] = []
    monkeypatch.setattr(gpus_mod.os, "killpg", lambda pgid, sig: spared.append(pgid))
    start = time.monotonic()
    try:
        assert read(machine, timeout=0.5) == []
        assert time.monotonic() - start < 0.5 + 1.0 + 2.0
        assert len(spared) == 1
    finally:
        monkeypatch.undo()
        for pid in spared:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_no_driver_and_no_nvidia_smi_gives_no_gpus_without_running_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))

    def no_spawn(*args: object, **kw: object) -> None:
        raise AssertionError("spawned a process")

    monkeypatch.setattr(subprocess, "Popen", no_spawn)
    assert physical_gpus(proc_dir=str(tmp_path / "proc")) == []
    assert physical_gpus(proc_dir=str(tmp_path / "proc"), with_migs=True) == []


def test_nvidia_smi_is_found_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    machine = two_socket_8gpu(tmp_path, proc_driver=False)
    monkeypatch.setenv("PATH", machine.path_env(os.environ.get("PATH", "")))
    assert [g.uuid for g in physical_gpus(proc_dir=machine.proc_nvidia)] == [uuid(i) for i in range(8)]


# --- CUDA_VISIBLE_DEVICES -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("visible", "chosen"),
    [
        (None, list(range(8))),
        ("3,1", [3, 1]),  # cuda:0 is GPU 3: never NVML index 0
        ("1,1", []),  # a repeat empties the set
        ("2,x,3", [2]),  # the list ends at the first invalid entry
        ("9", []),  # past the last device
        ("1,9,2", [1]),  # cut at the first ordinal past the end
        ("", []),
        (" 5gpu, +6", [5, 6]),  # strtoul
        ("4,-1,5", [4]),
    ],
)
def test_ordinals(gpus_of: GpusOf, source: str, visible: str | None, chosen: list[int]) -> None:
    physical = gpus_of("eight", source)
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert buses(visible_gpus(env, physical)) == [BUSES[i] for i in chosen]


@pytest.mark.parametrize(
    ("visible", "chosen"),
    [
        (f"{uuid(6)},{uuid(2)}", [6, 2]),
        ("GPU-00000007,GPU-00000000-", [7, 0]),  # unique prefixes
        ("GPU-00000005,GPU-0000000,GPU-00000001", [5]),  # an ambiguous prefix ends the list
        (f"{uuid(3)},GPU-ffff,{uuid(4)}", [3]),  # so does an unknown UUID
        (f"{uuid(3)},{uuid(3)}", []),
        ("GPU-00000003,GPU-00000003-1111", []),  # two spellings of one GPU
        (f"{uuid(1)},2", [1]),  # an ordinal after UUIDs ends the list
    ],
)
def test_gpu_uuids(gpus_of: GpusOf, source: str, visible: str, chosen: list[int]) -> None:
    physical = gpus_of("eight", source)
    assert buses(visible_gpus({"CUDA_VISIBLE_DEVICES": visible}, physical)) == [BUSES[i] for i in chosen]


def mig_machine(tmp_path: Path, source: str) -> FakeMachine:
    gpus = [FakeGpu(uuid=uuid(i), pci=BUSES[i], numa_node=i // 2) for i in range(8)]
    gpus[1].migs = ["MIG-aaaa1111-0000", "MIG-aaaa2222-0000"]
    gpus[6].migs = ["MIG-bbbb1111-0000"]
    return machine_for(tmp_path, source, gpus)


@pytest.mark.parametrize(
    ("visible", "chosen"),
    [
        ("MIG-bbbb1111-0000,MIG-aaaa2222-0000", [(6, "MIG-bbbb1111-0000"), (1, "MIG-aaaa2222-0000")]),
        ("MIG-aaaa2,MIG-aaaa1", [(1, "MIG-aaaa2222-0000"), (1, "MIG-aaaa1111-0000")]),  # prefixes
        ("MIG-aaaa1111-0000,MIG-aaaa,MIG-bbbb", [(1, "MIG-aaaa1111-0000")]),  # ambiguous: stops
        ("MIG-bbbb1111-0000,MIG-cccc", [(6, "MIG-bbbb1111-0000")]),  # unknown: stops
        ("MIG-bbbb1111-0000,MIG-bbbb1111-0000", []),
        ("MIG-bbbb1111-0000," + uuid(0), [(6, "MIG-bbbb1111-0000")]),
    ],
)
def test_mig_uuids_map_to_their_parent_gpu(
    gpus_of: GpusOf, source: str, visible: str, chosen: list[tuple[int, str]]
) -> None:
    physical = gpus_of("mig", source, with_migs=True)
    found = visible_gpus({"CUDA_VISIBLE_DEVICES": visible}, physical)
    assert [(v.gpu.pci_bus_id, v.mig) for v in found] == [(BUSES[i], mig) for i, mig in chosen]
    assert [v.cuda_index for v in found] == list(range(len(chosen)))


def test_the_old_mig_form_names_its_parent(gpus_of: GpusOf, source: str) -> None:
    physical = gpus_of("eight", source)  # no nvidia-smi -L needed
    old = [f"MIG-{uuid(5)}/1/0", f"MIG-{uuid(2)}/2/0"]
    found = visible_gpus({"CUDA_VISIBLE_DEVICES": ",".join(old)}, physical)
    assert [(v.gpu.pci_bus_id, v.mig) for v in found] == [(BUSES[5], old[0]), (BUSES[2], old[1])]


def test_mig_uuids_without_mig_data_are_refused(gpus_of: GpusOf, source: str) -> None:
    physical = gpus_of("mig", source)  # with_migs left out
    with pytest.raises(GpuOrderUnknown, match=r"MIG device MIG-bbbb1111-0000 .*nvidia-smi -L listed no MIG"):
        visible_gpus({"CUDA_VISIBLE_DEVICES": "MIG-bbbb1111-0000"}, physical)


def test_uuids_the_driver_did_not_report_are_refused(tmp_path: Path) -> None:
    machine = single_socket(tmp_path, ngpus=2)
    (Path(machine.proc_nvidia) / BUSES[0]).mkdir()  # a GPU without `information`
    with pytest.raises(
        GpuOrderUnknown, match=r"UUID of the GPU\(s\) at 0000:1b:00.0.*CUDA_DEVICE_ORDER=PCI_BUS_ID"
    ):
        visible_gpus({"CUDA_VISIBLE_DEVICES": uuid(1)}, read(machine))


def test_no_gpus_means_no_devices() -> None:
    for visible in (None, "0", uuid(0), "MIG-aaaa"):
        env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
        assert visible_gpus(env, []) == []


# --- CUDA_DEVICE_ORDER ----------------------------------------------------------------------------


def mixed_machine(tmp_path: Path, source: str) -> FakeMachine:
    """An L4 at the lowest bus id (where FASTEST_FIRST would not start), H100s after it; listed by
    the sources out of PCI order."""
    names = {0: L4, 3: L4}
    gpus = [
        FakeGpu(uuid=uuid(i), pci=BUSES[i], numa_node=i // 2, name=names.get(i, H100)) for i in (5, 0, 3, 1)
    ]
    return machine_for(tmp_path, source, gpus)


@pytest.mark.parametrize("visible", [None, "0", "2,1", "1,9"])
def test_pci_bus_id_order_numbers_devices_by_bus(gpus_of: GpusOf, source: str, visible: str | None) -> None:
    physical = gpus_of("mixed", source)
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    in_pci_order = [BUSES[i] for i in (0, 1, 3, 5)]
    expected = {
        None: in_pci_order,
        "0": in_pci_order[:1],
        "2,1": in_pci_order[2:0:-1],
        "1,9": in_pci_order[1:2],
    }
    assert buses(visible_gpus(env, physical)) == expected[visible]


@pytest.mark.parametrize("order", [None, "FASTEST_FIRST", "pci_bus_id", "bogus"])
@pytest.mark.parametrize("visible", [None, "0", "2,1"])
def test_fastest_first_on_mixed_models_refuses_ordinals(
    gpus_of: GpusOf, source: str, order: str | None, visible: str | None
) -> None:
    physical = gpus_of("mixed", source)
    env = {} if order is None else {"CUDA_DEVICE_ORDER": order}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    with pytest.raises(GpuOrderUnknown) as e:
        visible_gpus(env, physical)
    said = "unset" if order is None else repr(order)
    assert f"mixes GPU models (0000:1b:00.0 {L4}, 0000:29:00.0 {H100}," in str(e.value)
    assert f"CUDA_DEVICE_ORDER is {said}" in str(e.value)
    assert "set CUDA_DEVICE_ORDER=PCI_BUS_ID, or list the GPUs by UUID in CUDA_VISIBLE_DEVICES" in str(
        e.value
    )


@pytest.mark.parametrize("visible", ["", "1,1", "9", "x"])
def test_fastest_first_on_mixed_models_allows_no_device(gpus_of: GpusOf, source: str, visible: str) -> None:
    physical = gpus_of("mixed", source)
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": visible}, physical) == []


def test_fastest_first_on_mixed_models_takes_uuids_exactly(gpus_of: GpusOf, source: str) -> None:
    physical = gpus_of("mixed", source)
    env = {"CUDA_VISIBLE_DEVICES": f"{uuid(3)},{uuid(5)},{uuid(0)}"}
    assert buses(visible_gpus(env, physical)) == [BUSES[3], BUSES[5], BUSES[0]]


@pytest.mark.parametrize("order", [None, "FASTEST_FIRST", "PCI_BUS_ID"])
def test_one_model_is_numbered_in_pci_order_either_way(
    gpus_of: GpusOf, source: str, order: str | None
) -> None:
    physical = gpus_of("shuffled", source)
    env = {"CUDA_VISIBLE_DEVICES": "7,0,4"}
    if order is not None:
        env["CUDA_DEVICE_ORDER"] = order
    assert buses(visible_gpus(env, physical)) == [BUSES[7], BUSES[0], BUSES[4]]


# --- --nproc-per-node gpu counts the same GPUs -----------------------------------------------------


def test_nproc_counts_gpus_from_the_driver(tmp_path: Path) -> None:
    machine = two_socket_8gpu(tmp_path)
    assert physical_gpu_uuids(machine.proc_nvidia) == [uuid(i) for i in range(8)]
    assert machine.calls() == []


def test_nproc_counts_gpus_from_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    machine = two_socket_8gpu(tmp_path, proc_driver=False)
    monkeypatch.setenv("PATH", machine.path_env(os.environ.get("PATH", "")))
    assert physical_gpu_uuids(machine.proc_nvidia) == [uuid(i) for i in range(8)]


def test_nproc_count_never_depends_on_the_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # On a mixed node the count is exact even where the order is not.
    machine = mixed_machine(tmp_path, "proc")
    from node_agent.cli import nproc

    monkeypatch.setattr(nproc, "physical_gpu_uuids", lambda: physical_gpu_uuids(machine.proc_nvidia))
    assert resolve_nproc("gpu", environ={}) == 4
    assert resolve_nproc("gpu", environ={"CUDA_VISIBLE_DEVICES": "2,1"}) == 2
    assert resolve_nproc("auto", environ={"CUDA_VISIBLE_DEVICES": "MIG-a,MIG-b,MIG-c"}) == 3


# --- helpers --------------------------------------------------------------------------------------


def smi_processes(needle: str) -> list[int]:
    """Pids of live processes whose command line contains ``needle``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read(4096).replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read(512).rsplit(b")", 1)[-1].split()[0]
        except (OSError, IndexError):
            continue
        if needle in cmdline and state != b"Z":
            found.append(int(entry))
    return found


def exits_within(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` (not our child) has ended or ends within ``timeout`` seconds."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])  # a pidfd is readable once it exits
    finally:
        os.close(fd)


def test_an_nvidia_smi_that_says_too_much_gives_no_gpus(tmp_path: Path) -> None:
    """Past 1 MiB of output nvidia-smi's answer is not one: no GPU, not a huge list."""
    smi = tmp_path / "nvidia-smi"
    line = "0, GPU-00000000-1111-2222-3333-444444440000, 00000000:1B:00.0, NVIDIA H100"
    smi.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.write(({line!r} + '\\n') * 20000)\n")
    smi.chmod(0o755)
    assert physical_gpus(proc_dir=str(tmp_path / "no-proc"), smi=str(smi), timeout=10) == []
