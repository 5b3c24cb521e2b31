"""Case 11: the start-up budget, what a standalone launch costs over no launcher at all.

    python -m bench.startup                 # ours and torchrun, 15 paired runs each; a table
    python -m bench.startup --no-torchrun --reps 31 --json

One trial runs, ``reps`` times and in alternating order, each of these (every process timed
from just before its ``Popen`` to the return of its ``wait4``, no polling; ``wait4`` also gives
its CPU time, its workers' and helpers' included, which a busy machine disturbs far less than
the wall time):

- the launch: ``L --standalone --nproc-per-node 2 noimport.py``; the workers stamp
  ``time.time()`` as their first statement (a file of events of its own per run), so launch →
  every worker started, and launch → the launcher exited;
- the floor: the same two workers started by a tiny Python parent with ``subprocess.Popen``
  (no agent, no asyncio, the same interpreter), which waits for them: the least any launcher
  written in Python costs here;
- the interpreter alone (``python -c pass``), and the launcher's own modules imported
  (``import node_agent.runner`` and what ``node-agent`` imports before it; for torchrun,
  ``from torch.distributed.run import main``): their difference is the import time;
- the launch again under ``python -X importtime``: the sum of every module it imports beyond
  what ``python -c pass`` imports (the importtime's own overhead included), whatever imports it
  and whenever (the embedded rendezvous server's modules count too).

A trial's figures are the medians of its runs; "over the floor" is the median of the paired
differences (each launch with the floor run next to it), the figure the budget is about; the
CPU over the floor is the difference of the two medians.

``measure(trial, launcher)`` is the ``python -m bench`` case ("startup"); smoke runs use 3 reps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

from .launch_cases import exe, worker
from .procs import Trial, TrialFailed

BUDGET = 0.03  # seconds over the floor, launch → every worker started (and → exit)
REPS = 15
BOUND = 60.0  # per process: torchrun imports torch on 2 cores in a few seconds

# The floor: no launcher, the two no-import workers from a bare parent (same interpreter).
FLOOR = """import os, subprocess, sys
ws = [subprocess.Popen([sys.executable, "-u", sys.argv[1]], env=dict(os.environ, RANK=str(r)))
      for r in range(2)]
