"""Watching the training end to end (issue 19): real gloo ranks that report progress through
node_agent.worker, under real agents and a real rdzv-server.

- a rank that sleeps for ever outside any collective while the others wait in all_reduce is
  found within the budget; every rank's stacks are collected first; the reports (each node's in
  its log dir, the job's at the server) name that rank and show its frame and the others'
  all_reduce; the job restarts once and finishes;
- a rank that spends longer than the step budget in a "checkpoint" phase (within that phase's
  own budget) is no hang;
- a rank twice as slow in compute is flagged as a straggler, and a balanced job flags nobody;
- the hang of a rank on the other node (issue 30): the job's root cause, both consoles' failure
  banners and both report files name it with its frame, and ``rdzv-server status`` prints the
  report as lines.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .live_job import get
from .procs import WORKERS, Proc, agent_cmd, server_cmd, start_server

SCRIPT = str(WORKERS / "train_progress.py")


@pytest.fixture
def server() -> Iterator[int]:
    srv, port = start_server()
    try:
        yield port
        srv.signal(signal.SIGTERM)
        assert srv.wait(timeout=15) == 0, srv.stderr
    finally:
        srv.kill()


def run_job(
    tmp_path: Path,
    port: int,
    job: str,
    env: dict[str, str],
    *flags: str,
    meanwhile: Callable[[list[Proc]], None] | None = None,
) -> list[Proc]:
    """Two nodes of two ranks each, to the end (bounded); their Procs, exited. ``meanwhile``
    runs while they do (its failure stops them)."""
    agents = [
        Proc(
            agent_cmd(
                "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", job, "--log-dir", str(tmp_path / f"node{i}"), *flags, SCRIPT,
            ),
            env=env,
        )
        for i in range(2)
    ]  # fmt: skip
    try:
        if meanwhile is not None:
            meanwhile(agents)
        for a in agents:
            a.wait(timeout=180)
    finally:
        for a in agents:
            a.kill()
    return agents


def hang_of_round(port: int, job: str, rnd: int, agents: list[Proc]) -> dict[str, Any]:
    """The server's view of round ``rnd``'s hang once every node's stacks are in: read while
    the job runs, since a later round's hang replaces it (on a starved machine the last round's
    teardown, a barrier after the last step, can outlast a 4 s budget)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status, body = get(port, f"/v1/jobs/{job}")
        hang = body.get("hang") if status == 200 else None
        if hang and hang["round"] == rnd and hang["nodes_reported"] == 2 and hang["report"]:
            return hang
        if (hang and hang["round"] > rnd) or all(a.p.poll() is not None for a in agents):
            break
        time.sleep(0.2)  # the server's API is the only way to see it; polled, bounded
    raise AssertionError(f"no report of round {rnd}'s hang with both nodes' stacks: {hang}")


def test_a_hung_rank_is_found_with_every_ranks_stacks_and_the_job_restarts(
    tmp_path: Path, server: int
) -> None:
    env = {"HANG_MODE": "sleep", "HANG_RANK": "3", "HANG_STEP": "20", "STEPS": "40"}
    seen: list[dict[str, Any]] = []
    agents = run_job(
        tmp_path, server, "hang", env, "--max-restarts", "1", "--hang-timeout", "4",
        meanwhile=lambda agents: seen.append(hang_of_round(server, "hang", 0, agents)),
    )  # fmt: skip
    assert [a.p.returncode for a in agents] == [0, 0], "\n".join(a.stderr for a in agents)
    both = "\n".join(a.stderr for a in agents)
    # Every rank waited: each node saw its own ranks hang, at step 19 (the last one reported).
    assert "rank 3 (local 1): no progress for" in both and "hang: rank" in both
    # Found within the budget (4 s) and a poll or two of it, not at gloo's 30-minute timeout.
    silences = [int(m) for m in re.findall(r"no progress for (\d+) s \(last step", both)]
    assert silences and max(silences) <= 6, silences
    assert "last step 19" in both
    assert "done 40" in "\n".join(a.stdout for a in agents)  # the second attempt finished
    # The node of rank 3: its report shows the sleeping frame and its neighbour's all_reduce.
    reports = [p.read_text() for p in tmp_path.glob("node*/*/attempt_*/hang_report.txt")]
    assert len(reports) == 2, reports
    text = "\n".join(reports)
    assert "stuck_outside_any_collective" in text
    assert "all_reduce" in text
    # The job's report at the server merges all four ranks: 3 is the odd one out.
    status, job = get(server, "/v1/jobs/hang")
    assert status == 200, job
    (found,) = seen
    assert found["ranks"] and found["nodes_reported"] == 2, found
    hang = found["report"]
    assert hang["suspects"] == [3], hang
    groups = {tuple(g["ranks"]): g for g in hang["groups"]}
    assert set(groups) == {(0, 1, 2), (3,)}, hang
    assert "stuck_outside_any_collective" in "\n".join(groups[(3,)]["frames"])
    assert "all_reduce" in "\n".join(groups[(0, 1, 2)]["frames"])
    assert job["restart_count"] == 1


