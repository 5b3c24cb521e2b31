"""A real gloo training loop that checkpoints every step and resumes from the checkpoint.

Each step: all_reduce of a tensor of ones (its sum must equal WORLD_SIZE), then rank 0 writes
the checkpoint {"step": n}. It stops at $TOTAL_STEPS and writes $DUMP_DIR/done-<rank>.json.
Every start appends "<world_size> <start_step>" to $DUMP_DIR/starts-<rank>.txt.
"""

import json
import os
import time

import torch
import torch.distributed as dist

out = os.environ["DUMP_DIR"]
ckpt = os.path.join(out, "ckpt.json")
total = int(os.environ["TOTAL_STEPS"])
step_time = float(os.environ.get("STEP_TIME", "0.1"))

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
start = json.load(open(ckpt))["step"] if os.path.exists(ckpt) else 0
with open(os.path.join(out, f"starts-{os.environ['GROUP_RANK']}-{rank}.txt"), "a") as f:
    f.write(f"{world} {start}\n")
with open(os.path.join(out, "progress.txt"), "a") as f:
    f.write(f"start world={world} rank={rank} step={start}\n")
step = start
while step < total:
    t = torch.ones(1)
    dist.all_reduce(t)
    assert int(t.item()) == world, (t.item(), world)
    step += 1
    print(f"step {step} world={world} rank={rank}", flush=True)
    if rank == 0:
        tmp = ckpt + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"step": step, "world": world}, f)
        os.replace(tmp, ckpt)
        with open(os.path.join(out, "progress.txt"), "a") as f:
            f.write(f"step {step} world={world}\n")
    time.sleep(step_time)
with open(os.path.join(out, f"done-{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": world, "step": step}, f)
# torch 2.13's gloo can abort at exit when ranks tear down at different times
# (torchrun hits it too); meet before destroying the group.
dist.barrier()
dist.destroy_process_group()
