"""Commit-point restarts end to end (issue 20): real gloo ranks, torch.distributed.checkpoint,
real agents and a real rdzv-server.

The worker (``workers/train_commit.py``) is deterministic: the state after step n is the same
whatever the world size and however often it resumed, and its logs say which steps each process
ran, what it saved and what it loaded. A 1:2 elastic job checkpoints every 50 steps.

- Scale-up with the commit check: node A trains alone; at about step 60 node B starts. The
  round of two resumes from exactly the commit step S (first step S+1 on both nodes, no step
  run twice, none skipped), the state loaded at S is the state saved at S, the restart count
  stays 0 and the history says "committed at step S".
- Drain with the check (``rdzv-server drain`` of node B, or SIGTERM to B's agent): B's agent
  exits 0, A's next attempt resumes from exactly S.
- The same scale-up without the check: as today (and as torchrun), the round of two resumes
  from step 50, and every step A ran after 50 runs again.
- A node SIGKILLed with in-memory snapshots marked as state every rank holds alike (issue 44):
  the survivor resumes alone from its own newest snapshot, in place or in a fresh worker.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .live_job import get, wait_until
from .procs import ROOT, WORKERS, Proc, agent_cmd, server_cmd, start_server
from .workers.train_commit_log import Attempt, attempts, last_step

SCRIPT = str(WORKERS / "train_commit.py")
EVERY = 50  # the periodic checkpoint interval
STEPS = 120  # the job's total
JOIN_AT = 60  # node B starts once A has done this step
# While A is alone its steps after SLOW_FROM take SLOW_SECONDS: B joins well before step 100
# however slow the machine, and the step time A reports is the slow one by then.
SLOW_FROM, SLOW_SECONDS = 30, 0.2
SPARSE = 10  # a script that calls should_stop() only every 10 steps
FIRST_STEPS_BOUND = 90.0  # agent start, import torch, gloo init on 2 busy cores
JOB_BOUND = 120.0


class Job:
    """A server and the 1:2 job's agents (A, then B), each node's workers tagged in the logs."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        *,
        commit: bool,
        slow: bool,
        check_every: int = 1,
        in_place: bool = False,
        snapshots: bool = False,
    ) -> None:
        self.tmp, self.name = tmp, name
        self.in_place = in_place
        self.snapshots = snapshots
        self.logs = tmp / "steps"
        self.commit = commit
        self.check_every = check_every
        self.slow = slow
        self.server, self.port = start_server()
        self.agents: dict[str, Proc] = {}

    def start(self, node: str, *, last_call: float = 1.0) -> Proc:
        script = [SCRIPT, "--ckpt-dir", str(self.tmp / "ckpt"), "--log-dir", str(self.logs)]
        script += ["--steps", str(STEPS), "--every", str(EVERY), "--step-seconds", "0.05"]
        if self.slow:
            script += ["--slow-from", str(SLOW_FROM), "--slow-seconds", str(SLOW_SECONDS)]
        if self.commit:
            script += ["--commit", "--check-every", str(self.check_every)]
        if self.in_place:
            script += ["--in-place"]
        if self.snapshots:
            script += ["--snapshots"]
        argv = agent_cmd(
            "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{self.port}",
            "--rdzv-id", self.name, "--rdzv-conf", f"last_call_timeout={last_call:g}",
            "--max-restarts", "1" if self.snapshots else "0",
            "--log-dir", str(self.tmp / f"agent-{node}"), *script,
        )  # fmt: skip
        p = self.agents[node] = Proc(argv, env={"NODE_TAG": node, "GLOO_SOCKET_IFNAME": "lo"})
        return p

    def wait_step(self, node: str, step: int) -> None:
        wait_until(
            f"node {node} at step {step}\n{self.stderr()}",
            lambda: last_step(self.logs, node) >= step,
            FIRST_STEPS_BOUND,
        )

    def node_id(self, node: str) -> str:
        """The server's id of that node's agent (it carries the agent's pid), once it joined."""
        pid = self.agents[node].p.pid
        found: list[str] = []

        def joined() -> bool:
            found[:] = [m["node_id"] for m in self.status()["members"] if f":{pid}:" in m["node_id"]]
            return bool(found)

        wait_until(f"node {node} (agent pid {pid}) joined\n{self.stderr()}", joined, FIRST_STEPS_BOUND)
        return found[0]

    def status(self) -> dict[str, Any]:
        status, job = get(self.port, f"/v1/jobs/{self.name}")
        assert status == 200, (status, job)
        return job

    def history(self) -> list[str]:
        return [e["text"] for e in self.status()["history"]]

    def stderr(self) -> str:
        return "\n".join(f"--- agent {n}:\n{p.stderr[-4000:]}" for n, p in self.agents.items())

    def wait_all(self) -> dict[str, int]:
        return {n: p.wait(timeout=JOB_BOUND) for n, p in self.agents.items()}

    def kill(self) -> None:
        for p in self.agents.values():
            p.kill()
        self.server.kill()


