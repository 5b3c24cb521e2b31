"""Goodput end to end (issue 47): a real 2-node gloo job fails twice, and what the server says
its time went to is what the test measured from outside.

Two agents (one rank each) under a real rdzv-server run ``workers/goodput_train.py``: 24
steps of 0.2 s, a checkpoint of 1.2 s after steps 7 and 15, rank 1 dies at step 11 on the
first attempt and at step 19 on the second (each attempt resumes after the last checkpoint, so
3 + 3 steps are done again). Every rank logs when it did what (``time.time()``); the test
takes from those logs, and from when it started the agents and saw them exit:

- the failures' cost: from each crash to the next attempt's first step, plus the steps lost
  times the step time; the steps lost themselves;
- the training time: from each attempt's first step to its crash (or the end), less the
  checkpoints and the time of the steps done again; the checkpoints' time;
- the wall time: the agents' launch to their exit; the finishing time: the last step to that
  exit.

The server sees each of those moments a little late: a crash when the agent reports it (well
under 0.5 s), a step when the agent's page poll sees it and sends its summary (at most 1 s
later), the start when the first agent has joined (its start-up, about a second). So each
figure is compared within a stated tolerance: the steps lost exactly, each failure's cost
within 1.5 s, the training and checkpoint times within 1.5 s per round, the wall time within
6 s (the agents' own start and exit are outside the job: a few seconds on a loaded machine),
goodput within 0.1 (those seconds are a large share of a 20-second job; of a real one, none).
The numbers of a run are printed (``-s``). Each agent prints the job's goodput line at the
end, the one the status API shows.
"""

from __future__ import annotations

import itertools
import json
import signal
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .live_job import get
from .procs import WORKERS, Proc, agent_cmd, start_server

SCRIPT = str(WORKERS / "goodput_train.py")
STEP_S = 0.2
PER_FAILURE_S = 1.5  # a failure's cost: the report's latency and a poll's
PER_ROUND_S = 1.5  # training and checkpoints: a round's two ends, each seen up to a poll late


@pytest.fixture
def server() -> Iterator[int]:
    srv, port = start_server()
    try:
        yield port
        srv.signal(signal.SIGTERM)
        assert srv.wait(timeout=15) == 0, srv.stderr
    finally:
        srv.kill()


def events(folder: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / f"rank{rank}.jsonl").read_text().splitlines()]


def measured(folder: Path, launched: float, exited: float) -> dict[str, Any]:
    """What the workers' own logs say (rank 0's steps, rank 1's crashes)."""
    r0, r1 = events(folder, 0), events(folder, 1)
    steps = [e for e in r0 if e["ev"] == "step"]
    attempts = sorted({e["attempt"] for e in steps})
    assert attempts == [0, 1, 2], attempts
    first = {k: next(e for e in steps if e["attempt"] == k) for k in attempts}
    last = {k: [e for e in steps if e["attempt"] == k][-1] for k in attempts}
    fails = {e["attempt"]: e for e in r1 if e["ev"] == "fail"}
    assert sorted(fails) == [0, 1]
    done = next(e for e in r0 if e["ev"] == "done")
    # The step time: consecutive steps of an attempt, the pauses after a first step left out.
    gaps = [
        b["t"] - a["t"]
        for a, b in itertools.pairwise(steps)
        if a["attempt"] == b["attempt"] and b["step"] == a["step"] + 1 and a is not first[a["attempt"]]
    ]
    step_s = statistics.median(gaps)
    ckpts = [e["end"] - e["begin"] for e in r0 if e["ev"] == "ckpt"]
    lost = [last[k]["step"] - (first[k + 1]["step"] - 1) for k in (0, 1)]
    down = [first[k + 1]["t"] - fails[k]["t"] for k in (0, 1)]
    gross = sum(fails[k]["t"] - first[k]["t"] for k in (0, 1)) + done["t"] - first[2]["t"]
    rerun = sum(lost) * step_s
    return {
        "wall_s": exited - launched,
        "to_first_step_s": first[0]["t"] - launched,
        "failures": [
            {"down_s": d, "steps_lost": n, "cost_s": d + n * step_s} for d, n in zip(down, lost, strict=True)
        ],
        "failures_s": sum(down) + rerun,
        "steps_lost": sum(lost),
        "step_s": step_s,
        "checkpoint_s": sum(ckpts),
        "training_s": gross - rerun - sum(ckpts),
        "finishing_s": exited - done["t"],
    }


