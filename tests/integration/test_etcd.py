"""The etcd backend against a real etcd: restarts of etcd itself, an unreachable etcd, reruns.

The shared end-to-end tests (test_launch.py, test_fault_tolerance.py) run on etcd too, through
the ``rdzv`` fixture; these are the cases only etcd has.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from node_agent.rdzv.etcd import DEFAULT_ETCD_PREFIX
from node_agent.rdzv.etcd_client import EtcdClient

from .etcd import Etcd, agent_args
from .procs import WORKERS, Proc, agent_cmd, free_port

SLEEPER = str(WORKERS / "sleeper.py")
DUMP = str(WORKERS / "dump_env.py")


def started(folder: Path) -> list[tuple[int, ...]]:
    p = folder / "started.txt"
    return [tuple(int(x) for x in line.split()) for line in p.read_text().splitlines()] if p.exists() else []


def log_leases(etcd: Etcd, job: str) -> set[bytes]:
    """The lease part of every log key of a job: which agents' entries etcd still holds."""

    async def read() -> set[bytes]:
        client = EtcdClient(f"http://{etcd.endpoint}")
        try:
            _, kvs = await client.range(f"{DEFAULT_ETCD_PREFIX}/{job}/log/".encode())
        finally:
            await client.close()
        return {kv.key.split(b"/")[-2] for kv in kvs}

    return asyncio.run(read())


def test_job_rides_out_an_etcd_restart_without_restarting_workers(tmp_path: Path) -> None:
    etcd = Etcd(tmp_path / "etcd")
    etcd.start()
    stop = tmp_path / "stop"
    env = {"DUMP_DIR": str(tmp_path), "EXIT_WHEN_FILE": str(stop)}
    args = ("--nnodes", "2", "--nproc-per-node", "1", *agent_args(etcd), "--rdzv-id", "etcd-restart")
    agents = [Proc(agent_cmd(*args, SLEEPER), env=env) for _ in range(2)]
    try:
        for a in agents:
            a.wait_for_line(r"started \d 2 ", stream="out", timeout=30)
        etcd.kill()  # SIGKILL: no clean shutdown, only its data dir survives
        for a in agents:
            a.wait_for_line(r"lost etcd at http://127\.0\.0\.1:\d+ .*workers keep running", timeout=30)
        etcd.start()
        for a in agents:
            a.wait_for_line(r"etcd at .* answers again", timeout=30)
        stop.write_text("")
        for a in agents:
            assert a.wait(timeout=60) == 0, a.stderr
    finally:
        for a in agents:
            a.kill()
        etcd.kill()
    starts = started(tmp_path)
    assert sorted(s[0] for s in starts) == [0, 1], starts  # one start per rank: nothing restarted
    assert {s[3] for s in starts} == {0}


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_unreachable_etcd_is_a_clear_error_after_the_join_timeout(backend: str) -> None:
    port = free_port()  # nothing listens there
    a = Proc(
        agent_cmd(
            "--nnodes",
            "2",
            "--rdzv-backend",
            backend,
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-conf",
            "join_timeout=0.3",
            DUMP,
        )
    )
    try:
        assert a.wait(timeout=30) == 1
    finally:
        a.kill()
    assert f"no etcd answered at http://127.0.0.1:{port} (connection refused)" in a.stderr
    assert "gave up after the join timeout" in a.stderr
    assert "Traceback" not in a.stderr


def test_a_rerun_with_the_same_id_clears_the_finished_runs_log(tmp_path: Path, etcd: Etcd) -> None:
    args = ("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd-v2")
    args += ("--rdzv-endpoint", etcd.endpoint, "--rdzv-id", "rerun", DUMP)
    first: set[bytes] = set()
    for attempt in range(2):
        (tmp_path / str(attempt)).mkdir()
        agents = [Proc(agent_cmd(*args), env={"DUMP_DIR": str(tmp_path / str(attempt))}) for _ in range(2)]
        try:
            for a in agents:
                assert a.wait(timeout=60) == 0, a.stderr
        finally:
            for a in agents:
                a.kill()
        if attempt == 0:
            first = log_leases(etcd, "rerun")
            assert len(first) == 2  # both agents wrote entries
    second = log_leases(etcd, "rerun")
    assert len(second) == 2 and not first & second, "the first run's entries were replayed, not cleared"


def test_https_to_a_plain_etcd_is_a_clear_error(etcd: Etcd) -> None:
    a = Proc(
        agent_cmd(
            *agent_args(etcd),
            "--nnodes",
            "2",
            "--rdzv-conf",
            "protocol=https,join_timeout=0.3",
            DUMP,
        )
    )
    try:
        assert a.wait(timeout=30) == 1
    finally:
        a.kill()
    assert f"https://{etcd.endpoint}" in a.stderr and "Traceback" not in a.stderr
