"""This node's side of in-memory snapshots (issue 35): the I/O the agent does for them.

- **Holding.** Each global rank's snapshots live in ``<runtime dir>/snapshots/r<rank>/`` (tmpfs,
  private to the agent and its workers, removed with the agent): ``holdings.py``. A worker
  writes there (``node_agent.worker.snapshot``); a replica from a peer lands there too; the
  whole is bounded by ``--snapshot-memory``: each snapshot file by an eighth of the per-rank
  share (see :func:`file_limit`), the replicas a peer sends by what is left.
- **Telling.** Every poll the holdings are read and handed to the machine
  (``SnapshotsRead``), which tells the server when they changed; the server's ``KeepSnapshot``
  comes back as :meth:`SnapshotNode.keep` (pinned, never pruned).
- **Replicating.** Each new complete snapshot of a local rank is offered to the replicator,
  which pushes the newest one of each rank to the round's ring peer (``Assignment.replica_to``)
  in the background, at ``--snapshot-replication-rate``: ``channel.py``.
- **Restoring.** Before a round's workers start (:meth:`SnapshotNode.prepare`): snapshots of a
  job of another world size are dropped (they can never be restored), half-written ones and
  any newer than the round's restore step are removed (another attempt's, which some rank
  lacks), and every local rank the node does not hold at the restore step is fetched from the
  member the Assignment names. The workers' environment then says where to write and which
  step to restore (``worker_env``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from protocol import Assignment

from ..agent_log import AgentLog
from ..config import AgentConfig
from ..machine.events import SnapshotsRead
from .channel import ReplicaError, ReplicaServer, Replicator, new_key, pull
from .holdings import Holdings

__all__ = ["POLL_S", "SnapshotNode", "default_memory", "file_limit", "start_snapshots"]

DIR_VAR = "NODE_AGENT_SNAPSHOT_DIR"
LIMIT_VAR = "NODE_AGENT_SNAPSHOT_LIMIT"
RESTORE_VAR = "NODE_AGENT_RESTORE_STEP"
POLL_S = 0.25  # how often the holdings are read (a listing of a few small folders)
# Files one rank may have at once, worst case: its own two newest, a pinned older one and one
# being written; a peer's rank's two newest, a pinned one and one arriving.
FILES_PER_RANK = 8
PULL_TIMEOUT = 120.0  # one restore fetch (no rate limit: the training waits for it)
PUSH_TIMEOUT = 600.0

log_ = logging.getLogger("node_agent.snapshots")


def default_memory(shm: str = "/dev/shm") -> int:
    """``--snapshot-memory auto``: a quarter of the node's tmpfs (0 where there is none)."""
    try:
        st = os.statvfs(shm)
    except OSError:
        return 0
    return st.f_frsize * st.f_blocks // 4


def file_limit(memory: int, nproc: int) -> int:
    """The most one snapshot file may hold: an eighth of each local rank's share."""
    return memory // (FILES_PER_RANK * max(1, nproc))


