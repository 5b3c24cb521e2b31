"""The agent's replica server: peers push replicas into this node's holdings and pull its
ranks' snapshots back (the wire: ``wire.py``; the peers' side: ``client.py``).

Each agent runs a :class:`ReplicaServer` on its :class:`~node_agent.snapshots.holdings.Holdings`,
with a key of its own (:func:`new_key`, a new one at every Join: ``wire.py``'s header).

**Pushes only where the server asked.** The server takes a push only of the ranks and steps the
agent allowed (:meth:`ReplicaServer.allow_pushes`: the ring predecessor's ranks, the step being
replicated); nothing before the first call. Another is refused before a byte is written, and
counted (``refused_pushes``). A pull may read any held (rank, step) with the current key.

**TLS.** When the rendezvous uses TLS, each agent's server has an ephemeral self-signed
certificate (``replica_tls.py``) whose sha256 the rendezvous relays beside the key (the client
pins it: ``client.py``). Without one, the channel is authenticated and checked, not secret. The
server does its TLS handshake inside the connection's handler, so a connection stuck in it
counts against the caps below and is bounded by the same deadline.

**Caps a stranger cannot fill.** At most ``max_connections`` connections are served at once; a
connection that has not proven the key within ``handshake_timeout`` (from its accept, TLS
included) is closed. A new connection over the cap evicts the oldest one that has not
authenticated; when every one has, the newcomer is closed at once. One address has at most
``max_unauthenticated_per_host`` unauthenticated connections: its next one evicts its oldest. An
authenticated transfer is never evicted by a newcomer.

Everything a peer sends is bounded: the request (``wire.parse_request``), a file's size (the
holdings' per-file limit and memory bound, checked before a byte is taken), the time to
authenticate and between any two reads, the connections at once, and the memory per connection
(one chunk: a file is never read whole). A peer's mistake gets a short error reply and a closed
connection, never a ``.part`` left behind; the server goes on serving the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import ssl
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass

from .holdings import Holdings, HoldingsError, hash_fd, write_all
from .wire import (
    CHALLENGE_BYTES,
    CHUNK,
    LEN,
    MAC_BYTES,
    MAGIC,
    MAX_HEADER,
    MAX_REASON,
    BadRequest,
    Request,
    parse_request,
    reply_mac,
    request_mac,
)

__all__ = ["ReplicaServer", "new_key"]

log = logging.getLogger("node_agent.snapshots")

OLD_KEYS = 8  # former keys remembered, only to say "stale key" rather than "not authenticated"
MAX_RECEIVED = 4096  # digests of received replicas remembered at most (those still held)
BACKLOG = 100  # connections the kernel queues before our accept (asyncio's default)
ACCEPT_RETRY_S = 1.0  # out of descriptors: the next accept waits this long (asyncio's too)
# A connection reset before we took it: the next accept goes on at once.
_ACCEPT_TRANSIENT = frozenset({errno.ECONNABORTED, errno.ECONNRESET, errno.EPROTO, errno.EINTR, errno.EAGAIN})


def new_key() -> str:
    """A fresh secret for this agent's replica server (256 bits, hex)."""
    return secrets.token_hex(32)


class _Conn:
    """One connection's state, for replies: the challenge and header the MACs bind."""

    def __init__(self, writer: asyncio.StreamWriter, key: str, timeout: float) -> None:
        self.writer = writer
        self.key = key
        self.timeout = timeout
        self.challenge = os.urandom(CHALLENGE_BYTES)
        self.header = b""
        self.index = 0
        self.greeted = False  # the greeting went out (after TLS): an error reply can follow it

    async def reply(self, **fields: object) -> None:
        body = json.dumps(fields, separators=(",", ":")).encode()
        mac = reply_mac(self.key, self.index, self.challenge, self.header, body)
        self.index += 1
        self.writer.write(LEN.pack(len(body)) + body + mac)
        async with asyncio.timeout(self.timeout):
            await self.writer.drain()


@dataclass(eq=False)
class _Slot:
    """A connection counted against the caps: whence, and whether it proved the key."""

    sock: socket.socket
    host: str
    handed: bool = False  # the socket is the event loop's (its transport closes it)
    authenticated: bool = False


