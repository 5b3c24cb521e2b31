"""Deterministic gloo training under ``worker.run`` (issue 44: restarts in place), with faults.

The training of ``snapshot_train.py`` (SGD with momentum, dropout, data from torch's generator,
a snapshot of model, optimizer and generator every SNAP_EVERY steps), inside ``train()``, which
``worker.run`` calls again in the same process when the job restarts.

Environment:
- DUMP_DIR: each attempt appends {"pid", "restart", "start", "rank", "world"} to
  starts-<rank>.jsonl; the last step's parameters go to final-<rank>.pt;
- STEPS, SNAP_EVERY, STEP_S;
- FAULT: "exit" (os._exit(1) after FAULT_STEP's snapshot), "kill" (SIGKILL itself there),
  "raise" (a RuntimeError of its own there), "hang" (sleep there, in Python, until stopped),
  "" (none); FAULT_RANK: which rank; FAULT_STEP may list steps ("12,20"). Once per step and
  job (a marker file in DUMP_DIR);
- WAIT_FILE: before each step past WAIT_STEP, wait until this file exists (a test's gate);
- NODE_TAG: written with each start, to tell the nodes apart.
"""

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from det_model import model_and_optimizer, train_step  # beside this script

from node_agent import worker
from node_agent.worker import snapshot_torch

steps = int(os.environ.get("STEPS", "30"))
every = int(os.environ.get("SNAP_EVERY", "1"))
step_s = float(os.environ.get("STEP_S", "0.02"))
fault = os.environ.get("FAULT", "")
fault_steps = {int(x) for x in os.environ.get("FAULT_STEP", "-1").split(",")}
fault_rank = int(os.environ.get("FAULT_RANK", "0"))
dump = os.environ["DUMP_DIR"]
wait_file, wait_step = os.environ.get("WAIT_FILE", ""), int(os.environ.get("WAIT_STEP", "-1"))


def marker(step: int) -> str:
    return os.path.join(dump, f"fault-{fault}-{fault_rank}-{step}")


def train() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = model_and_optimizer(rank)
    loaded = snapshot_torch.load(model=model, optimizer=opt)
    start = loaded.step + 1 if loaded is not None else 0
    with open(os.path.join(dump, f"starts-{rank}.jsonl"), "a") as f:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        world = dist.get_world_size()
        tag = os.environ.get("NODE_TAG", "")
        at = {"pid": os.getpid(), "restart": restart, "start": start, "rank": rank, "world": world}
        at["node"] = tag
        f.write(json.dumps(at) + "\n")
    # What the attempt's log files must hold (--redirects / --tee): one line each, per attempt.
    print(f"attempt of pid {os.getpid()} from step {start}", flush=True)
    print(f"attempt of pid {os.getpid()} from step {start} (stderr)", file=sys.stderr, flush=True)
    for step in range(start, steps):
        if wait_file and step > wait_step:
            while not os.path.exists(wait_file):
                time.sleep(0.01)
        train_step(model, opt)
        time.sleep(step_s)
        worker.progress(step)
        if step % every == 0:
            snapshot_torch.save(step, model=model, optimizer=opt)
        if rank == fault_rank and step in fault_steps and fault and not os.path.exists(marker(step)):
            open(marker(step), "w").close()
            if fault == "exit":
                os._exit(1)
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "raise":
                raise RuntimeError(f"rank {rank} fails at step {step}")
            if fault == "hang":
                while True:
                    time.sleep(1)
    torch.save([p.detach().clone() for p in model.parameters()], os.path.join(dump, f"final-{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    worker.run(train)
