"""The agent-to-agent snapshot channel: push a replica to a peer, pull a rank's snapshot back.

Each agent runs a :class:`ReplicaServer` on its :class:`Holdings`. A node pushes every newly
completed local snapshot to its peer in the background (:class:`Replicator`, rate-limited, one
at a time, skipping to the newest), so losing any one node loses no rank; at a restart a node
pulls the snapshots of the step the server picked from whoever holds them (:func:`pull`).

The wire, one request per connection:

    server: MAGIC (8 bytes) + challenge (32 random bytes, fresh per connection)
    client: len (4, big-endian) + header (JSON, <= 4 KiB) + HMAC-SHA256(key, "request" + challenge + header)
    server: reply frames: len + body (JSON) + HMAC-SHA256(key, "reply" + n + challenge + header + body)
    push:   header {v, op: "push", rank, step, size, sha256, nonce}
            -> {ok, go} then the client streams exactly ``size`` bytes -> {ok} | {ok: false, error}
            -> {ok, held}: the peer has it already, nothing is sent
    pull:   header {v, op: "pull", rank, step, nonce} -> {ok, size, sha256} then ``size`` bytes

``key`` is a random secret of the receiving agent (:func:`new_key`) that the rendezvous relays
only to the job's other agents. The client proves it holds the key over the server's fresh
challenge, so a recorded request cannot be replayed; the server proves it back over the client's
fresh nonce, so a stranger cannot pose as a peer. Each MAC covers the header, and the header (or
the authenticated pull reply) carries the data's sha256: an on-path attacker can cut a transfer
but not change its bytes unnoticed. TLS (an ``ssl.SSLContext``, passed through to asyncio) adds
secrecy where the network needs it.

Everything a peer sends is bounded: the header's size and every field, a file's size (the
holdings' per-file limit and memory bound, checked before a byte is taken), the time for the
handshake and between any two reads, the number of connections at once, and the memory per
connection (one chunk: a file is never read whole). A peer's mistake gets a short error reply
and a closed connection, never a ``.part`` left behind; the server goes on serving the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import ssl
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from .holdings import MAX_RANK, MAX_STEP, Holdings, HoldingsError

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

    async def reply(self, **fields: object) -> None:
        body = json.dumps(fields, separators=(",", ":")).encode()
        mac = reply_mac(self.key, self.index, self.challenge, self.header, body)
        self.index += 1
        self.writer.write(_LEN.pack(len(body)) + body + mac)
        async with asyncio.timeout(self.timeout):
            await self.writer.drain()


class ReplicaServer:
    """Serves pushes into and pulls from ``holdings`` to the job's other agents; see the header."""

    def __init__(
        self,
        holdings: Holdings,
        *,
        key: str,
        ssl: ssl.SSLContext | None = None,
        max_connections: int = 8,
        handshake_timeout: float = 10.0,
        idle_timeout: float = 30.0,
        chunk: int = CHUNK,
        on_received: Callable[[], None] | None = None,
    ) -> None:
        if len(key) < 16:
            raise ValueError("the replica key is too short to be a secret")
        self.holdings = holdings
        self.on_received = on_received  # a replica is complete: the agent tells the server now
        self.key = key
        self.ssl = ssl
        self.max_connections = max_connections
        self.handshake_timeout = handshake_timeout
        self.idle_timeout = idle_timeout
        self.chunk = chunk
        self.refused_busy = 0  # connections closed at once: max_connections were open
        self._server: asyncio.Server | None = None
        # Each connection's task and writer: close() aborts the writers, and each handler ends
        # by itself (a cancelled handler task makes asyncio 3.11's stream callback log an error).
        self._tasks: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    @property
    def connections(self) -> int:
        """Connections being served now."""
        return len(self._tasks)

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on ``host:port`` (0: a free port); returns the port."""
        self._server = await asyncio.start_server(
            self._handle,
            host,
            port,
            ssl=self.ssl,
            # A TLS handshake comes before our handler runs: bound it by the same timeout.
            ssl_handshake_timeout=self.handshake_timeout if self.ssl is not None else None,
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening and end the connections in flight (their ``.part`` files go)."""
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks.items())
        for _, writer in tasks:
            writer.transport.abort()  # its reads end at once; its handler removes its .part
        await asyncio.gather(*(task for task, _ in tasks), return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is None or len(self._tasks) >= self.max_connections:
            self.refused_busy += 1
            writer.transport.abort()  # before the challenge: costs nothing, says nothing
            return
        self._tasks[task] = writer
        peer = writer.get_extra_info("peername")
        conn = _Conn(writer, self.key, self.idle_timeout)
        try:
            await self._serve(reader, conn)
        except (BadRequest, OSError, EOFError, TimeoutError) as exc:
            reason = str(exc) or type(exc).__name__
            if isinstance(exc, asyncio.IncompleteReadError):
                reason = "the connection ended early"
            elif isinstance(exc, TimeoutError):
                reason = "too slow: timed out"
            log.info("snapshot replica: refused %s: %s", peer, reason)
            with contextlib.suppress(OSError, TimeoutError):
                await conn.reply(ok=False, error=reason[:_MAX_REASON])
        except Exception:  # our own bug: say so loudly, but keep serving the others
            log.exception("snapshot replica: the connection from %s failed", peer)
        finally:
            self._tasks.pop(task, None)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, conn: _Conn) -> None:
        conn.writer.write(MAGIC + conn.challenge)
        async with asyncio.timeout(self.handshake_timeout):
            await conn.writer.drain()
            (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
            if n > MAX_HEADER:  # refused on its length: the body is never buffered
                raise BadRequest(f"header over {MAX_HEADER} bytes")
            header = await reader.readexactly(n)
            mac = await reader.readexactly(MAC_BYTES)
        conn.header = header
        if not hmac.compare_digest(mac, request_mac(self.key, conn.challenge, header)):
            raise BadRequest("not authenticated (another job's key?)")
        req = parse_request(header, self.holdings.file_limit)
        if req.op == "push":
            await self._receive(reader, conn, req)
        else:
            await self._send(conn, req)

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
        log.info("snapshot replica: received rank %d step %d (%d bytes)", req.rank, req.step, req.size)
        if self.on_received is not None:
            self.on_received()
        await conn.reply(ok=True)

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
    host: str, port: int, key: str, timeout: float, ssl_context: ssl.SSLContext | None
) -> AsyncIterator[_Client]:
    """A connection to a peer's replica server; every failure becomes a ReplicaError."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port, ssl=ssl_context)
    except (OSError, TimeoutError) as exc:
        raise ReplicaError(f"cannot connect to {host}:{port}: {exc or 'timed out'}", remote=False) from None
    try:
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
    chunk: int = CHUNK,
    pacer: TokenBucket | None = None,
) -> None:
    """Send ``path``, ``rank``'s complete snapshot of ``step``, to the peer at ``host:port``.

    ``rate`` (bytes/s) paces the stream so a replication takes at most that share of the
    network; ``pacer`` replaces it with a bucket of the caller's. ``timeout`` bounds the connect
    and each read and write. Returns when the peer confirmed the file (or already held it)."""
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
        async with _connect(host, port, key, timeout, ssl) as c:
            answer = await c.request(timeout, op="push", rank=rank, step=step, size=size, sha256=digest)
            if answer.get("held"):
                return
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
    ssl: ssl.SSLContext | None = None,
    chunk: int = CHUNK,
) -> Path:
    """Fetch ``rank``'s snapshot of ``step`` from the peer at ``host:port`` into ``holdings``;
    returns the complete file's path (at once when it is held here already)."""
    have = holdings.path(rank, step)
    if have is not None:
        return have
    async with _connect(host, port, key, timeout, ssl) as c:
        answer = await c.request(timeout, op="pull", rank=rank, step=step)
        size, sha = answer.get("size"), answer.get("sha256")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0 or not _is_hex(sha, 64, 64):
            raise ReplicaError("the peer's reply has no valid size and sha256", remote=False)
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

