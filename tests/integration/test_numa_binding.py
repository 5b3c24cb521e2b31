"""--numa-binding, the GPU checks and --nproc-per-node gpu, end to end, on this machine's real
CPU topology with a fake nvidia-smi that reports GPUs sitting on real PCI devices of this
machine (so the NUMA node each "GPU" reads from sysfs, and every CPU list, are real).

The workers report the affinity they were started with, from inside: the main thread's and
that of a thread they start, for a script, a ``-m`` module, a ``--no-python`` command and a
preloaded (warm) interpreter. The expected sets come from node_agent.gpu.numa on the real sysfs,
which tests/node_agent/test_numa.py holds to torch's own computation.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from node_agent.gpu.numa import BindingError, cpu_sets, gpu_numa_node
from tests.fake_gpu_machine import FakeGpu, FakeMachine, build

from .procs import WORKERS, Proc, agent_cmd

PROBE = str(WORKERS / "affinity_probe.py")
ALLOWED = frozenset(os.sched_getaffinity(0))


def _real_pci_devices() -> list[str]:
    """Two PCI devices of this machine on one NUMA node where this process has two cores
    (every mode can bind two ranks there), or fewer: the tests are skipped."""
    try:
        devices = sorted(os.listdir("/sys/bus/pci/devices"))
    except OSError:
        return []
    by_node: dict[int, list[str]] = {}
    for dev in devices:
        try:
            by_node.setdefault(gpu_numa_node(dev), []).append(dev)
        except BindingError:
            continue
    for node, found in sorted(by_node.items()):
        try:
            if len(found) >= 2 and len(cpu_sets("exclusive", [node, node], ALLOWED)) == 2:
                return found[:2]
        except BindingError:
            continue  # fewer than two of its cores are ours
    return []


PCI = _real_pci_devices()
pytestmark = pytest.mark.skipif(
    len(PCI) < 2, reason="no two PCI devices in sysfs on a NUMA node with two of our cores"
)


def fake_gpus(tmp_path: Path, n: int = 2, **kw: object) -> FakeMachine:
    """A fake nvidia-smi whose ``n`` GPUs are this machine's first PCI devices."""
    gpus = [
        FakeGpu(uuid=f"GPU-{i:08x}-aaaa-bbbb-cccc-0000000000{i:02x}", pci=PCI[i], numa_node=0, **kw)  # type: ignore[arg-type]
        for i in range(n)
    ]
    return build(
        tmp_path / "machine", sockets=1, nodes_per_socket=1, cores_per_node=1, threads_per_core=1,
        cores_per_l3=1, gpus=gpus, proc_driver=False,
    )  # fmt: skip


def run_agent(machine: FakeMachine, out: Path, *args: str, timeout: float = 60, **env: str) -> Proc:
    out.mkdir(exist_ok=True)
    p = Proc(
        agent_cmd("--standalone", *args),
        env={"DUMP_DIR": str(out), "PATH": machine.path_env(os.environ.get("PATH", "")), **env},
    )
    try:
        p.wait(timeout=timeout)
    finally:
        p.kill()
    return p


def affinities(out: Path, restart: int = 0) -> dict[int, dict[str, list[int]]]:
    found = {}
    for f in out.glob(f"affinity-*-{restart}.json"):
        found[int(f.name.split("-")[1])] = json.loads(f.read_text())
    return found


def expected(mode: str, n: int) -> list[frozenset[int]]:
    nodes = [gpu_numa_node(PCI[i]) for i in range(n)]
    return cpu_sets(mode, nodes, ALLOWED)


