"""AMD (ROCm) and Intel (xpu) GPUs counted from a fake sysfs and /dev, as torchrun's
``--nproc-per-node gpu|xpu|auto`` would count them through torch; and the command line's
answer to ``xpu`` on this GPU-less machine, beside torchrun's."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from node_agent.cli import nproc
from node_agent.cli.nproc import resolve_nproc
from node_agent.cli.parse import parse_config
from node_agent.config import ConfigError
from node_agent.gpu import amd_intel as mod
from node_agent.gpu.amd_intel import (
    AmdGpu,
    IntelGpu,
    UnknownMask,
    amd_gpus,
    intel_gpus,
    visible_amd_count,
    visible_xpu_count,
)

REPO = Path(__file__).resolve().parents[3]


@dataclass
class FakeNode:
    """A fake machine's /sys and /dev, under one folder."""

    sys: Path
    dev: Path


def fake_node(root: Path) -> FakeNode:
    node = FakeNode(sys=root / "sys", dev=root / "dev")
    (node.dev / "dri").mkdir(parents=True)
    node.sys.mkdir()
    return node


def kfd_node(
    node: FakeNode, n: int, *, gpu_id: int = 0, simd: int = 0, minor: int = 0, unique: int = 0
) -> None:
    folder = node.sys / mod.KFD_NODES / str(n)
    folder.mkdir(parents=True)
    (folder / "gpu_id").write_text(f"{gpu_id}\n")
    lines = [
        f"cpu_cores_count {0 if gpu_id else 48}",
        f"simd_count {simd}",
        "mem_banks_count 1",
        f"gfx_target_version {90402 if gpu_id else 0}",
        "vendor_id 4098",
        f"drm_render_minor {minor}",
        f"unique_id {unique}",
        "local_mem_size 0",
    ]
    (folder / "properties").write_text("\n".join(lines) + "\n")


def amd_node(root: Path, gpus: int = 8, *, cpus: int = 2) -> FakeNode:
    """An MI300X-like node: ``cpus`` CPU nodes first, then ``gpus`` GPU nodes, /dev/kfd and
    each GPU's render device."""
    node = fake_node(root)
    (node.dev / "kfd").write_text("")
    for n in range(cpus):
        kfd_node(node, n)
    for i in range(gpus):
        minor = 128 + 8 * i
        kfd_node(node, cpus + i, gpu_id=1000 + i, simd=1216, minor=minor, unique=0xABC0 + i)
        (node.dev / "dri" / f"renderD{minor}").write_text("")
    return node


def intel_card(
    node: FakeNode,
    card: int,
    bus: str,
    *,
    driver: str = "xe",
    tiles: int = 1,
    vendor: str = "0x8086",
    render: int | None = None,
) -> None:
    device = node.sys / "devices" / "pci0000:00" / bus
    device.mkdir(parents=True)
    (device / "vendor").write_text(vendor + "\n")
    drivers = node.sys / "bus" / "pci" / "drivers" / driver
    drivers.mkdir(parents=True, exist_ok=True)
    (device / "driver").symlink_to(drivers)
    minor = 128 + card if render is None else render
    (device / "drm" / f"renderD{minor}").mkdir(parents=True)
    (node.dev / "dri" / f"renderD{minor}").write_text("")
    drm = node.sys / mod.DRM_CLASS
    (drm / f"card{card}").mkdir(parents=True)
    (drm / f"card{card}" / "device").symlink_to(device)
    (drm / f"card{card}-DP-1").mkdir()  # a connector: not a card
    for t in range(tiles):
        if driver == "xe":
            (device / f"tile{t}" / "gt0").mkdir(parents=True)
        else:
            (drm / f"card{card}" / "gt" / f"gt{t}").mkdir(parents=True)


