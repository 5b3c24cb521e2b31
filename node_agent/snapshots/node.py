"""This node's side of in-memory snapshots (issue 35): the I/O the agent does for them.

- **Holding.** Each global rank's snapshots live in ``<runtime dir>/snapshots/r<rank>/`` (tmpfs,
  private to the agent and its workers, removed with the agent): ``holdings.py``. A worker
  writes there (``node_agent.worker.snapshot``); a replica from a peer lands there too; the
  whole is bounded by ``--snapshot-memory``: each snapshot file by an eighth of the per-rank
  share (see :func:`file_limit`), the replicas a peer sends by what is left.
- **Telling.** Every poll the holdings are read and handed to the machine
  (``SnapshotsRead``), which tells the server when they changed; the server's ``KeepSnapshot``
  comes back as :meth:`SnapshotNode.keep` (pinned, never pruned).
- **Replicating.** The server names one step for the whole job to copy
  (``KeepSnapshot.replicate``, see ``rdzv_server/restore_rules.py``); each local rank's
  snapshot of it is pushed to the round's ring peer (``Assignment.replica_to``) in the
  background, at ``--snapshot-replication-rate``, and offered again while the copy is missing:
  ``channel.py``. A job of one node has no peer: no replica server, no channel.
- **Restoring.** Before a round's workers start (:meth:`SnapshotNode.prepare`): snapshots of a
  job of another world size are dropped (they can never be restored), half-written ones and
  any newer than the round's restore step are removed (another attempt's, which some rank
  lacks), and every local rank the node does not hold at the restore step is fetched from the
  member the Assignment names. The workers' environment then says where to write and which
  step to restore (``worker_env``).

Only what a launch uses is loaded: until a worker writes its first snapshot the agent only
lists the ranks' empty folders at each poll (the holdings, ``pathlib`` and the channel's
crypto are imported then, or at the start of a job of several nodes, which serves replicas
from its first Join).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from protocol import Assignment

from ..agent_log import AgentLog
from ..config import AgentConfig
from ..machine.events import SnapshotsRead
from ..worker_env import RESTORE_STEP_VAR, SNAPSHOT_DIR_VAR, SNAPSHOT_LIMIT_VAR

if TYPE_CHECKING:
    from .channel import ReplicaServer, Replicator
    from .durable import DurableDir, Offer
    from .holdings import Holdings

__all__ = ["POLL_S", "SnapshotNode", "default_memory", "file_limit", "start_snapshots"]

# How often the holdings are read (a listing of a few small folders): a worker's new snapshot
# is told to the server at most this late, and with it the step every node copies.
POLL_S = 0.1
# Files one rank may have at once, worst case: its own two newest, a pinned older one and one
# being written; a peer's rank's two newest, a pinned one and one arriving.
FILES_PER_RANK = 8
PULL_TIMEOUT = 120.0  # one restore fetch (no rate limit: the training waits for it)
PUSH_TIMEOUT = 600.0
RETRY_S = 1.0  # a copy that failed is offered again after this long

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
    """Holdings, replica server and replicator of one agent (``replicate``: a job that can
    have several nodes; otherwise there is nobody to copy to or fetch from)."""

    def __init__(
        self,
        root: str,
        *,
        memory: int,
        nproc: int,
        rate: int,
        log: AgentLog,
        replicate: bool = True,
        durable: DurableDir | None = None,
    ) -> None:
        self.root = root
        self.memory = memory
        self.limit = file_limit(memory, nproc)
        self.rate = rate
        self.log = log
        self._holdings: Holdings | None = None
        self._seen = False  # a file appeared under the root (then the holdings are read)
        # Set when a peer's replica is complete: the holdings are read (and the server told)
        # at once, not at the next poll: until then the server cannot restore from it.
        self._wake = asyncio.Event()
        self.server: ReplicaServer | None = None
        self.replicator: Replicator | None = None
        self.key = ""
        self.port = 0
        if replicate:
            from .channel import ReplicaServer, Replicator, new_key

            self.key = new_key()
            self.server = ReplicaServer(self.holdings, key=self.key, on_received=self._wake.set)
            self.replicator = Replicator(rate=float(rate) if rate > 0 else None, timeout=PUSH_TIMEOUT)
        os.makedirs(root, 0o700, exist_ok=True)
        self.world = 0  # the running round's world size (0: none yet)
        self.local: range = range(0)  # its global ranks on this node
        self.copying = -1  # the step the server asked every node to copy (-1: none)
        self._offered: dict[int, float] = {}  # local rank -> when its copy was last offered
        self._poll: asyncio.Task[None] | None = None
        # --snapshot-dir (durable.py): what the next Join offers from it, the newest kept step
        # asked to be persisted (world, step, local ranks) and the task persisting.
        self.durable = durable
        self.offer: Offer | None = None
        self._persist_asked: tuple[int, int, range] | None = None
        self._persisted = -1
        self._persist_error = ""
        self._persisting: asyncio.Task[None] | None = None

    @property
    def holdings(self) -> Holdings:
        if self._holdings is None:
            from .holdings import Holdings

            self._holdings = Holdings(self.root, memory=self.memory, file_limit=self.limit)
        return self._holdings

    def _written(self) -> bool:
        """Whether anything was ever written here (a worker's snapshot, a peer's replica)."""
        if self._seen:
            return True
        try:
            with os.scandir(self.root) as folders:
                for folder in folders:
                    if folder.is_dir(follow_symlinks=False):
                        with os.scandir(folder.path) as names:
                            if next(names, None) is not None:
                                self._seen = True
                                break
        except OSError:
            pass
        return self._seen

    async def start(self, emit: Callable[[SnapshotsRead], None], addr: str) -> None:
        """Serve replicas (on every interface of this node's address family: a peer reaches us
        at the address the server has for this node) and start reading the holdings."""
        if self.server is not None:
            self.port = await self.server.start("::" if ":" in addr else "0.0.0.0", 0)
        if self.durable is not None:
            self.offer = await asyncio.to_thread(self._read_offer, self.durable)
        self._poll = asyncio.get_running_loop().create_task(self._polling(emit))

    def _read_offer(self, durable: DurableDir) -> Offer:
        from .durable import Offer, Refused

        try:
            durable.claim()  # checked, and this job's command line recorded or compared
            offer = durable.offer()
        except Refused as exc:
            # Not to be trusted, or another command line's: neither read nor written (nor
            # removed when this job succeeds); the job starts afresh.
            self.log(f"--snapshot-dir: {exc}: nothing restored from it, nothing persisted to it", "warning")
            self.durable = None
            return Offer()
        except OSError as exc:
            self.log(
                f"--snapshot-dir {durable.root}: unreadable ({exc}); nothing restored from it", "warning"
            )
            return Offer()
        if offer.steps:
            self.log(
                f"--snapshot-dir {durable.job}: snapshots of a {offer.world}-rank job, complete at "
                f"step{'s' if len(offer.steps) > 1 else ''} {', '.join(map(str, offer.steps))}"
            )
        return offer

    async def close(self, *, succeeded: bool = False) -> None:
        """Stop serving and polling; a persist under way finishes first (it is what a job
        lost whole falls back to). ``succeeded``: the job is done, its persisted snapshots go."""
        if self._poll is not None:
            self._poll.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll
        if self._persisting is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._persisting
        if succeeded and self.durable is not None:
            await asyncio.to_thread(self.durable.forget)
        if self.replicator is not None:
            await self.replicator.close()
        if self.server is not None:
            await self.server.close()

    def join_fields(self) -> dict[str, object]:
        """This node's Join fields: its replica port and key (none: it takes none) and the
        steps its snapshot directory offers (none: nothing complete there)."""
        fields: dict[str, object] = {}
        if self.port:
            fields.update(replica_port=self.port, replica_key=self.key)
        if self.offer is not None and self.offer.steps:
            fields.update(durable_world=self.offer.world, durable_steps=self.offer.steps)
        return fields

    # -- a round ---------------------------------------------------------------------------

    async def prepare(self, a: Assignment, nproc: int) -> None:
        """Before the round's workers start (none runs): the holdings fit the round, and every
        local rank's restore step is here."""
        self.local = range(a.rank_offset, a.rank_offset + nproc)
        self._offered = {}
        self.copying = -1
        if self.replicator is not None:
            if a.replica_to and a.replica_key:
                host, port = _split(a.replica_to)
                self.replicator.set_peer(host, port, a.replica_key)
            else:
                self.replicator.set_peer(None)
        world, self.world = self.world, a.world_size
        if self._written() or a.restore_step >= 0:  # a spare holds nothing yet: it fetches
            await self._fit(a, world)
        for rank in self.local:  # the workers' folders (NODE_AGENT_SNAPSHOT_DIR) exist
            if self._holdings is not None:
                self._holdings.rank_dir(rank)  # with the pins
            else:
                os.makedirs(self._rank_dir(rank), 0o700, exist_ok=True)

    async def _fit(self, a: Assignment, world: int) -> None:
        h = self.holdings
        if world and a.world_size != world:
            h.clear()  # another world size: those snapshots can never be restored
            self.log(f"round {a.round}: the job's world size changed; its in-memory snapshots are dropped")
        h.drop_partials()
        self._drop_after(a.restore_step)
        if a.restore_step < 0:
            return
        if a.restore_durable:
            await self._read_back(a)
            return
        fetched = 0
        for i, rank in enumerate(self.local):
            src = a.restore_source[i] if i < len(a.restore_source) else -1
            if src < 0 or h.path(rank, a.restore_step) is not None:
                continue
            fetched += await self._fetch(a, rank, src)
        how = f"; {fetched} fetched from peers" if fetched else ""
        self.log(f"round {a.round}: every rank restores the in-memory snapshot of step {a.restore_step}{how}")

    async def _fetch(self, a: Assignment, rank: int, src: int) -> int:
        from .channel import ReplicaError, pull

        host, port = _split(a.restore_addrs[src])
        try:
            key, step = a.restore_keys[src], a.restore_step
            await pull(host, port, key, rank, step, self.holdings, timeout=PULL_TIMEOUT)
        except (ReplicaError, OSError, asyncio.TimeoutError) as exc:
            # The worker finds no snapshot and says so (SnapshotMissing): the job restarts.
            self.log(
                f"round {a.round}: could not fetch rank {rank}'s snapshot of step {a.restore_step} "
                f"from {a.restore_addrs[src]}: {exc}",
                "error",
            )
            return 0
        return 1

    async def _read_back(self, a: Assignment) -> None:
        """Every local rank's snapshot of the restore step, from the snapshot directory."""
        durable, step = self.durable, a.restore_step
        if durable is None:  # not offered by us: the workers say what is missing
            self.log(
                f"round {a.round}: told to restore step {step} from a --snapshot-dir this node lacks", "error"
            )
            return
        started, size = time.monotonic(), 0
        for rank in self.local:
            if self.holdings.path(rank, step) is not None:
                continue
            try:
                size += await asyncio.to_thread(durable.read_into, self.holdings, a.world_size, rank, step)
            except (OSError, ValueError) as exc:
                # The worker finds no snapshot and says so (SnapshotMissing); the next Join
                # offers the step no more, so the job does not come back to it.
                why = f"could not read rank {rank}'s snapshot of step {step} from {durable.job}: {exc}"
                self.log(f"round {a.round}: {why}", "error")
                if self.offer is not None:
                    from .durable import Offer

                    self.offer = Offer(self.offer.world, tuple(s for s in self.offer.steps if s != step))
                return
        self._persisted = max(self._persisted, step)  # it is there already
        took = time.monotonic() - started
        self.log(
            f"round {a.round}: every rank restores the snapshot of step {step} persisted in --snapshot-dir "
            f"({len(self.local)} rank{'s' if len(self.local) != 1 else ''} read back, "
            f"{size / 2**20:.1f} MiB in {took:.2f} s)"
        )

    def _rank_dir(self, rank: int) -> str:
        return os.path.join(self.root, f"r{rank}")

    def worker_env(self, rank: int, restore_step: int) -> dict[str, str]:
        env = {SNAPSHOT_DIR_VAR: self._rank_dir(rank), SNAPSHOT_LIMIT_VAR: str(self.limit)}
        if restore_step >= 0:
            env[RESTORE_STEP_VAR] = str(restore_step)
        return env

    def keep(self, step: int, replicate: int = -1) -> None:
        """The server's choice: ``step`` is on two nodes for every rank (kept until a newer one
        comes), ``replicate`` is the step every node copies now (kept until copied)."""
        h = self.holdings
        h.pin(step, replicate)
        h.prune()
        self.copying = replicate if self.replicator is not None else -1
        self._offered = {}
        self._offer()
        if self.durable is not None and step > self._persisted and self.world:
            self._persist_asked = (self.world, step, self.local)
            if self._persisting is None or self._persisting.done():
                self._persisting = asyncio.get_running_loop().create_task(self._persist())

    async def _persist(self) -> None:
        """Persist the newest kept step, one at a time (a newer one asked meanwhile is next;
        those in between are skipped)."""
        durable = self.durable
        assert durable is not None
        while self._persist_asked is not None:
            world, step, ranks = self._persist_asked
            self._persist_asked = None
            if step <= self._persisted:
                continue
            started = time.monotonic()
            fds: list[int] = []
            try:
                # Opened now, while pinned: a newer keep may unpin it, an open file stays readable.
                for rank in ranks:
                    path = self.holdings.path(rank, step)
                    if path is None:
                        raise FileNotFoundError(f"rank {rank} has no snapshot of step {step} here")
                    fds.append(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC))
                size = await asyncio.to_thread(self._persist_step, durable, world, step, ranks, fds)
            except OSError as exc:
                if str(exc) != self._persist_error:  # once per cause, not at every kept step
                    self._persist_error = str(exc)
                    self.log(f"could not persist step {step}'s snapshot to {durable.job}: {exc}", "warning")
                continue
            finally:
                for fd in fds:
                    os.close(fd)
            self._persisted, self._persist_error = step, ""
            log_.debug("step %d persisted: %d bytes in %.2f s", step, size, time.monotonic() - started)

    def _persist_step(self, durable: DurableDir, world: int, step: int, ranks: range, fds: list[int]) -> int:
        size = sum(durable.persist(world, rank, step, fd) for rank, fd in zip(ranks, fds, strict=True))
        durable.prune(world, ranks)
        self.offer = durable.offer()
        return size

    def _offer(self) -> None:
        """Offer the copy of each local rank's snapshot of the step being copied, again after
        RETRY_S where a copy failed (the server waits for it)."""
        rep, step = self.replicator, self.copying
        if rep is None or step < 0 or rep.peer is None:
            return
        now = time.monotonic()
        pending = rep.pending()
        for rank in self.local:
            if rep.replicated.get(rank, -1) >= step or pending.get(rank) == step:
                continue
            if now - self._offered.get(rank, -RETRY_S) < RETRY_S:
                continue
            path = self.holdings.path(rank, step)
            if path is not None:
                self._offered[rank] = now
                rep.offer(rank, step, path)

    def _drop_after(self, step: int) -> None:
        """Complete snapshots newer than the restore step are another attempt's (some rank
        lacks them): never restored, and in the way of this attempt's."""
        h = self.holdings
        for rank, steps in h.inventory().items():
            for s in steps:
                if s > step:
                    path = h.path(rank, s)
                    if path is not None:
                        with contextlib.suppress(FileNotFoundError):
                            path.unlink()

    # -- the poll --------------------------------------------------------------------------

    async def _polling(self, emit: Callable[[SnapshotsRead], None]) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_S):
                    await self._wake.wait()
            self._wake.clear()
            try:
                read = self.read()
            except OSError as exc:  # the folder went away under us (the run ends)
                log_.debug("snapshot holdings unreadable: %s", exc)
                continue
            if read is not None:
                emit(read)

    def read(self) -> SnapshotsRead | None:
        """The holdings as the machine takes them (None: no round yet, or nothing ever written)."""
        if not self.world or not self._written():
            return None
        self._offer()
        inv = self.holdings.inventory()
        pairs = sorted(((r, s) for r, steps in inv.items() for s in steps), key=lambda p: (-p[1], p[0]))
        return SnapshotsRead(world_size=self.world, pairs=tuple(pairs))