class SnapshotNode:
    """Holdings, replica server and replicator of one agent."""

    def __init__(
        self, root: str, *, memory: int, nproc: int, rate: int, log: AgentLog, tls: object | None = None
    ) -> None:
        self.memory = memory
        self.limit = file_limit(memory, nproc)
        self.holdings = Holdings(root, memory=memory, file_limit=self.limit)
        self.key = new_key()
        self.rate = rate
        self.log = log
        self.server = ReplicaServer(self.holdings, key=self.key)
        self.replicator = Replicator(rate=float(rate) if rate > 0 else None, timeout=PUSH_TIMEOUT)
        self.port = 0
        self.world = 0  # the running round's world size (0: none yet)
        self.local: range = range(0)  # its global ranks on this node
        self._offered: dict[int, int] = {}  # local rank -> newest step offered to the replicator
        self._poll: asyncio.Task[None] | None = None

    async def start(self, emit: Callable[[SnapshotsRead], None], addr: str) -> None:
        """Serve replicas (on every interface of this node's address family: a peer reaches us
        at the address the server has for this node) and start reading the holdings."""
        self.port = await self.server.start("::" if ":" in addr else "0.0.0.0", 0)
        self._poll = asyncio.get_running_loop().create_task(self._polling(emit))

    async def close(self) -> None:
        if self._poll is not None:
            self._poll.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll
        await self.replicator.close()
        await self.server.close()

    def join_fields(self) -> tuple[int, str]:
        """This node's replica port and key, for its Join."""
        return self.port, self.key

    # -- a round ---------------------------------------------------------------------------

    async def prepare(self, a: Assignment, nproc: int) -> None:
        """Before the round's workers start (none runs): the holdings fit the round, and every
        local rank's restore step is here."""
        if self.world and a.world_size != self.world:
            self.holdings.clear()  # another world size: those snapshots can never be restored
            self.log(f"round {a.round}: the job's world size changed; its in-memory snapshots are dropped")
        self.world = a.world_size
        self.local = range(a.rank_offset, a.rank_offset + nproc)
        self._offered = {}
        self.holdings.drop_partials()
        self._drop_after(a.restore_step)
        if a.replica_to and a.replica_key:
            host, port = _split(a.replica_to)
            self.replicator.set_peer(host, port, a.replica_key)
        else:
            self.replicator.set_peer(None)
        if a.restore_step < 0:
            return
        fetched = 0
        for i, rank in enumerate(self.local):
            src = a.restore_source[i] if i < len(a.restore_source) else -1
            if src < 0 or self.holdings.path(rank, a.restore_step) is not None:
                continue
            host, port = _split(a.restore_addrs[src])
            try:
                await pull(
                    host, port, a.restore_keys[src], rank, a.restore_step, self.holdings, timeout=PULL_TIMEOUT
                )
                fetched += 1
            except (ReplicaError, OSError, asyncio.TimeoutError) as exc:
                # The worker finds no snapshot and says so (SnapshotMissing): the job restarts.
                self.log(
                    f"round {a.round}: could not fetch rank {rank}'s snapshot of step {a.restore_step} "
                    f"from {a.restore_addrs[src]}: {exc}",
                    "error",
                )
        how = f"; {fetched} fetched from peers" if fetched else ""
        self.log(f"round {a.round}: every rank restores the in-memory snapshot of step {a.restore_step}{how}")

    def worker_env(self, rank: int, restore_step: int) -> dict[str, str]:
        env = {DIR_VAR: str(self.holdings.rank_dir(rank)), LIMIT_VAR: str(self.limit)}
        if restore_step >= 0:
            env[RESTORE_VAR] = str(restore_step)
        return env

    def keep(self, step: int) -> None:
        """Every rank has ``step`` on two nodes: keep it until a newer one comes."""
        self.holdings.pin(step)
        self.holdings.prune()

    def _drop_after(self, step: int) -> None:
        """Complete snapshots newer than the restore step are another attempt's (some rank
        lacks them): never restored, and in the way of this attempt's."""
        for rank, steps in self.holdings.inventory().items():
            for s in steps:
                if s > step:
                    path = self.holdings.path(rank, s)
                    if path is not None:
                        with contextlib.suppress(FileNotFoundError):
                            path.unlink()

    # -- the poll --------------------------------------------------------------------------

    async def _polling(self, emit: Callable[[SnapshotsRead], None]) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            try:
                read = self.read()
            except OSError as exc:  # the folder went away under us (the run ends)
                log_.debug("snapshot holdings unreadable: %s", exc)
                continue
            if read is not None:
                emit(read)

    def read(self) -> SnapshotsRead | None:
        """The holdings as the machine takes them; offers new local snapshots for replication."""
        if not self.world:
            return None
        inv = self.holdings.inventory()
        for rank in self.local:
            steps = inv.get(rank)
            if steps and steps[0] > self._offered.get(rank, -1):
                path = self.holdings.path(rank, steps[0])
                if path is not None:
                    self._offered[rank] = steps[0]
                    self.replicator.offer(rank, steps[0], path)
        pairs = sorted(((r, s) for r, steps in inv.items() for s in steps), key=lambda p: (-p[1], p[0]))
        return SnapshotsRead(world_size=self.world, pairs=tuple(pairs))


async def start_snapshots(
    config: AgentConfig, runtime: str, addr: str, log: AgentLog, emit: Callable[[SnapshotsRead], None]
) -> SnapshotNode | None:
    """This agent's snapshot service, or None where the node has no memory for one."""
    memory = config.snapshot_memory if config.snapshot_memory is not None else default_memory()
    if memory <= 0 or file_limit(memory, config.nproc_per_node) <= 0:
        return None
    node = SnapshotNode(
        str(Path(runtime) / "snapshots"),
        memory=memory,
        nproc=config.nproc_per_node,
        rate=config.snapshot_replication_rate,
        log=log,
    )
    try:
        await node.start(emit, addr)
    except OSError as exc:
        log(f"in-memory snapshots are off: cannot serve replicas ({exc})", "warning")
        await node.close()
        return None
    return node


def _split(addr: str) -> tuple[str, int]:
    """ "host:port" or "[v6]:port" -> (host, port)."""
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)
