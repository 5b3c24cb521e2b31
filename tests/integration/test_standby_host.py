"""No node is special (issue 45): a job whose agents host the rendezvous goes on when the agent
hosting it is lost. Real agents on loopback, the first hosting as torchrun's c10d does, real gloo
training; the host's whole node (agent and workers) is SIGKILLed."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

from .live_job import wait_until
from .procs import ROOT, WORKERS, Proc, agent_cmd, free_port, server_cmd

TOTAL = 60


def _args(
    port: int, nnodes: str, job: str, script: str, *, last_call: int = 0, restarts: int = 3
) -> tuple[str, ...]:
    """An agent's launch line: one worker of ``script``, the first agent hosting at ``port``."""
    args = ("--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}")
    args += ("--rdzv-id", job, "--max-restarts", str(restarts))
    if last_call:
        args += ("--rdzv-conf", f"last_call_timeout={last_call}")
    return (*args, str(WORKERS / script))


def _worlds(folder: Path) -> list[int]:
    lines = (folder / "progress.txt").read_text().splitlines()
    return [int(line.split("world=")[1].split()[0]) for line in lines if line.startswith("start")]


def _status(port: int, job: str) -> dict[str, Any]:
    """``rdzv-server status --json`` of ``job`` as an operator asks it of an agent's port."""
    argv = server_cmd("status", "--endpoint", f"127.0.0.1:{port}", "--job", job, "--json")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def test_the_job_goes_on_when_the_node_hosting_its_rendezvous_dies(tmp_path: Path) -> None:
    """Also what an operator sees: ``rdzv-server status`` asked of the hosting agent's port
    answers (HTTP set up at that first request), and after the take-over the new host's port
    answers, its history saying who took over the rendezvous from which lost node."""
    port = free_port()
    args = _args(port, "1:2", "standby", "elastic_train.py", last_call=1)
    env = {"DUMP_DIR": str(tmp_path), "TOTAL_STEPS": str(TOTAL), "STEP_TIME": "0.1"}
    host = Proc(agent_cmd(*args), env=env)
    other = None
    try:
        host.wait_for_line("this agent hosts it", timeout=30)
        other = Proc(agent_cmd(*args), env=env)
        other.wait_for_line(r"step [5-9] world=2", stream="out", timeout=90)
        before = _status(port, "standby")
        assert before["phase"] == "running" and len(before["members"]) == 2, before
        host.kill()  # the whole node: the agent, the rendezvous it hosts, its workers
        took_over = r"host \(node (\S+)\) is gone: this node hosts the rendezvous now, on port (\d+)"
        moved = other.wait_for_line(took_over, timeout=60)
        assert moved[1] in {m["node_id"] for m in before["members"]}, (moved[0], before["members"])
        after = _status(int(moved[2]), "standby")
        took = [e["text"] for e in after["history"] if e["kind"] == "takeover"]
        assert len(took) == 1 and f"node {moved[1]}, which hosted it, is lost" in took[0], after["history"]
        assert other.wait(timeout=120) == 0, other.stderr
    finally:
        host.kill()
        if other is not None:
            other.kill()
    # The survivor said who was lost and that it hosts the rendezvous now, then finished alone.
    assert "the rendezvous host (node " in other.stderr
    assert "this node hosts the rendezvous now" in other.stderr
    done = json.loads((tmp_path / "done-0.json").read_text())
    assert done == {"rank": 0, "world": 1, "step": TOTAL}
    worlds = _worlds(tmp_path)
    assert worlds[:2] == [2, 2] and worlds[-1] == 1
    # it resumed from the checkpoint, not from step 0
    starts = [
        line for line in (tmp_path / "progress.txt").read_text().splitlines() if line.startswith("start")
    ]
    assert int(starts[-1].rsplit("step=", 1)[1]) > 0


