"""The agent-to-agent snapshot channel: push a replica to a peer, pull a rank's snapshot back.

Each agent runs a :class:`ReplicaServer` on its :class:`Holdings`. A node pushes its ranks'
snapshots of the step the server asked to its ring peer in the background (:class:`Replicator`,
rate-limited, one at a time, skipping to the newest), so losing any one node loses no rank; at a
restart a node pulls the snapshots of the step the server picked from whoever holds them
(:func:`pull`).

The wire, one request per connection (TLS first, when the server has a certificate):

    server: MAGIC (8 bytes) + challenge (32 random bytes, fresh per connection)
    client: len (4, big-endian) + header (JSON, <= 4 KiB) + HMAC-SHA256(key, "request" + challenge + header)
    server: reply frames: len + body (JSON) + HMAC-SHA256(key, "reply" + n + challenge + header + body)
    push:   header {v, op: "push", rank, step, size, sha256, nonce}
            -> {ok, go} then the client streams exactly ``size`` bytes -> {ok} | {ok: false, error}
            -> {ok, held}: the peer has it already, nothing is sent
    pull:   header {v, op: "pull", rank, step, nonce} -> {ok, size, sha256} then ``size`` bytes

**Keys per round.** ``key`` is a random secret of the receiving agent (:func:`new_key`) that the
rendezvous relays only to the round's other members; the agent picks a new one at every Join
(:meth:`ReplicaServer.set_key`), so a node that left the job, or was left out of the round, can
neither read nor write here with the key it was given: its requests are refused as "stale key".
A connection already authenticated finishes its transfer. The client proves it holds the key
over the server's fresh challenge, so a recorded request cannot be replayed; the server proves
it back over the client's fresh nonce, so a stranger cannot pose as a peer. Each MAC covers the
header, and the header (or the authenticated pull reply) carries the data's sha256: an on-path
attacker can cut a transfer but not change its bytes unnoticed.

**Pushes only where the server asked.** The server takes a push only of the ranks and steps the
agent allowed (:meth:`ReplicaServer.allow_pushes`: the ring predecessor's ranks, the step being
replicated); nothing before the first call. Another is refused before a byte is written, and
counted (``refused_pushes``). A pull may read any held (rank, step) with the current key.

**TLS.** When the rendezvous uses TLS, each agent's server has an ephemeral self-signed
certificate (``replica_tls.py``) whose sha256 the rendezvous relays beside the key; a client given
that fingerprint (``cert_sha256``) speaks TLS, verifies no chain, and refuses a server whose
certificate has another ("certificate mismatch"). Without one, the channel is authenticated and
checked, not secret. The server does its TLS handshake inside the connection's handler, so a
connection stuck in it counts against the caps below and is bounded by the same deadline.

**Caps a stranger cannot fill.** At most ``max_connections`` connections are served at once; a
connection that has not proven the key within ``handshake_timeout`` (from its accept, TLS
included) is closed. A new connection over the cap evicts the oldest one that has not
authenticated; when every one has, the newcomer is closed at once. One address has at most
``max_unauthenticated_per_host`` unauthenticated connections: its next one evicts its oldest. An
authenticated transfer is never evicted by a newcomer.

Everything a peer sends is bounded: the header's size and every field, a file's size (the
holdings' per-file limit and memory bound, checked before a byte is taken), the time to
authenticate and between any two reads, a whole pull (``deadline``), the connections at once,
and the memory per connection (one chunk: a file is never read whole). A peer's mistake gets a
short error reply and a closed connection, never a ``.part`` left behind; the server goes on
serving the others. A pull given the owner's digest (``expected_sha256``, from the rendezvous)
takes nothing else, whatever the holder announces.
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
import struct
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from .holdings import MAX_RANK, MAX_STEP, Holdings, HoldingsError
from .replica_tls import client_context, peer_cert_sha256

__all__ = [
    "CHUNK",
    "MAGIC",
    "MAX_HEADER",
    "BadRequest",
    "ReplicaError",
    "ReplicaServer",
    "Replicator",
    "Request",
    "TokenBucket",
    "file_sha256",
    "new_key",
    "parse_request",
    "pull",
    "push",
    "reply_mac",
    "request_mac",
]

log = logging.getLogger("node_agent.snapshots")

VERSION = 1
MAGIC = b"PETSNAP1"
CHALLENGE_BYTES = 32
MAC_BYTES = 32
MAX_HEADER = 4096
CHUNK = 1 << 20  # bytes per read and write: a connection's memory stays near this
_LEN = struct.Struct(">I")
_HEX = frozenset("0123456789abcdef")
_MAX_REASON = 200  # an error reply's text is cut here: a peer's words go into our logs
OLD_KEYS = 8  # former keys remembered, only to say "stale key" rather than "not authenticated"
MAX_RECEIVED = 4096  # digests of received replicas remembered at most (those still held)
BACKLOG = 100  # connections the kernel queues before our accept (asyncio's default)
ACCEPT_RETRY_S = 1.0  # out of descriptors: the next accept waits this long (asyncio's too)
# A connection reset before we took it: the next accept goes on at once.
_ACCEPT_TRANSIENT = frozenset({errno.ECONNABORTED, errno.ECONNRESET, errno.EPROTO, errno.EINTR, errno.EAGAIN})


class ReplicaError(Exception):
    """A push or pull failed. ``remote``: the peer said why (``reason``); else the connection or
    this node failed."""

    def __init__(self, reason: str, *, remote: bool) -> None:
        super().__init__(f"peer refused: {reason}" if remote else reason)
        self.reason = reason
        self.remote = remote


class BadRequest(Exception):
    """A peer's request is malformed, unauthenticated or cannot be served (the reply's text)."""


def new_key() -> str:
    """A fresh secret for this agent's replica server (256 bits, hex)."""
    return secrets.token_hex(32)