def use(monkeypatch: pytest.MonkeyPatch, node: FakeNode, *, nvidia: int = 0) -> None:
    """Make nproc read ``node`` (and ``nvidia`` NVIDIA GPUs)."""
    monkeypatch.setattr(mod, "SYS_ROOT", str(node.sys))
    monkeypatch.setattr(mod, "DEV_DIR", str(node.dev))
    monkeypatch.setattr(nproc, "physical_gpu_uuids", lambda: [f"GPU-{i}" for i in range(nvidia)])


# --- AMD ------------------------------------------------------------------------------------------


def test_amd_gpus_are_the_kfd_gpu_nodes(tmp_path: Path) -> None:
    node = amd_node(tmp_path)
    found = amd_gpus(sys_root=str(node.sys), dev_dir=str(node.dev))
    assert [g.node for g in found] == list(range(2, 10))
    assert found[0] == AmdGpu(node=2, uuid="GPU-000000000000abc0", render_minor=128)


def test_amd_gpus_skip_what_this_process_may_not_use(tmp_path: Path) -> None:
    node = amd_node(tmp_path)
    (node.sys / mod.KFD_NODES / "3" / "gpu_id").write_text("")  # EPERM from a device cgroup
    (node.dev / "dri" / "renderD144").unlink()  # GPU 2's render node not in this container
    kfd_node(node, 10, gpu_id=77, simd=0, minor=200)  # a GPU node without SIMDs
    (node.dev / "dri" / "renderD200").write_text("")
    found = amd_gpus(sys_root=str(node.sys), dev_dir=str(node.dev))
    assert [g.node for g in found] == [2, 5, 6, 7, 8, 9]
    (node.dev / "kfd").unlink()
    assert amd_gpus(sys_root=str(node.sys), dev_dir=str(node.dev)) == []
    assert amd_gpus(sys_root=str(tmp_path / "none"), dev_dir=str(node.dev)) == []


EIGHT = [AmdGpu(node=i + 1, uuid=f"GPU-{i:016x}", render_minor=128 + i) for i in range(8)]


@pytest.mark.parametrize(
    ("env", "count"),
    [
        ({}, 8),
        ({"ROCR_VISIBLE_DEVICES": "0,1,2"}, 3),
        ({"ROCR_VISIBLE_DEVICES": "GPU-0000000000000005,7"}, 2),
        ({"ROCR_VISIBLE_DEVICES": "1,9,2"}, 1),  # ends at an entry that names no GPU
        ({"ROCR_VISIBLE_DEVICES": ""}, 0),
        ({"HIP_VISIBLE_DEVICES": "4,5"}, 2),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 4),  # HIP reads it when HIP_VISIBLE_DEVICES is unset
        ({"CUDA_VISIBLE_DEVICES": "0,1,2,3", "HIP_VISIBLE_DEVICES": "0"}, 1),  # HIP's wins
        ({"ROCR_VISIBLE_DEVICES": "4,5,6", "HIP_VISIBLE_DEVICES": "0,2"}, 2),  # HIP over ROCr's list
        ({"ROCR_VISIBLE_DEVICES": "4,5", "HIP_VISIBLE_DEVICES": "0,1,2"}, 2),  # cut past ROCr's last
        ({"HIP_VISIBLE_DEVICES": "0,0"}, 0),  # a repeat empties the list, as CUDA's
        ({"HIP_VISIBLE_DEVICES": "GPU-0000000000000003,GPU-0000000000000001"}, 2),
    ],
)
def test_amd_visible_devices(env: dict[str, str], count: int) -> None:
    assert visible_amd_count(env, EIGHT) == count


def test_auto_and_gpu_count_eight_amd_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use(monkeypatch, amd_node(tmp_path))
    assert resolve_nproc("auto", environ={}) == 8
    assert resolve_nproc("gpu", environ={}) == 8
    assert resolve_nproc("gpu", environ={"HIP_VISIBLE_DEVICES": "0,1"}) == 2
    # Kubeflow's default runtime passes PET_NPROC_PER_NODE=auto
    script = tmp_path / "train.py"
    script.write_text("")
    assert parse_config([str(script)], {"PET_NPROC_PER_NODE": "auto"}).nproc_per_node == 8
    with pytest.raises(ConfigError, match=r"=xpu is not supported on this node: no Intel GPU"):
        resolve_nproc("xpu", environ={})


