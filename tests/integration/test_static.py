"""--rdzv-backend static: ranks from --node-rank, the master from --master-addr/--master-port."""

from __future__ import annotations

import json
from pathlib import Path

from .procs import WORKERS, Proc, agent_cmd, free_port


def test_two_static_nodes_run_a_real_gloo_all_reduce(tmp_path: Path) -> None:
    port = free_port()
    common = ("--rdzv-backend", "static", "--nnodes", "2", "--nproc-per-node", "2")
    common += ("--master-addr", "127.0.0.1", "--master-port", str(port))
    script = str(WORKERS / "gloo_check.py")
    agents = [
        Proc(agent_cmd(*common, "--node-rank", str(r), script), env={"DUMP_DIR": str(tmp_path)})
        for r in (1, 0)
    ]
    try:
        for a in agents:
            assert a.wait(timeout=120) == 0, a.stderr
    finally:
        for a in agents:
            a.kill()
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("gloo-*.json"))]
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert all(r["world"] == 4 and r["sum"] == r["expected"] == 10.0 for r in results)
    assert all(r["params"] == results[0]["params"] for r in results)


def test_static_restart_is_local_and_counted_by_the_node(tmp_path: Path) -> None:
    port = free_port()
    args = ("--rdzv-backend", "static", "--nnodes", "1", "--nproc-per-node", "2", "--master-port", str(port))
    args += ("--max-restarts", "1", str(WORKERS / "fail_once.py"))
    a = Proc(agent_cmd(*args), env={"DUMP_DIR": str(tmp_path), "FAIL_RANK": "1"})
    try:
        assert a.wait(timeout=60) == 0, a.stderr
    finally:
        a.kill()
    rows = sorted(tuple(line.split()[:2]) for line in (tmp_path / "attempts.txt").read_text().splitlines())
    # rank 0's first attempt may be stopped before it writes its line
    assert {("0", "1"), ("1", "0"), ("1", "1")} <= set(rows)
    assert "re-rendezvous after round 0: worker failure" in a.stderr
