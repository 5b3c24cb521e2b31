"""The agent's side of a restore at another world size (issue 44): the old rank's snapshot the
Assignment names becomes each new local rank's, linked (no copy), everything else of the old
world is dropped; the holdings say whether the workers marked their state alike."""

from __future__ import annotations

import asyncio
import io
import os
from pathlib import Path

import pytest

from node_agent.agent_log import AgentLog
from node_agent.snapshots.holdings import snap_name
from node_agent.snapshots.node import RestoreFailed, SnapshotNode
from node_agent.worker import snapshots as worker_snapshots
from node_agent.worker_env import RESTORE_STEP_VAR, SNAPSHOT_DIR_VAR
from protocol import Assignment


def _node(root: Path) -> tuple[SnapshotNode, io.StringIO]:
    out = io.StringIO()
    return SnapshotNode(str(root), memory=64 << 20, nproc=2, rate=0, log=AgentLog(out), replicate=False), out


def _round(world: int, offset: int, rnd: int, **kw: object) -> Assignment:
    return Assignment(
        job_id="job", round=rnd, group_rank=0, group_world_size=world // 2, rank_offset=offset,
        world_size=world, master_addr="127.0.0.1", master_port=29500, restart_count=rnd,
        max_restarts=3, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def _write(node: SnapshotNode, rank: int, step: int, data: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the rank's worker writes, through the worker's own API, marked alike."""
    monkeypatch.setenv(SNAPSHOT_DIR_VAR, str(node.holdings.rank_dir(rank)))
    with worker_snapshots.snapshot(step, replicated=True) as f:
        f.write(data)


async def _old_world(root: Path, monkeypatch: pytest.MonkeyPatch, *written: tuple[int, int]) -> SnapshotNode:
    """A node holding ranks 2 and 3 of a 4-rank job, whose workers wrote ``written`` (rank,
    step) marked alike; its data: "<rank>@<step>"."""
    node, _ = _node(root)
    await node.prepare(_round(4, 2, 0), 2)
    for rank, step in written:
        _write(node, rank, step, f"{rank}@{step}".encode(), monkeypatch)
    return node


def test_a_shrink_links_the_old_rank_s_snapshot_into_every_new_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def go() -> None:
        node, said = _node(tmp_path / "snap")
        await node.prepare(_round(4, 2, 0), 2)  # ranks 2 and 3 of 4
        for rank in (2, 3):
            for step in (5, 6):
                _write(node, rank, step, f"{rank}@{step}".encode(), monkeypatch)
        read = node.read()
        assert read is not None and read.replicated and read.world_size == 4
        old = (node.holdings.rank_dir(3) / snap_name(6)).stat().st_ino
        # The job shrank to 2 ranks, this node's are 0 and 1: both restore rank 3's step 6.
        await node.prepare(_round(2, 0, 1, restore_step=6, restore_world=4, restore_ranks=(3, 3)), 2)
        for rank in (0, 1):
            path = node.holdings.rank_dir(rank) / snap_name(6)
            assert path.read_bytes() == b"3@6" and path.stat().st_ino == old  # the same file
            env = node.worker_env(rank, 6)
            monkeypatch.setenv(SNAPSHOT_DIR_VAR, env[SNAPSHOT_DIR_VAR])
            monkeypatch.setenv(worker_snapshots.RESTORE_VAR, env[RESTORE_STEP_VAR])
            got = worker_snapshots.restore()
            assert got is not None and got.step == 6 and Path(got.path) == path
        assert node.holdings.inventory() == {0: (6,), 1: (6,)}  # the old world's are gone
        assert not os.path.exists(f"{node.root}.carried")
        assert "the job's world size changed (4 -> 2 ranks); every rank restores the in-memory " \
            "snapshot of step 6 of rank 3" in said.getvalue()  # fmt: skip
        # The carried files keep their mark: a second shrink may restore from them too.
        read = node.read()
        assert read is not None and read.replicated and read.world_size == 2

    asyncio.run(go())


def test_a_file_that_is_gone_fails_the_start_and_drops_the_old_world(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def go() -> None:
        node = await _old_world(tmp_path / "snap", monkeypatch, (2, 5))
        with pytest.raises(RestoreFailed) as failed:
            await node.prepare(_round(2, 0, 1, restore_step=6, restore_world=4, restore_ranks=(2, 2)), 2)
        assert failed.value.step == 6 and "rank 2's snapshot of step 6 is no longer here" in str(failed.value)
        assert node.holdings.inventory() == {}

    asyncio.run(go())


def test_a_rank_written_without_the_mark_makes_the_node_say_not_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def go() -> None:
        node = await _old_world(tmp_path / "snap", monkeypatch, (2, 5), (3, 5))
        monkeypatch.setenv(SNAPSHOT_DIR_VAR, str(node.holdings.rank_dir(3)))
        with worker_snapshots.snapshot(6) as f:  # rank 3 no longer says so
            f.write(b"3@6")
        read = node.read()
        assert read is not None and not read.replicated

    asyncio.run(go())
