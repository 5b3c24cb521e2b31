"""Restarts, elasticity, node loss, drain and signals, with real processes and real signals."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from .conftest import Rendezvous
from .procs import WORKERS, Proc, agent_cmd, pid_alive

FAIL_ONCE = str(WORKERS / "fail_once.py")
SLEEPER = str(WORKERS / "sleeper.py")


def attempts(folder: Path) -> list[tuple[int, int]]:
    rows = [line.split() for line in (folder / "attempts.txt").read_text().splitlines() if line]
    return sorted((int(r), int(c)) for r, c, _pid in rows)


def started(folder: Path) -> list[tuple[int, int, int, int]]:
    """(rank, world_size, pid, restart_count) of every worker start so far."""
    p = folder / "started.txt"
    if not p.exists():
        return []
    return [tuple(int(x) for x in line.split()) for line in p.read_text().splitlines() if line]  # type: ignore[misc]


def wait_dead(pids: list[int], within: float) -> list[int]:
    """The pids still alive after `within` seconds (a bounded check of other processes' deaths)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [p for p in pids if pid_alive(p)]
        if not alive:
            return []
        time.sleep(0.02)
    return [p for p in pids if pid_alive(p)]


def run(argv: list[str], env: dict[str, str], timeout: float = 90) -> Proc:
    p = Proc(argv, env=env)
    try:
        p.wait(timeout=timeout)
    finally:
        p.kill()
    return p


def test_worker_failing_once_is_restarted_with_incremented_count(tmp_path: Path) -> None:
    env = {"DUMP_DIR": str(tmp_path), "FAIL_RANK": "0"}
    p = run(agent_cmd("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", FAIL_ONCE), env)
    assert p.p.returncode == 0, p.stderr
    # rank 1's first attempt may be stopped before it writes its line
    assert {(0, 0), (0, 1), (1, 1)} <= set(attempts(tmp_path))
    assert "re-rendezvous after round 0: worker failure" in p.stderr


def test_no_restarts_left_fails_with_root_cause_summary(tmp_path: Path) -> None:
    env = {"DUMP_DIR": str(tmp_path), "FAIL_RANK": "1"}
    p = run(agent_cmd("--standalone", "--nproc-per-node", "2", "--max-restarts", "0", FAIL_ONCE), env)
    assert p.p.returncode == 1
    assert "Root Cause (first observed failure):" in p.stderr
    assert "rank      : 1 (local_rank: 1)" in p.stderr
    assert "exitcode  : 1" in p.stderr
    assert "rank 1 fails on attempt 0" in p.stderr
    assert "job failed" in p.stderr and "--max-restarts 0" in p.stderr


def test_restart_budget_is_the_jobs_so_every_node_agrees(tmp_path: Path, rdzv: Rendezvous) -> None:
    args = ("--nnodes", "2", "--nproc-per-node", "1", *rdzv.args)
    args += ("--rdzv-id", f"budget-{rdzv.backend}", "--max-restarts", "1", FAIL_ONCE)
    env = {"DUMP_DIR": str(tmp_path), "FAIL_RANK": "0"}
    agents = [Proc(agent_cmd(*args), env=env) for _ in range(2)]
    try:
        for a in agents:
            assert a.wait(timeout=60) == 0, a.stderr
    finally:
        for a in agents:
            a.kill()
    seen = attempts(tmp_path)
    assert (0, 0) in seen and (0, 1) in seen
    # the node whose worker did not fail also sees restart count 1 (torchrun would say 0);
    # its first attempt may have been stopped before it got to write its line
    assert (1, 1) in seen and max(c for r, c in seen if r == 1) == 1


def test_record_decorated_worker_error_appears_in_summary(tmp_path: Path) -> None:
    p = run(agent_cmd("--standalone", "--nproc-per-node", "1", str(WORKERS / "record_raise.py")), {})
    assert p.p.returncode == 1
    assert "Root Cause" in p.stderr
    assert "boom from rank 0" in p.stderr


def test_sigkill_of_agent_leaves_no_worker_alive(tmp_path: Path) -> None:
    a = Proc(agent_cmd("--standalone", "--nproc-per-node", "2", SLEEPER), env={"DUMP_DIR": str(tmp_path)})
    try:
        a.wait_for_line(r"started 1 ", stream="out", timeout=30)
        a.wait_for_line(r"started 0 ", stream="out", timeout=30)
        pids = [s[2] for s in started(tmp_path)]
        assert len(pids) == 2
        os.kill(a.p.pid, signal.SIGKILL)  # the agent alone, not its session
        assert wait_dead(pids, within=2.0) == []
    finally:
        a.kill()


@pytest.mark.parametrize("ignore_term", [False, True])
def test_sigterm_reaches_workers_before_sigkill(tmp_path: Path, ignore_term: bool) -> None:
    env = {"DUMP_DIR": str(tmp_path)}
    if ignore_term:
        env["IGNORE_TERM"] = "1"
    # Real seconds, kept: with ignore_term the agent waits the whole grace, which must let a
    # loaded worker's SIGTERM handler run before the SIGKILL (1 s is that margin). The group's
    # escalation rule is tests/node_agent/test_supervisor.py's (a 0.5 s grace, in-process).
    a = Proc(agent_cmd("--standalone", "--nproc-per-node", "2", "--shutdown-timeout", "1", SLEEPER), env=env)
    try:
        a.wait_for_line(r"started 1 ", stream="out", timeout=30)
        a.wait_for_line(r"started 0 ", stream="out", timeout=30)
        pids = [s[2] for s in started(tmp_path)]
        a.signal(signal.SIGTERM)
        rc = a.wait(timeout=30)
    finally:
        a.kill()
    assert rc == 1  # as torchrun: a signal ends the job with a failure
    assert "received SIGTERM" in a.stderr
    for pid in pids:
        assert (tmp_path / f"sigterm-{pid}").exists(), f"worker {pid} never saw SIGTERM"
    assert wait_dead(pids, within=2.0) == []


def test_drained_node_leaves_without_using_a_restart(tmp_path: Path, rdzv: Rendezvous) -> None:
    args = ("--nnodes", "1:2", "--nproc-per-node", "1", *rdzv.args)
    args += ("--rdzv-id", f"drain-{rdzv.backend}", "--rdzv-conf", "last_call_timeout=1", SLEEPER)
    a = Proc(agent_cmd(*args), env={"DUMP_DIR": str(tmp_path), "SLEEP_EXIT": "120"})
    b = Proc(agent_cmd(*args), env={"DUMP_DIR": str(tmp_path), "SLEEP_EXIT": "120"})
    try:
        for x in (a, b):
            x.wait_for_line(r"started \d 2 ", stream="out", timeout=30)
        b_pid = next(s[2] for s in started(tmp_path) if s[1] == 2 and f"started {s[0]} 2 {s[2]}" in b.stdout)
        b.signal(signal.SIGTERM)
        assert b.wait(timeout=30) == 0, b.stderr
        assert "drained" in b.stderr
        assert (tmp_path / f"sigterm-{b_pid}").exists()
        a.wait_for_line(r"started 0 1 \d+ 0", stream="out", timeout=30)  # world 1, restart count 0
    finally:
        for x in (a, b):
            x.kill()
    rdzv.server_logs(r"job drain-c10d: node .* left \(drain", timeout=5)


def test_spare_replaces_a_lost_node_and_world_size_stays(tmp_path: Path, rdzv: Rendezvous) -> None:
    args = ("--nnodes", "2", "--nproc-per-node", "1", *rdzv.args)
    args += ("--rdzv-id", f"spare-{rdzv.backend}", SLEEPER)
    env = {"DUMP_DIR": str(tmp_path)}
    a, b = Proc(agent_cmd(*args), env=env), Proc(agent_cmd(*args), env=env)
    spare = None
    try:
        for x in (a, b):
            x.wait_for_line(r"started \d 2 ", stream="out", timeout=30)
        spare = Proc(agent_cmd(*args), env=env)
        spare.wait_for_line(r"spare", timeout=30)
        b.kill()
        spare.wait_for_line(r"started \d 2 \d+ 0", stream="out", timeout=30)
        # our server sees the connection drop; etcd sees the node's lease expire
        a.wait_for_line(r"re-rendezvous after round 0: node .* (connection|lease)", timeout=30)
    finally:
        for x in (a, b, spare):
            if x is not None:
                x.kill()
    worlds = {s[1] for s in started(tmp_path)}
    assert worlds == {2}


def test_failing_health_check_never_joins(tmp_path: Path) -> None:
    p = run(
        agent_cmd("--standalone", "--health-check", "echo gpu 3 missing; exit 7", SLEEPER),
        {"DUMP_DIR": str(tmp_path)},
    )
    assert p.p.returncode == 1
    assert "health check failed" in p.stderr and "gpu 3 missing" in p.stderr
    assert started(tmp_path) == []


def test_flaky_node_is_excluded_and_the_job_finishes_without_it(tmp_path: Path, rdzv: Rendezvous) -> None:
    args = ("--nnodes", "1:2", "--nproc-per-node", "1", *rdzv.args)
    args += (
        "--rdzv-id",
        f"flaky-{rdzv.backend}",
        "--max-restarts",
        "3",
        "--rdzv-conf",
        "last_call_timeout=5,exclude_after=2",
    )
    release = tmp_path / "release"
    # The good node's workers run until the bad node is gone; then the round without it finishes.
    good = Proc(agent_cmd(*args, SLEEPER), env={"DUMP_DIR": str(tmp_path), "EXIT_WHEN_FILE": str(release)})
    bad = Proc(agent_cmd(*args, SLEEPER), env={"DUMP_DIR": str(tmp_path), "FAIL_ALWAYS": "1"})
    try:
        assert bad.wait(timeout=60) == 1
        assert "excluded" in bad.stderr and "failed 2 times" in bad.stderr
        release.touch()
        assert good.wait(timeout=60) == 0, good.stderr
    finally:
        release.touch()
        good.kill()
        bad.kill()
    rdzv.server_logs(r"job flaky-c10d: node .* excluded", timeout=5)
    assert any(s[1] == 1 for s in started(tmp_path))


def test_elastic_grow_then_shrink_with_checkpointed_gloo_training(tmp_path: Path, rdzv: Rendezvous) -> None:
    total = 60
    args = ("--nnodes", "2:3", "--nproc-per-node", "1", *rdzv.args)
    args += ("--rdzv-id", f"grow-{rdzv.backend}", "--max-restarts", "3", "--rdzv-conf", "last_call_timeout=1")
    args += (str(WORKERS / "elastic_train.py"),)
    env = {"DUMP_DIR": str(tmp_path), "TOTAL_STEPS": str(total), "STEP_TIME": "0.15"}
    a, b = Proc(agent_cmd(*args), env=env), Proc(agent_cmd(*args), env=env)
    c = None
    try:
        a.wait_for_line(r"step \d+ world=2", stream="out", timeout=60)
        c = Proc(agent_cmd(*args), env=env)
        a.wait_for_line(r"step \d+ world=3", stream="out", timeout=60)
        c.kill()  # SIGKILL the whole third node
        seen = len(a.out)
        # Our server sees the connection drop at once. etcd notices a dead node only when its
        # lease expires, so there a collective failing first may count as a worker failure.
        lost = "node .* (connection|silent)" if rdzv.backend == "c10d" else "(node .* lease|worker failure)"
        a.wait_for_line(rf"re-rendezvous after round 1: {lost}", timeout=30)
        assert any("world=3" in line for line in a.out[:seen])
        for x in (a, b):
            assert x.wait(timeout=90) == 0, x.stderr
    finally:
        for x in (a, b, c):
            if x is not None:
                x.kill()
    done = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("done-*.json"))]
    assert sorted(d["rank"] for d in done) == [0, 1]
    assert all(d["step"] == total and d["world"] == 2 for d in done)
    assert json.loads((tmp_path / "ckpt.json").read_text())["step"] == total
    starts = (tmp_path / "progress.txt").read_text()
    worlds = [
        int(line.split("world=")[1].split()[0]) for line in starts.splitlines() if line.startswith("start")
    ]
    # started at 2, grew to 3, shrank back to 2; each restart resumed from the checkpoint
    assert worlds[:2] == [2, 2] and 3 in worlds and worlds[-1] == 2
    resumed = [int(line.rsplit("step=", 1)[1]) for line in starts.splitlines() if line.startswith("start")]
    assert max(resumed) > 0
