"""Two gloo ranks report progress (node_agent.worker); on the first attempt rank 1 hangs.

Every rank emits ``start`` once its process group is up (``replacement`` when this is not the
first attempt: a marker file, as fail_once.py). On the first attempt rank 1 emits ``hang`` and
sleeps for ever after step BENCH_HANG_STEP (rank 0 then waits in all_reduce); a replacement
runs a few steps and exits 0.
"""

import time

T0 = time.time()

import os  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _ev import emit  # noqa: E402

from node_agent import worker  # noqa: E402

marker = os.environ["BENCH_MARKER"]
replacement = os.path.exists(marker)
dist.init_process_group("gloo")
emit("start", T0, replacement=replacement)
rank = dist.get_rank()
t = torch.ones(1)
for step in range(10 if replacement else 1_000_000):
    if not replacement and rank == 1 and step == int(os.environ.get("BENCH_HANG_STEP", "10")):
        with open(marker, "w") as f:
            f.write("hung once\n")
        emit("hang")
        while True:
            time.sleep(3600)
    time.sleep(0.02)
    dist.all_reduce(t)
    worker.progress(step)
dist.barrier()
dist.destroy_process_group()
