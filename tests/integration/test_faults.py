"""Faults found by a seeded campaign against one elastic job, each reproduced with real processes.

A real ``rdzv-server`` (``--state-dir`` where the fault needs it), real ``node-agent``
processes on 127.0.0.1, and ``workers/faults_worker.py``, which leaves marker files: when it
started and which workers that started before it were still alive then, when it got SIGTERM,
when it exited. The tests compare those, so they assert the order of events, never timings.
Every wait is bounded, and waits for a line or a file rather than for time to pass.

- The server going away (SIGTERM, the upgrade path) while an agent stops its workers for a
  restart: the agent finishes stopping them, reconnects to the next server on the state dir
  and joins the next round (it used to exit 1, leaving the other node waiting for ever).
- An agent frozen (SIGSTOP) past its heartbeat timeout with a Restart queued: thawed, it stops
  its workers and joins again (it used to exit 1).
- A worker failure while the server is down: reported when the server is back, which decides
  (it used to be a deliberate exit 1).
- A drain: the next round starts only after the drained node's workers have exited (it used
  to start while a drained rank 0 was still writing its checkpoint).
- A node waiting to be admitted when the server restarts: no round completes without it while
  it is away, and it is in the next one when it is back (a round used to complete with it,
  its ranks never ran, and everyone restarted again when it came back).
"""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .procs import WORKERS, Proc, agent_cmd, server_cmd, start_server

WORKER = str(WORKERS / "faults_worker.py")


def starts(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("start-*.json"))]


def wait_until(check: Callable[[], Any], what: str | Callable[[], str], within: float = 60.0) -> Any:
    """Poll a condition on what other processes write (there is no event to wait on)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"not within {within} s: {what if isinstance(what, str) else what()}")


def wait_starts(
    folder: Path, n: int, *, world: int, restart: int | None = None, within: float = 60.0
) -> list[dict[str, Any]]:
    def found() -> list[dict[str, Any]]:
        rows = [
            r for r in starts(folder) if r["world"] == world and (restart is None or r["restart"] == restart)
        ]
        return rows if len(rows) >= n else []

    return wait_until(found, f"{n} worker(s) of world size {world} started", within)


def job_status(port: int, job: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/jobs/{job}", timeout=5) as resp:
        return json.loads(resp.read())


def restart_server(port: int, state: Path) -> Proc:
    again = Proc(server_cmd("--host", "127.0.0.1", "--port", str(port), "--state-dir", str(state)))
    again.wait_for_line(r"listening on", timeout=20)
    return again


def explain(agents: list[Proc], *servers: Proc | None) -> str:
    parts = [f"agent {i}:\n{a.stderr}" for i, a in enumerate(agents)]
    parts += [f"server:\n{s.stderr}" for s in servers if s is not None]
    return "\n---\n".join(parts)


def finish(release: Path, agents: list[Proc], *servers: Proc | None) -> None:
    """Release the workers: every agent exits 0, and none logged an error."""
    release.touch()
    for a in agents:
        assert a.wait(timeout=60) == 0, explain(agents, *servers)
    for a in agents:
        assert "ERROR" not in a.stderr and "Traceback" not in a.stderr, a.stderr


def stop(*procs: Proc | None) -> None:
    for p in procs:
        if p is not None:
            p.kill()


def by_group_rank(agents: list[Proc], world: int) -> list[Proc]:
    for a in agents:
        a.wait_for_line(rf"round 0: group rank \d of {world}", timeout=60)
    return sorted(agents, key=lambda a: int(a.wait_for_line(r"round 0: group rank (\d)").group(1)))


def rank_of(agent: Proc, world: int) -> int:
    """The global rank of an agent's (only) worker, from the line the worker prints."""
    return int(
        agent.wait_for_line(rf"faults: rank (\d) of {world} started", stream="out", timeout=60).group(1)
    )