@pytest.fixture
def make_job(tmp_path: Path) -> Iterator[Any]:
    jobs: list[Job] = []

    def make(name: str, *, commit: bool, slow: bool = False, **kw: Any) -> Job:
        jobs.append(Job(tmp_path, name, commit=commit, slow=slow, **kw))
        return jobs[-1]

    try:
        yield make
    finally:
        for j in jobs:
            j.kill()


def the(items: list[Attempt], what: str) -> Attempt:
    assert len(items) == 1, f"{what}: {items}"
    return items[0]


def assert_deterministic(runs: list[Attempt]) -> None:
    """Every process that ran step n reached the same state (so the logs compare like for like)."""
    seen: dict[int, str] = {}
    for a in runs:
        for step, s in a.sums.items():
            assert seen.setdefault(step, s) == s, f"step {step}: state {s} != {seen[step]}"


def assert_round_lines_say_restart_0(job: Job) -> None:
    for n, p in job.agents.items():
        rounds = [line for line in p.err if re.search(r"round \d+: group rank", line)]
        assert rounds, f"agent {n} logged no round\n{p.stderr}"
        assert all(line.endswith("restart 0") for line in rounds), rounds


@pytest.mark.parametrize(("check_every", "in_place"), [(1, False), (SPARSE, False), (1, True)])
def test_scale_up_with_the_check_resumes_from_the_commit_step(
    make_job: Any, check_every: int, in_place: bool
) -> None:
    """Also for a script that calls should_stop() only every SPARSE steps: it stops at its first
    check past S, the job goes on from there, and no step is lost or run twice. Under
    ``worker.run`` (issue 44) A's process is the one that trains on with B: it returned at S,
    waited alive, and trained again from S in the round of two."""
    name = f"commit-up-{check_every}" + ("-in-place" if in_place else "")
    job = make_job(name, commit=True, slow=True, check_every=check_every, in_place=in_place)
    job.start("A")
    job.wait_step("A", JOIN_AT)
    job.start("B")
    b_id = job.node_id("B")
    assert job.wait_all() == {"A": 0, "B": 0}, job.stderr()

    runs = attempts(job.logs)
    assert_deterministic(runs)
    alone = the([a for a in runs if a.world == 1], "A's attempt alone")
    pair = [a for a in runs if a.world == 2]
    assert sorted(a.node for a in pair) == ["A", "B"], runs
    # A stopped at S, where should_stop() said so, and saved there; nothing ran past S.
    S = alone.stopped
    assert S is not None, f"A never stopped at a commit step\n{job.stderr()}"
    assert EVERY < S < STEPS and alone.steps == list(range(1, S + 1)), (S, alone.steps)
    assert S % check_every == 0, S  # a step the script checks at
    saved, _why = alone.saves[S]
    assert saved == alone.sums[S]
    for a in pair:
        # Both nodes loaded exactly that state and went on from the step after it.
        assert a.start_from == S and a.loaded == saved, (a, S, saved)
        assert a.steps == list(range(S + 1, STEPS + 1)), (a.node, a.steps[:3], S)
        assert a.done
    # No step lost, none run twice: A's steps over both attempts are 1..STEPS once each.
    a_pair = next(a for a in pair if a.node == "A")
    assert sorted(alone.steps + a_pair.steps) == list(range(1, STEPS + 1))
    # In place: one process of A for both rounds; else a new one, as torchrun.
    assert (a_pair.pid == alone.pid) == in_place, (alone, a_pair)
    if in_place:
        assert "stopped at a commit point and wait for the next round" in job.agents["A"].stderr
        assert "(1 in place: local ranks [0])" in job.agents["A"].stderr, job.agents["A"].stderr

    status = job.status()
    assert status["phase"] == "finished" and status["restart_count"] == 0, status
    assert not status["failures"], status["failures"]
    # What an operator reads: the commit, its step and its cause.
    said = f"committed at step {S} for: node(s) joined: {b_id}"
    assert any(said in t for t in job.history()), (said, job.history())
    assert_round_lines_say_restart_0(job)


