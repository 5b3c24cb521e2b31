"""What the deterministic training workers left behind, read the same way by every test that
resumes them (``workers/snapshot_train.py``, ``workers/inplace_train.py``): each attempt's
start record, the last step's parameters, the snapshots on the node, the server's kept step.

The workers train the same model the same way: any run resumed from a snapshot ends with the
parameters of an uninterrupted run, which :func:`same` compares (bit for bit, and finite).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .live_job import get
from .procs import Proc, agent_cmd


def standalone_fault_run(
    tmp: Path, script: Iterable[str], *, steps: int, fault_step: int, in_place: bool, bound: float
) -> Proc:
    """``node-agent --standalone`` with two ranks and one restart allowed, running ``script``
    (its path and arguments) with $DUMP_DIR, $STEPS, $FAULT_STEP (-1: none) and $IN_PLACE set as
    the fault workers read them; it must exit 0 within ``bound``."""
    argv = agent_cmd("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", *script)
    env = {
        "DUMP_DIR": str(tmp),
        "STEPS": str(steps),
        "FAULT_STEP": str(fault_step),
        "GLOO_SOCKET_IFNAME": "lo",
        "IN_PLACE": "1" if in_place else "0",
    }
    p = Proc(argv, env=env)
    assert p.wait(timeout=bound) == 0, p.stderr
    return p


def starts(tmp: Path, rank: int) -> list[dict[str, Any]]:
    """Each attempt of ``rank``, in order: what its start record says."""
    path = tmp / f"starts-{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def final(tmp: Path, rank: int) -> list[Any]:
    import torch

    return torch.load(tmp / f"final-{rank}.pt", weights_only=True)


def same(a: list[Any], b: list[Any]) -> bool:
    import torch

    finite = all(bool(torch.isfinite(x).all()) for x in a)
    return finite and len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def at_step(step: int, agents: Iterable[Proc]) -> bool:
    """Both ranks have a complete snapshot of ``step`` (their agents' folders say so)."""
    name = f"{step:020d}.snap"
    found = {
        path.parent.name
        for a in agents
        for path in Path("/dev/shm").glob(f"node-agent-{a.p.pid}-*/snapshots/r*/{name}")
    }
    return {"r0", "r1"} <= found


def rank_of(tmp: Path, tag: str) -> int:
    """The rank node ``tag`` ran (in any attempt)."""
    for r in (0, 1):
        if any(s["node"] == tag for s in starts(tmp, r)):
            return r
    raise AssertionError(f"node {tag} ran no rank")


def kept_step(port: int, tls: Any = None) -> int:
    """The step whose snapshots the server knows on two nodes for every rank (-1: none)."""
    status, body = get(port, "/v1/jobs", tls=tls)
    jobs = body["jobs"] if status == 200 else []
    snap = jobs[0]["snapshot"] if jobs else None
    return snap["kept_step"] or -1 if snap else -1
