"""GPU check for restarts in place (issue 44 item 7), for a machine with CUDA and one GPU or more.

    python scripts/gpu_inplace_check.py            # exit 0: every check passed

What it checks, in one process, as ``worker.run`` does across attempts: an NCCL process group
of world 1 on cuda:0 is made, all-reduces, is aborted through torch's own path
(``_abort_process_group``, what ``node_agent.worker.inplace`` calls) and destroyed; a second
one is then made in the same process (a new store port, as the next round's place gives),
all-reduces the right sum, and the CUDA context still allocates and computes. With two GPUs or
more it then runs ``node-agent --standalone --nproc-per-node 2`` over NCCL with rank 1 exiting
mid-training, and checks that rank 0 kept its process (its pid in both attempts). Prints one
line per check; not run in CI (no GPU there).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_process() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _abort_process_group

    torch.cuda.set_device(0)
    for attempt in (0, 1):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()), RANK="0", WORLD_SIZE="1")
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
        t = torch.full((4,), float(attempt + 1), device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        assert t.sum().item() == 4 * (attempt + 1), t
        print(f"ok: attempt {attempt}: NCCL all_reduce", flush=True)
        _abort_process_group()
        dist.destroy_process_group()
        print(f"ok: attempt {attempt}: aborted and destroyed", flush=True)
    x = torch.randn(1024, 1024, device="cuda")
    assert torch.isfinite(x @ x).all()
    print("ok: the CUDA context computes after two aborted communicators", flush=True)


TRAIN = textwrap.dedent(
    """
    import json, os, sys, time
    import torch, torch.distributed as dist
    from node_agent import worker

    def train():
        rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
        with open(os.path.join(sys.argv[1], f"pids-{rank}"), "a") as f:
            f.write(json.dumps({"pid": os.getpid()}) + "\\n")
        for step in range(40):
            t = torch.ones(1, device="cuda")
            dist.all_reduce(t)
            torch.cuda.synchronize()
            if rank == 1 and step == 20 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
                os._exit(1)
            time.sleep(0.05)
        dist.destroy_process_group()

    worker.run(train)
    """
)


def two_ranks() -> None:
    import torch

    if torch.cuda.device_count() < 2:
        print("skipped: two ranks over NCCL need two GPUs", flush=True)
        return
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "train.py")
        with open(script, "w") as f:
            f.write(TRAIN)
        argv = [sys.executable, "-m", "node_agent", "--standalone", "--nproc-per-node", "2",
                "--max-restarts", "1", script, d]  # fmt: skip
        p = subprocess.run(argv, timeout=300, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        pids = [json.loads(line)["pid"] for line in open(os.path.join(d, "pids-0"))]
        assert len(pids) == 2 and pids[0] == pids[1], pids
        print("ok: NCCL, rank 1 exits: rank 0 kept its process across the restart", flush=True)


if __name__ == "__main__":
    one_process()
    two_ranks()
