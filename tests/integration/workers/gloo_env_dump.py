"""A real gloo group across hosts: init_process_group + all_reduce, then a dump of what it saw.

Writes $DUMP_DIR/node-<RANK>.json: the environment, this process's pid and network namespace
(the inode of /proc/self/ns/net, so the test can tell which host it ran on), and the all_reduce
result next to the expected one.
"""

import datetime
import json
import os

import torch
import torch.distributed as dist

# Bounded: a group that cannot form (a wrong interface, an unreachable master) fails in seconds
# with gloo's own error, instead of torch's default of 30 minutes.
dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=40))
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
dist.barrier()

env = dict(os.environ)
env["_pid"] = str(os.getpid())
env["_netns"] = str(os.stat("/proc/self/ns/net").st_ino)
env["_sum"] = repr(t.item())
env["_expected"] = repr(world * (world + 1) / 2)
out = os.environ["DUMP_DIR"]
tmp = os.path.join(out, f".node-{rank}.tmp")
with open(tmp, "w") as f:
    json.dump(env, f)
os.replace(tmp, os.path.join(out, f"node-{rank}.json"))
# torch 2.13's gloo can abort at exit when ranks tear down at different times
# (torchrun hits it too); meet before destroying the group.
dist.barrier()
dist.destroy_process_group()
