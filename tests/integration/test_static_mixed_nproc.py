"""A static job whose nodes give different --nproc-per-node (issue 33 item 5).

torchrun's static rendezvous has the agents tell each other their local world sizes, so nodes
of 1 and 2 processes make one job of WORLD_SIZE 3, ranks in node-rank order. Both launchers run
the same two-node line on loopback, a worker does a real gloo all_reduce and dumps its
environment, and every rank's place in the job must be torchrun's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from .dropin import LAUNCHERS
from .procs import WORKERS, Proc, agent_cmd, free_port

# What says where a worker is in the job; MASTER_PORT differs (each run its own free port).
PLACE = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
)


def run_job(launcher: str, tmp: Path, sizes: tuple[int, ...]) -> dict[int, dict[str, str]]:
    """Run one node per entry of ``sizes`` (node rank = index), the last node started first."""
    dumps = tmp / launcher
    dumps.mkdir()
    port = free_port()
    script = str(WORKERS / "gloo_env_dump.py")
    procs = []
    try:
        for rank in reversed(range(len(sizes))):
            args: tuple[str, ...] = (
                "--nnodes",
                str(len(sizes)),
                "--node-rank",
                str(rank),
                "--master-addr",
                "127.0.0.1",
            )
            args += ("--master-port", str(port), "--nproc-per-node", str(sizes[rank]), script)
            procs.append(Proc([*LAUNCHERS[launcher], *args], env={"DUMP_DIR": str(dumps)}))
        for p in procs:
            assert p.wait(timeout=120) == 0, f"{launcher}:\n{p.stderr}"
    finally:
        for p in procs:
            p.kill()
    out = {}
    for path in dumps.glob("node-*.json"):
        env = json.loads(path.read_text())
        assert env["_sum"] == env["_expected"], env  # the gloo all_reduce really spanned the job
        assert env["MASTER_PORT"] == str(port)
        out[int(env["RANK"])] = env
    return out


@pytest.mark.parametrize("sizes", [(1, 2), (2, 1)])
def test_nodes_of_different_sizes_get_torchruns_ranks(tmp_path: Path, sizes: tuple[int, ...]) -> None:
    ours = run_job("ours", tmp_path, sizes)
    theirs = run_job("torchrun", tmp_path, sizes)
    world = sum(sizes)
    assert sorted(ours) == sorted(theirs) == list(range(world))
    for rank in range(world):
        assert {k: ours[rank].get(k) for k in PLACE} == {k: theirs[rank].get(k) for k in PLACE}, rank
    assert ours[0]["WORLD_SIZE"] == str(world)


def test_a_node_that_never_hears_from_node_rank_0_exits_naming_it() -> None:
    port = free_port()  # nothing listens: node rank 0 never started
    args: tuple[str, ...] = (
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    )
    args += ("--nproc-per-node", "2", "--rdzv-conf", "timeout=2", str(WORKERS / "gloo_env_dump.py"))
    started = time.monotonic()
    agent = Proc(agent_cmd(*args))
    try:
        assert agent.wait(timeout=30) != 0
    finally:
        agent.kill()
    assert time.monotonic() - started < 20
    assert f"node rank 1 waited 2 s for node rank 0's agent at 127.0.0.1:{port}" in agent.stderr
    assert "--nproc-per-node" in agent.stderr


def test_a_node_giving_another_nnodes_is_refused_with_both_values() -> None:
    port = free_port()
    base: tuple[str, ...] = (
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--nproc-per-node",
        "1",
    )
    base += ("--rdzv-conf", "timeout=4")
    script = str(WORKERS / "gloo_env_dump.py")
    head = Proc(agent_cmd("--nnodes", "2", "--node-rank", "0", *base, script))
    try:
        head.wait_for_line("waits on port", timeout=20)
        stray = Proc(agent_cmd("--nnodes", "3", "--node-rank", "1", *base, script))
        try:
            assert stray.wait(timeout=20) != 0
        finally:
            stray.kill()
        assert "--nnodes 3 of node rank 1 differs from node rank 0's --nnodes 2" in stray.stderr
        assert head.wait(timeout=20) != 0  # and node rank 0 still misses its node rank 1
    finally:
        head.kill()
    assert "node rank(s) 1 of 2" in head.stderr