def request_mac(key: str, challenge: bytes, header: bytes) -> bytes:
    return hmac.new(key.encode(), b"request\0" + challenge + header, hashlib.sha256).digest()


def reply_mac(key: str, index: int, challenge: bytes, header: bytes, body: bytes) -> bytes:
    # The length of the header is bound in too: no byte can move between header and body.
    msg = b"reply\0" + bytes([index]) + challenge + _LEN.pack(len(header)) + header + body
    return hmac.new(key.encode(), msg, hashlib.sha256).digest()


# -- requests: pure parsing ------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Request:
    op: str  # "push" | "pull"
    rank: int
    step: int
    size: int = 0  # push only
    sha256: str = ""  # push only


def _is_hex(value: object, lo: int, hi: int) -> TypeGuard[str]:
    return isinstance(value, str) and lo <= len(value) <= hi and set(value) <= _HEX


def _int_field(doc: dict[str, Any], name: str, below: int) -> int:
    value = doc.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < below:
        raise BadRequest(f"{name}: not an integer in [0, {below})")
    return value


def parse_request(raw: bytes, file_limit: int) -> Request:
    """A request header, every field checked; unknown fields are ignored (a newer peer's)."""
    if len(raw) > MAX_HEADER:
        raise BadRequest(f"header over {MAX_HEADER} bytes")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise BadRequest("header: not JSON") from None
    if not isinstance(doc, dict):
        raise BadRequest("header: not an object")
    if doc.get("v") != VERSION:
        raise BadRequest(f"v: this agent speaks version {VERSION}")
    if not _is_hex(doc.get("nonce"), 32, 128):
        raise BadRequest("nonce: not 32 to 128 hex digits")
    op = doc.get("op")
    rank = _int_field(doc, "rank", MAX_RANK)
    step = _int_field(doc, "step", MAX_STEP)
    if op == "pull":
        return Request(op=op, rank=rank, step=step)
    if op != "push":
        raise BadRequest("op: not 'push' or 'pull'")
    size = _int_field(doc, "size", 2**63)
    if size > file_limit:
        raise BadRequest(f"size: {size} bytes is over this node's per-file limit of {file_limit}")
    sha = doc.get("sha256")
    if not _is_hex(sha, 64, 64):
        raise BadRequest("sha256: not 64 lowercase hex digits")
    return Request(op=op, rank=rank, step=step, size=size, sha256=sha)