@pytest.mark.parametrize("form", ["script", "module", "no-python", "preload"])
def test_each_worker_runs_on_its_gpus_cpus(tmp_path: Path, form: str) -> None:
    machine = fake_gpus(tmp_path)
    logs = tmp_path / "logs"
    flags = ["--nproc-per-node", "2", "--numa-binding", "exclusive", "--log-dir", str(logs)]
    target = {
        "script": [PROBE],
        "module": ["-m", "tests.integration.workers.affinity_probe"],
        "no-python": ["--no-python", sys.executable, PROBE],
        "preload": ["--preload", "affinity_at_import", PROBE],
    }[form]
    p = run_agent(machine, tmp_path / "out", *flags, *target)
    assert p.p.returncode == 0, p.stderr
    want = expected("exclusive", 2)
    seen = affinities(tmp_path / "out")
    assert sorted(seen) == [0, 1]
    for rank in (0, 1):
        assert seen[rank]["main"] == sorted(want[rank]), (rank, p.stderr)
        assert seen[rank]["thread"] == sorted(want[rank])
    if len(ALLOWED) >= 2:  # exclusive: no CPU shared, none idle (this machine has no SMT: one core each)
        assert not want[0] & want[1] and want[0] | want[1] == ALLOWED
    if form == "preload":
        assert "(2 warm: local ranks [0, 1])" in p.stderr
        # The interpreter ran there from its start: its preloaded imports saw the rank's CPUs.
        assert [seen[rank]["at_import"] for rank in (0, 1)] == [sorted(want[0]), sorted(want[1])]
    # The agent says each rank's binding, and --log-dir keeps it beside the attempt's logs.
    for rank in (0, 1):
        said = f"NUMA binding: local_rank {rank}: cuda:{rank} {machine.gpus[rank].uuid} (PCI {PCI[rank]}"
        assert said in p.stderr
    table = list(logs.glob("*/attempt_0/numa_binding.txt"))
    assert len(table) == 1
    assert table[0].read_text().count("local_rank") == 2


def test_node_mode_and_visible_devices_pick_the_gpu(tmp_path: Path) -> None:
    """CUDA_VISIBLE_DEVICES=1: the one worker's GPU is physical GPU 1, not NVML's GPU 0."""
    machine = fake_gpus(tmp_path)
    p = run_agent(
        machine, tmp_path / "out", "--nproc-per-node", "1", "--numa-binding", "node", PROBE,
        CUDA_VISIBLE_DEVICES="1",
    )  # fmt: skip
    assert p.p.returncode == 0, p.stderr
    assert f"cuda:0 {machine.gpus[1].uuid} (PCI {PCI[1]}" in p.stderr
    want = cpu_sets("node", [gpu_numa_node(PCI[1])], ALLOWED)[0]
    assert affinities(tmp_path / "out")[0]["main"] == sorted(want)


def test_no_binding_unless_one_gpu_per_worker(tmp_path: Path) -> None:
    machine = fake_gpus(tmp_path, n=2)
    p = run_agent(machine, tmp_path / "out", "--nproc-per-node", "1", "--numa-binding", "node", PROBE)
    assert p.p.returncode == 0, p.stderr
    assert "--numa-binding node: not applied: 1 worker(s) per node but 2 visible NVIDIA GPU(s)" in p.stderr
    assert affinities(tmp_path / "out")[0]["main"] == sorted(ALLOWED)


def test_nproc_gpu_counts_the_visible_gpus(tmp_path: Path) -> None:
    machine = fake_gpus(tmp_path, n=2)
    p = run_agent(machine, tmp_path / "out", "--nproc-per-node", "gpu", PROBE)
    assert p.p.returncode == 0, p.stderr
    assert sorted(affinities(tmp_path / "out")) == [0, 1]
    p = run_agent(machine, tmp_path / "out1", "--nproc-per-node", "gpu", PROBE, CUDA_VISIBLE_DEVICES="1")
    assert p.p.returncode == 0, p.stderr
    assert sorted(affinities(tmp_path / "out1")) == [0]


