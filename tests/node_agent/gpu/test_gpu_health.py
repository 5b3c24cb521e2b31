"""The GPU health check and the "GPU memory released" wait, against the fake machine's
nvidia-smi (tests/fake_gpu_machine.py) and fake kernel logs.

Timeouts are real but short (0.3-0.5 s); nothing sleeps to wait for an event.  After the
tests that kill nvidia-smi, no process running the fake nvidia-smi may be left.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from node_agent.gpu.health import (
    FATAL_XIDS,
    GpuQueryError,
    GpuReading,
    gpu_problem,
    kmsg_readable,
    read_gpus,
    wait_released,
    xid_errors,
)
from tests.fake_gpu_machine import FakeMachine, single_socket, two_socket_8gpu

QUERY = (
    "--query-gpu=uuid,pci.bus_id,memory.used,memory.total,ecc.errors.uncorrected.volatile.total "
    "--format=csv,noheader,nounits"
)


def smi_processes(machine: FakeMachine) -> list[int]:
    """Pids of live processes running this machine's fake nvidia-smi."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if machine.smi.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile
            continue
    return pids


def kmsg_file(path: Path, *records: tuple[int, str]) -> str:
    """A plain file in /dev/kmsg's format: (timestamp in µs, message) per record."""
    lines = []
    for seq, (ts, message) in enumerate(records):
        lines.append(f"4,{seq},{ts},-;{message}\n")
        lines.append(" SUBSYSTEM=pci\n DEVICE=+pci:0000:1b:00.0\n")  # the record's dictionary
    path.write_text("".join(lines))
    return str(path)


def xid(bus: str, code: int, text: str = "pid=4242, name=python, Ch 00000008") -> str:
    return f"NVRM: Xid (PCI:{bus}): {code}, {text}"


# --- read_gpus ------------------------------------------------------------------------------------


async def test_read_gpus_parses_every_gpu(tmp_path: Path) -> None:
    machine = single_socket(tmp_path, ngpus=2)
    machine.gpus[0].memory_used = [30000]
    machine.gpus[1].ecc_uncorrected = "[N/A]"  # ECC off
    machine.write_smi()

    readings = await read_gpus(machine.smi)

    assert readings == [
        GpuReading(
            uuid=machine.gpus[0].uuid,
            pci_bus_id="0000:3b:00.0",
            memory_used_mib=30000,
            memory_total_mib=81559,
            ecc_uncorrected=0,
        ),
        GpuReading(
            uuid=machine.gpus[1].uuid,
            pci_bus_id="0000:3c:00.0",
            memory_used_mib=0,
            memory_total_mib=81559,
            ecc_uncorrected=None,
        ),
    ]
    assert machine.calls() == [QUERY]


async def test_read_gpus_returns_the_gpus_left_when_one_is_lost(tmp_path: Path) -> None:
    machine = two_socket_8gpu(tmp_path)
    machine.gpus[0].lost = True
    machine.write_smi()

    readings = await read_gpus(machine.smi)

    assert [r.uuid for r in readings] == [g.uuid for g in machine.gpus[1:]]
    assert readings[0].pci_bus_id == "0000:29:00.0"


async def test_a_hanging_nvidia_smi_times_out_and_is_killed(tmp_path: Path) -> None:
    machine = single_socket(tmp_path)
    machine.write_smi(hang=True)

    start = time.monotonic()
    with pytest.raises(GpuQueryError, match=r"did not answer within 0\.5 s"):
        await read_gpus(machine.smi, timeout=0.5)

    assert (
        time.monotonic() - start < 5.0
    )  # the timeout, the kill, the reaping (slack for a busy machine); never the hour
    assert machine.calls() == [QUERY]  # it had started
    assert smi_processes(machine) == []


async def test_a_cancelled_query_kills_nvidia_smi(tmp_path: Path) -> None:
    machine = single_socket(tmp_path)
    machine.write_smi(hang=True)

    with pytest.raises(asyncio.TimeoutError):  # wait_for cancels the query
        await asyncio.wait_for(read_gpus(machine.smi, timeout=60), 0.3)

    assert smi_processes(machine) == []


