"""A deterministic gloo training loop with torch.distributed.checkpoint, for commit-point restarts.

    train_commit.py --ckpt-dir DIR --log-dir DIR [--steps 150] [--every 50] [--step-seconds 0.05]
                    [--slow-from N --slow-seconds 0.2] [--commit [--check-every K]] [--in-place]
                    [--snapshots]

A tiny model (``nn.Linear``) and Adam, seeded; the batch of step ``n`` is drawn from a
generator seeded with ``n`` and is the same on every rank, and the gradients are averaged over
the ranks, so a run is bit-identical whatever the world size and however often it resumes:
the state after step ``n`` is always the same.

Steps are numbered from 1: "step n" is the n-th optimizer step done. On start the newest
complete checkpoint (``DIR/step-NNNNNN``, complete once ``DONE`` is in it) is loaded with
``torch.distributed.checkpoint`` (model, optimizer, step) and training goes on from the step
after it. Each step: compute (a sleep of ``--step-seconds`` in the "compute" phase, then the
step), ``worker.progress(step)``, a periodic checkpoint every ``--every`` steps, and with
``--commit``: ``if worker.should_stop():`` checkpoint at this step and return (exit 0), called
every step or, with ``--check-every K``, only at steps divisible by K (the common
``if step % log_every == 0 and worker.should_stop()``). The lines a script adds are marked
"the commit check" below.

With ``--slow-from N``, steps after N take ``--slow-seconds`` while the world has one rank: a
node started when a lone rank reaches step N then joins well before the next periodic
checkpoint, however slow the machine is.

Each process appends lines to ``<log-dir>/<NODE_TAG>-<LOCAL_RANK>.log`` (one write each):

    start pid=P world=W rank=R restart=C from=N          (N: the step loaded, 0 for none)
    load pid=P step=N sum=H src=memory|checkpoint        (H: checksum of model + optimizer)
    step pid=P world=W rank=R restart=C step=N sum=H
    save pid=P step=N sum=H why=periodic|commit
    stop pid=P step=N                                    (should_stop() said yes)
    done pid=P step=N

and every line ends with ``t=<time.time()>`` (the bench times the restarts with it).
With ``--snapshots`` every step is also snapshotted in memory, marked as state every rank
holds alike (``replicated=True``: it is), and a start restores the step the server chose
(``snapshot_torch.load``) before it looks for a checkpoint: a job that shrank resumes from it.

``pid`` tells the attempts apart (and a second ``load`` or ``start`` line of one process, under
``--in-place``: ``worker.run`` trains again in the same process): a commit restart keeps the
restart count. The tests and the
bench read these logs with ``train_commit_log.py``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from node_agent import worker
from node_agent.worker import snapshot_torch

DONE = "DONE"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", default=os.environ.get("COMMIT_CKPT_DIR", ""))
    p.add_argument("--log-dir", default=os.environ.get("COMMIT_LOG_DIR", ""))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--every", type=int, default=50, help="periodic checkpoint interval (steps)")
    p.add_argument("--step-seconds", type=float, default=0.05)
    p.add_argument(
        "--slow-from",
        type=int,
        default=0,
        help="while alone (world size 1), steps after this one take --slow-seconds (0: never)",
    )
    p.add_argument("--slow-seconds", type=float, default=0.2)
    p.add_argument("--commit", action="store_true", help="stop at the commit step the agent gives")
    p.add_argument("--in-place", action="store_true", help="train under worker.run (restarts in place)")
    p.add_argument("--snapshots", action="store_true", help="snapshot every step in memory, replicated")
    p.add_argument(
        "--check-every",
        type=int,
        default=1,
        help="call should_stop() only at steps divisible by this (a script that checks every few steps)",
    )
    args = p.parse_args()
    if not args.ckpt_dir or not args.log_dir:
        p.error("--ckpt-dir and --log-dir are required (or COMMIT_CKPT_DIR / COMMIT_LOG_DIR)")
    return args


class Log:
    """One line per event, each a single O_APPEND write (readers never see half a line)."""

    def __init__(self, folder: str) -> None:
        name = f"{os.environ.get('NODE_TAG', 'node')}-{os.environ.get('LOCAL_RANK', '0')}.log"
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.fd = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.pid = os.getpid()

    def __call__(self, kind: str, **fields: object) -> None:
        text = " ".join(f"{k}={v}" for k, v in fields.items())
        os.write(self.fd, f"{kind} pid={self.pid} {text} t={time.time():.6f}\n".encode())


def checksum(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """Of every parameter and every optimizer state tensor, in a fixed order, to the bit."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().numpy().tobytes())
        for key in sorted(opt.state.get(p, {})):
            value = opt.state[p][key]
            h.update(key.encode())
            h.update(value.detach().numpy().tobytes() if torch.is_tensor(value) else repr(value).encode())
    return h.hexdigest()[:16]


def newest(ckpt_dir: Path) -> Path | None:
    done = sorted(d for d in ckpt_dir.glob("step-*") if (d / DONE).exists())
    return done[-1] if done else None


def save(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, ckpt_dir: Path) -> None:
    msd, osd = get_state_dict(model, opt)
    path = ckpt_dir / f"step-{step:06d}"
    with worker.phase("checkpoint"):
        dcp.save({"model": msd, "optim": osd, "step": torch.tensor(step)}, checkpoint_id=str(path))
        dist.barrier()  # every rank wrote its part before it counts as complete
        if dist.get_rank() == 0:
            (path / DONE).touch()
        dist.barrier()


def load(model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path) -> int:
    msd, osd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": msd, "optim": osd, "step": torch.tensor(0)}
    with worker.phase("checkpoint"):
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


def main() -> None:
    args = parse()
    if args.in_place:
        worker.run(train, args)  # (the two lines a script adds for restarts in place)
    else:
        train(args)


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
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
    found = newest(ckpt_dir)
    restored = snapshot_torch.load(model=model, optimizer=opt) if args.snapshots else None
    if restored is not None:
        start = restored.step
        log("load", step=start, sum=checksum(model, opt), src="memory")
    elif found is not None:
        start = load(model, opt, found)
        log("load", step=start, sum=checksum(model, opt), src="checkpoint")
    log("start", world=world, rank=rank, restart=restart, **{"from": start})

    for step in range(start + 1, args.steps + 1):
        with worker.phase("compute"):
            slow = world == 1 and 0 < args.slow_from < step
            time.sleep(args.slow_seconds if slow else args.step_seconds)
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
        if args.snapshots:
            snapshot_torch.save(step, model=model, optimizer=opt, replicated=True)
        worker.progress(step)
        saved = False
        if step % args.every == 0:
            save(model, opt, step, ckpt_dir)
            log("save", step=step, sum=checksum(model, opt), why="periodic")
            saved = True
        checked = step % args.check_every == 0
        if args.commit and checked and worker.should_stop():  # the commit check: where the job stops,
            log("stop", step=step)
            if not saved:
                save(model, opt, step, ckpt_dir)  # save (the script's own checkpoint)
                log("save", step=step, sum=checksum(model, opt), why="commit")
            dist.destroy_process_group()
            return  # and return: the worker exits 0
    dist.barrier()  # meet before tearing down (gloo can abort when ranks leave at different times)
    log("done", step=args.steps)
    if rank == 0:
        print(f"done {args.steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