def test_scale_up_without_the_check_loses_the_steps_since_the_last_checkpoint(make_job: Any) -> None:
    job = make_job("plain-up", commit=False, slow=True)
    job.start("A")
    job.wait_step("A", JOIN_AT)
    job.start("B")
    assert job.wait_all() == {"A": 0, "B": 0}, job.stderr()

    runs = attempts(job.logs)
    assert_deterministic(runs)
    alone = the([a for a in runs if a.world == 1], "A's attempt alone")
    pair = [a for a in runs if a.world == 2]
    assert sorted(a.node for a in pair) == ["A", "B"], runs
    stopped_at = alone.steps[-1]  # where the restart killed it
    assert alone.stopped is None and JOIN_AT <= stopped_at < 2 * EVERY, alone.steps[-3:]
    for a in pair:
        # As torchrun: the round of two starts again from the periodic checkpoint at 50.
        assert a.start_from == EVERY and a.loaded == alone.saves[EVERY][0], a
        assert a.steps == list(range(EVERY + 1, STEPS + 1)), (a.node, a.steps[:3])
    again = sorted(set(alone.steps) & set(next(a for a in pair if a.node == "A").steps))
    assert again == list(range(EVERY + 1, stopped_at + 1)), again  # the lost steps ran twice
    status = job.status()
    assert status["phase"] == "finished" and status["restart_count"] == 0, status
    assert not any("committed" in t for t in job.history()), job.history()


