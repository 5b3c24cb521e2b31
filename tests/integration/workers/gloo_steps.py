"""Real gloo training steps until released: an all_reduce per step, checked, on every rank.

At start each worker appends "<rank> <world_size> <pid> <TORCHELASTIC_RESTART_COUNT>" to
$DUMP_DIR/started.txt. Each step all-reduces [1, stop]: the first entry must sum to the world
size; rank 0 sets stop once $RELEASE_FILE exists, so every rank leaves after the same step
(a collective cannot be left alone). Every step prints "step N rank R". Exits 3 if not
released within $HOLD_TIMEOUT seconds (default 120).
"""

import os
import sys
import time

import torch
import torch.distributed as dist

out = os.environ["DUMP_DIR"]
release = os.environ["RELEASE_FILE"]
limit = time.monotonic() + float(os.environ.get("HOLD_TIMEOUT", "120"))
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
line = f"{rank} {world} {os.getpid()} {os.environ['TORCHELASTIC_RESTART_COUNT']}\n"
with open(os.path.join(out, "started.txt"), "a") as f:
    f.write(line)
step = 0
while True:
    stop = 1.0 if rank == 0 and os.path.exists(release) else 0.0
    t = torch.tensor([1.0, stop])
    dist.all_reduce(t)
    assert int(t[0].item()) == world, (t.tolist(), world)
    step += 1
    print(f"step {step} rank {rank}", flush=True)
    if t[1].item() > 0:
        break
    if time.monotonic() > limit:
        print(f"rank {rank} was never released", file=sys.stderr, flush=True)
        sys.exit(3)
    time.sleep(0.05)  # a training step's worth of time; the release is another process's file
# Meet before destroying the group (gloo can abort when ranks tear down apart).
dist.barrier()
dist.destroy_process_group()
