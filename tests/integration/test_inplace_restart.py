"""Restarts in place end to end (issue 44): real agents, real gloo ranks under ``worker.run``.

The worker (``workers/inplace_train.py``) is deterministic: any run resumed from a snapshot
ends with the parameters of an uninterrupted run, which the tests check. Each test also reads
every attempt's pid: a survivor's must not change, only the lost rank's process is new.

- One node, two ranks: a rank exits 1, raises its own exception, or hangs (in Python, while
  the other waits in a gloo all_reduce); the job resumes from the snapshot in place.
- Failures in a row: rank 1 exits twice; rank 0 runs all three attempts in one process.
- A survivor that cannot leave its attempt (the park signal blocked, asleep) is stopped after
  the park's bound and replaced, as without ``worker.run``.
- Two nodes with a spare: a node is SIGKILLed; the survivor keeps its process, the spare runs
  the lost rank.
- Two nodes of a 1:2 job: a node is SIGKILLed; the survivor goes on alone, in place, at the
  smaller world (from step 0: snapshots restore at their own world size only).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from .live_job import wait_until
from .procs import WORKERS, Proc, agent_cmd, start_server
from .resumed_runs import at_step, final, kept_step, rank_of, same, starts

torch = pytest.importorskip("torch")

SCRIPT = str(WORKERS / "inplace_train.py")
STEPS = 30
FAULT_STEP = 12
JOB_BOUND = 150.0


def _env(tmp: Path, **kw: str) -> dict[str, str]:
    env = {"DUMP_DIR": str(tmp), "STEPS": str(STEPS), "GLOO_SOCKET_IFNAME": "lo", "STEP_S": "0.03"}
    env.update(kw)
    return env


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list]:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    p = Proc(agent_cmd("--standalone", "--nproc-per-node", "2", SCRIPT), env=_env(tmp))
    assert p.wait(timeout=JOB_BOUND) == 0, p.stderr
    return {r: final(tmp, r) for r in (0, 1)}


@pytest.mark.parametrize(
    ("fault", "in_place"),
    [("exit", [0]), ("raise", [0]), ("hang", [0, 1])],
    ids=["a-rank-exits-1", "a-rank-raises-its-own-error", "a-rank-hangs"],
)
def test_one_node_restarts_only_the_lost_rank(
    tmp_path: Path, uninterrupted: dict, fault: str, in_place: list[int]
) -> None:
    # A hang budget only where the fault is a hang, and not a tight one: on a loaded machine the
    # last step's save and the process group's teardown have outlasted 4 s (issue 48).
    hang = ("--hang-timeout", "8") if fault == "hang" else ()
    argv = agent_cmd("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", *hang, SCRIPT)
    p = Proc(argv, env=_env(tmp_path, FAULT=fault, FAULT_STEP=str(FAULT_STEP), FAULT_RANK="1"))
    assert p.wait(timeout=JOB_BOUND) == 0, p.stderr
    assert f"({len(in_place)} in place: local ranks {in_place})" in p.stderr, p.stderr
    assert "every rank restores the in-memory snapshot of step 12" in p.stderr, p.stderr
    for rank in (0, 1):
        runs = starts(tmp_path, rank)
        assert [s["start"] for s in runs] == [0, FAULT_STEP + 1], runs
        same_pid = runs[0]["pid"] == runs[1]["pid"]
        assert same_pid == (rank in in_place), (rank, runs)
        assert same(final(tmp_path, rank), uninterrupted[rank]), rank


def test_a_survivor_writes_the_new_attempt_s_log_files(tmp_path: Path) -> None:
    """``--redirects 1 --tee 2``: stdout goes straight to its file (the survivor reopens the
    new attempt's), stderr passes through the agent (which switches the file): each attempt's
    files hold that attempt's lines only, as for a worker started afresh."""
    logs = tmp_path / "logs"
    argv = agent_cmd(
        "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--redirects", "1", "--tee", "2",
        "--log-dir", str(logs), SCRIPT,
    )  # fmt: skip
    p = Proc(argv, env=_env(tmp_path, FAULT="exit", FAULT_STEP=str(FAULT_STEP), FAULT_RANK="1"))
    assert p.wait(timeout=JOB_BOUND) == 0, p.stderr
    assert "(1 in place: local ranks [0])" in p.stderr, p.stderr
    runs = starts(tmp_path, 0)
    assert len(runs) == 2 and runs[0]["pid"] == runs[1]["pid"], runs
    pid = runs[0]["pid"]
    (run_dir,) = logs.iterdir()
    for attempt, start in ((0, 0), (1, FAULT_STEP + 1)):
        folder = run_dir / f"attempt_{attempt}" / "0"
        out = (folder / "stdout.log").read_text()
        err = (folder / "stderr.log").read_text()
        assert out.splitlines() == [f"attempt of pid {pid} from step {start}"], (attempt, out)
        assert f"attempt of pid {pid} from step {start} (stderr)" in err.splitlines(), (attempt, err)
        assert "(stderr)" not in out and err.count("attempt of pid") == 1, (attempt, err)


def _node(port: int, tmp: Path, tag: str, nnodes: str, **env: str) -> Proc:
    argv = agent_cmd(
        "--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "inplace", "--max-restarts", "2", SCRIPT,
    )  # fmt: skip
    return Proc(argv, env=_env(tmp, NODE_TAG=tag, **env))


def _kill_one_at_step_15(tmp: Path, nodes: dict[str, Proc], gate: Path, port: int) -> str:
    """Once both ranks snapshotted step 15 (training waits there) and its replicas are in,
    SIGKILL rank 1's node (agent and worker); returns the surviving node of the two."""
    wait_until("both ranks at step 15", lambda: at_step(15, [nodes["a"], nodes["b"]]), JOB_BOUND)
    wait_until("step 15 kept", lambda: kept_step(port) >= 15, 30)
    lost = next(t for t in ("a", "b") if rank_of(tmp, t) == 1)
    kept = "b" if lost == "a" else "a"
    os.killpg(nodes[lost].p.pid, signal.SIGKILL)
    gate.touch()
    return kept


def test_a_node_killed_with_a_spare_waiting_keeps_the_survivor_s_process(
    tmp_path: Path, uninterrupted: dict
) -> None:
    srv, port = start_server()
    gate = tmp_path / "go"
    nodes: dict[str, Proc] = {}
    try:
        for tag in ("a", "b"):
            nodes[tag] = _node(port, tmp_path, tag, "2", WAIT_FILE=str(gate), WAIT_STEP="15")
        for tag in ("a", "b"):  # round 0 formed of a and b: c can only be the spare
            nodes[tag].wait_for_line("started 1 worker", timeout=60)
        nodes["c"] = _node(port, tmp_path, "c", "2")
        nodes["c"].wait_for_line("spare", timeout=60)
        kept = _kill_one_at_step_15(tmp_path, nodes, gate, port)
        for t in (kept, "c"):
            assert nodes[t].wait(timeout=JOB_BOUND) == 0, nodes[t].stderr
        assert "(1 in place: local ranks [0])" in nodes[kept].stderr, nodes[kept].stderr
    finally:
        for p in nodes.values():
            p.kill()
        srv.kill()
    survivor = rank_of(tmp_path, kept)
    runs = starts(tmp_path, survivor)
    assert len({s["pid"] for s in runs}) == 1, runs  # one process, two attempts
    for rank in (0, 1):
        last = starts(tmp_path, rank)[-1]
        assert last["start"] == 16 and last["world"] == 2, last
        assert same(final(tmp_path, rank), uninterrupted[rank]), rank


def test_a_node_lost_in_an_elastic_job_leaves_the_survivor_training_alone_in_place(tmp_path: Path) -> None:
    srv, port = start_server()
    gate = tmp_path / "go"
    nodes: dict[str, Proc] = {}
    try:
        for tag in ("a", "b"):
            nodes[tag] = _node(port, tmp_path, tag, "1:2", WAIT_FILE=str(gate), WAIT_STEP="15")
        kept = _kill_one_at_step_15(tmp_path, nodes, gate, port)
        assert nodes[kept].wait(timeout=JOB_BOUND) == 0, nodes[kept].stderr
        assert "(1 in place: local ranks [0])" in nodes[kept].stderr, nodes[kept].stderr
    finally:
        for p in nodes.values():
            p.kill()
        srv.kill()
    runs = starts(tmp_path, 0)
    assert len({s["pid"] for s in runs}) == 1, runs
    # Snapshots restore at their own world size only (docs/snapshots.md): alone, it starts over.
    assert (runs[-1]["world"], runs[-1]["start"]) == (1, 0), runs
    assert (tmp_path / "final-0.pt").exists()


def test_a_survivor_that_cannot_leave_its_attempt_is_stopped_and_replaced(tmp_path: Path) -> None:
    argv = agent_cmd(
        "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", str(WORKERS / "inplace_stuck.py")
    )  # fmt: skip
    p = Proc(argv, env={"DUMP_DIR": str(tmp_path)})
    assert p.wait(timeout=JOB_BOUND) == 0, p.stderr
    assert "stopping 1 worker(s) with SIGTERM" in p.stderr and "in place" not in p.stderr, p.stderr
    rows = [line.split() for line in (tmp_path / "attempts").read_text().splitlines()]
    pids = {(rank, restart): pid for rank, pid, restart in rows}
    assert set(pids) == {("0", "0"), ("1", "0"), ("0", "1"), ("1", "1")}, rows
    assert pids[("0", "0")] != pids[("0", "1")] and pids[("1", "0")] != pids[("1", "1")], rows


def test_failures_in_a_row_keep_the_survivor_in_one_process(tmp_path: Path, uninterrupted: dict) -> None:
    argv = agent_cmd("--standalone", "--nproc-per-node", "2", "--max-restarts", "2", SCRIPT)
    p = Proc(argv, env=_env(tmp_path, FAULT="exit", FAULT_STEP="12,20", FAULT_RANK="1"))
    assert p.wait(timeout=JOB_BOUND) == 0, p.stderr
    assert p.stderr.count("(1 in place: local ranks [0])") == 2, p.stderr
    survivor, lost = starts(tmp_path, 0), starts(tmp_path, 1)
    assert [s["start"] for s in survivor] == [s["start"] for s in lost] == [0, 13, 21], (survivor, lost)
    assert len({s["pid"] for s in survivor}) == 1 and len({s["pid"] for s in lost}) == 3
    for rank in (0, 1):
        assert same(final(tmp_path, rank), uninterrupted[rank]), rank