@pytest.mark.parametrize(
    ("how", "check_every", "in_place"),
    [("rdzv-server drain", 1, False), ("SIGTERM", 1, False), ("SIGTERM", 10, False), ("SIGTERM", 1, True)],
)
def test_a_drain_with_the_check_resumes_from_the_commit_step(
    make_job: Any, how: str, check_every: int, in_place: bool
) -> None:
    """Under ``worker.run`` the survivor A keeps its process; B's worker, which waited alive
    after the commit, is let go by its leaving agent and ends by itself (exit 0, its output
    flushed), not killed."""
    name = f"commit-drain-{how.split()[0].lower()}-{check_every}" + ("-in-place" if in_place else "")
    job = make_job(name, commit=True, check_every=check_every, in_place=in_place)
    # With 1:2 the round forms at once when both are in; a long last call keeps them together.
    job.start("A", last_call=30)
    job.start("B", last_call=30)
    job.wait_step("A", JOIN_AT)
    b_id = job.node_id("B")
    if how == "SIGTERM":
        job.agents["B"].signal(signal.SIGTERM)
    else:
        argv = server_cmd(
            "drain", "--endpoint", f"127.0.0.1:{job.port}", "--job", job.name, "--node", b_id,
            "--reason", "maintenance",
        )  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=ROOT, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
    assert job.wait_all() == {"A": 0, "B": 0}, job.stderr()

    runs = attempts(job.logs)
    assert_deterministic(runs)
    b = the([a for a in runs if a.node == "B"], "B's one attempt")
    a_pair = the([a for a in runs if a.node == "A" and a.world == 2], "A's attempt with B")
    a_alone = the([a for a in runs if a.node == "A" and a.world == 1], f"A after the drain\n{job.stderr()}")
    S = b.stopped
    assert S is not None and S == a_pair.stopped, (b, a_pair)
    assert JOIN_AT < S < STEPS and S % check_every == 0, S
    assert b.steps == a_pair.steps == list(range(1, S + 1))
    saved = a_pair.saves[S][0]
    assert saved == b.saves[S][0] == a_pair.sums[S]
    assert a_alone.start_from == S and a_alone.loaded == saved, (a_alone, S)
    assert a_alone.steps == list(range(S + 1, STEPS + 1)) and a_alone.done
    assert (a_alone.pid == a_pair.pid) == in_place, (a_pair, a_alone)
    if in_place:
        assert "stopped with SIGKILL" not in job.agents["B"].stderr, job.agents["B"].stderr
        assert "exitcode" not in job.agents["B"].stderr, job.agents["B"].stderr
    status = job.status()
    assert status["phase"] == "finished" and status["restart_count"] == 0, status
    assert not status["failures"], status["failures"]
    # The history names the commit's step and the node that left; B's agent says so too.
    said = f"committed at step {S} for: node {b_id}"
    assert any(said in t for t in job.history()), (said, job.history())
    assert "goes on without this node" in job.agents["B"].stderr, job.agents["B"].stderr
    assert_round_lines_say_restart_0(job)


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "fresh-worker"])
def test_a_node_lost_resumes_the_shrunk_job_from_the_survivor_s_own_snapshot(
    make_job: Any, in_place: bool
) -> None:
    """Issue 44: snapshots marked as state every rank holds alike (this worker's: every rank
    has the same batch, the mean gradient is exact) restore a job that shrank. B is SIGKILLed
    (agent and worker) while both train; A goes on alone from the newest step it snapshotted
    itself, not from the periodic checkpoint (step 50), with the state it had there."""
    name = "alike-" + ("in-place" if in_place else "fresh")
    job = make_job(name, commit=False, in_place=in_place, snapshots=True)
    job.start("A", last_call=30)
    job.start("B", last_call=30)
    job.wait_step("A", JOIN_AT)
    job.wait_step("B", JOIN_AT)
    os.killpg(job.agents["B"].p.pid, signal.SIGKILL)
    assert job.agents["A"].wait(timeout=JOB_BOUND) == 0, job.stderr()

    runs = attempts(job.logs)
    assert_deterministic(runs)
    a_pair = the([a for a in runs if a.node == "A" and a.world == 2], "A's attempt with B")
    a_alone = the([a for a in runs if a.node == "A" and a.world == 1], f"A alone\n{job.stderr()}")
    S = a_alone.start_from
    # The newest step A had snapshotted: its last, or the one before if the park came between
    # that step's log line and its snapshot. Steps lost <= the snapshot interval (1).
    assert a_pair.steps[-1] - 1 <= S <= a_pair.steps[-1] and S > EVERY, (a_pair, a_alone)
    assert a_alone.loaded_from == "memory" and a_alone.loaded == a_pair.sums[S], (a_pair, a_alone)
    assert a_alone.steps == list(range(S + 1, STEPS + 1)) and a_alone.done, a_alone
    assert (a_alone.pid == a_pair.pid) == in_place, (a_pair, a_alone)
    said = f"every rank restores the in-memory snapshot of step {S} of rank"
    assert said in job.agents["A"].stderr, job.agents["A"].stderr
    history = job.history()
    told = f"resumes every rank from the in-memory snapshot of step {S} of the 2-rank world"
    assert any(told in t for t in history), history
