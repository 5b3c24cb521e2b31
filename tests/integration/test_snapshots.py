"""In-memory snapshots end to end (issue 35): real agents, a real rdzv-server, real gloo ranks
that ``torch.save`` into their snapshots and ``torch.load`` out of them.

The worker (``workers/snapshot_train.py``) is deterministic: an uninterrupted run and any run
resumed from a snapshot end with bit-identical parameters, which every test checks against an
uninterrupted run. Each test also checks from which step every process started, and what the
agents' consoles and the server's history say.

- A worker SIGKILLed right after a snapshot: the restart resumes from it (at most one snapshot
  interval lost), both ranks from the same step.
- A worker SIGKILLed halfway through writing a snapshot: the restart resumes from the previous
  one; the half-written file was never a snapshot.
- A node SIGKILLed (its agent and workers) with a spare waiting: the spare takes its place and
  restores the lost node's ranks from the replicas the lost node had sent to its peer.
- The server restarted (from its state dir) while the job trains: the agents tell it again
  what they hold, and a worker failure after that still resumes from a snapshot.
- A snapshot every step with a state of 4 MB and --snapshot-memory 96M: the node's snapshot
  folder never holds more than its bound.
"""

from __future__ import annotations

import os
import re
import signal
import ssl
import time
from pathlib import Path

import pytest

from ..pki import make_pki
from .live_job import get, wait_until
from .procs import WORKERS, Proc, agent_cmd, server_cmd, start_server
from .resumed_runs import at_step as _at_step
from .resumed_runs import final as _final
from .resumed_runs import kept_step as _kept
from .resumed_runs import rank_of as _rank_of
from .resumed_runs import same as _same
from .resumed_runs import starts as _starts

torch = pytest.importorskip("torch")

SCRIPT = str(WORKERS / "snapshot_train.py")
STEPS = 30
JOB_BOUND = 120.0