sys.exit(max(w.wait() for w in ws))
"""
# What each launcher's entry point imports before it starts any worker.
IMPORTS = {
    "ours": "from node_agent.cli import main; import node_agent.cli.parse, node_agent.runner",
    "torchrun": "from torch.distributed.run import main",
}


class Run(NamedTuple):
    t_launch: float  # time.time() just before Popen
    t_exit: float  # just after its wait4 returned
    cpu: float  # user + system seconds of the process and every child it reaped (wait4)
    log: str


def _timed(trial: Trial, name: str, argv: list[str], events: Path | None = None) -> Run:
    """Run one process to its end, reaped by ``wait4`` (its CPU time, its workers' included)."""
    env = {"BENCH_EVENTS": str(events)} if events is not None else None
    p = trial.launch(name, argv, env)
    bound = threading.Timer(BOUND, trial.kill, (p,))  # a wedged run is killed, then reported
    bound.start()
    try:
        _, status, usage = os.wait4(p.pid, 0)
    finally:
        bound.cancel()
    p.t_exit = time.time()
    p.popen.returncode = rc = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait
    if rc != 0:
        raise TrialFailed(f"{name}: exit code {rc}\n{p.log_text()[-2000:]}")
    return Run(p.t_launch, p.t_exit, usage.ru_utime + usage.ru_stime, p.log_text())


def _started(events: Path, n: int) -> float:
    """The last of the ``n`` workers' start stamps in ``events``."""
    starts = []
    for line in events.read_text().splitlines():
        rec = json.loads(line)
        if rec["ev"] == "start":
            starts.append(rec["t"])
    if len(starts) != n:
        raise TrialFailed(f"{len(starts)} worker start(s) in {events}, expected {n}")
    return max(starts)


def _top_level(importtime_log: str) -> dict[str, int]:
    """{module: cumulative µs} of the modules ``-X importtime`` shows at the top level (those
    imported by another module are in their importer's cumulative time)."""
    out: dict[str, int] = {}
    for line in importtime_log.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = line[len("import time:") :].split("|")
        if not name[1:].startswith(" "):  # "| name": top level; "|   name": nested
            out[name.strip()] = out.get(name.strip(), 0) + int(cumulative)
    return out


def imported_ms(importtime_log: str, exclude: set[str]) -> float:
    """What the modules of ``-X importtime`` lines took, in ms, but for those in ``exclude``
    (the bare interpreter's own)."""
    return sum(us for name, us in _top_level(importtime_log).items() if name not in exclude) / 1000


def measure(trial: Trial, launcher: str, reps: int = REPS) -> dict[str, float]:
    """One trial: ``reps`` paired runs of the launch and the floor, of the bare interpreter and
    the launcher's imports, and one importtime launch each; the medians (seconds, ms)."""
    py = sys.executable
    launch = [exe(launcher), "--standalone", "--nproc-per-node", "2", worker("noimport.py")]
    floor = [py, "-c", FLOOR, worker("noimport.py")]
    keys = ("start", "wall", "cpu", "floor_start", "floor_wall", "floor_cpu", "bare", "imports")
    runs: dict[str, list[float]] = {k: [] for k in (*keys, "over_floor", "over_floor_wall", "imported_ms")}
    bare = _timed(trial, "bare-importtime", [py, "-X", "importtime", "-c", "pass"])
    bare_modules = set(_top_level(bare.log))

    def two_workers(name: str, argv: list[str]) -> tuple[float, float, float]:
        """(launch → both workers started, launch → exit, CPU)"""
        ev = trial.dir / f"{name}.jsonl"
        run = _timed(trial, name, argv, ev)
        return _started(ev, 2) - run.t_launch, run.t_exit - run.t_launch, run.cpu

    for i in range(reps):
        pair = {}
        for name in ("launch", "floor") if i % 2 == 0 else ("floor", "launch"):
            pair[name] = two_workers(f"{name}-{i}", launch if name == "launch" else floor)
        for key, value in zip(("start", "wall", "cpu"), pair["launch"], strict=True):
            runs[key].append(value)
        for key, value in zip(("floor_start", "floor_wall", "floor_cpu"), pair["floor"], strict=True):
            runs[key].append(value)
        runs["over_floor"].append(pair["launch"][0] - pair["floor"][0])
        runs["over_floor_wall"].append(pair["launch"][1] - pair["floor"][1])
        for name in ("bare", "imports") if i % 2 == 0 else ("imports", "bare"):
            run = _timed(trial, f"{name}-{i}", [py, "-c", "pass" if name == "bare" else IMPORTS[launcher]])
            runs[name].append(run.t_exit - run.t_launch)
        traced = _timed(
            trial, f"importtime-{i}", [py, "-X", "importtime", *launch], trial.dir / f"it-{i}.jsonl"
        )
        runs["imported_ms"].append(imported_ms(traced.log, bare_modules))
    out = {k: statistics.median(v) for k, v in runs.items()}
    out["import_ms"] = 1000 * (out.pop("imports") - out["bare"])
    out["cpu_over_floor"] = out.pop("cpu") - out.pop("floor_cpu")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=REPS, help=f"paired runs per launcher (default {REPS})")
    p.add_argument("--no-torchrun", action="store_true", help="measure node-agent only")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    from .__main__ import compile_sources

    compile_sources()
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as root:
        for who in ("ours",) if args.no_torchrun else ("ours", "torchrun"):
            with Trial(Path(root) / who) as trial:
                results[who] = measure(trial, who, args.reps)
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    rows: list[tuple[str, Any]] = [
        (k, {who: r.get(k) for who, r in results.items()}) for k in next(iter(results.values()))
    ]
    for key, by in rows:
        cells = "  ".join(f"{who} {v:8.4f}" for who, v in by.items() if v is not None)
        print(f"{key:16} {cells}")
    ours = results["ours"]["over_floor"]
    print(f"budget: ours - floor = {ours:.4f} s <= {BUDGET} s: {'yes' if ours <= BUDGET else 'no'}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