async def start_snapshots(
    config: AgentConfig, runtime: str, addr: str, log: AgentLog, emit: Callable[[SnapshotsRead], None]
) -> SnapshotNode | None:
    """This agent's snapshot service, or None where the node has no memory for one."""
    memory = config.snapshot_memory if config.snapshot_memory is not None else default_memory()
    if memory <= 0 or file_limit(memory, config.nproc_per_node) <= 0:
        return None
    durable = None
    if config.snapshot_dir:
        from .durable import DurableDir, command_of, standalone_job

        loop = asyncio.get_running_loop()

        def warn(text: str) -> None:  # from the thread the directory is read in
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(log, text, "warning")

        rate = config.snapshot_replication_rate
        command = command_of(config)
        # A standalone job's id is random per launch: its relaunch finds its folder by its
        # command line (and another command line never does).
        job = standalone_job(command) if config.standalone else config.rdzv_id
        durable = DurableDir(
            config.snapshot_dir, job, rate=float(rate) if rate > 0 else None, command=command, warn=warn
        )
    node = SnapshotNode(
        os.path.join(runtime, "snapshots"),
        memory=memory,
        nproc=config.nproc_per_node,
        rate=config.snapshot_replication_rate,
        log=log,
        replicate=config.max_nodes > 1,
        durable=durable,
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