def test_a_checkpoint_longer_than_a_step_budget_is_no_hang(tmp_path: Path, server: int) -> None:
    env = {
        "HANG_MODE": "checkpoint",
        "HANG_RANK": "3",
        "HANG_STEP": "10",
        "STEPS": "20",
        "CHECKPOINT_SECONDS": "8",
    }
    # 5 s: under the parallel suite on 2 cores the ranks' last steps and exit can take 3 s of
    # CPU starvation (seen once); the checkpoint's 8 s are still past the step budget.
    flags = ("--max-restarts", "0", "--hang-timeout", "5", "--hang-conf", "checkpoint=60")
    agents = run_job(tmp_path, server, "ckpt", env, *flags)
    assert [a.p.returncode for a in agents] == [0, 0], "\n".join(a.stderr for a in agents)
    assert "hang:" not in "\n".join(a.stderr for a in agents)
    assert not list(tmp_path.glob("node*/*/attempt_*/hang_report.txt"))


def straggler_events(port: int, job: str) -> list[dict[str, object]]:
    status, view = get(port, f"/v1/jobs/{job}")
    assert status == 200, view
    return [e for e in view["history"] if e["kind"] == "straggler"]


@pytest.mark.parametrize("slow_rank", [1, -1], ids=["rank-1-twice-as-slow", "balanced"])
def test_a_rank_twice_as_slow_in_compute_is_flagged_and_a_balanced_job_flags_nobody(
    tmp_path: Path, server: int, slow_rank: int
) -> None:
    job = f"straggle{slow_rank}"
    # 80 steps of 50 ms compute: a bounded run, within which the slow rank must be flagged.
    env = {"STEPS": "80", "STEP_SECONDS": "0.05", "SLOW_RANK": str(slow_rank), "SLOW_FACTOR": "2"}
    agent = Proc(
        agent_cmd(
            "--nnodes", "1", "--nproc-per-node", "4", "--rdzv-endpoint", f"127.0.0.1:{server}",
            "--rdzv-id", job, "--log-dir", str(tmp_path), SCRIPT,
        ),
        env=env,
    )  # fmt: skip
    try:
        assert agent.wait(timeout=120) == 0, agent.stderr
    finally:
        agent.kill()
    events = straggler_events(server, job)
    if slow_rank < 0:
        assert events == [], events
        return
    assert events, "the slow rank was never flagged"
    assert all(e["ranks"] == [1] for e in events), events
    (score,) = events[0]["scores"]
    assert 0.3 < score < 0.75, score  # about 0.5: half the median speed


def test_restarts_that_make_no_step_progress_end_the_job_with_exit_code_3(tmp_path: Path) -> None:
    # Every attempt dies at step 5: after the first failure sets the job's best step, three more
    # restarts in a row make no progress, and the job stops there, not at --max-restarts 10.
    agent = Proc(
        agent_cmd(
            "--standalone", "--nproc-per-node", "2", "--max-restarts", "10", "--log-dir", str(tmp_path),
            str(WORKERS / "stuck_at_step.py"),
        )
    )  # fmt: skip
    try:
        assert agent.wait(timeout=120) == 3, agent.stderr
    finally:
        agent.kill()
    assert "3 restarts in a row made no step progress" in agent.stderr
    assert "crash loop" in agent.stderr
    attempts = {line.split()[1] for line in agent.stderr.splitlines() if line.startswith("attempt ")}
    assert attempts == {"0", "1", "2", "3"}, agent.stderr  # and no fifth


