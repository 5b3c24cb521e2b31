"""FSDP2 training under node-agent with ``dcp_snapshots``: sharded state (DTensors) in the
rank's in-memory snapshot, as a user's script would hold it.

Every rank shards a tiny model (two Linear layers, ``fully_shard`` over a CPU ``DeviceMesh``
of the whole world, gloo) and trains it with Adam on a batch drawn from a generator seeded by
the step and the rank: the state after step n depends only on n and the state it resumed from,
so any run resumed from a snapshot ends bit-identical to an uninterrupted one. Each step is
reported (``worker.progress``) and snapshotted (``dcp_snapshots.save`` of ``get_state_dict``'s
model and optimizer state, a collective); an attempt first loads the snapshot of the step the
server chose, if any, and resumes from the step after it.

Environment:
- DUMP_DIR: each attempt appends {"start", "pid", "world"} to starts-<rank>.jsonl; the end
  saves every parameter's full tensor (gathered from its shards) to final-<rank>.pt;
- STEPS (12);
- FAULT_STEP: rank 1 SIGKILLs itself after its snapshot of that step, once per job (a marker
  file in DUMP_DIR);
- IN_PLACE=1: the entry is ``worker.run(main)`` (restarts in place): the process group and the
  FSDP model are built and torn down inside ``main``, so a survivor trains again in its process.
"""

import json
import os
import signal
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DeviceMesh, DTensor

from node_agent import worker
from node_agent.worker import dcp_snapshots

steps = int(os.environ.get("STEPS", "12"))
fault_step = int(os.environ.get("FAULT_STEP", "-1"))
dump = os.environ["DUMP_DIR"]
FAULT_RANK = 1


def model_and_optimizer(mesh: DeviceMesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights in every run (each rank keeps its shards)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)  # this step's batch, whatever came before
    x = torch.randn(4, 8, generator=g)
    y = torch.stack([x.sum(dim=1), x[:, 0] - x[:, 1]], dim=1)
    torch.nn.functional.mse_loss(model(x), y).backward()  # FSDP reduce-scatters the gradients
    opt.step()
    opt.zero_grad()


def full_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter whole, gathered from the ranks' shards (a collective per parameter)."""
    full = []
    for p in model.parameters():
        assert isinstance(p, DTensor), type(p)  # fully_shard made it a sharded DTensor
        full.append(p.full_tensor().detach().clone())
    return full


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = model_and_optimizer(DeviceMesh("cpu", list(range(world))))

    def state() -> dict[str, Any]:
        msd, osd = get_state_dict(model, opt)  # FSDP2: DTensors (the optimizer's made, zeroed)
        return {"model": msd, "optim": osd}

    sd = state()
    loaded = dcp_snapshots.load(sd)  # a collective; None: nothing to restore
    if loaded is not None:
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    start = loaded + 1 if loaded is not None else 0
    with open(os.path.join(dump, f"starts-{rank}.jsonl"), "a") as f:
        f.write(json.dumps({"start": start, "pid": os.getpid(), "world": world}) + "\n")
    for step in range(start, steps):
        train_step(model, opt, step, rank)
        worker.progress(step)
        dcp_snapshots.save(step, state())
        marker = os.path.join(dump, "killed")
        if rank == FAULT_RANK and step == fault_step and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
    torch.save(full_parameters(model), os.path.join(dump, f"final-{rank}.pt"))
    dist.destroy_process_group()  # (an interrupted attempt's is torn down by worker.run)


if __name__ == "__main__":
    if os.environ.get("IN_PLACE") == "1":
        worker.run(main)  # restarts in place: a survivor trains again in this process
    else:
        main()
