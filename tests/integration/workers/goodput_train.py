"""A gloo training loop with checkpoints and planned crashes, that logs what it did when (issue 47).

Every step: a "compute" phase (a sleep of $STEP_SECONDS), an all_reduce, ``worker.progress``.
After every $CKPT_EVERY steps, a "checkpoint" phase of $CKPT_SECONDS (rank 0 writes the step to
$CKPT_DIR/step after a barrier); a new attempt resumes after the last one. On attempt k
(TORCHELASTIC_RESTART_COUNT) rank $FAIL_RANK dies with exit code 1 on reaching step
$FAIL_AT[k] (a comma list), after $FAIL_PAUSE seconds (its last step reported by then: the
agents report at most once a second). The first step of an attempt is followed by a pause of
$FIRST_PAUSE seconds (that step reported alone, before its next). $STEPS steps in all.

Each rank appends JSON lines to $LOG_DIR/rank<r>.jsonl: ``{"attempt", "ev", "t", "step"}``
with ``ev`` one of start (the process began), step (a step done), ckpt (a checkpoint from t to
"end"), fail (about to exit 1), done; ``t`` is time.time().
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from node_agent import worker


def main() -> None:
    started = time.time()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    log_path = os.path.join(os.environ["LOG_DIR"], f"rank{rank}.jsonl")
    log = open(log_path, "a", buffering=1)  # for the process's life

    def note(ev: str, step: int = -1, **more: float) -> None:
        log.write(json.dumps({"attempt": attempt, "ev": ev, "t": time.time(), "step": step, **more}) + "\n")

    note("start", t0=started)
    dist.init_process_group("gloo")
    steps = int(os.environ.get("STEPS", "24"))
    step_s = float(os.environ.get("STEP_SECONDS", "0.2"))
    every = int(os.environ.get("CKPT_EVERY", "8"))
    ckpt_s = float(os.environ.get("CKPT_SECONDS", "1.2"))
    fails = [int(x) for x in os.environ.get("FAIL_AT", "").split(",") if x]
    fail_rank = int(os.environ.get("FAIL_RANK", "1"))
    ckpt = os.path.join(os.environ["CKPT_DIR"], "step")
    start = 0
    if os.path.exists(ckpt):
        with open(ckpt) as f:
            start = int(f.read()) + 1
    t = torch.ones(4)
    for step in range(start, steps):
        if attempt < len(fails) and step == fails[attempt] and rank == fail_rank:
            time.sleep(float(os.environ.get("FAIL_PAUSE", "1.5")))
            note("fail", step)
            log.close()
            sys.exit(1)
        with worker.phase("compute"):
            time.sleep(step_s)
        dist.all_reduce(t)
        worker.progress(step)
        note("step", step)
        if step == start:
            time.sleep(float(os.environ.get("FIRST_PAUSE", "0.6")))
        if (step + 1) % every == 0 and step + 1 < steps:
            begin = time.time()
            with worker.phase("checkpoint"):
                dist.barrier()
                if rank == 0:
                    time.sleep(ckpt_s)
                    with open(ckpt + ".tmp", "w") as f:
                        f.write(str(step))
                    os.replace(ckpt + ".tmp", ckpt)
                dist.barrier()
            note("ckpt", step, end=time.time(), begin=begin)
    dist.barrier()
    note("done", steps - 1)
    if rank == 0:
        print(f"done {steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