def test_the_hang_of_a_rank_on_the_other_node_is_named_by_the_root_cause_both_consoles_and_the_reports(
    tmp_path: Path, server: int
) -> None:
    # Rank 3 (the second node's local rank 1) stops outside any collective; ranks 0-2 wait in
    # all_reduce. Each node sees only its own ranks pass their budget, and the first node's are
    # both in all_reduce: only the server, with every node's stacks, sees rank 3 as the odd one out.
    env = {"HANG_MODE": "sleep", "HANG_RANK": "3", "HANG_STEP": "20", "STEPS": "40"}
    agents = run_job(tmp_path, server, "hang-elsewhere", env, "--max-restarts", "0", "--hang-timeout", "6")
    assert [a.p.returncode for a in agents] == [1, 1], "\n".join(a.stderr for a in agents)
    for a in agents:
        # The failure banner's root cause, on both consoles: rank 3 and the frame it is stuck in.
        root = a.stderr[a.stderr.index("Root Cause") :]
        assert "rank      : 3 (local_rank: 1)" in root, a.stderr
        assert "stuck_outside_any_collective" in root.split("=" * 20)[0], a.stderr
        # When, in wall-clock time (not the agent's monotonic clock: "1970-01-01").
        assert "time      : 1970" not in root and f"time      : {time.strftime('%Y')}" in root, root
        # The final line: the job's root cause is rank 3's hang, not the first ranks past their budget.
        last = [line for line in a.err if "job failed:" in line][-1]
        assert "rank 3 (local rank 1)" in last and "failed with a hang" in last, last
    # Each node's report file has the job-wide merge, whose odd one out is rank 3 in its frame.
    reports = sorted(tmp_path.glob("node*/*/attempt_0/hang_report.txt"))
    assert len(reports) == 2, reports
    for path in reports:
        text = path.read_text()
        assert "job-wide hang report" in text, text
        job_wide = text[text.index("job-wide hang report") :]
        assert "hang: suspect rank 3" in job_wide and "stuck_outside_any_collective" in job_wide, text
        assert "all_reduce" in job_wide, text
    # The operator's view: the root cause names rank 3, its report printed as lines, not "\n".
    status = Proc(server_cmd("status", "--endpoint", f"127.0.0.1:{server}", "--job", "hang-elsewhere"))
    assert status.wait(timeout=30) == 0, status.stderr
    out = status.stdout
    failures = out[out.index("failures (the root cause") :]
    assert "rank 3 (local rank 1)" in failures.splitlines()[1], out
    assert "\\n" not in out, out
    assert any(line.strip().startswith("stuck_outside_any_collective") for line in failures.splitlines()), out


# --- a stack request at any moment of an armed rank's life (issue 48, item 1) -------------------

STACKS_WORKER = str(WORKERS / "stacks_at_exit.py")


class _StackRequests:
    """The agent's stack requests (its page's signal, to a rank whose page says it is armed),
    to ``pid`` every millisecond until it is gone: through its exit and teardown."""

    def __init__(self, pid: int, sig: int) -> None:
        self.pid, self.sig, self.sent = pid, sig, 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                os.kill(self.pid, self.sig)
            except ProcessLookupError:
                return
            self.sent += 1
            time.sleep(0.001)


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_stack_requests_through_a_restarted_ranks_life_and_exit_never_kill_it(
    tmp_path: Path, start: str
) -> None:
    """In round 1 after a restart the agent asked a rank for its stacks (a hang found while the
    ranks tore down on a loaded node) and the rank died of the signal (``exitcode -38``): the
    job failed. Requests from the moment each rank is armed until it is gone, in both rounds,
    for cold and --preload (warm) workers: no rank dies of them, and the job succeeds."""
    from node_agent.worker import STACK_SIGNAL

    out = tmp_path / "stacks"
    out.mkdir()
    flags = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    if start == "warm":
        flags += ["--preload", "torch"]
    agent = Proc(agent_cmd(*flags, STACKS_WORKER), env={"STACKS_DIR": str(out)})
    requests = []
    try:
        for restart in range(2):
            armed = [out / f"armed-{restart}-{rank}" for rank in range(2)]
            deadline = time.monotonic() + 120
            while not all(p.exists() for p in armed):
                assert agent.p.poll() is None and time.monotonic() < deadline, agent.stderr
                time.sleep(0.02)
            requests += [_StackRequests(int(p.read_text()), STACK_SIGNAL) for p in armed]
            time.sleep(0.2)  # requests while the rank runs, too
            (out / f"go-{restart}").touch()
        code = agent.wait(120)
    finally:
        agent.kill()
    assert all(r.sent for r in requests)
    assert f"signal {STACK_SIGNAL}" not in agent.stderr, agent.stderr
    assert code == 0, agent.stderr