async def test_a_failing_nvidia_smi_says_what_it_printed(tmp_path: Path) -> None:
    machine = single_socket(tmp_path)
    machine.write_smi(fail="NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")

    with pytest.raises(GpuQueryError) as e:
        await read_gpus(machine.smi)

    assert str(e.value) == (
        f"{machine.smi} exited with 9: "
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    )


async def test_a_missing_nvidia_smi_cannot_run(tmp_path: Path) -> None:
    with pytest.raises(GpuQueryError, match=r"cannot run .*nvidia-smi: No such file or directory"):
        await read_gpus(str(tmp_path / "nvidia-smi"))


async def test_every_gpu_lost_is_an_error(tmp_path: Path) -> None:
    machine = single_socket(tmp_path, ngpus=1)
    machine.gpus[0].lost = True
    machine.write_smi()

    with pytest.raises(GpuQueryError, match=r"exited with 15: Unable to determine .*GPU is lost"):
        await read_gpus(machine.smi)


# --- wait_released --------------------------------------------------------------------------------


async def test_memory_released_on_the_third_poll(tmp_path: Path) -> None:
    machine = two_socket_8gpu(tmp_path)
    machine.gpus[3].memory_used = [30000, 30000, 100]
    machine.write_smi()

    assert await wait_released([g.uuid for g in machine.gpus], smi=machine.smi, poll=0.05) is None
    assert len(machine.calls()) == 3


async def test_memory_never_released_gives_up_after_the_timeout(tmp_path: Path) -> None:
    machine = two_socket_8gpu(tmp_path)
    machine.gpus[0].memory_used = [30000]
    machine.write_smi()
    uuids = [g.uuid for g in machine.gpus]

    start = time.monotonic()
    problem = await wait_released(uuids, smi=machine.smi, timeout=0.3, poll=0.05)

    assert problem == (
        f"GPU 0000:1b:00.0 ({uuids[0]}) still holds 30000 MiB after 0.3 s; starting the workers anyway"
    )
    assert 0.3 <= time.monotonic() - start < 5.0
    assert len(machine.calls()) >= 2


async def test_memory_already_free_costs_one_query(tmp_path: Path) -> None:
    machine = two_socket_8gpu(tmp_path)
    machine.gpus[0].memory_used = [512]  # at the threshold counts as free

    machine.write_smi()
    assert await wait_released([g.uuid for g in machine.gpus], smi=machine.smi) is None
    assert machine.calls() == [QUERY]


async def test_only_the_listed_gpus_are_waited_for(tmp_path: Path) -> None:
    machine = two_socket_8gpu(tmp_path)
    machine.gpus[7].memory_used = [70000]  # another job's GPU
    machine.write_smi()

    assert await wait_released([machine.gpus[0].uuid], smi=machine.smi) is None


async def test_a_failing_query_ends_the_wait_at_once(tmp_path: Path) -> None:
    machine = single_socket(tmp_path)
    machine.write_smi(fail="Failed to initialize NVML: Driver/library version mismatch")

    problem = await wait_released([g.uuid for g in machine.gpus], smi=machine.smi, poll=0.05)

    assert problem == (
        f"cannot check that the GPUs' memory is released: {machine.smi} exited with 9: "
        "Failed to initialize NVML: Driver/library version mismatch; starting the workers anyway"
    )
    assert len(machine.calls()) == 1


# --- xid_errors -----------------------------------------------------------------------------------