# -- small helpers ---------------------------------------------------------------------------


def _hash_fd(fd: int, size: int, chunk: int) -> str:
    """sha256 of the first ``size`` bytes of ``fd`` (in a thread: a large file takes seconds).
    Closes ``fd``: the caller hands over a dup, so a cancelled caller never closes it under us."""
    try:
        digest = hashlib.sha256()
        offset = 0
        while offset < size:
            data = os.pread(fd, min(chunk, size - offset), offset)
            if not data:
                raise OSError(f"the file ended {size - offset} bytes short")
            digest.update(data)
            offset += len(data)
        return digest.hexdigest()
    finally:
        os.close(fd)


def file_sha256(path: str | Path, chunk: int = CHUNK) -> str:
    """sha256 of a held file, read ``chunk`` bytes at a time (never whole; no symlink followed).
    Blocking: call it in a thread from an event loop. Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        digest = hashlib.sha256()
        while data := os.read(fd, chunk):
            digest.update(data)
        return digest.hexdigest()
    finally:
        os.close(fd)


def _digest_arg(value: str, name: str) -> str:
    """A sha256 the caller passes on from the rendezvous ("": none): a malformed one is refused
    as a failed transfer (a hostile member may have announced it), never raised past the caller."""
    if value and not _is_hex(value, 64, 64):
        raise ReplicaError(f"{name}: not 64 lowercase hex digits", remote=False)
    return value


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class TokenBucket:
    """Paces a transfer to ``rate`` bytes/s, ``burst`` bytes at once at most (default one chunk);
    ``waits`` counts the pauses. ``clock`` and ``sleep`` are injectable so tests never sleep."""

    def __init__(
        self,
        rate: float,
        burst: float = CHUNK,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if rate <= 0 or burst < 0:
            raise ValueError("rate must be > 0 and burst >= 0")
        self.rate = rate
        self.burst = burst
        self.waits = 0
        self.slept = 0.0
        self._clock = clock
        self._sleep = sleep
        self._tokens = burst
        self._last = clock()

    async def take(self, n: int) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= n  # a debt is paid by waiting: a chunk larger than the burst still goes
        if self._tokens < 0:
            delay = -self._tokens / self.rate
            self.waits += 1
            self.slept += delay
            await self._sleep(delay)


# -- the server ------------------------------------------------------------------------------


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
        self.writer.write(_LEN.pack(len(body)) + body + mac)
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
                    await conn.reply(ok=False, error=reason[:_MAX_REASON])
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
        (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
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
                    _write_all(fd, data)  # tmpfs: a memory copy, no disk wait in the loop
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
            digest = await asyncio.to_thread(_hash_fd, os.dup(fd), size, self.chunk)
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


# -- the client ------------------------------------------------------------------------------


class _Client:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: str) -> None:
        self.reader = reader
        self.writer = writer
        self.key = key
        self.challenge = b""
        self.header = b""
        self.index = 0

    async def request(self, timeout: float, **fields: object) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            greeting = await self.reader.readexactly(len(MAGIC) + CHALLENGE_BYTES)
        if greeting[: len(MAGIC)] != MAGIC:
            raise ReplicaError("not a snapshot replica server", remote=False)
        self.challenge = greeting[len(MAGIC) :]
        doc = {"v": VERSION, **fields, "nonce": secrets.token_hex(16)}
        self.header = json.dumps(doc, separators=(",", ":")).encode()
        mac = request_mac(self.key, self.challenge, self.header)
        self.writer.write(_LEN.pack(len(self.header)) + self.header + mac)
        async with asyncio.timeout(timeout):
            await self.writer.drain()
        return await self.reply(timeout)

    async def reply(self, timeout: float) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            (n,) = _LEN.unpack(await self.reader.readexactly(_LEN.size))
            if n > MAX_HEADER:
                raise ReplicaError("the peer's reply is too large", remote=False)
            body = await self.reader.readexactly(n)
            mac = await self.reader.readexactly(MAC_BYTES)
        try:
            doc = json.loads(body)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            raise ReplicaError("the peer's reply is not a JSON object", remote=False)
        if doc.get("ok") is not True:
            # Believed without its MAC: a forged refusal can only stop a transfer, as a cut can.
            raise ReplicaError(str(doc.get("error", "refused"))[:_MAX_REASON], remote=True)
        if not hmac.compare_digest(mac, reply_mac(self.key, self.index, self.challenge, self.header, body)):
            raise ReplicaError("the peer's reply is not authenticated (another key?)", remote=False)
        self.index += 1
        return doc


@contextlib.asynccontextmanager
async def _connect(
    host: str, port: int, key: str, timeout: float, ssl_context: ssl.SSLContext | None, cert_sha256: str = ""
) -> AsyncIterator[_Client]:
    """A connection to a peer's replica server; every failure becomes a ReplicaError.
    ``cert_sha256``: speak TLS (``ssl_context``, else one that verifies no chain) and refuse a
    server whose certificate has another fingerprint."""
    pin = _digest_arg(cert_sha256, "cert_sha256")
    if pin and ssl_context is None:
        ssl_context = client_context()
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port, ssl=ssl_context)
    except (OSError, TimeoutError) as exc:
        raise ReplicaError(f"cannot connect to {host}:{port}: {exc or 'timed out'}", remote=False) from None
    try:
        if pin and not hmac.compare_digest(peer_cert_sha256(writer.get_extra_info("ssl_object")), pin):
            raise ReplicaError(
                f"certificate mismatch: {host}:{port} is not the replica server announced for it",
                remote=False,
            )
        yield _Client(reader, writer, key)
    except asyncio.IncompleteReadError:
        raise ReplicaError(f"{host}:{port} closed the connection early", remote=False) from None
    except TimeoutError:
        raise ReplicaError(f"{host}:{port} did not answer in {timeout:g} s", remote=False) from None
    except OSError as exc:
        raise ReplicaError(f"{host}:{port}: {exc}", remote=False) from None
    finally:
        writer.close()
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(1.0):
                await writer.wait_closed()


async def push(
    host: str,
    port: int,
    key: str,
    rank: int,
    step: int,
    path: str | Path,
    *,
    rate: float | None = None,
    timeout: float,
    ssl: ssl.SSLContext | None = None,
    cert_sha256: str = "",
    chunk: int = CHUNK,
    pacer: TokenBucket | None = None,
) -> str:
    """Send ``path``, ``rank``'s complete snapshot of ``step``, to the peer at ``host:port``;
    returns the file's sha256 (what the peer checked the bytes against).

    ``rate`` (bytes/s) paces the stream so a replication takes at most that share of the
    network; ``pacer`` replaces it with a bucket of the caller's. ``timeout`` bounds the connect
    and each read and write. ``cert_sha256``: the peer's certificate fingerprint, from the
    rendezvous: TLS, pinned (the header's "TLS"). Returns when the peer confirmed the file (or
    already held it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ReplicaError(f"cannot read {path}: {exc}", remote=False) from None
    try:
        size = os.fstat(fd).st_size
        try:
            digest = await asyncio.to_thread(_hash_fd, os.dup(fd), size, chunk)
        except OSError as exc:
            raise ReplicaError(f"cannot read {path}: {exc}", remote=False) from None
        if pacer is None and rate is not None:
            pacer = TokenBucket(rate, burst=min(float(chunk), rate))
        async with _connect(host, port, key, timeout, ssl, cert_sha256) as c:
            answer = await c.request(timeout, op="push", rank=rank, step=step, size=size, sha256=digest)
            if answer.get("held"):
                return digest
            offset = 0
            while offset < size:
                data = os.pread(fd, min(chunk, size - offset), offset)
                if not data:
                    raise ReplicaError(f"{path} shrank while it was sent", remote=False)
                if pacer is not None:
                    await pacer.take(len(data))
                c.writer.write(data)
                async with asyncio.timeout(timeout):
                    await c.writer.drain()
                offset += len(data)
            await c.reply(timeout)
        return digest
    finally:
        os.close(fd)


async def pull(
    host: str,
    port: int,
    key: str,
    rank: int,
    step: int,
    holdings: Holdings,
    *,
    timeout: float,
    deadline: float | None = None,
    expected_sha256: str = "",
    ssl: ssl.SSLContext | None = None,
    cert_sha256: str = "",
    chunk: int = CHUNK,
) -> Path:
    """Fetch ``rank``'s snapshot of ``step`` from the peer at ``host:port`` into ``holdings``;
    returns the complete file's path (at once when it is held here already).

    ``timeout`` bounds the connect and each read; ``deadline`` (a ``time.monotonic()`` instant)
    the whole pull, connect to last byte. ``expected_sha256``: the digest the rank's owner
    announced (through the rendezvous, not the holder's word): a transfer announced or found
    with another is refused, nothing kept. ``cert_sha256``: TLS, pinned (the header's "TLS").
    Every failure is a :class:`ReplicaError`, and leaves no ``.part`` and no room taken."""
    expected = _digest_arg(expected_sha256, "expected_sha256")
    have = holdings.path(rank, step)
    if have is not None:
        return have
    if deadline is None:
        return await _pull(host, port, key, rank, step, holdings, timeout, expected, ssl, cert_sha256, chunk)
    left = deadline - time.monotonic()
    try:
        async with asyncio.timeout(max(left, 0.0)):
            return await _pull(
                host, port, key, rank, step, holdings, timeout, expected, ssl, cert_sha256, chunk
            )
    except TimeoutError:  # ours: the reads' timeouts are ReplicaErrors by now
        raise ReplicaError(
            f"the fetch of rank {rank} step {step} from {host}:{port} passed its deadline "
            f"({max(left, 0.0):.3g} s)",
            remote=False,
        ) from None


async def _pull(
    host: str,
    port: int,
    key: str,
    rank: int,
    step: int,
    holdings: Holdings,
    timeout: float,
    expected: str,
    ssl_context: ssl.SSLContext | None,
    cert_sha256: str,
    chunk: int,
) -> Path:
    async with _connect(host, port, key, timeout, ssl_context, cert_sha256) as c:
        answer = await c.request(timeout, op="pull", rank=rank, step=step)
        size, sha = answer.get("size"), answer.get("sha256")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0 or not _is_hex(sha, 64, 64):
            raise ReplicaError("the peer's reply has no valid size and sha256", remote=False)
        if expected and sha != expected:
            raise ReplicaError(
                f"sha256 mismatch: {host}:{port} offers another rank {rank} step {step} than its owner's",
                remote=False,
            )
        try:
            part = holdings.admit(rank, step, size)
        except HoldingsError as exc:
            raise ReplicaError(f"no room here: {exc}", remote=False) from None
        try:
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                digest = hashlib.sha256()
                left = size
                while left:
                    async with asyncio.timeout(timeout):
                        data = await c.reader.read(min(chunk, left))
                    if not data:
                        raise ReplicaError(f"the peer's stream ended {left} bytes short", remote=False)
                    _write_all(fd, data)
                    digest.update(data)
                    left -= len(data)
            finally:
                os.close(fd)
            if digest.hexdigest() != sha:
                raise ReplicaError("sha256 mismatch: the bytes are not the ones announced", remote=False)
            try:
                return holdings.complete(rank, step, part)
            except OSError as exc:
                raise ReplicaError(f"cannot keep the snapshot: {exc}", remote=False) from None
        except BaseException:
            holdings.abandon(rank, step)
            raise


# -- the background replication --------------------------------------------------------------

PushFn = Callable[..., Awaitable[str | None]]
Peer = tuple[str, int, str, str]  # host, port, key, certificate fingerprint ("": plain TCP)


class Replicator:
    """Pushes each rank's newest offered snapshot to the peer, one push at a time, in the
    background. A newer offer replaces a queued older one, so replication falls behind by at
    most one snapshot per rank (it skips, it never queues up). A failure is logged and the
    rank waits for its next offer. ``replicated``: rank -> newest step the current peer
    confirmed. ``replicated_digest``: rank -> (step, sha256) of its newest push that completed,
    to whichever peer (the file's digest: the agent announces it as the owner's). The agent
    re-offers what it holds after ``set_peer`` names a new peer."""

    def __init__(
        self,
        *,
        rate: float | None = None,
        timeout: float = 30.0,
        ssl: ssl.SSLContext | None = None,
        push_fn: PushFn = push,
    ) -> None:
        self.rate = rate
        self.timeout = timeout
        self.ssl = ssl
        self.replicated: dict[int, int] = {}
        self.replicated_digest: dict[int, tuple[int, str]] = {}
        self.failures = 0
        self._push = push_fn
        self._peer: Peer | None = None
        self._pending: dict[int, tuple[int, Path]] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None

    @property
    def peer(self) -> Peer | None:
        """(host, port, key, cert_sha256) of the peer, or None."""
        return self._peer

    def pending(self) -> dict[int, int]:
        """rank -> the step queued for it."""
        return {rank: step for rank, (step, _) in self._pending.items()}

    def offer(self, rank: int, step: int, path: str | Path) -> None:
        """``rank``'s snapshot of ``step`` is complete at ``path``: replicate it when its turn comes."""
        queued = self._pending.get(rank)
        if (queued is not None and queued[0] >= step) or self.replicated.get(rank, -1) >= step:
            return
        self._pending.pop(rank, None)  # to the back of the queue: every rank gets its turn
        self._pending[rank] = (step, Path(path))
        self._kick()

    def set_peer(self, host: str | None, port: int = 0, key: str = "", cert_sha256: str = "") -> None:
        """Replicate to ``host:port`` (its key; ``cert_sha256``, its certificate's fingerprint:
        TLS, pinned; "": plain TCP), or to nobody (``None``) from now on. A new key or
        fingerprint is a new peer: nothing is known confirmed."""
        peer = None if host is None else (host, port, key, cert_sha256)
        if peer != self._peer:
            self._peer = peer
            self.replicated.clear()  # a new peer holds nothing we know of
        self._kick()

    def _kick(self) -> None:
        if self._peer is None or not self._pending:
            return
        self._idle.clear()
        self._wake.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="snapshot-replicator")

    async def drain(self) -> None:
        """Return when nothing is left to push (or there is no peer to push to)."""
        await self._idle.wait()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._idle.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._peer is not None and self._pending:
                peer = self._peer
                rank = next(iter(self._pending))
                step, path = self._pending.pop(rank)
                await self._push_one(peer, rank, step, path)
            self._idle.set()

    async def _push_one(self, peer: Peer, rank: int, step: int, path: Path) -> None:
        host, port, key, cert = peer
        pin = {"cert_sha256": cert} if cert else {}  # a push_fn of a test's need not know it
        try:
            digest = await self._push(
                host, port, key, rank, step, path, rate=self.rate, timeout=self.timeout, ssl=self.ssl, **pin
            )
        except ReplicaError as exc:
            self.failures += 1
            log.warning("snapshot replica: rank %d step %d to %s:%d failed: %s", rank, step, host, port, exc)
            return
        except Exception:
            self.failures += 1
            log.exception("snapshot replica: rank %d step %d to %s:%d failed", rank, step, host, port)
            return
        if isinstance(digest, str) and step >= self.replicated_digest.get(rank, (-1, ""))[0]:
            self.replicated_digest[rank] = (step, digest)
        if self._peer == peer:  # the peer did not change while we pushed
            self.replicated[rank] = max(step, self.replicated.get(rank, -1))
