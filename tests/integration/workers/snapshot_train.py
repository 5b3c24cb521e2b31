"""Deterministic gloo training with in-memory snapshots (issue 35), and faults on demand.

Every rank trains a small model with SGD and momentum on data drawn from torch's generator
(dropout too), all-reduces the gradients, and snapshots model, optimizer and generator with
``snapshot_torch`` every SNAP_EVERY steps. The state after step n is therefore the same however
often the job was interrupted, as long as each resume restores the snapshot it was given.

Environment:
- DUMP_DIR: where each process appends what it did (starts-<rank>.jsonl: the restart count and
  the step it starts at) and the last step's parameters (final-<rank>.pt);
- STEPS, SNAP_EVERY, STEP_S (seconds of "work" per step, so a test can act mid-training);
- FAULT: "kill" (SIGKILL itself after FAULT_STEP's snapshot), "mid_write" (SIGKILL itself
  inside FAULT_STEP's snapshot, half written), "" (none); FAULT_RANK: which rank; once per job
  (a marker file in DUMP_DIR);
- STATE_MB: pad the state with a buffer this large (the memory bound's test);
- WAIT_FILE: before each step past WAIT_STEP, wait until this file exists (a test's gate).
"""

import json
import os
import signal
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
fault_step = int(os.environ.get("FAULT_STEP", "-1"))
fault_rank = int(os.environ.get("FAULT_RANK", "0"))
dump = os.environ["DUMP_DIR"]
wait_file, wait_step = os.environ.get("WAIT_FILE", ""), int(os.environ.get("WAIT_STEP", "-1"))

dist.init_process_group("gloo")
rank = dist.get_rank()
model, opt = model_and_optimizer(rank)
pad_mb = int(os.environ.get("STATE_MB", "0"))
pad = torch.zeros(pad_mb * (1 << 20) // 4) if pad_mb else None

loaded = snapshot_torch.load(model=model, optimizer=opt)
start = loaded.step + 1 if loaded is not None else 0
with open(os.path.join(dump, f"starts-{rank}.jsonl"), "a") as f:
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    f.write(json.dumps({"restart": restart, "start": start, "node": os.environ.get("NODE_TAG", "")}) + "\n")


def marker() -> str:
    return os.path.join(dump, f"fault-{fault}-{fault_rank}-{fault_step}")


class _HalfThenDie:
    """A file that lets half of a snapshot through, then SIGKILLs the process."""

    def __init__(self, f, budget):  # type: ignore[no-untyped-def]
        self.f, self.budget = f, budget

    def write(self, b):  # type: ignore[no-untyped-def]
        self.budget -= len(b)
        if self.budget < 0:
            self.f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return self.f.write(b)

    def __getattr__(self, name):  # type: ignore[no-untyped-def]
        return getattr(self.f, name)


for step in range(start, steps):
    if wait_file and step > wait_step:
        while not os.path.exists(wait_file):
            time.sleep(0.01)
    train_step(model, opt)
    time.sleep(step_s)
    worker.progress(step)
    if step % every == 0:
        mine = rank == fault_rank and step == fault_step and not os.path.exists(marker())
        if mine and fault == "mid_write":
            open(marker(), "w").close()
            state = {"model": model.state_dict(), "pad": pad}
            with worker.snapshot(step) as f:
                torch.save(state, _HalfThenDie(f, 2000))
        extra = {"pad": pad} if pad is not None else {}
        snapshot_torch.save(step, model=model, optimizer=opt, **extra)
        if mine and fault == "kill":
            open(marker(), "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

torch.save([p.detach().clone() for p in model.parameters()], os.path.join(dump, f"final-{rank}.pt"))
dist.destroy_process_group()