def test_xid_errors_keeps_fatal_xids_after_the_moment(tmp_path: Path) -> None:
    kmsg = kmsg_file(
        tmp_path / "kmsg",
        (1_000_000, xid("0000:1b:00", 79, "pid=1, GPU has fallen off the bus.")),  # before since_us
        (5_000_000, "nvidia-nvlink: Nvlink Core is being initialized"),
        (6_000_000, xid("0000:29:00", 13, "Graphics SM Warp Exception")),  # the application's fault
        (7_000_000, xid("0000:29:00", 48, "An uncorrectable double bit error")),
        (8_000_000, "NVRM: Xid (0000:AA:00): 79, GPU has fallen off the bus."),  # older drivers' form
    )

    assert xid_errors(2_000_000, kmsg=kmsg) == [
        ("0000:29:00", 48, "NVRM: Xid (PCI:0000:29:00): 48, An uncorrectable double bit error"),
        ("0000:aa:00", 79, "NVRM: Xid (0000:AA:00): 79, GPU has fallen off the bus."),
    ]
    assert [x for _, x, _ in xid_errors(0, kmsg=kmsg)] == [79, 48, 79]


def test_fatal_xids_are_the_hardware_ones() -> None:
    assert {48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140} <= FATAL_XIDS
    assert not {13, 31, 43, 45} & FATAL_XIDS  # application faults: a restart cures them


def test_xid_errors_reads_the_newest_part_of_a_long_log(tmp_path: Path) -> None:
    noise = [(i, f"eth0: link flapped {i:06d}") for i in range(1, 2000)]
    kmsg = kmsg_file(tmp_path / "kmsg", *noise, (9_000_000, xid("0000:1b:00", 95, "Uncontained")))

    assert xid_errors(0, kmsg=kmsg, max_bytes=4096) == [
        ("0000:1b:00", 95, "NVRM: Xid (PCI:0000:1b:00): 95, Uncontained")
    ]


def test_xid_errors_stops_when_a_live_log_has_nothing_more(tmp_path: Path) -> None:
    # A pipe whose writer stays open answers EAGAIN, as /dev/kmsg does after its newest record.
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, f"3,7,5000,-;{xid('0000:1b:00', 79)}\n".encode())
        assert xid_errors(0, kmsg=f"/proc/self/fd/{read_end}") == [("0000:1b:00", 79, xid("0000:1b:00", 79))]
    finally:
        os.close(read_end)
        os.close(write_end)


