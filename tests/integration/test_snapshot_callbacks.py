"""The Lightning and Hugging Face snapshot callbacks end to end: a real ``node-agent
--standalone`` with two gloo ranks on CPU, the real libraries, tiny models built in the scripts.

For each library, a run nothing interrupts and a run whose rank 1 SIGKILLs itself after its
snapshot of step 5 (once per job): the agent restarts both ranks, which resume from the
in-memory snapshot of step 5 through ``resume_path()`` / ``resume_checkpoint()``, and end with
parameters bit-identical to the uninterrupted run's (the HF model has dropout: the random
generators are restored too).

Then the same fault with the script's entry under ``worker.run`` (issue 44, restarts in place;
``IN_PLACE=1``): the Trainer is built and torn down inside the function ``worker.run`` calls,
so the survivor, rank 0, keeps its process (its pid in both attempts), builds a new Trainer
and process group in it, and ends bit-identical too; only rank 1 starts a new process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .procs import WORKERS, Proc
from .resumed_runs import standalone_fault_run

torch = pytest.importorskip("torch")

STEPS = 12
FAULT_STEP = 5
JOB_BOUND = 120.0
SCRIPTS = {"lightning": "lightning_snapshot_train.py", "hf": "hf_snapshot_train.py"}


def _run(tmp: Path, script: str, fault_step: int, *, in_place: bool = False) -> Proc:
    return standalone_fault_run(
        tmp, [str(WORKERS / script), str(tmp / "out")], steps=STEPS, fault_step=fault_step,
        in_place=in_place, bound=JOB_BOUND,
    )  # fmt: skip


def _starts(tmp: Path, rank: int, what: str = "start") -> list[int]:
    lines = (tmp / f"starts-{rank}.jsonl").read_text().splitlines()
    return [json.loads(line)[what] for line in lines]


def _final(tmp: Path, rank: int) -> list:
    return torch.load(tmp / f"final-{rank}.pt", weights_only=True)


@pytest.mark.timeout(3 * JOB_BOUND)  # three runs of a real library, each bounded (two busy cores: 40 s each)
@pytest.mark.parametrize("lib", sorted(SCRIPTS))
def test_a_killed_rank_resumes_from_the_callbacks_snapshot_bit_identical(tmp_path: Path, lib: str) -> None:
    pytest.importorskip("lightning" if lib == "lightning" else "transformers")
    clean, faulty, in_place = tmp_path / "clean", tmp_path / "faulty", tmp_path / "in_place"
    for d in (clean, faulty, in_place):
        d.mkdir()
    _run(clean, SCRIPTS[lib], -1)
    for folder in (faulty, in_place):
        p = _run(folder, SCRIPTS[lib], FAULT_STEP, in_place=folder is in_place)
        assert f"every rank restores the in-memory snapshot of step {FAULT_STEP}" in p.stderr, p.stderr
        for rank in (0, 1):
            assert _starts(clean, rank) == [0]
            assert _starts(folder, rank) == [0, FAULT_STEP]  # nothing lost past the snapshot's step
            a, b = _final(clean, rank), _final(folder, rank)
            assert len(a) == len(b) > 0
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (a, b)
        survivor, killed = _starts(folder, 0, "pid"), _starts(folder, 1, "pid")
        assert (survivor[0] == survivor[1]) == (folder is in_place), survivor  # rank 0 kept its process
        assert killed[0] != killed[1], killed
    assert "(1 in place: local ranks [0])" in p.stderr, p.stderr
