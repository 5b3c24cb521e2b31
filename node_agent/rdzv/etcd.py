"""``--rdzv-backend etcd`` (and ``etcd-v2``): the rendezvous machine, replicated through etcd.

There is no rendezvous server. The job's state lives in etcd as an append-only *log of the
machine's input events* (a node connected, a node sent a message, a node's lease expired, a
deadline passed), each entry stamped with its proposer's wall clock. etcd orders the entries
(its revision is a total order every watcher sees alike), and every agent feeds them, in that
order, into its own copy of :class:`rdzv_server.machine.state.Rendezvous`, the very machine the
daemon runs. The machine is deterministic with time passed in, so every copy reaches the same
state and computes the same effects; each agent carries out only those addressed to its own
connection. Nothing is lost when etcd restarts (its data dir keeps the log), and a highly
available etcd cluster replaces the single server.

Under ``PREFIX/JOB/``:

- ``log/<lease>/<n>``: entries, msgpack, never rewritten.
- ``alive/<lease>``: one per agent, attached to its lease. The lease is liveness: an agent
  that dies or freezes stops refreshing it, etcd deletes the key after the TTL, and whoever
  sees the deletion first proposes "disconnected". Heartbeats are not logged.
- ``gone/<lease>``, ``tick/<deadline>``: compare-and-swap guards, so that of all the agents
  that notice a lost node or a passed deadline, exactly one appends the entry.

A connection's id in the machine is its agent's lease id, unique in the etcd cluster. When a
newcomer finds the log of a job nobody is in any more (every earlier node left or died), it
deletes that log in a transaction that fails if anyone wrote meanwhile, so an old run's
entries are not replayed for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import socket
import ssl
import time
from collections.abc import Callable

import msgpack

from protocol import (
    CLIENT_MESSAGES,
    SUPPORTED_VERSIONS,
    Error,
    Heartbeat,
    Hello,
    Message,
    Progress,
    Stacks,
    Welcome,
    encode,
)
from protocol.codec import decode_payload
from protocol.errors import ProtocolError
from protocol.records import record
from rdzv_server.machine.state import Close, Connected, Disconnected, Effect, Received, Rendezvous, Send, Tick

from ..config import AgentConfig, ConfigError
from . import NotARendezvousServer, RendezvousRefused, RendezvousUnreachable
from .etcd_client import (
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    KeyValue,
    WatchCompacted,
    absent,
    delete_range_op,
    prefix_end,
    put_op,
    unchanged_since,
)
from .server import retry_until

DEFAULT_ETCD_PREFIX = "/node-agent/rdzv/v1"
ENTRY_VERSION = 1
MIN_LEASE_TTL = 2  # etcd's own minimum lease TTL is about 1.5 s
SOFTWARE = "node-agent/0.1 (etcd)"
CLOSE_FLUSH_TIMEOUT = 3.0

CONNECTED, RECEIVED, DISCONNECTED, TICK = "connected", "received", "disconnected", "tick"
_KINDS = (CONNECTED, RECEIVED, DISCONNECTED, TICK)


class BadLogEntry(Exception):
    """An entry in etcd that this agent cannot read: written by an incompatible version?"""


@record(frozen=True, slots=True)
class Entry:
    """One input event of the replicated machine."""

    kind: str
    now: float  # the proposer's wall clock
    conn: int = 0
    peer: str = ""
    msg: Message | None = None
    reason: str = ""


def encode_entry(entry: Entry) -> bytes:
    payload = encode(entry.msg)[4:] if entry.msg is not None else b""  # the frame minus its length
    return msgpack.packb(
        {
            "v": ENTRY_VERSION,
            "k": entry.kind,
            "now": entry.now,
            "c": entry.conn,
            "p": entry.peer,
            "m": payload,
            "r": entry.reason,
        },
        use_bin_type=True,
    )


def decode_entry(data: bytes) -> Entry:
    try:
        raw = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # on purpose: msgpack fails in many ways (ValueError, ExtraData, RecursionError)
        raise BadLogEntry(f"not msgpack ({type(exc).__name__})") from None
    if not isinstance(raw, dict) or raw.get("v") != ENTRY_VERSION:
        version = raw.get("v") if isinstance(raw, dict) else None
        raise BadLogEntry(f"entry version {version!r}; this agent reads version {ENTRY_VERSION}")
    kind, now, conn = raw.get("k"), raw.get("now"), raw.get("c")
    peer, payload, reason = raw.get("p", ""), raw.get("m", b""), raw.get("r", "")
    if kind not in _KINDS or not isinstance(now, int | float) or not isinstance(conn, int):
        raise BadLogEntry(f"malformed entry {raw!r:.120}")
    if not isinstance(peer, str) or not isinstance(reason, str) or not isinstance(payload, bytes):
        raise BadLogEntry(f"malformed entry {raw!r:.120}")
    msg = None
    if kind == RECEIVED:
        try:
            msg = decode_payload(payload, allowed=CLIENT_MESSAGES)
        except ProtocolError as exc:
            raise BadLogEntry(f"bad message in entry: {exc}") from None
    return Entry(kind=kind, now=float(now), conn=conn, peer=peer, msg=msg, reason=reason)


class Replica:
    """One agent's copy of the job's rendezvous machine, fed the log in etcd's order."""

    def __init__(self) -> None:
        self.machine = Rendezvous(expire_silent=False)  # liveness is the leases' job
        self.now = 0.0

    def apply(self, entry: Entry) -> list[Effect]:
        # Proposers' clocks differ a little: time in the machine never runs backwards.
        self.now = now = max(self.now, entry.now)
        conns = self.machine.conns
        if entry.kind == CONNECTED:
            if entry.conn in conns:
                return []
            return self.machine.handle(Connected(entry.conn, entry.peer), now)
        if entry.kind == RECEIVED:
            # A message can trail its sender's removal (another agent logged the expiry first).
            if entry.conn not in conns or entry.msg is None:
                return []
            return self.machine.handle(Received(entry.conn, entry.msg), now)
        if entry.kind == DISCONNECTED:
            return self.machine.handle(Disconnected(entry.conn, entry.reason or "connection closed"), now)
        return self.machine.handle(Tick(), now)

    @property
    def idle(self) -> bool:
        return not self.machine.conns and not self.machine.jobs


