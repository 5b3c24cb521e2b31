"""``dcp_snapshots`` end to end, as users receive it: a real ``node-agent --standalone`` with two
gloo ranks on CPU training a tiny FSDP2 model (``workers/fsdp_snapshot_train.py``), its
sharded model and Adam state snapshotted through torch.distributed.checkpoint every step.

A run nothing interrupts, then a run whose rank 1 SIGKILLs itself after its snapshot of step 5
(once per job): the agent restarts both ranks (as torchrun would), every rank loads its own
file of step 5 and resumes at step 6, and the parameters end bit-identical to the
uninterrupted run's. Then the same fault with the script's entry under ``worker.run``
(restarts in place): rank 0 keeps its process, builds a new process group, mesh and FSDP model
in it and loads the snapshot there; only rank 1 starts a new process. Bit-identical too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .procs import WORKERS, Proc
from .resumed_runs import standalone_fault_run

torch = pytest.importorskip("torch")

STEPS = 12
FAULT_STEP = 5
JOB_BOUND = 120.0
SCRIPT = WORKERS / "fsdp_snapshot_train.py"


def _run(tmp: Path, fault_step: int, *, in_place: bool = False) -> Proc:
    return standalone_fault_run(
        tmp, [str(SCRIPT)], steps=STEPS, fault_step=fault_step, in_place=in_place, bound=JOB_BOUND
    )


def _starts(tmp: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp / f"starts-{rank}.jsonl").read_text().splitlines()]


def _final(tmp: Path, rank: int) -> list[Any]:
    return torch.load(tmp / f"final-{rank}.pt", weights_only=True)


@pytest.mark.timeout(3 * JOB_BOUND)  # three runs, each bounded
def test_a_killed_fsdp_rank_resumes_from_its_dcp_snapshot_bit_identical(tmp_path: Path) -> None:
    clean, faulty, in_place = tmp_path / "clean", tmp_path / "faulty", tmp_path / "in_place"
    for d in (clean, faulty, in_place):
        d.mkdir()
    _run(clean, -1)
    for rank in (0, 1):
        assert [s["start"] for s in _starts(clean, rank)] == [0]
        assert [s["world"] for s in _starts(clean, rank)] == [2]
    for folder in (faulty, in_place):
        p = _run(folder, FAULT_STEP, in_place=folder is in_place)
        assert f"every rank restores the in-memory snapshot of step {FAULT_STEP}" in p.stderr, p.stderr
        for rank in (0, 1):
            starts = _starts(folder, rank)
            assert [s["start"] for s in starts] == [0, FAULT_STEP + 1], starts  # nothing lost past step 5
            assert [s["world"] for s in starts] == [2, 2], starts
            a, b = _final(clean, rank), _final(folder, rank)
            assert len(a) == len(b) == 4  # two Linear layers' weights and biases, gathered whole
            assert all(bool(torch.isfinite(x).all()) for x in a)
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (a, b)
        survivor = [s["pid"] for s in _starts(folder, 0)]
        killed = [s["pid"] for s in _starts(folder, 1)]
        assert (survivor[0] == survivor[1]) == (folder is in_place), survivor  # rank 0 kept its process
        assert killed[0] != killed[1], killed
        if folder is in_place:
            assert "(1 in place: local ranks [0])" in p.stderr, p.stderr
    assert all(torch.equal(x, y) for x, y in zip(_final(clean, 0), _final(clean, 1), strict=True))
