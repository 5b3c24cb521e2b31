"""What watching the training costs: ``worker.progress()`` per call, and the agent's page reads.

    python -m bench.progress_cost              # a table; --json for the numbers

Each worker-side figure comes from a fresh interpreter (the way a worker meets the module): one
with ``NODE_AGENT_PROGRESS_PAGE`` pointing at a page made by ``create_page`` (attached), one
without it (every call a no-op). A figure is the best of 5 runs of N calls, divided by N; the
loop's own cost is included (a ``for`` over a range, about 10 ns), so the figures are what a
training loop pays. The agent-side figure reads 8 attached pages with a ``PageSet`` (one
``pread`` each), as a poll does. The import figure is ``import node_agent.worker`` in a fresh
interpreter, measured inside it (no interpreter start-up).

``measure(trial, launcher)`` is the same as a ``python -m bench`` case (ours only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RANKS = 8

# Run in the worker's interpreter; prints one JSON line of ns per operation.
_WORKER = r"""
import json, sys, time
t0 = time.perf_counter_ns()
from node_agent import worker
imported = time.perf_counter_ns() - t0
N = int(sys.argv[1])
progress, phase, should_stop = worker.progress, worker.phase, worker.should_stop
attached = worker.attached()

def best(fn):
    runs = []
    for _ in range(5):
        t = time.perf_counter_ns()
        fn()
        runs.append((time.perf_counter_ns() - t) / N)
    return min(runs)

def calls():
    for i in range(N):
        progress(i)

def phases():
    for _ in range(N):
        with phase("compute"):
            pass

def stops():
    for _ in range(N):
        should_stop()

def empty():
    for _ in range(N):
        pass

figures = {"attached": attached, "import_ms": imported / 1e6, "progress_ns": best(calls),
           "phase_ns": best(phases), "should_stop_ns": best(stops), "loop_ns": best(empty)}
if attached:  # a stop step armed far ahead: every call reads and checks the whole record
    import os
    from node_agent.progress import pages
    from node_agent.worker import layout
    pages.write_stop(os.environ[worker.PAGE_VAR], 1 << 62, layout.STOP_ARMED)
    figures["should_stop_armed_ns"] = best(stops)
    assert not should_stop()
print(json.dumps(figures))
"""


def _worker_figures(page: str | None, n: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "NODE_AGENT_PROGRESS_PAGE"}
    if page is not None:
        env["NODE_AGENT_PROGRESS_PAGE"] = page
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-c", _WORKER, str(n)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    if result["attached"] != (page is not None):
        raise RuntimeError(f"worker attached={result['attached']} with page {page!r}")
    return result


def _agent_read_ns(folder: str, n: int) -> float:
    """ns per page read, 8 attached pages read together by a PageSet."""
    from node_agent.progress.pages import PageSet, create_page
    from node_agent.worker import layout

    paths = [os.path.join(folder, f"agent-{r}.page") for r in range(RANKS)]
    for r, path in enumerate(paths):
        create_page(path)
        with open(path, "r+b") as f:  # attached, with progress and a phase, as a worker leaves it
            f.seek(layout.PID_OFFSET)
            f.write((100_000 + r).to_bytes(4, "little"))
            f.seek(layout.PROGRESS_OFFSET)
            f.write(layout.PROGRESS.pack(7, 8, 9, layout.check(7, 8, 9)))
    rounds = max(1, n // RANKS)
    with PageSet(paths) as pages:
        if any(s is None or s.step != 7 for s in pages.read()):
            raise RuntimeError("the agent read back a page wrong")
        runs = []
        for _ in range(5):
            t = time.perf_counter_ns()
            for _ in range(rounds):
                pages.read()
            runs.append((time.perf_counter_ns() - t) / (rounds * RANKS))
    return min(runs)


def figures(n: int = 200_000) -> dict[str, float]:
    from node_agent.progress.pages import create_page

    with tempfile.TemporaryDirectory(prefix="progress-cost-") as folder:
        page = os.path.join(folder, "progress.page")
        create_page(page)
        on = _worker_figures(page, n)
        off = _worker_figures(None, n)
        read = _agent_read_ns(folder, n // 10)
    return {
        "progress_attached_ns": on["progress_ns"],
        "progress_noop_ns": off["progress_ns"],
        "phase_attached_ns": on["phase_ns"],
        "phase_noop_ns": off["phase_ns"],
        "should_stop_attached_ns": on["should_stop_ns"],
        "should_stop_armed_ns": on["should_stop_armed_ns"],
        "loop_ns": on["loop_ns"],
        "import_ms": off["import_ms"],
        "agent_read_ns": read,
        # the reads alone (no hang policy, no summary): 8 pages every 50 ms, the fastest poll
        "agent_poll_pct": read * RANKS * 20 / 1e9 * 100,
    }


ROWS = [
    ("progress_attached_ns", "worker.progress(step), attached (target < 1000 ns)", "ns"),
    ("progress_noop_ns", "worker.progress(step), outside node-agent (no-op)", "ns"),
    ("phase_attached_ns", 'with worker.phase("compute"): enter + exit, attached', "ns"),
    ("phase_noop_ns", 'with worker.phase("compute"): enter + exit, no-op', "ns"),
    ("should_stop_attached_ns", "worker.should_stop(), attached, no stop asked", "ns"),
    ("should_stop_armed_ns", "worker.should_stop(), attached, a stop step armed ahead", "ns"),
    ("loop_ns", "(the empty for-loop, included in each figure above)", "ns"),
    ("import_ms", "import node_agent.worker in a fresh interpreter (target < 5 ms)", "ms"),
    ("agent_read_ns", f"agent: one page read, {RANKS} pages per poll (PageSet, pread)", "ns"),
    ("agent_poll_pct", f"agent: those reads for {RANKS} ranks every 50 ms (the fastest poll)", "% core"),
]


def table(values: dict[str, float]) -> str:
    width = max(len(label) for _, label, _ in ROWS)
    lines = [f"{'what':<{width}}  per call", f"{'-' * width}  --------"]
    for key, label, unit in ROWS:
        lines.append(f"{label:<{width}}  {values[key]:8.{3 if unit == '% core' else 1}f} {unit}")
    return "\n".join(lines)


def measure(trial: object, launcher: str) -> dict[str, float]:
    """A ``python -m bench`` case: the figures above (ours only; ``trial`` is unused)."""
    return figures()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.progress_cost", description=__doc__.split("\n")[0])
    p.add_argument("-n", type=int, default=200_000, help="calls per run (default 200000)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    values = figures(args.n)
    print(json.dumps(values, indent=1) if args.json else table(values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