def test_nvidia_gpus_come_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use(monkeypatch, amd_node(tmp_path), nvidia=4)
    assert resolve_nproc("auto", environ={}) == 4
    assert resolve_nproc("gpu", environ={"CUDA_VISIBLE_DEVICES": "1"}) == 1


def test_gpu_without_any_gpu_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use(monkeypatch, amd_node(tmp_path))
    env = {"ROCR_VISIBLE_DEVICES": ""}
    with pytest.raises(
        ConfigError, match=r"no NVIDIA GPU .*nor an AMD \(ROCm\) one; ROCR_VISIBLE_DEVICES=''"
    ):
        resolve_nproc("gpu", environ=env)
    assert resolve_nproc("auto", environ=env) == nproc.cpu_count()


# --- Intel ----------------------------------------------------------------------------------------


def test_intel_gpus_in_pci_order_with_tiles(tmp_path: Path) -> None:
    node = fake_node(tmp_path)
    intel_card(node, 0, "0000:00:02.0", driver="i915")  # integrated
    intel_card(node, 2, "0000:9a:00.0", driver="i915", tiles=2)  # Max 1550 on i915
    intel_card(node, 1, "0000:3a:00.0", driver="xe", tiles=2)  # Max 1550 on xe
    intel_card(node, 3, "0000:c1:00.0", driver="xe")  # Arc / Flex: one tile
    intel_card(node, 4, "0000:05:00.0", driver="amdgpu", vendor="0x1002")  # not Intel
    intel_card(node, 5, "0000:06:00.0", driver="vfio-pci")  # Intel, passed to a VM
    assert intel_gpus(sys_root=str(node.sys), dev_dir=str(node.dev)) == [
        IntelGpu("0000:00:02.0", 1, True),
        IntelGpu("0000:3a:00.0", 2, False),
        IntelGpu("0000:9a:00.0", 2, False),
        IntelGpu("0000:c1:00.0", 1, False),
    ]
    (node.dev / "dri" / "renderD129").unlink()  # card1's render node not in this container
    assert [g.pci_bus_id for g in intel_gpus(sys_root=str(node.sys), dev_dir=str(node.dev))] == [
        "0000:00:02.0",
        "0000:9a:00.0",
        "0000:c1:00.0",
    ]


IGPU = IntelGpu("0000:00:02.0", 1, True)
MAX = [IntelGpu(f"0000:{b}:00.0", 2, False) for b in ("3a", "9a", "bc")]


@pytest.mark.parametrize(
    ("gpus", "env", "count"),
    [
        (MAX, {}, 6),  # FLAT, torch's default: a device per tile
        (MAX, {"ZE_FLAT_DEVICE_HIERARCHY": "COMBINED"}, 6),
        (MAX, {"ZE_FLAT_DEVICE_HIERARCHY": "COMPOSITE"}, 3),
        (MAX, {"ZE_AFFINITY_MASK": "0,1,5"}, 3),
        (MAX, {"ZE_AFFINITY_MASK": "0,0,-1,9"}, 1),  # repeats and negatives skipped, 9 is no device
        (MAX, {"ZE_AFFINITY_MASK": ""}, 6),  # an empty mask is no mask
        (MAX, {"ZE_AFFINITY_MASK": "0.0,0.1,2.1", "ZE_FLAT_DEVICE_HIERARCHY": "COMPOSITE"}, 2),
        ([IGPU, *MAX], {}, 6),  # an integrated GPU counts only without a discrete one
        ([IGPU, *MAX], {"ZE_AFFINITY_MASK": "0"}, 1),
        ([IGPU], {}, 1),
        ([], {}, 0),
    ],
)
def test_xpu_count(gpus: list[IntelGpu], env: dict[str, str], count: int) -> None:
    assert visible_xpu_count(env, gpus) == count


