"""``python -m bench --smoke`` runs, and measures something: the bench must not rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STARTUP = "11. start-up budget: a standalone launch against no launcher (medians of paired runs)"
# (case, a words of the metric label) the smoke run must report with positive numbers
EXPECTED = [
    ("1. standalone launch", "launch → all workers started"),
    ("1. standalone launch", "floor: python imports asyncio"),
    ("2. N-node rendezvous", "N=2, agents host the rendezvous"),
    ("3. restart after a worker failure", "failure → every rank's replacement running"),
    ("3. restart after a worker failure", "floor: a python parent reaps rank 0"),
    ("7. scale: 100 simulated agents (ours only)", "cold join storm"),
    ("7. scale: 100 simulated agents (ours only)", "1 % close their sockets"),
    ("7. scale: 100 simulated agents (ours only)", "server RSS"),
    ("7. scale: 100 simulated agents (ours only)", "heartbeats per second"),
    ("7. scale: 100 simulated agents (ours only)", "floor: plain socket.send"),
    ("7. scale: 100 simulated agents (ours only)", "heartbeats + summaries: server RSS"),
    ("7. scale: 100 simulated agents (ours only)", "summaries per second"),
    ("7. scale: 100 simulated agents (ours only)", "one hang: every rank stops"),
    ("7. scale: 100 simulated agents (ours only)", "every node holds the next round"),
    ("7. scale: 100 simulated agents (ours only)", "hang: Stacks messages"),
    ("8. watching the training (ours only)", "worker.progress(step), attached"),
    (STARTUP, "launch → every worker started"),
    (STARTUP, "launch → launcher exited"),
    (STARTUP, "floor: a bare python parent"),
    (STARTUP, "`python -c pass`"),
    (STARTUP, "the launcher's imports"),
    (STARTUP, "`-X importtime` of a launch"),
    (STARTUP, "over the floor: CPU time"),
]


def test_smoke_run_reports_every_case_with_positive_numbers(tmp_path: Path) -> None:
    md, js = tmp_path / "bench.md", tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--out", str(md), "--json", str(js)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(js.read_text())
    assert data["meta"]["leftover_processes"] == 0
    rows = data["rows"]
    for case, words in EXPECTED:
        found = [r for r in rows if r["case"] == case and words in r["label"]]
        assert found, f"no row for {case} / {words!r}: {[(r['case'], r['label']) for r in rows]}"
        row = found[0]
        assert not row["failures"], row["failures"]
        assert row["ours"] and all(v > 0 for v in row["ours"]), row
        assert row["torchrun"] in ([], None)  # smoke runs no torchrun
    storm = next(r for r in rows if "cold join storm" in r["label"])
    assert storm["median_ours"] < 10.0  # 100 agents on loopback: well under a second normally
    hb = next(r for r in rows if "heartbeats per second" in r["label"])
    assert 50 <= hb["median_ours"] <= 150  # 100 agents at 1 Hz
    summaries = next(r for r in rows if "summaries per second" in r["label"])
    assert 50 <= summaries["median_ours"] <= 150  # one Progress per node a second
    stacks = next(r for r in rows if "hang: Stacks messages" in r["label"])
    assert stacks["median_ours"] >= 100  # every node's stacks (some collect twice)
    # The budget: ours over the floor, a yes/no in the target column (which, depends on the machine).
    for words in ("over the floor: launch → every worker started", "over the floor: launch → exited"):
        row = next(r for r in rows if r["case"] == STARTUP and r["label"] == words)
        assert row["ours"] and row["target"]["abs_max"] == 0.03 and row["holds"] in (True, False), row
    floor = next(r for r in rows if r["case"] == STARTUP and r["label"].startswith("floor: a bare"))
    launch = next(r for r in rows if r["case"] == STARTUP and r["label"].startswith("`--standalone"))
    assert floor["median_ours"] < launch["median_ours"] < 10.0
    assert "with summaries: server CPU" in md.read_text()  # the side-by-side table
    text = md.read_text()
    assert "| 1. standalone launch |" in text and "cold join storm" in text