def test_with_three_nodes_the_first_standby_hosts_and_the_other_finds_it(tmp_path: Path) -> None:
    port = free_port()
    args = _args(port, "2:3", "standby3", "elastic_train.py", last_call=2)
    env = {"DUMP_DIR": str(tmp_path), "TOTAL_STEPS": str(TOTAL), "STEP_TIME": "0.1"}
    host = Proc(agent_cmd(*args), env=env)
    others: list[Proc] = []
    try:
        host.wait_for_line("this agent hosts it", timeout=30)
        others = [Proc(agent_cmd(*args), env=env) for _ in range(2)]
        others[0].wait_for_line(r"step [5-9] world=3", stream="out", timeout=60)
        host.kill()
        for p in others:
            assert p.wait(timeout=50) == 0, p.stderr
    finally:
        for p in (host, *others):
            p.kill()
    took = [p for p in others if "this node hosts the rendezvous now" in p.stderr]
    assert len(took) == 1
    (follower,) = [p for p in others if p is not took[0]]
    assert "the rendezvous moved: node " in follower.stderr
    done = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("done-*.json"))]
    assert sorted(d["rank"] for d in done) == [0, 1]
    assert all(d["world"] == 2 and d["step"] == TOTAL for d in done)
    assert _worlds(tmp_path)[-1] == 2


def test_a_spare_takes_the_lost_hosts_place_in_a_fixed_size_job(tmp_path: Path) -> None:
    port = free_port()
    args = _args(port, "2", "standby-spare", "elastic_train.py")
    env = {"DUMP_DIR": str(tmp_path), "TOTAL_STEPS": str(TOTAL), "STEP_TIME": "0.1"}
    host = Proc(agent_cmd(*args), env=env)
    member = spare = None
    try:
        host.wait_for_line("this agent hosts it", timeout=30)
        member = Proc(agent_cmd(*args), env=env)
        member.wait_for_line(r"step [5-9] world=2", stream="out", timeout=90)
        spare = Proc(agent_cmd(*args), env=env)
        spare.wait_for_line("spare", timeout=30)
        host.kill()
        for p in (member, spare):
            assert p.wait(timeout=120) == 0, p.stderr
    finally:
        for p in (host, member, spare):
            if p is not None:
                p.kill()
    assert "this node hosts the rendezvous now" in member.stderr
    assert "the rendezvous moved: node " in spare.stderr
    done = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("done-*.json"))]
    assert sorted(d["rank"] for d in done) == [0, 1]
    assert all(d["world"] == 2 and d["step"] == TOTAL for d in done)


def test_a_fixed_size_job_without_a_spare_ends_naming_the_lost_host(tmp_path: Path) -> None:
    port = free_port()
    args = _args(port, "2", "standby-fixed", "sleeper.py")
    env = {"DUMP_DIR": str(tmp_path)}
    host = Proc(agent_cmd(*args), env=env)
    other = None
    try:
        host.wait_for_line("this agent hosts it", timeout=30)
        other = Proc(agent_cmd(*args), env=env)
        other.wait_for_line("started 1 2 ", stream="out", timeout=60)
        host.kill()
        assert other.wait(timeout=60) == 1, other.stderr
    finally:
        host.kill()
        if other is not None:
            other.kill()
    # Its last line says why, naming the lost host (and nothing was left running: the session
    # of each agent is killed above, and the survivor exited on its own).
    last = other.stderr.strip().splitlines()[-1]
    assert "ERROR: job failed" in last and "which hosted the rendezvous, is lost" in last, other.stderr
    assert "no node took its place" in last and "needs 2 nodes, 1 remain" in last


