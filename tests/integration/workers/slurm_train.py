"""A small gloo training for the Slurm tests (test_slurm.py): steps with an all_reduce each.

Environment:
  TRAIN_DIR        where it writes (required): one JSON-lines file per process,
                   ``<host>-<pid>.jsonl``, with events "start" (rank, world size, restart
                   counts, host), "running" (after the first step), "usr1" (one per SIGUSR1,
                   written by the handler), "checkpoint", "done"
  TRAIN_STEPS      steps to run (default 3); TRAIN_STEP_S seconds a step takes (default 0.05)
  FAIL_RANK, FAIL_STEP   that rank raises RuntimeError at that step
  TRAIN_UNTIL_STOP=1     run until ``<dir>/stop`` exists instead, or TRAIN_MAX_S (default 120)
  ON_USR1          "exit" or "continue": on SIGUSR1 every rank saves a checkpoint
                   (``<dir>/checkpoint-<rank>``) at the same step, then exits 0 or goes on
Each step all-reduces [1, stop, usr1], so every rank stops, or saves, after the same step.
Prints "rank R of W on HOST: done" at the end.
"""

import json
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

out = os.environ["TRAIN_DIR"]
host = socket.gethostname()
log_path = os.path.join(out, f"{host}-{os.getpid()}.jsonl")
usr1_pending = False


def event(name: str, **fields: object) -> None:
    with open(log_path, "a") as f:
        f.write(json.dumps({"event": name, "t": time.time(), **fields}) + "\n")


def on_usr1(_signum: int, _frame: object) -> None:
    global usr1_pending
    usr1_pending = True
    event("usr1")


@record
def main() -> None:
    global usr1_pending
    signal.signal(signal.SIGUSR1, on_usr1)
    env = os.environ
    event(
        "start",
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        group_rank=int(env["GROUP_RANK"]),
        host=host,
        restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "-1")),
        slurm_restart_count=int(env.get("SLURM_RESTART_COUNT", "0")),
        slurm_job_id=env.get("SLURM_JOB_ID"),
    )
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = int(env.get("TRAIN_STEPS", "3"))
    step_s = float(env.get("TRAIN_STEP_S", "0.05"))
    until_stop = env.get("TRAIN_UNTIL_STOP") == "1"
    limit = time.monotonic() + float(env.get("TRAIN_MAX_S", "120"))
    fail_rank, fail_step = int(env.get("FAIL_RANK", "-1")), int(env.get("FAIL_STEP", "-1"))
    on_usr1_do = env.get("ON_USR1", "continue")
    step = 0
    while True:
        step += 1
        if rank == fail_rank and step == fail_step:
            raise RuntimeError(f"planned failure of rank {rank} at step {step}")
        stop = os.path.exists(os.path.join(out, "stop")) or time.monotonic() > limit
        t = torch.tensor([1.0, float(stop), float(usr1_pending)])
        dist.all_reduce(t)
        assert int(t[0].item()) == world, (t.tolist(), world)
        if step == 1:
            event("running", rank=rank, world_size=world)
        if t[2].item() > 0:
            usr1_pending = False
            with open(os.path.join(out, f"checkpoint-{rank}"), "w") as f:
                f.write(f"{step}\n")
            event("checkpoint", rank=rank, step=step)
            if on_usr1_do == "exit":
                break
        if (t[1].item() > 0) if until_stop else (step >= steps):
            break
        time.sleep(step_s)
    dist.barrier()  # meet before tearing down (gloo can abort when ranks leave apart)
    dist.destroy_process_group()
    event("done", rank=rank, world_size=world, steps=step)
    print(f"rank {rank} of {world} on {host}: done", flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
