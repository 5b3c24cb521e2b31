"""The peers' side of the snapshot channel: push a replica to a peer, pull a rank's snapshot
back (the wire: ``wire.py``; the server: ``server.py``).

A node pushes its ranks' snapshots of the step the server asked to its ring peer in the
background (:class:`Replicator`, rate-limited by a :class:`TokenBucket`, one at a time,
skipping to the newest), so losing any one node loses no rank; at a restart a node pulls the
snapshots of the step the server picked from whoever holds them (:func:`pull`).

**TLS.** A client given the peer's certificate fingerprint (``cert_sha256``, relayed by the
rendezvous beside its key) speaks TLS, verifies no chain, and refuses a server whose
certificate has another ("certificate mismatch").

Every wait is bounded: the connect and each read and write (``timeout``), a whole pull
(``deadline``). A pull given the owner's digest (``expected_sha256``, from the rendezvous) takes
nothing else, whatever the holder announces; every failure is a :class:`ReplicaError` and
leaves no ``.part`` behind.
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
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from .holdings import Holdings, HoldingsError, hash_fd, write_all
from .replica_tls import client_context, peer_cert_sha256
from .wire import (
    CHALLENGE_BYTES,
    CHUNK,
    LEN,
    MAC_BYTES,
    MAGIC,
    MAX_HEADER,
    MAX_REASON,
    VERSION,
    is_hex,
    reply_mac,
    request_mac,
)

__all__ = ["ReplicaError", "Replicator", "TokenBucket", "pull", "push"]

log = logging.getLogger("node_agent.snapshots")


class ReplicaError(Exception):
    """A push or pull failed. ``remote``: the peer said why (``reason``); else the connection or
    this node failed."""

    def __init__(self, reason: str, *, remote: bool) -> None:
        super().__init__(f"peer refused: {reason}" if remote else reason)
        self.reason = reason
        self.remote = remote


def _digest_arg(value: str, name: str) -> str:
    """A sha256 the caller passes on from the rendezvous ("": none): a malformed one is refused
    as a failed transfer (a hostile member may have announced it), never raised past the caller."""
    if value and not is_hex(value, 64, 64):
        raise ReplicaError(f"{name}: not 64 lowercase hex digits", remote=False)
    return value


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


# -- a connection ----------------------------------------------------------------------------


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
        self.writer.write(LEN.pack(len(self.header)) + self.header + mac)
        async with asyncio.timeout(timeout):
            await self.writer.drain()
        return await self.reply(timeout)

    async def reply(self, timeout: float) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            (n,) = LEN.unpack(await self.reader.readexactly(LEN.size))
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
            raise ReplicaError(str(doc.get("error", "refused"))[:MAX_REASON], remote=True)
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
            digest = await asyncio.to_thread(hash_fd, os.dup(fd), size, chunk)
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
        if isinstance(size, bool) or not isinstance(size, int) or size < 0 or not is_hex(sha, 64, 64):
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
                    write_all(fd, data)
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