def test_the_host_and_its_first_standby_lost_together_the_second_standby_hosts(tmp_path: Path) -> None:
    """Four nodes, two standbys: the host and the first standby die at once; the second
    standby's turn comes (the first does not answer), and the fourth node finds it there."""
    port = free_port()
    release = tmp_path / "release"
    args = _args(port, "2:4", "standby2", "sleeper.py", last_call=2)
    env = {"DUMP_DIR": str(tmp_path), "EXIT_WHEN_FILE": str(release)}
    host = Proc(agent_cmd(*args), env=env)
    nodes: list[Proc] = []
    try:
        host.wait_for_line("this agent hosts it", timeout=30)
        nodes = [Proc(agent_cmd(*args), env=env) for _ in range(3)]
        said = nodes[0].wait_for_line(r"it moves to: node (\S+) at \S+, node (\S+) at ", timeout=60)
        by_pid = {p.p.pid: p for p in nodes}
        first, second = (by_pid[int(said.group(k).split(":")[1])] for k in (1, 2))
        (fourth,) = [p for p in nodes if p is not first and p is not second]
        host.kill()
        first.kill()
        second.wait_for_line("this node hosts the rendezvous now", timeout=60)
        fourth.wait_for_line("the rendezvous moved: node ", timeout=60)
        for p in (second, fourth):
            p.wait_for_line(r"round \d+: group rank \d of 2", timeout=60)
        release.touch()
        for p in (second, fourth):
            assert p.wait(timeout=60) == 0, p.stderr
    finally:
        release.touch()
        for p in (host, *nodes):
            p.kill()
    assert "which hosted the rendezvous" in second.stderr or "did not come back" in second.stderr


def test_the_host_lost_while_a_newcomer_waits_to_join_the_next_round_forms_without_it(
    tmp_path: Path,
) -> None:
    """A round change under way: node C has joined the running job of A (the host) and B and
    waits for the last call; A is SIGKILLed then. B takes over (C was told the standbys while
    it waited) and the job goes on with B and C, no failure counted against the job. (Which
    reaches B first decides how: B's own Resume rebuilds the round and C joins it, or C's Join
    starts the job anew at round 0 and B is told to join it: either way a round of both.)"""
    port = free_port()
    release = tmp_path / "release"
    args = _args(port, "1:4", "change", "sleeper.py", last_call=5, restarts=0)
    env = {"DUMP_DIR": str(tmp_path), "EXIT_WHEN_FILE": str(release)}
    host = Proc(agent_cmd(*args), env=env)
    nodes: list[Proc] = []
    try:
        host.wait_for_line("this agent hosts it", timeout=30)
        b = Proc(agent_cmd(*args), env=env)
        nodes.append(b)
        b.wait_for_line(r"round \d+: group rank 1 of 2", timeout=60)
        c = Proc(agent_cmd(*args), env=env)
        nodes.append(c)
        c.wait_for_line(r"waiting for nodes: 3 of 1:4 joined \(joining a running job\)", timeout=60)
        host.kill()
        moved = b.wait_for_line(r"this node hosts the rendezvous now, on port (\d+)", timeout=60)
        c.wait_for_line("the rendezvous moved: node ", timeout=60)
        # B's worker started again in a round of two formed after the take-over; C's in it.
        wait_until("both in a round of two after the take-over", lambda: _after_takeover(b, c), 60)
        took = [e["text"] for e in _status(int(moved[1]), "change")["history"] if e["kind"] == "takeover"]
        assert len(took) == 1 and "which hosted it, is lost" in took[0], took
        release.touch()
        for p in (b, c):
            assert p.wait(timeout=60) == 0, p.stderr
    finally:
        release.touch()
        for p in (host, *nodes):
            p.kill()
    assert "done: all nodes finished" in b.stderr, b.stderr


def _after_takeover(b: Proc, c: Proc) -> bool:
    """B started a worker in a round of two after it took over, and C started one."""
    two = re.compile(r"round \d+: group rank \d of 2, rank \d, world size 2")
    after = b.stderr.split("this node hosts the rendezvous now", 1)[-1]
    return bool(two.search(after) and two.search(c.stderr)) and all(
        "started 1 worker" in text for text in (after, c.stderr)
    )
