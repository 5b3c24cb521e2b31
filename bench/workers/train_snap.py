"""Case 12's training script: train_commit.py's deterministic loop, a DCP checkpoint and/or an
in-memory snapshot at fixed intervals, and a hold at one step so the bench kills at that step.

    train_snap.py --ckpt-dir DIR --log-dir DIR [--steps 90] [--every 50] [--snap-every 0]
                  [--step-seconds 0.05] [--hold-at N --hold-file PATH] [--in-place] [--replicated]

As ``tests/integration/workers/train_commit.py``: ``nn.Linear`` and Adam, seeded; the batch of
step ``n`` comes from a generator seeded with ``n`` and is the same on every rank, and the
gradients are averaged, so the state after step ``n`` is bit-identical whatever the world size
and however often the job resumed (the bench compares the checksums every attempt logs).

On start: ``snapshot_torch.load(model=, optimizer=)`` first (None outside node-agent, and when
no snapshot step was chosen), else the newest complete DCP checkpoint (``--every`` > 0), else
step 0. Each step: a sleep of ``--step-seconds`` ("compute"), the step, the all_reduce, the
step line, ``worker.progress(step)``, a DCP checkpoint when ``step % every == 0``, a snapshot
(``snapshot_torch.save(step, model=, optimizer=)``) when ``step % snap_every == 0``. After step
``--hold-at`` (its checkpoint and snapshot written) every rank waits until ``--hold-file``
exists (at most 60 s): the bench kills there, then creates the file. ``--in-place``: the
training runs under ``worker.run`` (a survivor restarts in its process; outside node-agent the
same as without). ``--replicated``: the snapshots are marked as state every rank holds alike
(``replicated=True``; true of this script), so a job that shrinks restores from them.

The log lines are train_commit.py's (``train_commit_log.attempts`` reads them), each ending with
``t=<time.time()>``: ``start pid= world= rank= restart= from=N`` (N: the step restored),
``load pid= step= sum= how=snapshot|dcp``, ``step pid= world= rank= restart= step= sum=``,
``save pid= step= sum= why=periodic``, ``done pid= step=``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict

from node_agent import worker
from node_agent.worker import snapshot_torch

# Run by path: the checkout's root, so the log, checksum and DCP helpers are train_commit.py's
# own (the bench reads both scripts' lines with one parser, train_commit_log.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.integration.workers.train_commit import Log, checksum, load, newest, save

HOLD_BOUND = 60.0


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--log-dir", required=True)
    p.add_argument("--steps", type=int, default=90)
    p.add_argument("--every", type=int, default=50, help="DCP checkpoint interval (0: none)")
    p.add_argument("--snap-every", type=int, default=0, help="in-memory snapshot interval (0: none)")
    p.add_argument("--replicated", action="store_true", help="mark the snapshots as alike on every rank")
    p.add_argument("--step-seconds", type=float, default=0.05)
    p.add_argument("--hold-at", type=int, default=0)
    p.add_argument("--hold-file", default="")
    p.add_argument("--in-place", action="store_true", help="train under worker.run")
    return p.parse_args()


def hold(path: str) -> None:
    deadline = time.monotonic() + HOLD_BOUND
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.005)


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    if args.in_place:
        worker.run(train, args)
    else:
        train(args)


def train(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    log = Log(args.log_dir)
    ckpt_dir = Path(args.ckpt_dir)

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    get_state_dict(model, opt)  # creates the optimizer's state, as a load does: same path either way
    start = 0
    loaded = snapshot_torch.load(model=model, optimizer=opt)
    if loaded is not None:
        start = loaded.step
        log("load", step=start, sum=checksum(model, opt), how="snapshot")
    elif args.every > 0 and (found := newest(ckpt_dir)) is not None:
        start = load(model, opt, found)
        log("load", step=start, sum=checksum(model, opt), how="dcp")
    log("start", world=world, rank=rank, restart=restart, **{"from": start})

    for step in range(start + 1, args.steps + 1):
        with worker.phase("compute"):
            time.sleep(args.step_seconds)
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():  # every rank has the same batch: the mean is exact
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        log("step", world=world, rank=rank, restart=restart, step=step, sum=checksum(model, opt))
        worker.progress(step)
        if args.every > 0 and step % args.every == 0:
            save(model, opt, step, ckpt_dir)
            log("save", step=step, sum=checksum(model, opt), why="periodic")
        if args.snap_every > 0 and step % args.snap_every == 0:
            snapshot_torch.save(step, model=model, optimizer=opt, replicated=args.replicated)
        if step == args.hold_at and args.hold_file:
            hold(args.hold_file)
    dist.barrier()  # meet before tearing down (gloo can abort when ranks leave at different times)
    log("done", step=args.steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
