"""The GPU checks of issue 22, for a machine with real NVIDIA GPUs (CI has none).

    python scripts/gpu_check.py [OUT_DIR]

1. Our enumeration (node_agent.gpu.devices) against nvidia-smi's and torch's: the same GPUs, and
   logical CUDA device k is the same PCI bus id for us and for CUDA, with CUDA_VISIBLE_DEVICES
   unset and reversed.
2. ``node-agent --standalone --nproc-per-node gpu --numa-binding node`` runs one worker per GPU;
   each checks that the CPUs it started on are the set torch's own binding code computes for its
   GPU on this machine (asking CUDA), and runs an NCCL all_reduce.
3. The same NCCL job under torchrun (with ``--numa-binding node`` when numactl is installed).

Writes OUT_DIR/summary.json (default $OUT or ./gpu_check) and exits 0 only when every check
passed. Runs in about a minute; needs torch with CUDA in this Python.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from node_agent.gpu.devices import physical_gpus, visible_gpus  # noqa: E402

WORKER = str(ROOT / "scripts" / "gpu_check_worker.py")


def cuda_view(env: dict[str, str]) -> list[str]:
    code = (
        "import torch, json\n"
        "props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]\n"
        "bus = [f'{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0' for p in props]\n"
        "print(json.dumps(bus))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        return [f"error: {out.stderr[-500:]}"]
    return json.loads(out.stdout.strip().splitlines()[-1])


def launch(argv: list[str], out: Path, launcher: str, extra_env: dict[str, str]) -> dict[str, object]:
    env = {**os.environ, "OUT_DIR": str(out), "GPU_CHECK_LAUNCHER": launcher, **extra_env}
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob(f"{launcher}-*.json"))]
    return {"rc": p.returncode, "stderr_tail": p.stderr[-3000:], "ranks": ranks}


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "gpu_check")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, object] = {}
    checks: dict[str, bool] = {}
    if shutil.which("nvidia-smi") is None:
        print("gpu_check: no nvidia-smi on PATH: this is not a GPU machine", file=sys.stderr)
        return 2
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    summary["nvidia_smi_L"] = smi.stdout
    physical = physical_gpus()
    summary["ours_physical"] = [g.__dict__ for g in physical]
    base = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    n = len(physical)
    orders = {"all": base}
    if n > 1:
        orders["reversed"] = {**base, "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in reversed(range(n)))}
    if physical and physical[0].uuid:
        orders["uuid"] = {**base, "CUDA_VISIBLE_DEVICES": physical[-1].uuid}
    for name, env in orders.items():
        ours = [v.gpu.pci_bus_id for v in visible_gpus(env, physical)]
        theirs = cuda_view(env)
        summary[f"order_{name}"] = {"ours": ours, "cuda": theirs}
        checks[f"enumeration_{name}"] = ours == theirs
    agent = [sys.executable, "-m", "node_agent.cli", "--standalone", "--nproc-per-node", "gpu"]
    r = launch([*agent, "--numa-binding", "node", WORKER], out, "node-agent", {"GPU_CHECK_MODE": "node"})
    summary["node_agent"] = r
    ranks = r["ranks"]
    assert isinstance(ranks, list)
    checks["node_agent_rc"] = r["rc"] == 0
    checks["node_agent_one_worker_per_gpu"] = len(ranks) == n
    checks["node_agent_binding_is_torchs"] = bool(ranks) and all(
        x.get("affinity") == x.get("torch_binding") for x in ranks
    )
    checks["node_agent_all_reduce"] = bool(ranks) and all(x.get("all_reduce_ok") for x in ranks)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "gpu"]
    if shutil.which("numactl"):
        torchrun += ["--numa-binding", "node"]
    r = launch([*torchrun, WORKER], out, "torchrun", {"GPU_CHECK_MODE": "node"})
    summary["torchrun"] = r
    ranks = r["ranks"]
    assert isinstance(ranks, list)
    reduced = bool(ranks) and all(x.get("all_reduce_ok") for x in ranks)
    checks["torchrun_all_reduce"] = r["rc"] == 0 and reduced
    if shutil.which("numactl"):
        ours = {x["local_rank"]: x["affinity"] for x in summary["node_agent"]["ranks"]}  # type: ignore[index]
        checks["same_affinity_as_torchrun"] = ours == {x["local_rank"]: x["affinity"] for x in ranks}
    summary["checks"] = checks
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(json.dumps(checks, indent=2))
    return 0 if checks and all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