def test_two_failures_cost_what_the_test_measured(tmp_path: Path, server: int) -> None:
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    logs.mkdir()
    ckpt.mkdir()
    env = {
        "LOG_DIR": str(logs),
        "CKPT_DIR": str(ckpt),
        "STEPS": "24",
        "STEP_SECONDS": str(STEP_S),
        "CKPT_EVERY": "8",
        "FAIL_AT": "11,19",
        "FAIL_RANK": "1",
    }
    launched = time.time()
    agents = [
        Proc(
            agent_cmd(
                "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{server}",
                "--rdzv-id", "goodput", "--max-restarts", "2", "--log-dir", str(tmp_path / f"node{i}"),
                SCRIPT,
            ),
            env=env,
        )
        for i in range(2)
    ]  # fmt: skip
    try:
        for a in agents:
            a.wait(timeout=120)
    finally:
        for a in agents:
            a.kill()
    exited = time.time()
    assert [a.p.returncode for a in agents] == [0, 0], "\n".join(a.stderr for a in agents)
    status, job = get(server, "/v1/jobs/goodput")
    assert status == 200 and job["phase"] == "finished"
    g = job["goodput"]
    out = measured(logs, launched, exited)
    said = {
        "wall_s": g["wall_s"],
        "to_first_step_s": g["rendezvous_s"] + g["startup_s"],
        "failures": g["causes"]["worker_crash"],
        "failures_s": g["failures"]["seconds"],
        "steps_lost": g["failures"]["steps_lost"],
        "checkpoint_s": g["checkpoint_s"],
        "training_s": g["training_s"],
        "finishing_s": g["finishing_s"],
        "goodput": g["goodput"],
    }
    print(f"\nmeasured outside: {json.dumps(out, indent=1)}\nthe server said: {json.dumps(said, indent=1)}")
    print(f"the line: {g['text']}")
    assert g["failures"]["count"] == 2 and set(g["causes"]) == {"worker_crash"}
    # The failing node's report carries its last step; the other node's last step the server
    # knows from its summaries, once a second: on a loaded machine (two busy loops) its rank 0
    # ran one more step after its last summary before the restart stopped it (5 of 6 counted).
    # Never more than were lost, at most one fewer per failure.
    assert out["steps_lost"] == 6
    assert out["steps_lost"] - 2 <= g["failures"]["steps_lost"] <= out["steps_lost"]
    assert g["failures"]["steps_lost_unknown"] == 0
    assert abs(g["failures"]["seconds"] - out["failures_s"]) <= 2 * PER_FAILURE_S
    assert abs(g["training_s"] - out["training_s"]) <= 3 * PER_ROUND_S
    assert abs(g["checkpoint_s"] - out["checkpoint_s"]) <= 2 * PER_ROUND_S
    assert 0 <= out["wall_s"] - g["wall_s"] <= 6.0
    # The training ends at the last step, not when the last node's workers have exited: the
    # process group's teardown and the exits are the job's finishing (the agents' own exit,
    # after the job's end, is only in the test's figure).
    assert 0 < g["finishing_s"] <= out["finishing_s"] + PER_ROUND_S
    assert abs(g["goodput"] - out["training_s"] / out["wall_s"]) <= 0.1
    # The line every agent printed as the job ended: the server's, word for word.
    lost = g["failures"]["steps_lost"]
    assert (
        g["text"].startswith("goodput ")
        and "2 failures cost" in g["text"]
        and f"and {lost} steps" in g["text"]
    )
    for a in agents:
        assert f"job: {g['text']}" in a.stderr, a.stderr
