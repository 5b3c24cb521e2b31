"""Issue 44: back to training after a failure, survivors kept in their processes, side by side
with torchrun in one run.

One deterministic gloo script for every setup, ``bench/workers/train_snap.py`` (case 12's: a
step every 50 ms, 90 steps, a checksum of the state logged each step; every trial checks that
all attempts logged the same checksum at every step). The failure comes after step 73 (every
rank holds there on a file; the bench kills, then creates the file).

Setups:

- ``torchrun``: torch 2.13's launcher, a DCP checkpoint every 50 steps (what its users resume
  from; 23 steps lost), ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` as in case 12;
- ``ours``: node-agent, ``--in-place`` (the script's ``worker.run``), ``--preload
  torch,torch._dynamo,torch.distributed.checkpoint.state_dict`` (:data:`PRELOAD`), a snapshot every
  step (``snapshot_torch``, ``replicated=True``): survivors stay in their processes, the lost rank
  starts from the warm pool and restores from memory (or its peer's replica).

Cases (the time is from the SIGKILL to the first step of the next attempt on every rank, the
slowest's; "survivor" is the surviving rank's own first step):

- ``worker``: ``--standalone --nproc-per-node 2 --max-restarts 3``; SIGKILL of local rank 1's
  worker process.
- ``node``: two nodes of one rank (``--nnodes 2``, c10d for torchrun with ``is_host`` on node 1
  and case 5's keep-alive tuning; our ``rdzv-server`` for ours) and, for ours, a third waiting
  as a spare; SIGKILL of node 2 (launcher and worker). torchrun has no working spare (case 12's
  docstring): its replacement launcher starts right after the kill, as a scheduler would.
- ``shrink``: ``--nnodes 1:2``, two nodes; SIGKILL of node 2; the survivor goes on alone at
  world 1 (torchrun's host survives: node 2 is not its host). Ours marks its snapshots as state
  every rank holds alike (``--replicated``, true of this script), so the survivor restores its
  own newest snapshot at the smaller world; torchrun resumes from its DCP checkpoint.

Run: ``python -m bench.inplace_lost [--repeat N] [--cases worker,node,shrink] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tests.integration.workers.train_commit_log import Attempt, attempts

from .launch_cases import exe
from .procs import Trial, TrialFailed, wait_for_log
from .snapshot_lost import (
    FIRST_STEPS_BOUND,
    JOB_BOUND,
    KILL_AT,
    _at_step,
    _env,
    _finish,
    _kill,
    _rank1_pid,
    _script,
    kill_node_b,
    node_launcher,
)

SETUPS = ("torchrun", "ours")
CASES = ("worker", "node", "shrink")


def _args(trial: Trial, launcher: str) -> list[str]:
    if launcher == "torchrun":
        return _script(trial, True, 0)
    return [*_script(trial, False, 1), "--in-place", "--replicated"]


# What the script imports that takes long, as a user names their script's heavy imports: torch
# (1.4 s here), DCP's state_dict helpers (0.9 s more) and torch._dynamo, which torch imports at
# the first optimizer's construction (0.5 s: a replacement's first Adam() otherwise pays it).
PRELOAD = "torch,torch._dynamo,torch.distributed.checkpoint.state_dict"


def _ours_flags(launcher: str) -> list[str]:
    return [] if launcher == "torchrun" else ["--preload", PRELOAD]


def _after(trial: Trial, t_kill: float, world: int) -> list[Attempt]:
    """The next attempt of every rank: the first ``world`` attempts with a step after the kill."""

    def resumed() -> list[Attempt] | None:
        new = [a for a in attempts(trial.dir / "steps") if a.first_t is not None and a.first_t > t_kill]
        new.sort(key=lambda a: a.first_t or 0.0)
        return new[:world] if len(new) >= world else None

    return trial.until("every rank training again", resumed, JOB_BOUND)


def _times(new: list[Attempt], t_kill: float, survivor_node: str) -> dict[str, float]:
    starts = {a.start_from for a in new}
    if len(starts) != 1:
        raise TrialFailed(f"the ranks resumed from different steps {sorted(starts)}: {new}")
    out = {"back": max(a.first_t or 0.0 for a in new) - t_kill, "lost": float(KILL_AT - starts.pop())}
    mine = [a.first_t for a in new if a.node == survivor_node and a.first_t is not None]
    if mine:
        out["survivor"] = min(mine) - t_kill
    return out


def _kept_pids(trial: Trial, before: list[Attempt], new: list[Attempt]) -> float:
    """How many of the surviving ranks kept their process (ours must keep every one)."""
    old = {a.pid for a in before}
    return float(sum(1 for a in new if a.pid in old))


def worker_kill(trial: Trial, launcher: str) -> dict[str, float]:
    argv = [
        exe(launcher),
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        *_ours_flags(launcher),
    ]
    agent = trial.launch("agent", [*argv, *_args(trial, launcher)], _env(launcher))
    held = trial.until(
        f"both ranks at step {KILL_AT}", lambda: _at_step(trial, KILL_AT, 2), FIRST_STEPS_BOUND
    )
    victim = _rank1_pid(trial, held)
    t_kill = time.time()
    _kill([victim])
    (trial.dir / "go").touch()
    new = _after(trial, t_kill, 2)
    out = _times(new, t_kill, "A")
    out["kept"] = _kept_pids(trial, [a for a in held if a.pid != victim], new)
    _finish(trial, [agent], "worker kill")
    return out


def node_kill(trial: Trial, launcher: str, *, spare: bool) -> dict[str, float]:
    flags = tuple(_ours_flags(launcher))
    launch = node_launcher(trial, launcher, "2" if spare else "1:2", _args(trial, launcher), flags)
    a, b = launch("A"), launch("B")
    trial.until("both nodes training", lambda: _at_step(trial, 1, 2), FIRST_STEPS_BOUND)
    waiting = None
    if spare and launcher != "torchrun":
        waiting = launch("C")
        wait_for_log(waiting, r"spare", 60)
    held = trial.until(
        f"both nodes at step {KILL_AT}", lambda: _at_step(trial, KILL_AT, 2), FIRST_STEPS_BOUND
    )
    t_kill = kill_node_b(trial, b, held)
    if spare and waiting is None:
        waiting = launch("C")  # torchrun: the scheduler's replacement
    (trial.dir / "go").touch()
    new = _after(trial, t_kill, 2 if spare else 1)
    out = _times(new, t_kill, "A")
    out["kept"] = _kept_pids(trial, [x for x in held if x.node == "A"], new)
    _finish(trial, [a, *([waiting] if waiting is not None else [])], "node kill")
    return out


def run_case(trial: Trial, case: str, launcher: str) -> dict[str, float]:
    if case == "worker":
        return worker_kill(trial, launcher)
    return node_kill(trial, launcher, spare=case == "node")


LABELS = {
    "worker": "SIGKILL of 1 of 2 ranks (1 node)",
    "node": "SIGKILL of node 2 of 2 (ours: a spare waits; torchrun: relaunched at once)",
    "shrink": "SIGKILL of node 2 of a 1:2 job (the survivor goes on at world 1)",
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.inplace_lost", description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--cases", default=",".join(CASES), help=f"a subset of {','.join(CASES)}")
    p.add_argument("--out", type=Path, help="write the Markdown report here too")
    p.add_argument("--keep", action="store_true", help="keep the trials' folders")
    args = p.parse_args(argv)
    cases = args.cases.split(",")
    if args.repeat < 1 or not set(cases) <= set(CASES):
        p.error(f"--repeat must be >= 1 and --cases a subset of {','.join(CASES)}")
    results: dict[tuple[str, str], list[dict[str, float]]] = {(c, s): [] for c in cases for s in SETUPS}
    failed: list[str] = []
    root = tempfile.mkdtemp(prefix="bench-inplace-")
    try:
        for rep in range(args.repeat):
            for case in cases:
                order = SETUPS if rep % 2 == 0 else tuple(reversed(SETUPS))
                for setup in order:
                    with Trial(Path(root) / f"{case}-{setup}-{rep}") as trial:
                        try:
                            results[(case, setup)].append(run_case(trial, case, setup))
                        except TrialFailed as exc:
                            failed.append(f"{case} {setup} #{rep}: {str(exc).splitlines()[0]}")
                    got = results[(case, setup)][-1] if results[(case, setup)] else "failed"
                    print(f"{case} {setup} #{rep}: {got}", file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    text = report(results, cases, failed, args.repeat)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0 if not failed else 1


def _cell(rows: list[dict[str, float]], key: str, unit: str = "s") -> str:
    vals = [r[key] for r in rows if key in r]
    if not vals:
        return "n/a"
    if unit == "s":
        return f"{min(vals):.2f} / **{statistics.median(vals):.2f}** / {max(vals):.2f} s"
    return f"{min(vals):g} / **{statistics.median(vals):g}** / {max(vals):g}"


def _ratio(ours: list[dict[str, float]], theirs: list[dict[str, float]], key: str) -> str:
    a, b = [r[key] for r in ours if key in r], [r[key] for r in theirs if key in r]
    if not a or not b:
        return "n/a"
    return f"{statistics.median(a) / statistics.median(b):.3f}"


def report(
    results: dict[tuple[str, str], list[dict[str, float]]], cases: list[str], failed: list[str], repeat: int
) -> str:
    lines = [
        "# Back to training after a failure, survivors kept (issue 44)",
        "",
        f"`python -m bench.inplace_lost --repeat {repeat}`: `bench/inplace_lost.py` has the commands. "
        "Trials interleaved in one run on this machine (CPU only, gloo); cells are min / **median** / max.",
        "",
        "| failure | metric | torchrun 2.13 (DCP every 50) | ours (`worker.run`, `--preload`, "
        "snapshot every step) | ours / torchrun |",
        "|---|---|---|---|---|",
    ]
    for case in cases:
        t, o = results[(case, "torchrun")], results[(case, "ours")]
        lines.append(
            f"| {LABELS[case]} | kill → every rank's first step of the next attempt | {_cell(t, 'back')} | "
            f"{_cell(o, 'back')} | {_ratio(o, t, 'back')} |"
        )
        surv = f"{_cell(t, 'survivor')} | {_cell(o, 'survivor')} | {_ratio(o, t, 'survivor')}"
        lines.append(f"|  | kill → the surviving rank's first step | {surv} |")
        lines.append(f"|  | steps run again | {_cell(t, 'lost', '')} | {_cell(o, 'lost', '')} |  |")
        kept = f"{_cell(t, 'kept', '')} | {_cell(o, 'kept', '')}"
        lines.append(f"|  | surviving ranks that kept their process | {kept} |  |")
    lines.append("")
    if failed:
        lines += ["Failed trials:", "", *[f"- {f}" for f in failed], ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
