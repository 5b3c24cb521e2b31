"""Warm restarts never race the agent-hosted store (issue 29): a rank fails at once, again and
again, and the replacements (warm interpreters, --preload torch) connect to MASTER_PORT within
milliseconds of each new round. None may reach the last round's store: no connection cut under
a worker ("Failed to recv, got 0 bytes"), no reset that sends it into torch's connect retry,
and every start runs to its all_reduce, so the job spends exactly the restarts it planned.

Both ways a job meets its rendezvous: an ``rdzv-server`` of its own, and the first agent
hosting the server itself (c10d on an endpoint where nothing listens yet).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from .procs import WORKERS, Proc, agent_cmd, free_port, start_server

pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="the agent hosts the store only with a core to spare"
)

SCRIPT = str(WORKERS / "store_race.py")
# The hosting node serves each new round's store this much after the round forms, so that the
# other node's warm worker always connects first (workers/slow_fresh/sitecustomize.py).
SLOW_FRESH = {"PYTHONPATH": str(WORKERS / "slow_fresh"), "SLOW_FRESH_S": "0.3"}
STARTS = 6
# Each start's training: long enough for the agents to warm the next interpreters (an import of
# torch beside two agents and two workers on two cores), so that every replacement starts warm.
TRAIN_S = "3"
# What torch's store client writes (at the log level below) when a connect finds nothing
# listening and retries, or reaches a store that goes away under it.
TORCH_RETRY_WORDS = (
    "Failed to recv",
    "Connection reset",
    "failed to connect",
    "Connection refused",
    "is not yet listening",
    "will retry",
)
# torch's c10d socket traces every connect attempt at this level: evidence, not a clock.
TORCH_TRACE = {"TORCH_CPP_LOG_LEVEL": "INFO", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}


def _run(tmp_path: Path, endpoint: str, extra_env: dict[str, str] | None = None) -> list[Proc]:
    args = ("--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", str(STARTS - 1))
    args += ("--preload", "torch", "--rdzv-endpoint", endpoint, "--rdzv-id", "race", SCRIPT)
    env = {"DUMP_DIR": str(tmp_path), "STORE_RACE_STARTS": str(STARTS), "STORE_RACE_TRAIN_S": TRAIN_S}
    env.update(TORCH_TRACE)
    env.update(extra_env or {})
    agents = [Proc(agent_cmd(*args), env=env) for _ in "ab"]
    try:
        for a in agents:
            assert a.wait(timeout=60 + 8 * STARTS) == 0, a.stderr
    finally:
        for a in agents:
            a.kill()
    return agents


def _check(tmp_path: Path, agents: list[Proc]) -> None:
    records = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("race-*.json"))]
    # Each start ran once on each rank: a worker cut off by an old store fails, which would
    # spend a restart and leave a start missing at the end.
    starts = sorted((r["restart"], r["rank"]) for r in records)
    assert starts == [(s, k) for s in range(STARTS) for k in (0, 1)]
    assert {r["use_agent_store"] for r in records} == {"True"}
    assert all(r["sum"] == 2 for r in records)
    assert all(r["warm"] for r in records if r["restart"] > 0), "the replacements were not warm"
    for a in agents:
        # Every worker's connects are traced: each one reached the store it was meant for.
        assert "The client socket is attempting to connect" in a.stderr, a.stderr[-3000:]
        for words in TORCH_RETRY_WORDS:
            assert words not in a.stderr, a.stderr
        assert "agent-hosted TCPStore off" not in a.stderr, a.stderr
    slow = max(r["init_s"] for r in records if r["restart"] > 0)
    print(f"{STARTS} back-to-back warm starts; slowest init_process_group {slow:.3f} s")


def test_warm_replacements_never_reach_the_last_rounds_store_with_a_server(tmp_path: Path) -> None:
    srv, port = start_server()
    try:
        agents = _run(tmp_path, f"127.0.0.1:{port}", SLOW_FRESH)
    finally:
        srv.kill()
    _check(tmp_path, agents)


def test_warm_replacements_never_reach_the_last_rounds_store_with_an_agent_hosted_server(
    tmp_path: Path,
) -> None:
    agents = _run(tmp_path, f"127.0.0.1:{free_port()}", SLOW_FRESH)
    _check(tmp_path, agents)
