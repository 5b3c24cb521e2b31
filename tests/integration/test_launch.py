"""End to end with real processes: what a user sees when launching jobs."""

from __future__ import annotations

import json
from pathlib import Path

from .conftest import Rendezvous
from .procs import WORKERS, Proc, agent_cmd, pid_alive, read_env_dumps

DUMP = str(WORKERS / "dump_env.py")


def test_standalone_runs_three_workers_with_distinct_ranks(tmp_path: Path) -> None:
    a = Proc(agent_cmd("--standalone", "--nproc-per-node", "3", DUMP), env={"DUMP_DIR": str(tmp_path)})
    try:
        assert a.wait(timeout=60) == 0, a.stderr
    finally:
        a.kill()
    envs = read_env_dumps(tmp_path)
    assert sorted(e["RANK"] for e in envs) == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert sorted(e["LOCAL_RANK"] for e in envs) == ["0", "1", "2"]
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"3"}
    assert {e["GROUP_RANK"] for e in envs} == {"0"}
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert "worker rank 0 of 3 done" in a.stdout
    assert not any(pid_alive(int(e["_pid"])) for e in envs)


def test_two_agents_on_one_rendezvous_share_one_world(tmp_path: Path, rdzv: Rendezvous) -> None:
    args = ("--nnodes", "2", "--nproc-per-node", "2", *rdzv.args, "--rdzv-id", f"e2e-{rdzv.backend}")
    agents = [Proc(agent_cmd(*args, DUMP), env={"DUMP_DIR": str(tmp_path)}) for _ in range(2)]
    try:
        for a in agents:
            assert a.wait(timeout=60) == 0, a.stderr
    finally:
        for a in agents:
            a.kill()
    envs = read_env_dumps(tmp_path)
    assert sorted(int(e["RANK"]) for e in envs) == [0, 1, 2, 3]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert {e["GROUP_WORLD_SIZE"] for e in envs} == {"2"}
    for e in envs:
        assert int(e["RANK"]) == int(e["GROUP_RANK"]) * 2 + int(e["LOCAL_RANK"])
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert {e["TORCHELASTIC_RUN_ID"] for e in envs} == {f"e2e-{rdzv.backend}"}


def test_real_gloo_all_reduce_and_ddp_over_two_agents(tmp_path: Path, rdzv: Rendezvous) -> None:
    args = ("--nnodes", "2", "--nproc-per-node", "2", *rdzv.args, "--rdzv-id", f"gloo-{rdzv.backend}")
    script = str(WORKERS / "gloo_check.py")
    agents = [Proc(agent_cmd(*args, script), env={"DUMP_DIR": str(tmp_path)}) for _ in range(2)]
    try:
        for a in agents:
            assert a.wait(timeout=120) == 0, a.stderr
    finally:
        for a in agents:
            a.kill()
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("gloo-*.json"))]
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    for r in results:
        assert r["world"] == 4
        assert r["sum"] == r["expected"] == 10.0
    assert all(r["params"] == results[0]["params"] for r in results)


def test_worker_exit_code_is_reported_with_rank(tmp_path: Path) -> None:
    a = Proc(
        agent_cmd("--standalone", "--nproc-per-node", "2", DUMP),
        env={"DUMP_DIR": str(tmp_path), "FAIL_RANK": "1", "EXIT_CODE": "3"},
    )
    try:
        rc = a.wait(timeout=60)
    finally:
        a.kill()
    assert rc != 0
    assert "Root Cause" in a.stderr
    assert "rank      : 1 (local_rank: 1)" in a.stderr
    assert "exitcode  : 3" in a.stderr
    assert "rank 1 failing on purpose" in a.stderr
    envs = read_env_dumps(tmp_path)
    assert envs and not any(pid_alive(int(e["_pid"])) for e in envs)
