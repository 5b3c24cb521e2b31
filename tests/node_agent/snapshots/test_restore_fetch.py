"""A restore fetch as the agent makes it (issue 42): the owner's digest is checked, the second
holder is tried when the first fails, and when no holder has the owner's bytes no worker may
start (RestoreFailed, which the agent reports as the step it could not get)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import socket
from pathlib import Path

import pytest

from node_agent.agent_log import AgentLog
from node_agent.snapshots.holdings import snap_name
from node_agent.snapshots.node import RestoreFailed, SnapshotNode
from node_agent.worker_env import RESTORE_DIGEST_VAR
from protocol import Assignment

OWNERS = b"the owner's snapshot of rank 1, step 7"


def _node(root: Path) -> tuple[SnapshotNode, io.StringIO]:
    out = io.StringIO()
    node = SnapshotNode(str(root), memory=8 << 20, nproc=1, rate=0, log=AgentLog(out), replicate=True)
    return node, out


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: nobody listens there


def _plan(holders: list[tuple[int, str]]) -> Assignment:
    """Rank 1 of a 2-rank job restores step 7 from the first holder, else the second."""
    return Assignment(
        job_id="job", round=3, group_rank=1, group_world_size=2, rank_offset=1, world_size=2,
        master_addr="127.0.0.1", master_port=29500, restart_count=1, max_restarts=3,
        restore_step=7, restore_source=(0,), restore_alt=(1,) if len(holders) > 1 else (),
        restore_addrs=tuple(f"127.0.0.1:{port}" for port, _ in holders),
        restore_keys=tuple(key for _, key in holders),
        restore_digests=(hashlib.sha256(OWNERS).hexdigest(),),
    )  # fmt: skip


def test_a_fetch_tries_the_second_holder_and_checks_the_owners_digest(tmp_path: Path) -> None:
    async def go() -> None:
        good, _ = _node(tmp_path / "good")
        forger, _ = _node(tmp_path / "forger")
        me, said = _node(tmp_path / "me")
        for n in (good, forger, me):
            await n.start(lambda _read: None, "127.0.0.1")
        try:
            (good.holdings.rank_dir(1) / snap_name(7)).write_bytes(OWNERS)
            (forger.holdings.rank_dir(1) / snap_name(7)).write_bytes(b"a planted pickle")
            # The first holder is down, the second has the owner's bytes: fetched from it.
            await me.prepare(_plan([(_dead_port(), "ab" * 32), (good.port, good.key)]), 1)
            assert (me.holdings.rank_dir(1) / snap_name(7)).read_bytes() == OWNERS
            assert me.worker_env(1, 7)[RESTORE_DIGEST_VAR] == hashlib.sha256(OWNERS).hexdigest()
            assert "1 fetched from peers" in said.getvalue()
            # A holder whose bytes are not the owner's, then one that is down: nothing is kept,
            # and the workers must not start.
            again, said = _node(tmp_path / "again")
            await again.start(lambda _read: None, "127.0.0.1")
            try:
                with pytest.raises(RestoreFailed) as failed:
                    await again.prepare(_plan([(forger.port, forger.key), (_dead_port(), "cd" * 32)]), 1)
                assert failed.value.step == 7
                assert "could not fetch rank 1's snapshot of step 7" in str(failed.value)
                assert again.holdings.path(1, 7) is None
            finally:
                await again.close()
        finally:
            for n in (good, forger, me):
                await n.close()

    asyncio.run(go())