def _env(tmp: Path, **kw: str) -> dict[str, str]:
    env = {"DUMP_DIR": str(tmp), "STEPS": str(STEPS), "GLOO_SOCKET_IFNAME": "lo", "STEP_S": "0.03"}
    env.update(kw)
    return env


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list]:
    """The parameters of a run nothing interrupted (two ranks), to compare every resumed run with."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    p = Proc(agent_cmd("--standalone", "--nproc-per-node", "2", SCRIPT), env=_env(tmp))
    assert p.wait(timeout=JOB_BOUND) == 0, p.stderr
    return {r: _final(tmp, r) for r in (0, 1)}


def _standalone(tmp: Path, **env: str) -> Proc:
    argv = agent_cmd("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", SCRIPT)
    return Proc(argv, env=_env(tmp, **env))


def test_a_worker_killed_after_a_snapshot_resumes_from_it(tmp_path: Path, uninterrupted: dict) -> None:
    p = _standalone(tmp_path, FAULT="kill", FAULT_STEP="12", FAULT_RANK="1")
    assert p.wait(timeout=JOB_BOUND) == 0, p.stderr
    for rank in (0, 1):
        starts = [s["start"] for s in _starts(tmp_path, rank)]
        # Rank 1 died after its snapshot of step 12; rank 0 may have been stopped before its
        # own was complete: the restart resumes from 12 (or 11), never further back.
        assert len(starts) == 2 and starts[0] == 0 and starts[1] in (12, 13), starts
        assert _same(_final(tmp_path, rank), uninterrupted[rank])
    first = {_starts(tmp_path, r)[1]["start"] for r in (0, 1)}
    assert len(first) == 1, first  # one step for every rank
    step = first.pop() - 1
    assert f"every rank restores the in-memory snapshot of step {step}" in p.stderr, p.stderr


def test_a_worker_killed_while_writing_resumes_from_the_previous_snapshot(
    tmp_path: Path, uninterrupted: dict
) -> None:
    p = _standalone(tmp_path, FAULT="mid_write", FAULT_STEP="12", FAULT_RANK="0")
    assert p.wait(timeout=JOB_BOUND) == 0, p.stderr
    for rank in (0, 1):
        assert [s["start"] for s in _starts(tmp_path, rank)] == [0, 12]  # from step 11's snapshot
        assert _same(_final(tmp_path, rank), uninterrupted[rank])
    assert "every rank restores the in-memory snapshot of step 11" in p.stderr


def _node(port: int, tmp: Path, tag: str, *extra: str, **env: str) -> Proc:
    argv = agent_cmd(
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "snap", "--max-restarts", "2", *extra, SCRIPT,
    )  # fmt: skip
    return Proc(argv, env=_env(tmp, NODE_TAG=tag, **env))


def _history(port: int, tls: ssl.SSLContext | None = None) -> list[str]:
    status, body = get(port, "/v1/jobs/snap", tls=tls)
    assert status == 200, body
    return [e["text"] for e in body["history"]]


def test_a_lost_node_is_replaced_by_a_spare_that_restores_its_ranks_from_the_replicas(
    tmp_path: Path, uninterrupted: dict
) -> None:
    # Over TLS (issue 42): the replica channel then uses TLS too, each peer pinned to the
    # certificate its Join named; the spare's fetch checks the owner's digest.
    pki = make_pki(tmp_path / "pki")
    srv, port = start_server("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key))
    https = ssl.create_default_context(cafile=str(pki.ca))
    tls = ("--tls-ca", str(pki.ca))
    gate = tmp_path / "go"
    nodes: dict[str, Proc] = {}
    try:
        # Training waits at step 15 until the spare is in, so the loss lands mid-training.
        for tag in ("a", "b"):
            nodes[tag] = _node(port, tmp_path, tag, *tls, WAIT_FILE=str(gate), WAIT_STEP="15")
        wait_until("both ranks at step 15", lambda: _at_step(15, nodes.values()), JOB_BOUND)
        nodes["c"] = _node(port, tmp_path, "c", *tls)
        nodes["c"].wait_for_line("spare", timeout=30)
        # Every rank's step-15 snapshot is on two nodes before node b goes.
        wait_until("step 15 kept", lambda: _kept(port, https) >= 15, 30)
        lost = next(t for t in ("a", "b") if _rank_of(tmp_path, t) == 1)
        os.killpg(nodes[lost].p.pid, signal.SIGKILL)
        gate.touch()
        survivors = [t for t in ("a", "b", "c") if t != lost]
        for t in survivors:
            assert nodes[t].wait(timeout=JOB_BOUND) == 0, nodes[t].stderr
        spare = nodes["c"]
        assert "fetched from peers" in spare.stderr, spare.stderr
        # Each replica a node takes is no console line (issue 42 item 8: two a step a node).
        for t in survivors:
            assert "snapshot replica: received" not in nodes[t].stderr, nodes[t].stderr
        history = "\n".join(_history(port, https))
        assert "resumes every rank from the in-memory snapshot of step 15" in history, history
        for t in survivors:
            assert "without TLS" not in nodes[t].stderr, nodes[t].stderr
    finally:
        for p in nodes.values():
            p.kill()
        srv.kill()
    _resumed_at(tmp_path, 16, uninterrupted)


def _resumed_at(tmp: Path, start: int, uninterrupted: dict) -> None:
    """Both ranks' last attempt started at ``start`` and ended as the uninterrupted run did."""
    for rank in (0, 1):
        assert _starts(tmp, rank)[-1]["start"] == start
        assert _same(_final(tmp, rank), uninterrupted[rank])


def _persisted(folder: Path, step: int) -> bool:
    """Both ranks' snapshots of ``step`` are in the --snapshot-dir world folder ``folder``."""
    return all((folder / f"r{r}" / f"{step:020d}.snap").exists() for r in (0, 1))


def test_after_a_server_restart_the_agents_say_again_what_they_hold(
    tmp_path: Path, uninterrupted: dict
) -> None:
    state = tmp_path / "state"
    srv, port = start_server("--state-dir", str(state))
    gate = tmp_path / "go"
    fault = {
        "FAULT": "kill",
        "FAULT_STEP": "18",
        "FAULT_RANK": "0",
        "WAIT_FILE": str(gate),
        "WAIT_STEP": "10",
    }
    nodes = {t: _node(port, tmp_path, t, **fault) for t in ("a", "b")}
    try:
        wait_until("both ranks at step 10", lambda: _at_step(10, nodes.values()), JOB_BOUND)
        srv.kill()
        srv = Proc(server_cmd("--host", "127.0.0.1", "--port", str(port), "--state-dir", str(state)))
        srv.wait_for_line(r"listening on", timeout=30)
        gate.touch()  # then rank 0 dies after its snapshot of step 18
        for t in ("a", "b"):
            assert nodes[t].wait(timeout=JOB_BOUND) == 0, nodes[t].stderr
        history = "\n".join(_history(port))
        assert "resumes every rank from the in-memory snapshot of step 1" in history, history
    finally:
        for p in nodes.values():
            p.kill()
        srv.kill()
    for rank in (0, 1):
        assert _starts(tmp_path, rank)[-1]["start"] in (18, 19)
        assert _same(_final(tmp_path, rank), uninterrupted[rank])


