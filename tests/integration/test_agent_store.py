"""The agent-hosted TCPStore (issue 21): no worker's init_process_group waits in torch's
connect retry, across many two-node starts; without torch in the workers' interpreter the
job runs as before (worker rank 0 hosts the store on MASTER_PORT)."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest

from .procs import WORKERS, Proc, agent_cmd, start_server

SCRIPT = str(WORKERS / "init_timing.py")
STARTS = 10  # each start is a fresh chance for the race; 20 took 85 s of one worker
# What one two-node start may take: both workers start (torch's import), init_process_group,
# an all_reduce, the failure and the restart. About 4 s on a 2-core VM, idle or beside two busy
# loops (40 s for the 10); a loaded CI machine passed pytest's fixed 120 s (issue 48, item 3),
# so the test's bounds grow with its starts, with room for three times that.
START_BUDGET_S = 12
# torch's connect retry sleeps at least ~0.25 s before its next try; a worker that never
# waited in it does its whole init in a fraction of that, even on a busy 2-core machine.
RETRY_DELAY_S = 0.25


def _two_nodes(tmp_path: Path, starts: int, env: dict[str, str]) -> list[Proc]:
    srv, port = start_server()
    args = ("--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", str(starts - 1))
    args += ("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "store", SCRIPT)
    env = {"DUMP_DIR": str(tmp_path), "INIT_TIMING_STARTS": str(starts), **env}
    agents = [Proc(agent_cmd(*args), env=env) for _ in "ab"]
    try:
        for a in agents:
            assert a.wait(timeout=30 + START_BUDGET_S * starts) == 0, a.stderr
    finally:
        for a in agents:
            a.kill()
        srv.kill()
    return agents


def _records(folder: Path) -> list[dict[str, object]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("init-*.json"))]


def _overhang(start: list[dict[str, object]]) -> float:
    """From the last rank's call of init_process_group to the last rank done with it."""
    return max(float(r["init_end"]) for r in start) - max(float(r["init_start"]) for r in start)  # type: ignore[arg-type]


@pytest.mark.timeout(60 + START_BUDGET_S * STARTS)  # beyond the agents' own bound: their output shows
def test_no_rank_waits_in_the_connect_retry_across_ten_two_node_starts(tmp_path: Path) -> None:
    agents = _two_nodes(tmp_path, STARTS, {})
    records = _records(tmp_path)
    assert sorted((r["restart"], r["rank"]) for r in records) == [
        (s, k) for s in range(STARTS) for k in (0, 1)
    ]
    assert {r["use_agent_store"] for r in records} == {"True"}
    assert all(r["sum"] == r["world"] == 2 for r in records)
    # Every rank found the store listening when it arrived: torch's first connect succeeds, and
    # only a refused connect leads into its retry sleep (at least RETRY_DELAY_S).
    late = [(r["restart"], r["rank"], r["store_listening"]) for r in records]
    late = [x for x in late if x[2] is not True]
    assert not late, late
    times = [float(r["init_s"]) for r in records]  # type: ignore[arg-type]
    # Printed, not asserted (a timing on a shared 2-core machine is no test): a rank's init also
    # waits for the last rank to arrive; what is left once the last one is in is the store's part.
    overhangs = [_overhang([r for r in records if r["restart"] == s]) for s in range(STARTS)]
    print(
        f"init_process_group: per rank median {statistics.median(times):.4f} s, max {max(times):.4f} s;"
        f" after the last rank began: median {statistics.median(overhangs):.4f} s, max {max(overhangs):.4f} s"
    )
    # torch says so when a connect is refused and retried; none was.
    for a in agents:
        assert "failed to connect" not in a.stderr and "Connection refused" not in a.stderr
        assert "agent-hosted TCPStore off" not in a.stderr


@pytest.mark.skipif(shutil.which("python3", path="/usr/bin") is None, reason="needs /usr/bin/python3")
def test_without_torch_in_the_workers_interpreter_rank_0_hosts_the_store_as_before(tmp_path: Path) -> None:
    no_torch = shutil.which("python3", path="/usr/bin")
    assert no_torch is not None
    agents = _two_nodes(tmp_path, 1, {"PYTHON_EXEC": no_torch})
    records = _records(tmp_path)
    assert {r["use_agent_store"] for r in records} == {"False"}
    assert [r.get("bound_master_port") for r in records if r["rank"] == 0] == [True]
    for a in agents:  # said once, with why
        assert a.stderr.count("agent-hosted TCPStore off") == 1, a.stderr
        assert "no torch" in a.stderr