def test_an_unreadable_log_gives_no_xids(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-kmsg")
    assert xid_errors(0, kmsg=missing) == []
    assert not kmsg_readable(missing)
    assert xid_errors(0, kmsg=str(tmp_path)) == []  # a directory: read fails with EISDIR


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_a_forbidden_log_gives_no_xids(tmp_path: Path) -> None:
    kmsg = kmsg_file(tmp_path / "kmsg", (5, xid("0000:1b:00", 79)))
    os.chmod(kmsg, 0)
    assert xid_errors(0, kmsg=kmsg) == []
    assert not kmsg_readable(kmsg)


@pytest.mark.skipif(not kmsg_readable(), reason="/dev/kmsg is not readable here")
def test_the_real_kernel_log_is_read_to_its_end() -> None:
    # One record per read, then EAGAIN; nothing newer than the end of time.
    assert xid_errors(2**62) == []


# --- gpu_problem ----------------------------------------------------------------------------------


async def test_healthy_gpus_pass_with_one_query(tmp_path: Path) -> None:
    machine = two_socket_8gpu(tmp_path)
    kmsg = kmsg_file(tmp_path / "kmsg", (5, "Linux version 6.8.0"))

    assert await gpu_problem([g.uuid for g in machine.gpus], smi=machine.smi, kmsg=kmsg) is None
    assert machine.calls() == [QUERY]


async def test_uncorrected_ecc_errors_fail_the_check(tmp_path: Path) -> None:
    machine = two_socket_8gpu(tmp_path)
    machine.gpus[2].ecc_uncorrected = 3
    machine.write_smi()
    kmsg = kmsg_file(tmp_path / "kmsg")

    problem = await gpu_problem([g.uuid for g in machine.gpus], smi=machine.smi, kmsg=kmsg)

    assert problem == f"GPU 0000:45:00.0 ({machine.gpus[2].uuid}) has 3 uncorrected ECC errors"


async def test_a_lost_gpu_fails_the_check(tmp_path: Path) -> None:
    machine = two_socket_8gpu(tmp_path)
    machine.gpus[1].lost = True
    machine.write_smi()
    kmsg = kmsg_file(tmp_path / "kmsg")

    problem = await gpu_problem([g.uuid for g in machine.gpus], smi=machine.smi, kmsg=kmsg)

    assert problem == (
        f"GPU {machine.gpus[1].uuid} did not answer nvidia-smi (Unable to determine the device "
        "handle for GPU00000000:29:00.0: GPU is lost.)"
    )
    # Unlisted, it does not matter; with no GPU listed, every GPU must answer.
    assert await gpu_problem([machine.gpus[0].uuid], smi=machine.smi, kmsg=kmsg) is None
    assert "exited with 15" in (await gpu_problem([], smi=machine.smi, kmsg=kmsg) or "")


async def test_a_fatal_xid_fails_the_check_of_its_gpu_only(tmp_path: Path) -> None:
    machine = two_socket_8gpu(tmp_path)
    kmsg = kmsg_file(
        tmp_path / "kmsg",
        (1_000, xid("0000:45:00", 48, "an old error, before the agent started")),
        (9_000, xid("0000:d1:00", 79, "GPU has fallen off the bus.")),
    )
    mine = [g.uuid for g in machine.gpus[:4]]

    assert await gpu_problem(mine, smi=machine.smi, kmsg=kmsg, since_us=5_000) is None
    problem = await gpu_problem([machine.gpus[7].uuid], smi=machine.smi, kmsg=kmsg, since_us=5_000)
    assert problem == (
        f"GPU 0000:d1:00.0 ({machine.gpus[7].uuid}): "
        "NVRM: Xid (PCI:0000:d1:00): 79, GPU has fallen off the bus."
    )


async def test_memory_not_released_fails_the_check(tmp_path: Path) -> None:
    machine = two_socket_8gpu(tmp_path)
    machine.gpus[5].memory_used = [30000, 20000]
    machine.write_smi()
    kmsg = kmsg_file(tmp_path / "kmsg")

    problem = await gpu_problem(
        [g.uuid for g in machine.gpus], smi=machine.smi, kmsg=kmsg, release_timeout=0.3, poll=0.05
    )

    assert problem == f"GPU 0000:aa:00.0 ({machine.gpus[5].uuid}) still holds 20000 MiB after 0.3 s"


async def test_memory_released_while_checking_passes(tmp_path: Path) -> None:
    machine = two_socket_8gpu(tmp_path)
    machine.gpus[5].memory_used = [30000, 100]
    machine.write_smi()
    kmsg = kmsg_file(tmp_path / "kmsg")

    assert await gpu_problem([g.uuid for g in machine.gpus], smi=machine.smi, kmsg=kmsg, poll=0.05) is None
    assert len(machine.calls()) == 2


async def test_a_wedged_driver_fails_the_check(tmp_path: Path) -> None:
    machine = single_socket(tmp_path)
    machine.write_smi(hang=True)

    problem = await gpu_problem([g.uuid for g in machine.gpus], smi=machine.smi, timeout=0.3)

    assert problem == f"{machine.smi} did not answer within 0.3 s (a wedged GPU driver?)"
    assert smi_processes(machine) == []


async def test_an_nvidia_smi_that_says_too_much_is_read_to_its_bounds(tmp_path: Path) -> None:
    """20,000 GPU lines (1.5 MB): the query ends (the rest is drained, not left to block the
    writer) and keeps at most its 1,024 lines."""
    smi = tmp_path / "nvidia-smi"
    line = "GPU-00000000-1111-2222-3333-444444440000, 00000000:1B:00.0, 10, 81559, 0"
    smi.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.write(({line!r} + '\\n') * 20000)\n")
    smi.chmod(0o755)
    readings = await read_gpus(str(smi), timeout=10)
    assert len(readings) == 1024
    assert readings[0].pci_bus_id == "0000:1b:00.0" and readings[0].memory_used_mib == 10