def test_restart_waits_for_the_last_workers_gpu_memory(tmp_path: Path) -> None:
    """The first attempt fails; nvidia-smi reports its memory held once more, then released:
    the next workers start only after the query that saw it released."""
    machine = fake_gpus(tmp_path, n=1, memory_used=[30000, 10])
    p = run_agent(
        machine, tmp_path / "out", "--nproc-per-node", "1", "--max-restarts", "1",
        "--event-log-handler", "console", PROBE, PROBE_FAIL_FIRST="1",
    )  # fmt: skip
    assert p.p.returncode == 0, p.stderr
    out = tmp_path / "out"
    assert sorted(affinities(out, 0)) == sorted(affinities(out, 1)) == [0]
    queries = [c for c in machine.calls() if "memory.used" in c]
    assert len(queries) == 2, machine.calls()
    waited = float(p.wait_for_line(r"the last workers' GPU memory was released after ([\d.]+) s").group(1))
    released = (machine.bin / "nvidia-smi.count").stat().st_mtime
    assert (out / "affinity-0-1.json").stat().st_mtime >= released
    # torchrun's RENDEZVOUS event of the restart times the rendezvous, not the GPU wait after it.
    events = [json.loads(line)["metadata"] for line in p.err if '"state": "RENDEZVOUS"' in line]
    assert [e["agent_restarts"] for e in events] == [0, 1]
    assert events[1]["duration_ms"] < waited * 1000


def test_restart_stops_waiting_after_the_timeout(tmp_path: Path) -> None:
    machine = fake_gpus(tmp_path, n=1, memory_used=[30000])
    t0 = time.monotonic()
    p = run_agent(
        machine, tmp_path / "out", "--nproc-per-node", "1", "--max-restarts", "1",
        "--gpu-release-timeout", "1", PROBE, PROBE_FAIL_FIRST="1",
    )  # fmt: skip
    assert p.p.returncode == 0, p.stderr
    assert "still holds 30000 MiB after 1 s" in p.stderr
    assert sorted(affinities(tmp_path / "out", 1)) == [0]
    assert time.monotonic() - t0 < 30


def test_gpu_health_check(tmp_path: Path) -> None:
    machine = fake_gpus(tmp_path, n=2)
    p = run_agent(machine, tmp_path / "ok", "--nproc-per-node", "2", "--health-check", "gpu", PROBE)
    assert p.p.returncode == 0, p.stderr
    machine.gpus[1].ecc_uncorrected = 4
    machine.write_smi()
    p = run_agent(machine, tmp_path / "bad", "--nproc-per-node", "2", "--health-check", "gpu", PROBE)
    assert p.p.returncode == 1
    assert "health check failed, not joining" in p.stderr and machine.gpus[1].uuid in p.stderr, p.stderr
    assert not affinities(tmp_path / "bad")


def test_sigterm_while_a_restart_waits_for_the_gpus(tmp_path: Path) -> None:
    """A start deferred behind the GPU wait is called off by a signal: the agent exits at once
    and the next attempt's workers never start."""
    machine = fake_gpus(tmp_path, n=1, memory_used=[30000])
    out = tmp_path / "out"
    out.mkdir()
    p = Proc(
        agent_cmd(
            "--standalone",
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "1",
            "--gpu-release-timeout",
            "60",
            PROBE,
        ),
        env={
            "DUMP_DIR": str(out),
            "PATH": machine.path_env(os.environ.get("PATH", "")),
            "PROBE_FAIL_FIRST": "1",
        },
    )
    try:
        p.wait_for_line(r"round 1: the workers start once the last ones' GPU memory is released", timeout=30)
        t0 = time.monotonic()
        p.signal(15)
        rc = p.wait(timeout=20)
        assert time.monotonic() - t0 < 10
    finally:
        p.kill()
    assert rc != 0
    assert (out / "affinity-0-0.json").exists() and not (out / "affinity-0-1.json").exists()
    assert "(at most 60 s, --gpu-release-timeout)" in p.stderr
    assert p.stderr.count("started 1 worker(s)") == 1, p.stderr
