"""A real gloo all_reduce across the job, then one line: the rank, MASTER_ADDR, the sum.

Prints ``rank <r> of <world>: MASTER_ADDR=<addr> all_reduce=<sum> expected=<sum>`` on stdout.
"""

import datetime
import os

import torch
import torch.distributed as dist

# Bounded: a group that cannot form (an unreachable MASTER_ADDR) fails in seconds, not 30 min.
dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=40))
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
dist.barrier()
print(
    f"rank {rank} of {world}: MASTER_ADDR={os.environ['MASTER_ADDR']} "
    f"all_reduce={t.item():g} expected={world * (world + 1) / 2:g}",
    flush=True,
)
# torch 2.13's gloo can abort at exit when ranks tear down at different times: meet first.
dist.barrier()
dist.destroy_process_group()
