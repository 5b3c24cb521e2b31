"""One rank of scripts/gpu_check.py: on real CUDA, what the launcher gave it.

It writes OUT_DIR/<launcher>-<local rank>.json: its CUDA device count, its GPU's PCI bus id,
the CPU affinity it started with, the CPU set torch's own --numa-binding code computes for its
local rank (torch.numa.binding, asking CUDA, on this machine's real sysfs), and the result of an
NCCL all_reduce across the ranks."""

import json
import os

import torch
import torch.distributed as dist

local_rank = int(os.environ["LOCAL_RANK"])
started_on = sorted(os.sched_getaffinity(0))
state = {
    "local_rank": local_rank,
    "device_count": torch.cuda.device_count(),
    "affinity": started_on,
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
}
props = torch.cuda.get_device_properties(local_rank)
state["pci"] = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
try:
    from torch.numa.binding import AffinityMode, NumaOptions, _get_logical_cpus_to_bind_to

    mode = os.environ.get("GPU_CHECK_MODE", "node")
    torch_set = _get_logical_cpus_to_bind_to(
        gpu_index=local_rank, numa_options=NumaOptions(affinity_mode=AffinityMode(mode))
    )
    state["torch_binding"] = sorted(torch_set)
except Exception as e:  # reported, not fatal: the rest of the check still tells
    state["torch_binding_error"] = repr(e)
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl")
t = torch.ones(1 << 20, device="cuda") * (dist.get_rank() + 1)
dist.all_reduce(t)
n = dist.get_world_size()
state["all_reduce_ok"] = bool(torch.all(t == n * (n + 1) / 2).item())
dist.destroy_process_group()
name = f"{os.environ['GPU_CHECK_LAUNCHER']}-{local_rank}.json"
with open(os.path.join(os.environ["OUT_DIR"], name), "w") as f:
    json.dump(state, f)
print(json.dumps(state), flush=True)