PushFn = Callable[..., Awaitable[None]]


class Replicator:
    """Pushes each rank's newest offered snapshot to the peer, one push at a time, in the
    background. A newer offer replaces a queued older one, so replication falls behind by at
    most one snapshot per rank (it skips, it never queues up). A failure is logged and the
    rank waits for its next offer. ``replicated``: rank -> newest step the current peer
    confirmed. The agent re-offers what it holds after ``set_peer`` names a new peer."""

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
        self.failures = 0
        self._push = push_fn
        self._peer: tuple[str, int, str] | None = None
        self._pending: dict[int, tuple[int, Path]] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None

    @property
    def peer(self) -> tuple[str, int, str] | None:
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

    def set_peer(self, host: str | None, port: int = 0, key: str = "") -> None:
        """Replicate to ``host:port`` (its key), or to nobody (``None``) from now on."""
        peer = None if host is None else (host, port, key)
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

    async def _push_one(self, peer: tuple[str, int, str], rank: int, step: int, path: Path) -> None:
        host, port, key = peer
        try:
            await self._push(
                host, port, key, rank, step, path, rate=self.rate, timeout=self.timeout, ssl=self.ssl
            )
        except ReplicaError as exc:
            self.failures += 1
            log.warning("snapshot replica: rank %d step %d to %s:%d failed: %s", rank, step, host, port, exc)
            return
        except Exception:
            self.failures += 1
            log.exception("snapshot replica: rank %d step %d to %s:%d failed", rank, step, host, port)
            return
        if self._peer == peer:  # the peer did not change while we pushed
            self.replicated[rank] = max(step, self.replicated.get(rank, -1))