def test_the_server_going_away_while_an_agent_stops_its_workers_for_a_restart(tmp_path: Path) -> None:
    state = tmp_path / "state"
    srv, port = start_server("--state-dir", str(state))
    again: Proc | None = None
    linger, fail, release = tmp_path / "linger", tmp_path / "fail", tmp_path / "release"
    dump = tmp_path / "dump"
    dump.mkdir()
    env = {
        "DUMP_DIR": str(dump),
        "RELEASE_FILE": str(release),
        "FAIL_FILE": str(fail),
        "FAIL_RANK": "1",
        "LINGER_FILE": str(linger),  # a SIGTERM'd worker stays until the test lets it go
    }
    args = ("--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1")
    args += ("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "faults-going-away", WORKER)
    agents = [Proc(agent_cmd(*args), env=env) for _ in range(2)]
    try:
        stopper, _ = by_group_rank(agents, 2)  # rank 0 is stopped for the restart rank 1 causes
        (first,) = [r for r in wait_starts(dump, 2, world=2) if r["rank"] == 0]
        fail.touch()
        wait_until(lambda: (dump / f"term-{first['pid']}").exists(), "rank 0 told to stop for the restart")
        srv.signal(signal.SIGTERM)  # the documented upgrade path, mid re-rendezvous
        assert srv.wait(timeout=15) == 0, srv.stderr
        stopper.wait_for_line(
            r"going away \(received SIGTERM\); workers are being stopped; this node joins", timeout=10
        )
        stopper.wait_for_line(r"lost the connection .* reconnecting", timeout=10)
        linger.touch()  # its worker finishes "checkpointing" while no server runs
        wait_until(lambda: (dump / f"exited-{first['pid']}").exists(), "rank 0's worker exited")
        assert stopper.p.poll() is None, stopper.stderr  # it used to exit 1 here
        again = restart_server(port, state)
        rows = wait_starts(dump, 2, world=2, restart=1)
        assert sorted(r["rank"] for r in rows) == [0, 1]
        assert all(r["alive_before"] == [] for r in rows), rows
        finish(release, agents, srv, again)
    finally:
        stop(*agents, srv, again)


def test_an_agent_frozen_past_its_heartbeat_with_a_restart_queued_rejoins_when_thawed(tmp_path: Path) -> None:
    srv, port = start_server()
    fail, release = tmp_path / "fail", tmp_path / "release"
    env = {"DUMP_DIR": str(tmp_path), "RELEASE_FILE": str(release), "FAIL_FILE": str(fail), "FAIL_RANK": "1"}
    args = ("--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "2")
    args += ("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "faults-frozen")
    # Real seconds, kept: the agent must stay frozen past a heartbeat timeout that exceeds
    # scheduling noise. The agent's rule is scripted on a fake clock in tests/node_agent/
    # machine/test_link.py::test_a_restart_queued_behind_a_frozen_agent_ends_in_a_rejoin_once_it_is_back.
    args += ("--rdzv-conf", "heartbeat_timeout=3", WORKER)
    agents = [Proc(agent_cmd(*args), env=env) for _ in range(2)]
    try:
        frozen, _ = by_group_rank(agents, 2)
        wait_starts(tmp_path, 2, world=2)
        frozen.signal(signal.SIGSTOP)
        fail.touch()  # rank 1 fails: the server's Restart waits in the frozen agent's socket
        srv.wait_for_line(r"job faults-frozen: round 0: rank 1 .* failed .*; restart 1 of 2", timeout=30)
        srv.wait_for_line(r"job faults-frozen: node .* went silent", timeout=30)
        frozen.signal(signal.SIGCONT)
        frozen.wait_for_line(r"lost the connection .* reconnecting", timeout=30)
        rows = wait_starts(tmp_path, 2, world=2, restart=1)
        assert sorted(r["rank"] for r in rows) == [0, 1]
        assert all(r["alive_before"] == [] for r in rows), rows
        finish(release, agents, srv)
    finally:
        stop(*agents, srv)


def test_a_worker_failure_while_the_server_is_down_is_reported_when_it_is_back(tmp_path: Path) -> None:
    state = tmp_path / "state"
    srv, port = start_server("--state-dir", str(state))
    again: Proc | None = None
    fail, release = tmp_path / "fail", tmp_path / "release"
    env = {"DUMP_DIR": str(tmp_path), "RELEASE_FILE": str(release), "FAIL_FILE": str(fail), "FAIL_RANK": "1"}
    args = ("--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1")
    args += ("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "faults-down", WORKER)
    agents = [Proc(agent_cmd(*args), env=env) for _ in range(2)]
    try:
        _, failing = by_group_rank(agents, 2)
        wait_starts(tmp_path, 2, world=2)
        srv.signal(signal.SIGKILL)
        srv.wait(timeout=10)
        for a in agents:
            a.wait_for_line(r"lost the connection .* workers keep running; reconnecting", timeout=10)
        fail.touch()
        failing.wait_for_line(r"a worker failed while the rendezvous server is unreachable", timeout=30)
        assert failing.p.poll() is None, failing.stderr  # it used to exit 1 here
        again = restart_server(port, state)
        again.wait_for_line(
            r"job faults-down: round 0: rank 1 .* failed with exit code 1; restart 1 of 1", timeout=30
        )
        rows = wait_starts(tmp_path, 2, world=2, restart=1)
        assert sorted(r["rank"] for r in rows) == [0, 1]
        finish(release, agents, srv, again)
    finally:
        stop(*agents, srv, again)


def test_the_next_round_starts_only_after_a_drained_nodes_workers_have_exited(tmp_path: Path) -> None:
    srv, port = start_server()
    release = tmp_path / "release"
    env = {"DUMP_DIR": str(tmp_path), "RELEASE_FILE": str(release)}
    args = ("--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}")
    args += ("--rdzv-id", "faults-drain", "--rdzv-conf", "last_call_timeout=1", WORKER)
    survivor = Proc(agent_cmd(*args), env=env)
    # The drained node's worker writes its "checkpoint" for 2 s after SIGTERM.
    drained = Proc(agent_cmd(*args), env={**env, "LINGER": "2"})
    try:
        rank = rank_of(drained, 2)
        (old,) = [r for r in wait_starts(tmp_path, 2, world=2) if r["rank"] == rank]
        drained.signal(signal.SIGTERM)
        assert drained.wait(timeout=60) == 0, explain([survivor, drained], srv)
        assert "goes on without this node (1 node(s) remain" in drained.stderr
        (new,) = wait_starts(tmp_path, 1, world=1)
        assert (tmp_path / f"term-{old['pid']}").exists() and (tmp_path / f"exited-{old['pid']}").exists()
        # The survivor's new worker started after every worker of the round before had exited.
        assert new["alive_before"] == [], (new, old)
        srv.wait_for_line(r"job faults-drain: node .* leaves once its workers have exited", timeout=5)
        finish(release, [survivor], srv)
    finally:
        stop(survivor, drained, srv)


def test_a_node_waiting_to_be_admitted_when_the_server_restarts_is_in_the_next_round(tmp_path: Path) -> None:
    state = tmp_path / "state"
    srv, port = start_server("--state-dir", str(state))
    again: Proc | None = None
    release = tmp_path / "release"
    env = {"DUMP_DIR": str(tmp_path), "RELEASE_FILE": str(release)}
    job = "faults-admit"
    # heartbeat_timeout 15 s: the restarted server waits 30 s for agents to come back, far
    # more than this test needs, so the frozen newcomer is never dropped for being late.
    args = ("--nnodes", "2:4", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}")
    args += ("--rdzv-id", job, "--rdzv-conf", "last_call_timeout=4,heartbeat_timeout=15", WORKER)
    agents = [Proc(agent_cmd(*args), env=env) for _ in range(2)]
    newcomer: Proc | None = None
    try:
        wait_starts(tmp_path, 2, world=2)
        newcomer = Proc(agent_cmd(*args), env=env)
        newcomer.wait_for_line(r"waiting for nodes: 3 of 2:4 joined \(joining a running job\)", timeout=60)
        # Within its 4 s settle window: freeze it (it cannot come back quickly), kill the server.
        newcomer.signal(signal.SIGSTOP)
        srv.signal(signal.SIGKILL)
        srv.wait(timeout=10)
        again = restart_server(port, state)
        for a in agents:
            a.wait_for_line(r"re-rendezvous after round 0", timeout=60)

        def rejoined() -> dict[str, Any] | None:
            s = job_status(port, job)
            states = {m["node_id"]: m["state"] for m in s["members"] if m["role"] == "member"}
            done = sum(1 for v in states.values() if v in ("ready", "running")) >= 2
            return s if done and s["round"] == 1 else None

        status = wait_until(
            rejoined, lambda: f"the two resumed nodes joined round 1: {job_status(port, job)}", within=60
        )
        # The newcomer is away: no round may complete without it.
        assert status["phase"] == "gathering", explain(agents, again)
        assert sorted(m["state"] for m in status["members"] if m["role"] == "member") == [
            "ready",
            "ready",
            "waiting",
        ]
        newcomer.signal(signal.SIGCONT)
        rows = wait_starts(tmp_path, 3, world=3)
        assert sorted(r["rank"] for r in rows) == [0, 1, 2]
        assert all(r["alive_before"] == [] for r in rows), rows
        again.wait_for_line(rf"job {job}: round 1 complete: 3 nodes", timeout=10)
        finish(release, [*agents, newcomer], again)
        assert "came back without its round" not in again.stderr
        assert "round 2" not in again.stderr  # nobody restarted again
    finally:
        stop(*agents, newcomer, srv, again)
