"""One connection of the rendezvous server's port, as an ``asyncio.Protocol``: what it speaks
(our framed msgpack, HTTP relayed to aiohttp's protocol, TLS before either), its stage's frame
limit and deadline, the per-turn budget and flood caps, backpressure, and the busy answer of a
connection over the caps. What a frame means is the machine's; the connection hands it to
its owner (``ConnectionOwner``: the service, ``service.py``, which owns the timer and the
state log), and asks the owner's gate (``admission.py``) for its place in the caps.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol, cast

from protocol import (
    CLIENT_MESSAGES,
    MAGIC,
    Error,
    FrameDecoder,
    Heartbeat,
    Message,
    ProtocolError,
    classify_preface,
    encode,
    error_message,
)

from .admission import Gate, Place
from .machine.state import (
    SERVER_BUSY,
    Connected,
    ConnPhase,
    Disconnected,
    Received,
    Rendezvous,
    Tick,
)

logger = logging.getLogger("rdzv_server")

HEARTBEAT_FRAME = encode(Heartbeat())  # a heartbeat's whole frame: recognised by its bytes

HTTP_IDLE_TIMEOUT = 30.0  # an HTTP connection with no complete request head for this long
PREFACE_LIMIT = 64  # bytes we look at before deciding what a connection speaks
WRITE_BUFFER_LIMIT = 4 << 20  # a peer that reads slower than this much backlog is dropped
# One connection's share of a turn of the event loop: then reading pauses until the next turn.
FRAMES_PER_TURN = 64
BYTES_PER_TURN = 256 << 10
# Frames a connection may send: a burst, then this many a second. An agent sends about one a
# second (its heartbeat) and a few per round; a backlog after a stall of the server is allowed.
FRAME_RATE = 50
FRAME_BURST = 300
# Messages that change nothing (stale, repeated, ignored) a connection may send: a burst, then
# this many a second, before it is closed.
IGNORED_RATE = 0.5
IGNORED_BURST = 20
_monotonic = time.monotonic


class ConnectionOwner(Protocol):
    """What a connection reads and asks of the server that accepted it
    (``service.RendezvousService`` is one). The connection never imports the service."""

    gate: Gate  # the caps, the frame limits, the client certificate check
    machine: Rendezvous  # read only: what the last frame changed, and each connection's stage
    clock: Callable[[], float]  # the machine's clock
    hello_timeout: float
    http_idle_timeout: float
    write_buffer_limit: int
    # aiohttp's protocol for a connection that speaks HTTP; None: HTTP is off
    http_factory: Callable[[], asyncio.Protocol] | None
    stall_total: float  # seconds the server stood still so far: no agent's flood

    def agent_connected(self, conn: Connection) -> None:
        """The connection spoke our protocol (its hello deadline is the machine's now)."""
        ...

    def agent_disconnected(self, conn: Connection, reason: str) -> None: ...

    def http_later(self, conn: Connection) -> bool:
        """HTTP set up on demand: ``conn`` waits for it (False: HTTP is off)."""
        ...

    def heartbeat(self, conn_id: int) -> bool:
        """A heartbeat frame, alone: noted (False: hand it to ``dispatch`` as any frame)."""
        ...

    def dispatch(self, event: Connected | Received | Disconnected | Tick) -> bool:
        """Hand the machine an event; False when it was not handed."""
        ...


class Connection(asyncio.Protocol):
    """One accepted socket: until we know what it speaks, then an agent connection (frames
    decoded here) or an HTTP one (bytes relayed to aiohttp's protocol, so that its close still
    comes here and returns its place in the caps)."""

    __slots__ = (
        "_buf",
        "_decoder",
        "_http",
        "_ignored",
        "_ignored_at",
        "_lost",
        "_magic_due",
        "_paused",
        "_phase",
        "_stall_seen",
        "_tail",
        "_timer",
        "_timer_kind",
        "_tokens",
        "_tokens_at",
        "accepted",
        "conn_id",
        "host",
        "owner",
        "place",
        "transport",
    )

    def __init__(self, owner: ConnectionOwner, conn_id: int) -> None:
        self.owner = owner
        self.conn_id = conn_id
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._decoder: FrameDecoder | None = None
        self._phase = ConnPhase.HELLO
        self._http: asyncio.Protocol | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_kind = ""
        self.place = Place.NONE  # in the caps (HELD), or held only to be told "server busy"
        self._magic_due = False  # our MAGIC goes out with the first frame: one write, not two
        self._lost = False
        self._paused = False  # reading paused: the frames of this turn's budget are spent
        self._tail = b""  # the last bytes relayed to HTTP, to find a head's end across reads
        self._tokens = float(FRAME_BURST)
        self._tokens_at = _monotonic()
        self._stall_seen = owner.stall_total
        self._ignored = 0.0
        self._ignored_at = 0.0
        self.host = ""
        self.accepted = 0.0  # the machine's clock at the accept: the hello deadline counts from it

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream server's transport; uvloop's has a Transport's methods but not its class.
        t = self.transport = cast(asyncio.Transport, transport)
        owner = self.owner
        peer = t.get_extra_info("peername")
        self.host = peer[0] if isinstance(peer, tuple) else str(peer)
        self.place = owner.gate.admit(self.host)
        if self.place is Place.NONE:
            t.abort()
            self.transport = None
            return
        self.accepted = owner.clock()
        # Until its first bytes say what it speaks; then the machine holds an agent's deadline.
        self._arm(owner.hello_timeout if self.place is Place.HELD else owner.gate.busy_timeout, "hello")

    def data_received(self, data: bytes) -> None:
        if self._http is not None:
            self._relay_http(data)
            return
        if self._decoder is None:
            self._buf += data
            kind = classify_preface(bytes(self._buf[:PREFACE_LIMIT]))
            if kind == "more" and len(self._buf) < PREFACE_LIMIT:
                return
            if self.place is Place.REFUSING and kind in ("rdzv", "http"):
                self._refuse_busy(kind)
                return
            if kind in ("rdzv", "http") and self.owner.gate.lacks_client_cert(self.transport):
                self._refuse_without_cert(kind)
                return
            if kind == "rdzv":
                self._phase = ConnPhase.HELLO  # the stage whose frame limit the decoder has
                self._decoder = FrameDecoder(
                    max_frame_size=self.owner.gate.frame_limit(ConnPhase.HELLO),
                    allowed=CLIENT_MESSAGES,
                    expect_magic=True,
                )
                self._magic_due = True
                self._cancel_timer()  # the hello deadline is the machine's from now on
                self.owner.agent_connected(self)
                data, self._buf = bytes(self._buf), bytearray()
            elif kind == "http" and self.owner.http_factory is not None:
                self._to_http(self.owner.http_factory, bytes(self._buf))
                self._buf = bytearray()
                return
            elif kind == "http" and self.transport is not None and self.owner.http_later(self):
                self.transport.pause_reading()  # its bytes so far wait in _buf; http_ready
                return
            elif kind == "tls":
                # A TLS client on a plain port; it will see the connection close mid-handshake.
                logger.warning("closing %s: it speaks TLS, but this server has no --tls-cert", self.peer)
                self._close_now()
                return
            else:
                logger.warning("closing %s: it speaks neither our protocol nor HTTP", self.peer)
                self._close_now()
                return
        decoder = self._decoder
        if self._paused:
            decoder.feed(data, limit=0)  # kept for the turn already scheduled
            return
        if data == HEARTBEAT_FRAME and not decoder.buffered and self.owner.heartbeat(self.conn_id):
            # The common case, every second from every agent: no decoding, no dispatch.
            if not self._spend():
                self._flooded()
            return
        self._work(data)

    def eof_received(self) -> bool | None:
        if self._http is not None:
            return self._http.eof_received()
        return None

    def pause_writing(self) -> None:
        if self._http is not None:
            self._http.pause_writing()

    def resume_writing(self) -> None:
        if self._http is not None:
            self._http.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._lost = True
        self._cancel_timer()
        place, self.place = self.place, Place.NONE
        self.owner.gate.release(self.host, place)
        self.transport = None
        if self._http is not None:
            http, self._http = self._http, None
            http.connection_lost(exc)
        if self._decoder is not None:
            self.owner.agent_disconnected(self, "connection lost" if exc else "connection closed")

    # -- frames ----------------------------------------------------------------------------

    def _work(self, data: bytes = b"") -> None:
        """Decode and dispatch the frames buffered so far, up to this turn's budget; the rest
        waits for a later turn with reading paused, so one connection cannot hold the loop."""
        owner = self.owner
        decoder = self._decoder
        assert decoder is not None
        frames = 0
        taken = 0
        while True:
            if frames >= FRAMES_PER_TURN or taken >= BYTES_PER_TURN:
                if decoder.buffered:
                    self._pause()
                return
            before = decoder.buffered + len(data)
            try:
                msgs = decoder.feed(data, limit=1)
            except ProtocolError as exc:
                # The peer broke the protocol: tell it why, close, keep serving everyone else.
                logger.warning("closing %s: %s", self.peer, exc)
                self.write(encode(error_message(exc)))
                self._close_now()
                return
            data = b""
            if not msgs:
                return
            frames += 1
            left = decoder.buffered  # 0, as a read mostly holds one whole frame: no next feed
            taken += before - left
            if not self._spend():
                self._flooded()
                return
            msg = msgs[0]
            # A heartbeat that came in one read with other frames (a busy server reads late).
            if type(msg) is Heartbeat and owner.heartbeat(self.conn_id):
                if not left:
                    return
                continue
            handled = owner.dispatch(Received(self.conn_id, msg))
            t = self.transport
            if not handled or t is None or t.is_closing():
                return
            self._after(msg)
            if not left or self.transport is None or self.transport.is_closing():
                return

    def _after(self, msg: Message) -> None:
        """What the machine made of a message: the connection's frame limit (its stage's);
        and whether it keeps sending what changes nothing."""
        owner = self.owner
        machine = owner.machine
        if machine.unchanged and type(msg) is not Heartbeat:
            now = _monotonic()
            level = max(0.0, self._ignored - (now - self._ignored_at) * IGNORED_RATE) + 1
            self._ignored, self._ignored_at = level, now
            if level > IGNORED_BURST:
                self._close_with_error(
                    "flooding",
                    f"closing the connection: it sent more than {IGNORED_BURST} messages that change "
                    f"nothing (sustained limit {IGNORED_RATE:g} a second); the last was {msg.TYPE}",
                )
                return
        conn = machine.conns.get(self.conn_id)
        if conn is not None and conn.phase is not self._phase:
            # A new stage (the limit depends on nothing else): not every frame of a member's.
            assert self._decoder is not None
            self._phase = conn.phase
            self._decoder.max_frame_size = owner.gate.frame_limit(conn.phase)

    def _spend(self) -> bool:
        """One frame from this connection's allowance (a token bucket); False: it floods."""
        now = _monotonic()
        cap = float(FRAME_BURST)
        stalled = self.owner.stall_total - self._stall_seen
        if stalled:
            # The server stood still: the agent's heartbeats of that time arrive at once.
            self._stall_seen = self.owner.stall_total
            cap += stalled * FRAME_RATE
            self._tokens += stalled * FRAME_RATE
        # min(max(cap, tokens), refilled), without the two calls (every frame of every agent)
        tokens = self._tokens
        most = cap if cap > tokens else tokens
        tokens += (now - self._tokens_at) * FRAME_RATE
        if tokens > most:
            tokens = most
        self._tokens_at = now
        if tokens < 1.0:
            self._tokens = tokens
            return False
        self._tokens = tokens - 1.0
        return True

    def _flooded(self) -> None:
        self._close_with_error(
            "flooding",
            f"closing the connection: it sent frames faster than {FRAME_RATE} a second "
            f"(after a burst of {FRAME_BURST}); an agent sends about one a second",
        )

    def _close_with_error(self, code: str, text: str) -> None:
        logger.warning("closing %s: %s", self.peer, text.removeprefix("closing the connection: "))
        self.write(encode(Error(code=code, message=text, fatal=True)))
        self.close()
        self._cancel_timer()

    def _pause(self) -> None:
        if self._paused or self.transport is None:
            return
        self._paused = True
        self.transport.pause_reading()
        asyncio.get_running_loop().call_soon(self._resume)

    def _resume(self) -> None:
        self._paused = False
        if self.transport is None or self.transport.is_closing():
            return
        self._work()
        if not self._paused and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    # -- HTTP ------------------------------------------------------------------------------

    def http_ready(self, factory: Callable[[], asyncio.Protocol]) -> None:
        """HTTP, set up on demand, is ready: what this client sent goes to it."""
        if self.transport is None or self.transport.is_closing() or self._http is not None:
            return
        self._to_http(factory, bytes(self._buf))
        self._buf = bytearray()
        self.transport.resume_reading()

    def _to_http(self, factory: Callable[[], asyncio.Protocol], preface: bytes) -> None:
        """From now on the connection relays its bytes to aiohttp's protocol. It stays the
        transport's protocol (not swapped for aiohttp's), so its close releases its place in
        the caps; its hello timer becomes the deadline for the first request head."""
        assert self.transport is not None
        proto = factory()
        self._http = proto
        if self._timer_kind == "hello":
            self._timer_kind = "http-first"
        proto.connection_made(self.transport)
        self._relay_http(preface)

    def _relay_http(self, data: bytes) -> None:
        """Bytes for aiohttp. Each request head must be complete within the deadline: the
        first within hello_timeout of the accept, each next one within http_idle_timeout of
        the previous (an idle keep-alive connection is closed then too)."""
        seen = self._tail + data
        if b"\r\n\r\n" in seen:
            self._arm(self.owner.http_idle_timeout, "http")
        self._tail = seen[-3:]
        assert self._http is not None
        self._http.data_received(data)

    # -- timers ----------------------------------------------------------------------------

    def _arm(self, delay: float, kind: str) -> None:
        self._cancel_timer()
        self._timer = asyncio.get_running_loop().call_later(delay, self._expired)
        self._timer_kind = kind

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_kind = ""

    def _expired(self) -> None:
        kind, self._timer, self._timer_kind = self._timer_kind, None, ""
        owner = self.owner
        if self.place is Place.REFUSING:
            logger.debug("closing %s: over the connection limit, and it said nothing", self.peer)
        elif kind == "http":
            logger.warning(
                "closing %s: no complete HTTP request within %g s (an idle keep-alive, or a "
                "request sent too slowly)",
                self.peer,
                owner.http_idle_timeout,
            )
        elif self._http is not None:
            logger.warning("closing %s: no complete HTTP request within %g s", self.peer, owner.hello_timeout)
        else:
            logger.warning("closing %s: no hello within %g s", self.peer, owner.hello_timeout)
        self._close_now()

    # -- writing and closing ---------------------------------------------------------------

    @property
    def peer(self) -> str:
        if self.transport is None:
            return self.host or "?"
        addr = self.transport.get_extra_info("peername")
        if isinstance(addr, tuple) and len(addr) >= 2:
            return f"{addr[0]}:{addr[1]}"
        return str(addr)

    @property
    def local(self) -> str:
        """Our own address on this connection: the one the peer reached (an I/O fact for the
        machine's choice of a loopback member's address, ``machine/addresses.py``)."""
        addr = None if self.transport is None else self.transport.get_extra_info("sockname")
        return str(addr[0]) if isinstance(addr, tuple) and addr else ""

    def write(self, frame: bytes) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        if self._magic_due:
            frame, self._magic_due = MAGIC + frame, False
        t.write(frame)
        if t.get_write_buffer_size() > self.owner.write_buffer_limit:
            logger.warning("closing %s: it does not read what we send", self.peer)
            self._close_now()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _close_now(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _refuse_busy(self, kind: str) -> None:
        """Over the caps: say so, in the peer's own protocol, and close."""
        self._cancel_timer()
        text = self.owner.gate.busy_text()
        if kind == "rdzv":
            self.write(MAGIC + encode(Error(code=SERVER_BUSY, message=text, fatal=False)))
        else:
            self._write_http_error(503, "Service Unavailable", SERVER_BUSY, text, "Retry-After: 5\r\n")
        self.close()

    def _refuse_without_cert(self, kind: str) -> None:
        """Tell a peer that sent no client certificate so, in its own protocol, and close."""
        self._cancel_timer()
        logger.warning("closing %s: no client certificate (this server has --tls-client-ca)", self.peer)
        text = (
            "this server requires a client certificate signed by its --tls-client-ca: "
            "give --tls-cert and --tls-key"
        )
        if kind == "rdzv":
            self.write(MAGIC + encode(Error(code="auth_failed", message=text, fatal=True)))
        else:
            self._write_http_error(403, "Forbidden", "client_certificate_required", text)
        self.close()  # after the write is flushed

    def _write_http_error(self, status: int, phrase: str, code: str, text: str, extra: str = "") -> None:
        # The error shape of the HTTP API, written by hand: aiohttp never sees this peer.
        import json  # only for these refusals: 2 ms of every launch otherwise

        body = json.dumps({"error": code, "message": text}).encode()
        head = (
            f"HTTP/1.1 {status} {phrase}\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        self.write(head.encode() + body)