class ReplicaServer:
    """Serves pushes into and pulls from ``holdings`` to the job's other agents; see the header.

    ``handshake_timeout``: from a connection's accept until its request is authenticated (TLS
    handshake included). ``idle_timeout``: between any two reads or writes after that."""

    def __init__(
        self,
        holdings: Holdings,
        *,
        key: str,
        ssl: ssl.SSLContext | None = None,
        max_connections: int = 8,
        max_unauthenticated_per_host: int = 4,
        handshake_timeout: float = 3.0,
        idle_timeout: float = 30.0,
        chunk: int = CHUNK,
        on_received: Callable[[], None] | None = None,
    ) -> None:
        _check_key(key)
        if max_connections < 1 or max_unauthenticated_per_host < 1:
            raise ValueError("max_connections and max_unauthenticated_per_host must be >= 1")
        self.holdings = holdings
        self.on_received = on_received  # a replica is complete: the agent tells the server now
        self.key = key
        self.ssl = ssl
        self.max_connections = max_connections
        self.max_unauthenticated_per_host = max_unauthenticated_per_host
        self.handshake_timeout = handshake_timeout
        self.idle_timeout = idle_timeout
        self.chunk = chunk
        self.refused_busy = 0  # connections closed at once: max_connections were authenticated
        self.evicted = 0  # unauthenticated connections closed to make room for a newcomer
        self.refused_pushes = 0  # authenticated pushes of a rank or step not allowed
        self._old_keys: deque[str] = deque(maxlen=OLD_KEYS)
        self._push_ranks: range = range(0)
        self._push_steps: Collection[int] = frozenset()
        self._received: dict[tuple[int, int], str] = {}
        self._listener: socket.socket | None = None
        self._acceptor: asyncio.Task[None] | None = None
        # Every connection's handler (close() cancels them), and those counted against the caps,
        # oldest first: an evicted one leaves the count at once, its handler ends soon after.
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots: dict[asyncio.Task[None], _Slot] = {}

    @property
    def connections(self) -> int:
        """Connections counted now (being served, not evicted)."""
        return len(self._slots)

    @property
    def unauthenticated(self) -> int:
        """Connections counted now that have not proven the key yet."""
        return sum(not slot.authenticated for slot in self._slots.values())

    def set_key(self, key: str) -> None:
        """From now on, requests must prove ``key`` (the agent's key for its new round); one
        proving a former key is refused as stale. Transfers authenticated before go on."""
        _check_key(key)
        if key != self.key:
            self._old_keys.append(self.key)
            self.key = key

    def allow_pushes(self, ranks: range, steps: Collection[int]) -> None:
        """Take pushes of ``ranks``' snapshots at ``steps`` only (in place of those allowed
        before): the ring predecessor's global ranks and the step being replicated. ``steps``
        may be a ``range``; nothing is allowed before the first call."""
        if not isinstance(ranks, range):
            raise TypeError("ranks: a range of global ranks")
        self._push_ranks = ranks
        self._push_steps = steps if isinstance(steps, range) else frozenset(steps)

    @property
    def received(self) -> dict[tuple[int, int], str]:
        """(rank, step) -> sha256 of each replica this server received that is still held."""
        self._prune_received()
        return dict(self._received)

    def _prune_received(self) -> None:
        for rank_step in [rs for rs in self._received if self.holdings.path(*rs) is None]:
            del self._received[rank_step]

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on ``host:port`` (an address, e.g. ``0.0.0.0`` or ``::``; port 0: a free one);
        returns the port."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        if not infos:
            raise OSError(f"cannot listen on {host!r}: no address")
        family, _, _, _, address = infos[0]
        # Our own accept loop, not asyncio.start_server: each connection is counted against the
        # caps from its accept, and its TLS handshake (if any) happens in its handler, on a fresh
        # transport (upgrading a stream loses the bytes it read: cpython#142352, uvloop#707).
        sock = socket.create_server(address, family=family, backlog=BACKLOG)
        sock.setblocking(False)
        self._listener = sock
        self._acceptor = loop.create_task(self._accept(sock), name="snapshot-replica-accept")
        return int(sock.getsockname()[1])

    async def close(self) -> None:
        """Stop listening and end the connections in flight (their ``.part`` files go)."""
        if self._acceptor is not None:
            self._acceptor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._acceptor
            self._acceptor = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for slot in list(self._slots.values()):
            if not slot.handed:
                slot.sock.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._slots.clear()

    # -- the caps ----------------------------------------------------------------------------

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, address = await loop.sock_accept(listener)
            except OSError as exc:
                if exc.errno not in _ACCEPT_TRANSIENT:  # out of descriptors, say: wait, as asyncio does
                    log.warning("snapshot replica: cannot accept a connection: %s", exc)
                    await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            host = str(address[0]) if isinstance(address, tuple) and address else str(address)
            slot = self._take_slot(sock, host)
            if slot is None:
                self.refused_busy += 1
                sock.close()  # before the challenge: costs nothing, says nothing
                continue
            task = loop.create_task(self._handle(slot, address), name="snapshot-replica-conn")
            self._slots[task] = slot
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _take_slot(self, sock: socket.socket, host: str) -> _Slot | None:
        """Count a new connection, evicting an unauthenticated one where a cap is reached;
        None: every slot holds an authenticated transfer, the newcomer goes."""
        waiting = [t for t, slot in self._slots.items() if not slot.authenticated]  # oldest first
        same = [t for t in waiting if self._slots[t].host == host]
        if len(same) >= self.max_unauthenticated_per_host:
            self._evict(same[0])
        elif len(self._slots) >= self.max_connections:
            if not waiting:
                return None
            self._evict(waiting[0])
        return _Slot(sock, host)

    def _evict(self, task: asyncio.Task[None]) -> None:
        slot = self._slots.pop(task)
        self.evicted += 1
        if not slot.handed:  # its handler has not run yet: it never will
            slot.sock.close()
        task.cancel()  # its handler ends at once, saying nothing

    def _authenticate(self, challenge: bytes, header: bytes, mac: bytes) -> str:
        """The key the request proves (the current one), else why it is refused."""
        if hmac.compare_digest(mac, request_mac(self.key, challenge, header)):
            return self.key
        if any(hmac.compare_digest(mac, request_mac(old, challenge, header)) for old in self._old_keys):
            raise BadRequest("stale key: this node has a new key since (the job's rounds moved on)")
        raise BadRequest("not authenticated (another job's key?)")

    def _push_allowed(self, req: Request) -> None:
        if req.rank in self._push_ranks and req.step in self._push_steps:
            return
        self.refused_pushes += 1
        what = f"rank {req.rank} step {req.step}"
        if not self._push_ranks or not self._push_steps:
            raise BadRequest(f"push not asked: this node takes no replica now ({what})")
        ranks = self._push_ranks
        raise BadRequest(
            f"push not asked: {what} (this node takes ranks {ranks[0]}-{ranks[-1]} at the step copied)"
        )

    # -- a connection ------------------------------------------------------------------------

    async def _open(self, slot: _Slot) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The accepted socket as streams, after the TLS handshake when the server has TLS."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        # No await between here and the loop taking the socket: cancelled before, we close it.
        slot.handed = True
        transport, _ = await loop.connect_accepted_socket(
            lambda: protocol,
            slot.sock,
            ssl=self.ssl,
            ssl_handshake_timeout=self.handshake_timeout if self.ssl is not None else None,
        )
        return reader, asyncio.StreamWriter(transport, protocol, reader, loop)

    async def _handle(self, slot: _Slot, peer: object) -> None:
        writer: asyncio.StreamWriter | None = None
        conn: _Conn | None = None
        try:
            async with asyncio.timeout(self.handshake_timeout):  # from the accept to the key proven
                reader, writer = await self._open(slot)
                conn = _Conn(writer, self.key, self.idle_timeout)
                header, mac = await self._handshake(reader, conn)
            conn.header = header
            conn.key = self._authenticate(conn.challenge, header, mac)
            slot.authenticated = True  # from here on, no newcomer evicts it
            req = parse_request(header, self.holdings.file_limit)
            if req.op == "push":
                self._push_allowed(req)
                await self._receive(reader, conn, req)
            else:
                await self._send(conn, req)
        except (BadRequest, OSError, EOFError, TimeoutError) as exc:
            reason = str(exc) or type(exc).__name__
            if isinstance(exc, asyncio.IncompleteReadError):
                reason = "the connection ended early"
            elif isinstance(exc, TimeoutError):
                reason = "too slow: timed out"
            # A stranger's noise (a scan, a half-open connection) is no news; a peer's mistake is.
            level = logging.INFO if slot.authenticated or isinstance(exc, BadRequest) else logging.DEBUG
            log.log(level, "snapshot replica: refused %s: %s", peer, reason)
            if conn is not None and conn.greeted and writer is not None and not _closing(writer):
                with contextlib.suppress(OSError, TimeoutError, RuntimeError):
                    await conn.reply(ok=False, error=reason[:MAX_REASON])
        except Exception:
            if writer is not None and _closing(writer):  # uvloop's RuntimeError on a closed transport
                log.debug("snapshot replica: the connection from %s was closed", peer, exc_info=True)
            else:  # our own bug: say so loudly, but keep serving the others
                log.exception("snapshot replica: the connection from %s failed", peer)
        finally:
            task = asyncio.current_task()
            if task is not None and self._slots.get(task) is slot:
                del self._slots[task]
            if writer is not None:
                writer.close()
            elif not slot.handed:
                slot.sock.close()

    async def _handshake(self, reader: asyncio.StreamReader, conn: _Conn) -> tuple[bytes, bytes]:
        """The greeting out, the request's header and MAC in (not checked yet)."""
        conn.writer.write(MAGIC + conn.challenge)
        conn.greeted = True
        await conn.writer.drain()
        (n,) = LEN.unpack(await reader.readexactly(LEN.size))
        if n > MAX_HEADER:  # refused on its length: the body is never buffered
            raise BadRequest(f"header over {MAX_HEADER} bytes")
        header = await reader.readexactly(n)
        return header, await reader.readexactly(MAC_BYTES)

    async def _receive(self, reader: asyncio.StreamReader, conn: _Conn, req: Request) -> None:
        h = self.holdings
        if h.path(req.rank, req.step) is not None:
            await conn.reply(ok=True, held=True)
            return
        try:
            part = h.admit(req.rank, req.step, req.size)
        except HoldingsError as exc:
            raise BadRequest(str(exc)) from None
        try:
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                await conn.reply(ok=True, go=True)
                digest = hashlib.sha256()
                left = req.size
                while left:
                    try:
                        async with asyncio.timeout(self.idle_timeout):
                            data = await reader.read(min(self.chunk, left))
                    except TimeoutError:
                        raise BadRequest(f"no bytes for {self.idle_timeout:g} s") from None
                    if not data:
                        raise BadRequest(f"the stream ended {left} bytes short")
                    write_all(fd, data)  # tmpfs: a memory copy, no disk wait in the loop
                    digest.update(data)
                    left -= len(data)
            finally:
                os.close(fd)
            if digest.hexdigest() != req.sha256:
                raise BadRequest("sha256 mismatch: the bytes are not the ones announced")
            h.complete(req.rank, req.step, part)
        except BaseException:
            h.abandon(req.rank, req.step)
            raise
        self._record(req.rank, req.step, req.sha256)
        # Debug only: with a snapshot every step it would be two console lines a step a node.
        log.debug("snapshot replica: received rank %d step %d (%d bytes)", req.rank, req.step, req.size)
        if self.on_received is not None:
            self.on_received()
        await conn.reply(ok=True)

    def _record(self, rank: int, step: int, sha256: str) -> None:
        self._received.pop((rank, step), None)  # newest last: the oldest go first past the bound
        self._received[(rank, step)] = sha256
        self._prune_received()  # those no longer held go (complete() pruned the rank)
        while len(self._received) > MAX_RECEIVED:
            del self._received[next(iter(self._received))]

    async def _send(self, conn: _Conn, req: Request) -> None:
        path = self.holdings.path(req.rank, req.step)
        try:
            # One fd for the hash and the bytes: a worker may replace the name meanwhile.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW) if path is not None else -1
        except FileNotFoundError:
            fd = -1
        if fd < 0:
            raise BadRequest(f"not held: rank {req.rank} step {req.step}")
        try:
            size = os.fstat(fd).st_size
            digest = await asyncio.to_thread(hash_fd, os.dup(fd), size, self.chunk)
            await conn.reply(ok=True, size=size, sha256=digest)
            offset = 0
            while offset < size:
                data = os.pread(fd, min(self.chunk, size - offset), offset)
                if not data:
                    raise OSError("the snapshot shrank while it was sent")
                conn.writer.write(data)
                async with asyncio.timeout(self.idle_timeout):
                    await conn.writer.drain()
                offset += len(data)
        finally:
            os.close(fd)


def _closing(writer: asyncio.StreamWriter) -> bool:
    return writer.transport.is_closing()


def _check_key(key: str) -> None:
    if len(key) < 16:
        raise ValueError("the replica key is too short to be a secret")