def test_a_tile_mask_in_flat_mode_is_refused() -> None:
    with pytest.raises(UnknownMask, match=r"'0\.1' is not a device number"):
        visible_xpu_count({"ZE_AFFINITY_MASK": "0.1"}, MAX)


def test_xpu_and_auto_on_intel_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node = fake_node(tmp_path)
    intel_card(node, 0, "0000:00:02.0", driver="i915")
    use(monkeypatch, node)
    # a laptop's integrated GPU: xpu counts it, auto keeps the CPUs
    assert resolve_nproc("xpu", environ={}) == 1
    assert resolve_nproc("auto", environ={}) == nproc.cpu_count()
    for card, bus in enumerate(("0000:3a:00.0", "0000:9a:00.0"), start=1):
        intel_card(node, card, bus, tiles=2)
    assert resolve_nproc("xpu", environ={}) == 4
    assert resolve_nproc("auto", environ={}) == 4
    assert resolve_nproc("XPU", environ={"ZE_FLAT_DEVICE_HIERARCHY": "COMPOSITE"}) == 2
    with pytest.raises(ConfigError, match=r"--nproc-per-node: ZE_AFFINITY_MASK='1\.0'.*give a number"):
        resolve_nproc("xpu", environ={"ZE_AFFINITY_MASK": "1.0"})
    with pytest.raises(ConfigError, match=r"no NVIDIA GPU is visible"):
        resolve_nproc("gpu", environ={})


# --- the command line -------------------------------------------------------------------------------


def run(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "ZE_", "TORCHELASTIC_"))}
    return subprocess.run(
        [sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


def test_xpu_on_a_machine_without_one_fails_as_torchrun_does(tmp_path: Path) -> None:
    if intel_gpus():
        pytest.skip("this machine has an Intel GPU")
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    ours = run(["-m", "node_agent", "--nproc-per-node", "xpu", str(script)], tmp_path)
    assert ours.returncode == 2  # as every command-line error of ours (argparse's status)
    assert ours.stderr.startswith("node-agent: error: --nproc-per-node=xpu is not supported on this node")
    assert "no Intel GPU is visible (torchrun: 'Xpu is not available.')" in ours.stderr
    pytest.importorskip("torch.distributed.run")
    theirs = run(["-m", "torch.distributed.run", "--nproc-per-node", "xpu", str(script)], tmp_path)
    assert theirs.returncode == 1  # an uncaught ValueError
    assert theirs.stderr.rstrip().endswith("ValueError: Xpu is not available.")
    assert "must not run" not in ours.stderr + theirs.stderr


def test_auto_starts_eight_workers_on_a_fake_amd_node(tmp_path: Path) -> None:
    node = amd_node(tmp_path / "machine")
    script = tmp_path / "train.py"
    script.write_text(
        # One write per line: eight ranks share the console, unbuffered (print writes its
        # pieces apart, and two ranks' lines ran together once).
        "import os, sys\n"
        "sys.stdout.write(f\"worker {os.environ['LOCAL_RANK']} {os.environ['LOCAL_WORLD_SIZE']}\\n\")\n"
    )
    launcher = (
        "import sys\n"
        "from node_agent.cli import nproc\nfrom node_agent.gpu import amd_intel as m\n"
        f"m.SYS_ROOT, m.DEV_DIR = {str(node.sys)!r}, {str(node.dev)!r}\n"
        "nproc.physical_gpu_uuids = lambda: []\n"
        "from node_agent.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    out = run(["-c", launcher, "--standalone", "--nproc-per-node", "auto", str(script)], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    workers = sorted(line.split()[-2:] for line in out.stdout.splitlines() if "worker" in line)
    assert workers == sorted([str(r), "8"] for r in range(8)), out.stdout
