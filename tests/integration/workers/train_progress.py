"""A small gloo training loop that reports its progress through node_agent.worker.

Every step: a "compute" phase (a sleep of $STEP_SECONDS, times $SLOW_FACTOR on rank
$SLOW_RANK), an all_reduce, then ``worker.progress(step)``; $STEPS steps in all, then exit 0.
On the first attempt only (TORCHELASTIC_RESTART_COUNT=0), at step $HANG_STEP:

- HANG_MODE=sleep: rank $HANG_RANK sleeps for ever in ``stuck_outside_any_collective`` while
  the others block in the step's all_reduce;
- HANG_MODE=checkpoint: every rank enters a "checkpoint" phase that ends in a barrier (as
  torch.distributed.checkpoint.save does), and rank $HANG_RANK spends $CHECKPOINT_SECONDS in it.

Rank 0 prints "done <steps>" at the end.
"""

import os
import time

import torch
import torch.distributed as dist

from node_agent import worker


def stuck_outside_any_collective() -> None:
    while True:
        time.sleep(3600)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    steps = int(os.environ.get("STEPS", "40"))
    step_s = float(os.environ.get("STEP_SECONDS", "0.02"))
    slow_rank = int(os.environ.get("SLOW_RANK", "-1"))
    slow = float(os.environ.get("SLOW_FACTOR", "1")) if rank == slow_rank else 1.0
    hang_rank = int(os.environ.get("HANG_RANK", "-1"))
    hang_step = int(os.environ.get("HANG_STEP", "20"))
    mode = os.environ.get("HANG_MODE", "")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    t = torch.ones(4)
    for step in range(steps):
        if first_attempt and step == hang_step:
            if mode == "sleep" and rank == hang_rank:
                stuck_outside_any_collective()
            if mode == "checkpoint":
                with worker.phase("checkpoint"):
                    if rank == hang_rank:
                        time.sleep(float(os.environ.get("CHECKPOINT_SECONDS", "5")))
                    dist.barrier()
        with worker.phase("compute"):
            time.sleep(step_s * slow)
        dist.all_reduce(t)
        worker.progress(step)
    dist.barrier()
    if rank == 0:
        print(f"done {steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