def test_memory_stays_within_its_bound_with_a_snapshot_every_step(tmp_path: Path) -> None:
    bound = 96 << 20
    argv = agent_cmd("--standalone", "--nproc-per-node", "2", "--snapshot-memory", "96M", SCRIPT)
    p = Proc(argv, env=_env(tmp_path, STATE_MB="4", STEPS="60", STEP_S="0.005"))
    peak = 0
    deadline = time.monotonic() + JOB_BOUND
    while p.p.poll() is None and time.monotonic() < deadline:
        peak = max(peak, _used(p.p.pid))
        time.sleep(0.005)
    assert p.wait(timeout=10) == 0, p.stderr
    assert 8 << 20 <= peak <= bound, peak  # it did hold snapshots (two ranks of 4 MB), within the bound


def _used(pid: int) -> int:
    total = 0
    for folder in Path("/dev/shm").glob(f"node-agent-{pid}-*/snapshots"):
        for root, _dirs, files in os.walk(folder):
            for name in files:
                try:
                    total += os.stat(os.path.join(root, name)).st_blocks * 512
                except FileNotFoundError:
                    pass
    return total


def test_a_job_lost_whole_resumes_from_its_snapshot_dir(tmp_path: Path, uninterrupted: dict) -> None:
    """--snapshot-dir: the agent persists the kept step in the background; the whole job (the
    agent and its workers) SIGKILLed, a relaunch of the same line resumes from it, and once
    the job succeeds its persisted snapshots are gone."""
    snaps, gate = tmp_path / "snaps", tmp_path / "go"
    argv = agent_cmd("--standalone", "--nproc-per-node", "2", "--snapshot-dir", str(snaps), SCRIPT)
    # The standalone job's folder is named after its command line (standalone-<digest>).
    first = Proc(argv, env=_env(tmp_path, WAIT_FILE=str(gate), WAIT_STEP="15"))  # holds at step 16
    try:
        wait_until(
            "step 15 persisted",
            lambda: any(_persisted(job / "w2", 15) for job in snaps.glob("standalone-*")),
            JOB_BOUND,
        )
    finally:
        first.kill()  # the whole job: the agent's session, its workers with it
    assert "--snapshot-dir" not in first.stderr, first.stderr  # nothing there at the first start
    second = Proc(argv, env=_env(tmp_path))
    assert second.wait(timeout=JOB_BOUND) == 0, second.stderr
    assert re.search(r"snapshots of a 2-rank job, complete at steps? 15\b", second.stderr), second.stderr
    assert "every rank restores the snapshot of step 15 persisted in --snapshot-dir" in second.stderr
    for rank in (0, 1):
        assert [s["start"] for s in _starts(tmp_path, rank)] == [0, 16]
        assert _same(_final(tmp_path, rank), uninterrupted[rank])
    assert not list(snaps.glob("standalone*"))  # the job succeeded: no fallback left behind


def test_two_nodes_lost_together_resume_from_their_shared_snapshot_dir(
    tmp_path: Path, uninterrupted: dict
) -> None:
    """Two nodes persist their own ranks' kept step into one shared directory; both SIGKILLed
    (the job lost whole, the server keeps running), the relaunched nodes both offer it and the
    server restores every rank from it."""
    srv, port = start_server()
    snaps, gate = tmp_path / "snaps", tmp_path / "go"
    folder = snaps / "snap" / "w2"
    nodes: dict[str, Proc] = {}
    try:
        extra = ("--snapshot-dir", str(snaps))
        for tag in ("a", "b"):
            nodes[tag] = _node(port, tmp_path, tag, *extra, WAIT_FILE=str(gate), WAIT_STEP="15")
        wait_until("step 15 persisted", lambda: _persisted(folder, 15), JOB_BOUND)
        for p in nodes.values():
            p.kill()
        for tag in ("a", "b"):
            nodes[tag] = _node(port, tmp_path, tag, *extra)
        for p in nodes.values():
            assert p.wait(timeout=JOB_BOUND) == 0, p.stderr
            assert "every rank restores the snapshot of step 15 persisted in --snapshot-dir" in p.stderr, (
                p.stderr
            )
        history = "\n".join(_history(port))
        assert "resumes every rank from the snapshot of step 15 persisted in --snapshot-dir" in history, (
            history
        )
    finally:
        for p in nodes.values():
            p.kill()
        srv.kill()
    _resumed_at(tmp_path, 16, uninterrupted)
    assert not (snaps / "snap").exists()