@record(frozen=True, slots=True)
class _Closed:
    reason: str


def etcd_url(config: AgentConfig) -> str:
    protocol = config.rdzv_conf.extra.get("protocol", "http").lower()
    if protocol not in ("http", "https"):
        raise ConfigError(f"--rdzv-conf protocol={protocol!r}: use http or https")
    host = config.rdzv_host
    if ":" in host:
        host = f"[{host}]"
    return f"{protocol}://{host}:{config.rdzv_port}"


def etcd_ssl_context(config: AgentConfig) -> ssl.SSLContext | None:
    """From torch's etcd keys (cacert, cert, key) or etcd-v2's (ca_cert, ssl_cert, ssl_cert_key)."""
    extra = config.rdzv_conf.extra
    cacert = extra.get("cacert") or extra.get("ca_cert")
    cert = extra.get("cert") or extra.get("ssl_cert")
    key = extra.get("key") or extra.get("ssl_cert_key")
    if not (cacert or cert):
        return None
    try:
        ctx = ssl.create_default_context(cafile=cacert) if cacert else ssl.create_default_context()
        if cert:
            ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"--rdzv-conf etcd TLS files: {exc}") from None
    return ctx


def _local_ip_towards(host: str, port: int) -> str:
    """The address of the interface that routes to host (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except (OSError, IndexError):
        return socket.gethostname()


class EtcdBackend:
    """Links through etcd: each one a new lease, and a new connection in the replicated machine."""

    reconnects = True
    # The Join is stored in etcd for every agent of the job to read, and nothing there can be
    # resumed by a secret (any agent may write any entry).
    snapshots = False
    standby_port = 0  # never hosts as a standby (issue 45: server.py's links only)
    shares_joins = True

    def __init__(
        self,
        config: AgentConfig,
        *,
        log: Callable[..., None],
        clock: Callable[[], float],
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.log = log
        self.clock = clock  # the agent's monotonic clock: the join deadline
        self.wall = wall  # the time our log entries carry (see the module header)

    async def connect(self, deadline: float) -> EtcdConnection:
        return await EtcdConnection.open(
            self.config, deadline=deadline, log=self.log, clock=self.clock, wall=self.wall
        )

    async def close(self, *, linger: bool) -> None:
        return None


class EtcdConnection:
    """Stands in for the connection to a rendezvous server, with etcd in between."""

    challenge = ""  # etcd's own auth and TLS protect the store; there is no server nonce

    def __init__(
        self,
        client: EtcdClient,
        prefix: bytes,
        lease: int,
        ttl: int,
        local_ip: str,
        log: Callable[..., None],
        wall: Callable[[], float],
    ) -> None:
        self.client = client
        self.wall = wall  # the proposer's clock our entries carry, and our ticks wait on
        self.prefix = prefix
        self.lease = lease
        self.ttl = ttl
        self.local_ip = local_ip
        self._log = log
        self.replica = Replica()
        self.applied_revision = 0
        self._inbox: asyncio.Queue[Message | _Closed] = asyncio.Queue()
        self._outbox: asyncio.Queue[tuple[Entry, bytes | None, int]] = asyncio.Queue()
        self._seq = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._tick_task: asyncio.Task[None] | None = None
        self._tick_at: float | None = None
        self._closed = False
        self._problem = ""

    # -- keys ------------------------------------------------------------------------------

    def _key(self, *parts: str) -> bytes:
        return self.prefix + "/".join(parts).encode()

    def _log_key(self) -> bytes:
        self._seq += 1
        return self._key("log", f"{self.lease:016x}", f"{self._seq:010d}")

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        config: AgentConfig,
        *,
        deadline: float,
        log: Callable[..., None],
        clock: Callable[[], float],
        wall: Callable[[], float],
    ) -> EtcdConnection:
        url = etcd_url(config)
        client = EtcdClient(url, ssl_context=etcd_ssl_context(config))
        ttl = max(MIN_LEASE_TTL, math.ceil(config.rdzv_conf.heartbeat_timeout))
        try:
            lease = await _grant_lease(client, ttl, url=url, deadline=deadline, log=log, clock=clock)
        except BaseException:
            await client.close()
            raise
        base = config.rdzv_conf.extra.get("etcd_prefix", DEFAULT_ETCD_PREFIX).rstrip("/")
        prefix = f"{base}/{config.rdzv_id}/".encode()
        local_ip = _local_ip_towards(config.rdzv_host, config.rdzv_port)
        conn = cls(client, prefix, lease, ttl, local_ip, log, wall)
        try:
            await conn._start(deadline, clock)
        except BaseException:
            await conn.close()
            raise
        return conn

    async def _start(self, deadline: float, clock: Callable[[], float]) -> None:
        try:
            await self.client.put(self._key("alive", str(self.lease)), b"", lease=self.lease)
            revision, kvs = await self.client.range(self.prefix)
            alive = await self._load(revision, kvs)
        except (EtcdUnavailable, EtcdError) as exc:
            raise RendezvousUnreachable(
                f"etcd at {self.client.base_url} failed during the join: {exc}"
            ) from None
        for conn_id in sorted(set(self.replica.machine.conns) - alive):
            # Its agent died with nobody left to notice (its lease is gone): say so now.
            self._propose_disconnect(conn_id, "gone (its etcd lease expired)")
        self._tasks = [
            asyncio.create_task(self._append_loop()),
            asyncio.create_task(self._watch_loop()),
            asyncio.create_task(self._keepalive_loop()),
        ]
        now = self.wall()
        self._append(Entry(CONNECTED, now, self.lease, peer=self.local_ip))
        self._append(
            Entry(RECEIVED, now, self.lease, msg=Hello(versions=SUPPORTED_VERSIONS, software=SOFTWARE))
        )
        try:
            first = await asyncio.wait_for(self._inbox.get(), timeout=max(0.1, deadline - clock()))
        except asyncio.TimeoutError:
            raise RendezvousUnreachable(
                f"no answer through etcd at {self.client.base_url} before the join timeout"
            ) from None
        if isinstance(first, Error):
            raise RendezvousRefused(
                f"the rendezvous in etcd at {self.client.base_url} refused us: {first.message}"
            )
        if not isinstance(first, Welcome):
            what = first.reason if isinstance(first, _Closed) else first.TYPE
            raise NotARendezvousServer(f"unexpected answer through etcd at {self.client.base_url}: {what}")

    async def _load(self, revision: int, kvs: list[KeyValue]) -> set[int]:
        """Rebuild the replica from a range read; returns the connections etcd holds alive."""
        alive: set[int] = set()
        entries: list[KeyValue] = []
        for kv in kvs:
            rest = kv.key[len(self.prefix) :]
            if rest.startswith(b"alive/"):
                with contextlib.suppress(ValueError):
                    alive.add(int(rest[len(b"alive/") :]))
            elif rest.startswith(b"log/"):
                entries.append(kv)
        for kv in entries:
            self.replica.apply(decode_entry(kv.value))
        if self.replica.idle and entries:
            # A finished (or abandoned) run's log: clear it, unless an entry was written since
            # our read. An agent that read the old log before we cleared it holds an idle
            # replica, which decides exactly as an empty one does.
            log_prefix = self._key("log/")
            cleared = await self.client.txn(
                [unchanged_since(log_prefix, prefix_end(log_prefix), revision)],
                [
                    delete_range_op(self._key("log/"), prefix_end(self._key("log/"))),
                    delete_range_op(self._key("gone/"), prefix_end(self._key("gone/"))),
                    delete_range_op(self._key("tick/"), prefix_end(self._key("tick/"))),
                ],
            )
            if cleared:
                self.replica = Replica()
        self.applied_revision = revision
        return alive

    # -- the connection interface ----------------------------------------------------------

    def send(self, msg: Message) -> None:
        if self._closed or isinstance(msg, Heartbeat):
            return  # liveness is the lease, refreshed by _keepalive_loop
        if isinstance(msg, Progress | Stacks):
            # Progress summaries and stacks are for a server's surfaces (etcd has none) and
            # change nothing the job's log must keep: never written to etcd.
            return
        self._append(Entry(RECEIVED, self.wall(), self.lease, msg=msg))

    async def receive(self) -> Message:
        item = await self._inbox.get()
        if isinstance(item, _Closed):
            self._inbox.put_nowait(item)  # every later receive fails the same way
            raise ConnectionError(item.reason)
        return item

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._tasks and not self._tasks[0].done():
            # Say we are gone now rather than after the lease's TTL, then let the lease go.
            self._propose_disconnect(self.lease, "connection closed")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._outbox.join(), CLOSE_FLUSH_TIMEOUT)
        tasks = [t for t in [*self._tasks, self._tick_task] if t is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for t in tasks:
            exc = None if t.cancelled() else t.exception()
            if exc is not None:
                # A bug of ours in a background task (the watch re-raises one after telling the
                # agent): its traceback is said here, where the link ends, not lost with it.
                import traceback

                tb = "".join(traceback.format_exception(exc)).rstrip()
                self._log(f"internal error in the etcd backend: {exc!r} (a bug in node-agent)\n{tb}", "error")
        with contextlib.suppress(EtcdUnavailable, EtcdError):
            await self.client.revoke(self.lease)
        await self.client.close()

    # -- appending -------------------------------------------------------------------------

    def _append(self, entry: Entry, guard: bytes | None = None, guard_lease: int = 0) -> None:
        self._outbox.put_nowait((entry, guard, guard_lease))

    def _propose_disconnect(self, conn_id: int, reason: str) -> None:
        self._append(
            Entry(DISCONNECTED, self.wall(), conn_id, reason=reason), guard=self._key("gone", str(conn_id))
        )

    async def _append_loop(self) -> None:
        """Write our entries one at a time, in order, riding out etcd restarts."""
        while True:
            entry, guard, guard_lease = await self._outbox.get()
            try:
                value = encode_entry(entry)
                key = self._log_key()
                while True:
                    try:
                        if guard is None:
                            await self.client.put(key, value)
                        else:
                            await self.client.txn(
                                [absent(guard)], [put_op(guard, b"", guard_lease), put_op(key, value)]
                            )
                        self._etcd_ok()
                        break
                    except EtcdUnavailable as exc:
                        await self._etcd_trouble(exc)
                    except EtcdError as exc:
                        self._lose(f"etcd refused an update of the rendezvous: {exc}")
                        return
            finally:
                self._outbox.task_done()

    # -- watching --------------------------------------------------------------------------

    async def _watch_loop(self) -> None:
        while True:
            try:
                async for batch in self.client.watch(self.prefix, self.applied_revision + 1):
                    for event in batch:
                        self._on_change(event.kind, event.kv)
                        self.applied_revision = max(self.applied_revision, event.kv.mod_revision)
                    self._etcd_ok()
                    self._schedule_tick()
            except WatchCompacted:
                await self._resync()
            except EtcdUnavailable as exc:
                await self._etcd_trouble(exc)
            except BadLogEntry as exc:
                self._lose(f"cannot read the rendezvous log in etcd: {exc}")
                return
            except Exception as exc:  # a bug of ours in the replica: fail this agent loudly
                self._lose(f"internal error replaying the rendezvous log: {exc!r}")
                raise

    def _on_change(self, kind: str, kv: KeyValue) -> None:
        rest = kv.key[len(self.prefix) :]
        if rest.startswith(b"log/") and kind == "PUT":
            self._deliver(self.replica.apply(decode_entry(kv.value)))
        elif rest.startswith(b"alive/") and kind == "DELETE":
            try:
                conn_id = int(rest[len(b"alive/") :])
            except ValueError:
                return
            if conn_id == self.lease:
                if not self._closed:
                    self._lose(f"our etcd lease expired (no refresh for {self.ttl} s)")
            elif conn_id in self.replica.machine.conns:
                self._propose_disconnect(conn_id, f"went silent (its etcd lease of {self.ttl} s expired)")

    async def _resync(self) -> None:
        """The watch fell behind a compaction: rebuild from a fresh read, deliver what is new."""
        revision, kvs = await self.client.range(self.prefix)
        seen = self.applied_revision
        self.replica = Replica()
        for kv in kvs:
            if kv.key[len(self.prefix) :].startswith(b"log/"):
                effects = self.replica.apply(decode_entry(kv.value))
                if kv.create_revision > seen:
                    self._deliver(effects)
        self.applied_revision = revision

    def _deliver(self, effects: list[Effect]) -> None:
        for eff in effects:
            if isinstance(eff, Send) and eff.conn == self.lease:
                self._inbox.put_nowait(eff.msg)
            elif isinstance(eff, Close) and eff.conn == self.lease:
                self._inbox.put_nowait(_Closed(f"the rendezvous closed our connection: {eff.reason}"))

    def _lose(self, why: str) -> None:
        self._inbox.put_nowait(_Closed(why))

    # -- time ------------------------------------------------------------------------------

    def _schedule_tick(self) -> None:
        deadline = self.replica.machine.next_deadline()
        if deadline == self._tick_at:
            return
        if self._tick_task is not None:
            self._tick_task.cancel()
            self._tick_task = None
        self._tick_at = deadline
        if deadline is not None:
            self._tick_task = asyncio.create_task(self._tick_when_due(deadline))

    async def _tick_when_due(self, deadline: float) -> None:
        await asyncio.sleep(max(0.0, deadline - self.wall()))
        # Whoever of the agents gets here first logs the tick; the guard stops the others.
        self._append(
            Entry(TICK, max(self.wall(), deadline), self.lease),
            guard=self._key("tick", repr(deadline)),
            guard_lease=self.lease,
        )

    async def _keepalive_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                left = await self.client.keepalive(self.lease)
            except EtcdUnavailable as exc:
                await self._etcd_trouble(exc, pause=False)
                continue
            except EtcdError as exc:
                left, why = 0, str(exc)
            else:
                why = ""
                self._etcd_ok()
            if left <= 0:
                self._lose(f"etcd no longer has our lease {why}".strip())
                return

    # -- etcd trouble ----------------------------------------------------------------------

    async def _etcd_trouble(self, exc: Exception, *, pause: bool = True) -> None:
        problem = str(exc)
        if not self._problem:
            self._log(
                f"lost etcd at {self.client.base_url} ({problem}); the workers keep running, retrying",
                "warning",
            )
        self._problem = problem
        if pause:
            await asyncio.sleep(0.2 + 0.3 * random.random())

    def _etcd_ok(self) -> None:
        if self._problem:
            self._log(f"etcd at {self.client.base_url} answers again")
            self._problem = ""


async def _grant_lease(
    client: EtcdClient,
    ttl: int,
    *,
    url: str,
    deadline: float,
    log: Callable[..., None],
    clock: Callable[[], float],
) -> int:
    """Our lease, retrying an unreachable etcd until deadline (the join timeout)."""
    try:
        return await retry_until(
            lambda: client.grant(ttl),
            retry_on=(EtcdUnavailable,),
            describe=str,
            deadline=deadline,
            clock=clock,
            waiting=lambda problem: log(f"waiting for etcd at {url}: {problem}; retrying"),
            give_up=lambda problem: RendezvousUnreachable(
                f"no etcd answered at {url} ({problem}); gave up after the join timeout. "
                "Is etcd (3.4 or later, v3 API) running there?"
            ),
        )
    except EtcdError as exc:
        raise NotARendezvousServer(f"{url} does not answer as etcd's v3 API: {exc}") from None
