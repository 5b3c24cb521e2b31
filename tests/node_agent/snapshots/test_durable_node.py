"""The agent's side of --snapshot-dir (node_agent/snapshots/node.py with durable.py): a kept step
is persisted for the node's ranks, a newer one asked meanwhile is next, what the Join offers
follows the directory, a durable restore reads the ranks back, a failing directory warns once."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

from node_agent.agent_log import AgentLog
from node_agent.snapshots.durable import DurableDir, Offer
from node_agent.snapshots.holdings import snap_name
from node_agent.snapshots.node import SnapshotNode
from protocol import Assignment


def _node(tmp_path: Path, name: str = "mem") -> tuple[SnapshotNode, io.StringIO]:
    out = io.StringIO()
    durable = DurableDir(tmp_path / "dir", "job")
    node = SnapshotNode(
        str(tmp_path / name),
        memory=1 << 20,
        nproc=2,
        rate=0,
        log=AgentLog(out),
        replicate=False,
        durable=durable,
    )
    node.world, node.local = 2, range(0, 2)
    return node, out


def _write(node: SnapshotNode, step: int) -> None:
    for rank in node.local:
        (node.holdings.rank_dir(rank) / snap_name(step)).write_bytes(f"r{rank}s{step}".encode())


def _assignment(step: int, durable: bool) -> Assignment:
    return Assignment(
        job_id="job", round=1, group_rank=0, group_world_size=1, rank_offset=0, world_size=2,
        master_addr="127.0.0.1", master_port=29500, restart_count=1, max_restarts=3,
        restore_step=step, restore_durable=durable,
    )  # fmt: skip


def test_kept_steps_are_persisted_and_offered_and_read_back(tmp_path: Path) -> None:
    async def go() -> None:
        node, _ = _node(tmp_path)
        await node.start(lambda _read: None, "127.0.0.1")
        assert node.join_fields() == {}  # nothing persisted yet
        for step in (3, 4, 5):
            _write(node, step)
        node.keep(3)
        assert node._persisting is not None
        await node._persisting
        node.keep(4)
        node.keep(5)  # asked before 4's persist began: 4 is skipped
        await node._persisting
        assert sorted(p.name for p in (tmp_path / "dir" / "job" / "w2" / "r1").iterdir()) == [
            snap_name(3),
            snap_name(5),
        ]
        assert node.join_fields() == {"durable_world": 2, "durable_steps": (5, 3)}
        await node.close()

        # A relaunch (a fresh node, memory empty) offers it and reads it back when told to.
        again, out = _node(tmp_path, "mem2")
        await again.start(lambda _read: None, "127.0.0.1")
        assert again.offer == Offer(2, (5, 3))
        assert "snapshots of a 2-rank job, complete at steps 5, 3" in out.getvalue()
        await again.prepare(_assignment(5, durable=True), 2)
        for rank in (0, 1):
            path = again.holdings.path(rank, 5)
            assert path is not None and path.read_bytes() == f"r{rank}s5".encode()
        assert (
            "every rank restores the snapshot of step 5 persisted in --snapshot-dir (2 ranks"
            in out.getvalue()
        )
        await again.close(succeeded=True)
        assert not (tmp_path / "dir" / "job").exists()

    asyncio.run(go())


def test_a_directory_that_cannot_be_written_warns_once_and_training_goes_on(tmp_path: Path) -> None:
    async def go() -> None:
        node, out = _node(tmp_path)
        (tmp_path / "dir").write_text("a file where the directory should be")
        await node.start(lambda _read: None, "127.0.0.1")
        assert "unreadable" in out.getvalue() and node.join_fields() == {}
        for step in (1, 2):
            _write(node, step)
            node.keep(step)
            assert node._persisting is not None
            await node._persisting
        assert out.getvalue().count("could not persist") == 1, out.getvalue()
        await node.close()

    asyncio.run(go())


def test_a_file_missing_from_the_directory_is_said_and_no_longer_offered(tmp_path: Path) -> None:
    async def go() -> None:
        node, out = _node(tmp_path)
        await node.start(lambda _read: None, "127.0.0.1")
        node.offer = Offer(2, (7, 6))  # as if read at start; the files went since
        await node.prepare(_assignment(7, durable=True), 2)
        assert "could not read rank 0's snapshot of step 7" in out.getvalue()
        assert node.join_fields() == {"durable_world": 2, "durable_steps": (6,)}
        await node.close()

    asyncio.run(go())
