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
  (``KeepSnapshot.replicate``, see ``rdzv_server/machine/restore_rules.py``); each local rank's
  snapshot of it is pushed to the round's ring peer (``Assignment.replica_to``) in the
  background, at ``--snapshot-replication-rate``, and offered again while the copy is missing:
  ``client.py`` (to a peer's ``server.py``, over ``wire.py``). A job of one node has no peer: no
  replica server, no channel.
- **Restoring.** Before a round's workers start (:meth:`SnapshotNode.prepare`): snapshots of a
  job of another world size are dropped (they can never be restored), but for the files the
  Assignment names when the workers marked their state as alike on every rank
  (``restore_world``: each local rank of the smaller world gets its own link to one of this
  node's old ranks' snapshots, no copy), half-written ones and
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
from ..machine.events import Effect, KeepSteps, SnapshotsRead
from ..parts import RoundPart, RoundStart, StartFailed
from ..runtime_dir import ensure_dir, remove_tree
from ..worker_env import (
    REPLICATED_MARK,
    RESTORE_DIGEST_VAR,
    RESTORE_STEP_VAR,
    SNAPSHOT_DIR_VAR,
    SNAPSHOT_LIMIT_VAR,
)

if TYPE_CHECKING:
    from ..supervisor.spec import GroupResult
    from .client import Replicator
    from .durable import DurableDir, Offer
    from .holdings import Holdings
    from .server import ReplicaServer

__all__ = ["POLL_S", "RestoreFailed", "SnapshotNode", "default_memory", "file_limit", "start_snapshots"]

# How often the holdings are read (a listing of a few small folders): a worker's new snapshot
# is told to the server at most this late, and with it the step every node copies.
POLL_S = 0.1
# Files one rank may have at once, worst case: its own two newest, a pinned older one and one
# being written; a peer's rank's two newest, a pinned one and one arriving.
FILES_PER_RANK = 8
PULL_TIMEOUT = 30.0  # between two reads of a restore fetch (no rate limit: the training waits)
# A whole fetch of one file: this long, plus its size at this rate (a 1 GiB file: 81 s);
# past it the next holder is tried, then the round is failed with the step it could not get.
FETCH_BASE_S = 30.0
FETCH_MIN_RATE = 20 << 20
PUSH_TIMEOUT = 600.0
RETRY_S = 1.0  # a copy that failed is offered again after this long

log_ = logging.getLogger("node_agent.snapshots")


class RestoreFailed(StartFailed):
    """A local rank's snapshot of the restore step could not be had from any holder the
    Assignment named (or none had the owner's bytes): the workers must not start; the server
    is told the step (WorkersFailed.restore_failed) and restores the next round from another."""

    def __init__(self, step: int, reason: str) -> None:
        super().__init__(reason)
        self.step = self.restore_failed = step


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


class SnapshotNode(RoundPart):
    """Holdings, replica server and replicator of one agent (``replicate``: a job that can
    have several nodes; otherwise there is nobody to copy to or fetch from).

    One of the agent's parts (``parts.py``): its Join says where it takes replicas
    (:meth:`join_fields`), each fresh Join gets a new key (:meth:`before_join`), each start
    fits the holdings to the round and restores (:meth:`before_start`), the workers' exit is
    read (:meth:`after_exit`), and ``KeepSteps`` is its effect (:meth:`carry_out`).
    """

    name = "snapshots"

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
        tls: bool = False,
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
        self.cert = ""  # the sha256 of our replica server's certificate ("": no TLS)
        self.tls = tls  # the rendezvous uses TLS: so does the replica channel (issue 42)
        # (rank, step) -> sha256 of the snapshots whose digest this node knows: its own ranks'
        # once pushed (the owner's digest the server holds copies to), fetched ones.
        self.digests: dict[tuple[int, int], str] = {}
        self._fetched: dict[int, str] = {}  # local rank -> the digest its worker checks
        self._replica_ranks: range = range(0)  # whose replicas we take (our ring predecessor's)
        self._push_steps: tuple[int, ...] = ()
        if replicate:
            from .client import Replicator
            from .server import ReplicaServer, new_key

            self.key = new_key()
            self.server = ReplicaServer(self.holdings, key=self.key, on_received=self._wake.set)
            self.replicator = Replicator(rate=float(rate) if rate > 0 else None, timeout=PUSH_TIMEOUT)
        ensure_dir(root)
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
            if self.tls:
                await self._start_tls(self.server)
            self.port = await self.server.start("::" if ":" in addr else "0.0.0.0", 0)
        if self.durable is not None:
            self.offer = await asyncio.to_thread(self._read_offer, self.durable)
        self._poll = asyncio.get_running_loop().create_task(self._polling(emit))

    async def _start_tls(self, server: ReplicaServer) -> None:
        from .replica_tls import ReplicaTLSError, make_server_tls

        try:
            tls = await asyncio.to_thread(make_server_tls, self.root)
        except ReplicaTLSError as exc:
            self.log(
                f"the snapshot replica channel runs without TLS ({exc}): its transfers are "
                "authenticated and checked, but not secret",
                "warning",
            )
            return
        server.ssl, self.cert = tls.context, tls.cert_sha256

    def new_key(self) -> None:
        """A new replica key for the next Join (issue 42): the server gives it to that round's
        members only, so a node that left can no longer read or write here."""
        if self.server is not None:
            from .server import new_key

            self.key = new_key()
            self.server.set_key(self.key)

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
            if self.cert:
                fields["replica_cert"] = self.cert
        if self.offer is not None and self.offer.steps:
            fields.update(durable_world=self.offer.world, durable_steps=self.offer.steps)
        return fields

    # -- the agent's part (parts.py) --------------------------------------------------------

    async def before_join(self) -> None:
        self.new_key()  # a new round: the keys of the last one end (issue 42)

    async def before_start(self, r: RoundStart) -> dict[int, dict[str, str]]:
        """The holdings fit for round ``r`` and its restore step here (else
        :class:`RestoreFailed`); each local rank's worker environment."""
        await self.prepare(r.assignment, r.nproc)
        return {rank: self.worker_env(rank, r.assignment.restore_step) for rank in self.local}

    def after_exit(self, result: GroupResult, *, stopped: bool) -> SnapshotsRead | None:
        """The holdings as the workers left them: the server hears them before our failure
        report or our next Join, so the round it forms restores the newest step."""
        return self.read()

    def carry_out(self, eff: Effect) -> bool:
        if not isinstance(eff, KeepSteps):
            return False
        self.keep(eff.step, eff.replicate)
        return True

    # -- a round ---------------------------------------------------------------------------

    async def prepare(self, a: Assignment, nproc: int) -> None:
        """Before the round's workers start (none runs): the holdings fit the round, and every
        local rank's restore step is here."""
        self.local = range(a.rank_offset, a.rank_offset + nproc)
        self._offered = {}
        self._fetched = {}
        self.copying = -1
        if ensure_dir(self.root):  # removed under us: what we knew of it is gone with it
            self._holdings, self.digests, self._seen = None, {}, False
        if self.replicator is not None:
            if a.replica_to and a.replica_key:
                host, port = _split(a.replica_to)
                self.replicator.set_peer(host, port, a.replica_key, cert_sha256=a.replica_cert)
            else:
                self.replicator.set_peer(None)
        if self.server is not None:
            # Only the ring predecessor's ranks, only at the step the server asks to copy.
            self._replica_ranks = range(a.replica_from, a.replica_from + a.replica_count)
            self._push_steps = ()
            self.server.allow_pushes(self._replica_ranks, ())
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
        try:
            aside = self._set_aside(a) if a.restore_world else None
        except RestoreFailed:
            h.clear()  # the old world's snapshots: never to be restored now
            raise
        if world and a.world_size != world:
            h.clear()  # another world size: those snapshots can never be restored
            if aside is None:
                self.log(f"round {a.round}: the world size changed: the in-memory snapshots are dropped")
        h.drop_partials()
        self._drop_after(a.restore_step)
        if aside is not None:
            self._carry(a, world, aside)
            return
        if a.restore_step < 0:
            return
        if a.restore_durable:
            await self._read_back(a)
            return
        fetched = 0
        received = self.server.received if self.server is not None else {}
        for i, rank in enumerate(self.local):
            step = a.restore_step
            digest = a.restore_digests[i] if i < len(a.restore_digests) else ""
            if h.path(rank, step) is not None:
                if digest and (rank, step) in received:
                    self._fetched[i] = digest  # a peer pushed it: its worker checks the bytes
                continue
            sources = [x for x in (_at(a.restore_source, i), _at(a.restore_alt, i)) if x >= 0]
            if not sources:
                continue  # held nowhere the server knows: the worker says it is missing
            await self._fetch(a, rank, list(dict.fromkeys(sources)), digest)
            self._fetched[i] = digest
            if digest:
                self.digests[(rank, step)] = digest
            fetched += 1
        how = f"; {fetched} fetched from peers" if fetched else ""
        self.log(f"round {a.round}: every rank restores the in-memory snapshot of step {a.restore_step}{how}")

    def _set_aside(self, a: Assignment) -> str:
        """The old ranks' snapshots the round restores from (state alike on every rank), moved
        out of the holdings before they are cleared; RestoreFailed where one is not here (the
        server restores the next round from another step)."""
        aside, step = f"{self.root}.carried", a.restore_step
        remove_tree(aside)
        for old in sorted(set(a.restore_ranks)):
            path = self.holdings.path(old, step)
            if path is None:
                raise RestoreFailed(step, f"rank {old}'s snapshot of step {step} is no longer here")
            try:
                os.makedirs(aside, 0o700, exist_ok=True)
                os.link(path, os.path.join(aside, f"r{old}"))
            except OSError as exc:
                why = f"could not keep rank {old}'s snapshot of step {step}: {exc}"
                raise RestoreFailed(step, why) from exc
        return aside

    def _carry(self, a: Assignment, world: int, aside: str) -> None:
        """Each local rank's snapshot of the restore step: a link to the old rank's file the
        Assignment names (one file for all, in node-local memory: nothing is copied)."""
        from .holdings import snap_name

        name = snap_name(a.restore_step)
        try:
            for i, rank in enumerate(self.local):
                old = a.restore_ranks[i] if i < len(a.restore_ranks) else a.restore_ranks[-1]
                target = self.holdings.rank_dir(rank) / name
                with contextlib.suppress(FileNotFoundError):
                    target.unlink()
                os.link(os.path.join(aside, f"r{old}"), target)
                # Still state every rank holds alike: restorable at yet another world size.
                (target.parent / REPLICATED_MARK).touch(0o600)
        finally:
            remove_tree(aside)
        olds = sorted(set(a.restore_ranks))
        self.log(
            f"round {a.round}: the job's world size changed ({world or a.restore_world} -> "
            f"{a.world_size} ranks); every rank restores the in-memory snapshot of step "
            f"{a.restore_step} of rank{'s' if len(olds) > 1 else ''} {', '.join(map(str, olds))} "
            "(state every rank holds alike); the other snapshots are dropped"
        )

    async def _fetch(self, a: Assignment, rank: int, sources: list[int], digest: str) -> None:
        """``rank``'s snapshot of the restore step from the first holder that has the owner's
        bytes (each tried twice where the connection failed, once where the holder refused);
        RestoreFailed when none does."""
        from .client import ReplicaError, pull

        step, said = a.restore_step, []
        deadline_s = FETCH_BASE_S + self.limit / FETCH_MIN_RATE
        for src in sources:
            addr = a.restore_addrs[src]
            host, port = _split(addr)
            cert = a.restore_certs[src] if src < len(a.restore_certs) else ""
            for _ in range(2):
                try:
                    await pull(
                        host, port, a.restore_keys[src], rank, step, self.holdings,
                        timeout=PULL_TIMEOUT, deadline=time.monotonic() + deadline_s,
                        expected_sha256=digest, cert_sha256=cert,
                    )  # fmt: skip
                    return
                except (ReplicaError, OSError) as exc:
                    said.append(f"from {addr}: {exc}")
                    self.log(
                        f"round {a.round}: could not fetch rank {rank}'s snapshot of step {step} "
                        f"from {addr}: {exc}",
                        "warning",
                    )
                    if isinstance(exc, ReplicaError) and exc.remote:
                        break  # the holder refused: asking again gets the same answer
        raise RestoreFailed(
            step, f"could not fetch rank {rank}'s snapshot of step {step} ({'; '.join(said)})"
        )

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
            digest = self._fetched.get(rank - self.local.start, "") if rank in self.local else ""
            if digest:
                env[RESTORE_DIGEST_VAR] = digest
        return env

    def keep(self, step: int, replicate: int = -1) -> None:
        """The server's choice: ``step`` is on two nodes for every rank (kept until a newer one
        comes), ``replicate`` is the step every node copies now (kept until copied)."""
        h = self.holdings
        h.pin(step, replicate)
        h.prune()
        self.copying = replicate if self.replicator is not None else -1
        if self.server is not None and replicate >= 0 and replicate not in self._push_steps:
            # The step being copied now, and the one before (a push of it may be under way).
            self._push_steps = (replicate, *self._push_steps[:1])
            self.server.allow_pushes(self._replica_ranks, self._push_steps)
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
        return SnapshotsRead(
            world_size=self.world,
            pairs=tuple(pairs),
            digests=self._digests_of(pairs),
            replicated=self._replicated(),
        )

    def _replicated(self) -> bool:
        """Every local rank's worker marked its snapshots as state every rank holds alike."""
        return bool(self.local) and all(
            os.path.exists(os.path.join(self._rank_dir(rank), REPLICATED_MARK)) for rank in self.local
        )

    def _digests_of(self, pairs: list[tuple[int, int]]) -> tuple[str, ...]:
        """The digest of each pair this node knows (issue 42): its own ranks' once pushed (the
        owner's), the replicas it received (computed as they came), the ones it fetched."""
        known = self.digests
        if self.replicator is not None:
            for rank, (step, digest) in self.replicator.replicated_digest.items():
                known[(rank, step)] = digest
        if self.server is not None:
            known.update(self.server.received)
        held = set(pairs)
        for gone in [p for p in known if p not in held]:
            del known[gone]
        return tuple(known.get(p, "") for p in pairs)


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
        # The rendezvous is private (TLS): so are the snapshots the nodes send each other.
        tls=config.tls_ca is not None,
    )
    try:
        await node.start(emit, addr)
    except OSError as exc:
        log(f"in-memory snapshots are off: cannot serve replicas ({exc})", "warning")
        await node.close()
        return None
    return node


def _at(items: tuple[int, ...], i: int) -> int:
    return items[i] if i < len(items) else -1


def _split(addr: str) -> tuple[str, int]:
    """ "host:port" or "[v6]:port" -> (host, port)."""
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)
