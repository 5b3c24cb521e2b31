"""The asyncio layer of the rendezvous server: sockets and timers around the pure machine.

One TCP port carries both protocols. The first bytes of a connection decide: our magic means
an agent speaking framed msgpack (handled here, as an ``asyncio.Protocol``: no stream or task
per connection, which keeps 10,000 agents cheap); an HTTP request line means a person or a
monitoring system, and the connection is handed, bytes and all, to aiohttp's server protocol.
aiohttp is imported only when HTTP is enabled, so an agent's embedded server starts fast.
With an ``ssl.SSLContext`` the port speaks only TLS, and the same routing runs on the
decrypted bytes once the handshake is done (see ``protocol/tls.py``).

Everything the machine decides comes back as effects; this module only carries them out.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import ssl
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from protocol import (
    CLIENT_MESSAGES,
    MAGIC,
    MAX_FRAME_SIZE,
    Error,
    FrameDecoder,
    Heartbeat,
    Hello,
    Join,
    ProtocolError,
    Resume,
    classify_preface,
    encode,
    error_message,
)
from protocol.auth import TokenTable

from .listeners import check_port_free
from .state import Close, Connected, Disconnected, Effect, Log, Received, Rendezvous, Send, Tick

if TYPE_CHECKING:
    from .journal import StateLog

logger = logging.getLogger("rdzv_server")

HEARTBEAT_FRAME = encode(Heartbeat())

HELLO_TIMEOUT = 10.0  # a connection that has not said hello by then is closed
# ... and one that said hello but has not joined (proved its token) by then. Longer: an agent
# runs its --health-check (up to 60 s, node_agent.runner.HEALTH_CHECK_TIMEOUT) before joining.
AUTH_TIMEOUT = 90.0
PREFACE_LIMIT = 64  # bytes we look at before deciding what a connection speaks
WRITE_BUFFER_LIMIT = 4 << 20  # a peer that reads slower than this much backlog is dropped
MAX_CONNECTIONS = 60_000  # open sockets in all (each agent holds one)
MAX_PER_ADDRESS = 20_000  # from one address (benchmarks run 10,000 agents from loopback)


class _Connection(asyncio.Protocol):
    """One accepted socket, until we know what it speaks, and then an agent connection."""

    __slots__ = (
        "_buf",
        "_decoder",
        "_hello_timer",
        "_magic_due",
        "admitted",
        "conn_id",
        "host",
        "service",
        "transport",
    )

    def __init__(self, service: RendezvousService, conn_id: int) -> None:
        self.service = service
        self.conn_id = conn_id
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._decoder: FrameDecoder | None = None
        self._hello_timer: asyncio.TimerHandle | None = None
        self.admitted = False
        self._magic_due = False  # our MAGIC goes out with the first frame: one write, not two
        self.host = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport
        if not self.service._admit(self):
            transport.close()
            self.transport = None
            return
        self._hello_timer = asyncio.get_running_loop().call_later(
            self.service.hello_timeout, self._hello_expired
        )

    def data_received(self, data: bytes) -> None:
        if self._decoder is None:
            self._buf += data
            kind = classify_preface(bytes(self._buf[:PREFACE_LIMIT]))
            if kind == "more" and len(self._buf) < PREFACE_LIMIT:
                return
            if kind in ("rdzv", "http") and self.service._lacks_client_cert(self):
                self._refuse_without_cert(kind)
                return
            if kind == "rdzv":
                self._decoder = FrameDecoder(
                    max_frame_size=self.service.max_frame_size, allowed=CLIENT_MESSAGES, expect_magic=True
                )
                self.service._agent_connected(self)
                data, self._buf = bytes(self._buf), bytearray()
            elif kind == "http" and self.service.http_factory is not None:
                self._cancel_hello_timer()
                self.service._hand_to_http(self, bytes(self._buf))
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
        if data == HEARTBEAT_FRAME and not self._decoder.buffered and self.service._heartbeat(self.conn_id):
            return  # the common case, every second from every agent: no decoding, no dispatch
        try:
            messages = self._decoder.feed(data)
        except ProtocolError as exc:
            # The peer broke the protocol: tell it why, close, keep serving everyone else.
            logger.warning("closing %s: %s", self.peer, exc)
            self.write(encode(error_message(exc)))
            self._close_now()
            return
        for msg in messages:
            # A heartbeat that came in one read with other frames (a busy server reads late).
            if type(msg) is Heartbeat and self.service._heartbeat(self.conn_id):
                continue
            self.service._dispatch(Received(self.conn_id, msg))
            if self.transport is None or self.transport.is_closing():
                return
            # The machine refuses (and closes) a bad hello or join; one it kept moves the timer
            # on: after the hello, the join must come within auth_timeout; after it, no limit.
            if self._hello_timer is not None and isinstance(msg, Hello | Join | Resume):
                self._cancel_hello_timer()
                if isinstance(msg, Hello):
                    self._hello_timer = asyncio.get_running_loop().call_later(
                        self.service.auth_timeout, self._auth_expired
                    )

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_hello_timer()
        self.service._release(self)
        self.transport = None
        if self._decoder is not None:
            self.service._agent_disconnected(self, "connection lost" if exc else "connection closed")

    @property
    def peer(self) -> str:
        if self.transport is None:
            return "?"
        addr = self.transport.get_extra_info("peername")
        if isinstance(addr, tuple) and len(addr) >= 2:
            return f"{addr[0]}:{addr[1]}"
        return str(addr)

    def write(self, frame: bytes) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        if self._magic_due:
            frame, self._magic_due = MAGIC + frame, False
        t.write(frame)
        if t.get_write_buffer_size() > self.service.write_buffer_limit:
            logger.warning("closing %s: it does not read what we send", self.peer)
            self._close_now()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _close_now(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _refuse_without_cert(self, kind: str) -> None:
        """Tell a peer that sent no client certificate so, in its own protocol, and close."""
        self._cancel_hello_timer()
        logger.warning("closing %s: no client certificate (this server has --tls-client-ca)", self.peer)
        text = (
            "this server requires a client certificate signed by its --tls-client-ca: "
            "give --tls-cert and --tls-key"
        )
        if kind == "rdzv":
            self.write(MAGIC + encode(Error(code="auth_failed", message=text, fatal=True)))
        else:  # the error shape of the HTTP API, written by hand: aiohttp never sees this peer
            import json  # only for this refusal: 2 ms of every launch otherwise

            body = json.dumps({"error": "client_certificate_required", "message": text}).encode()
            head = f"HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
            self.write(head.encode() + b"\r\nConnection: close\r\n\r\n" + body)
        self.close()  # after the write is flushed

    def _hello_expired(self) -> None:
        self._hello_timer = None
        logger.warning("closing %s: no hello within %g s", self.peer, self.service.hello_timeout)
        self._close_now()

    def _auth_expired(self) -> None:
        self._hello_timer = None
        logger.warning("closing %s: no join within %g s of its hello", self.peer, self.service.auth_timeout)
        self._close_now()

    def _cancel_hello_timer(self) -> None:
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None


class RendezvousService:
    """Serves the rendezvous protocol (and optionally HTTP) on one TCP port."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        http: bool = False,
        max_frame_size: int = MAX_FRAME_SIZE,
        tokens: TokenTable | None = None,
        max_connections: int = MAX_CONNECTIONS,
        max_per_address: int = MAX_PER_ADDRESS,
        hello_timeout: float = HELLO_TIMEOUT,
        auth_timeout: float = AUTH_TIMEOUT,
        write_buffer_limit: int = WRITE_BUFFER_LIMIT,
        tls: ssl.SSLContext | None = None,
        listeners: int = 1,
    ) -> None:
        self.tls = tls  # None: plain TCP; else the port speaks only TLS
        # Sockets sharing the port (SO_REUSEPORT), for an accept queue a join storm of
        # thousands fits in (listeners.py). Embedded servers keep 1: agents racing to host
        # one must see a plain bind fail.
        self.listeners = listeners
        self.max_connections = max_connections
        self.max_per_address = max_per_address
        self.hello_timeout = hello_timeout
        self.auth_timeout = auth_timeout
        self.write_buffer_limit = write_buffer_limit
        self._open = 0
        self._per_host: dict[str, int] = {}
        self.machine = Rendezvous(tokens)
        self.tokens = tokens
        self.clock = clock
        self.max_frame_size = max_frame_size
        self.http_enabled = http
        self.http_factory: Callable[[], asyncio.Protocol] | None = None
        self._http_runner: object | None = None
        self._servers: list[asyncio.Server] = []
        self._conns: dict[int, _Connection] = {}
        self._next_id = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._closed = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._change_waiters: list[asyncio.Future[None]] = []  # woken after each machine step
        self._durable_init(None)

    def _durable_init(self, state_log: StateLog | None) -> None:
        # With a state log, the effects of the events handled in one turn of the loop wait
        # until their records are fsync'd together (journal.py, "Order").
        self.state_log = state_log
        self._pending: list[Effect] = []
        self._flush_soon = False
        self._inflight: asyncio.Future[None] | None = None  # the fsync of the batch being committed
        self._gone = False  # told the agents we are going away: the machine takes no more events
        self.on_fatal: Callable[[str], None] | None = None  # the state log cannot be written
        if state_log is not None:
            self.machine = state_log.machine
            self.clock = state_log.clock
            # Restored members hold the old process's connection ids (AWAY): never reuse one.
            self._next_id = max(self.machine.conns, default=0)

    def use_state_log(self, state_log: StateLog) -> None:
        """Serve the machine restored from ``state_log`` and log every change to it (before start)."""
        self._durable_init(state_log)

    def arm_timer(self) -> None:
        """Deliver the restored machine's next deadline (its resume window) even if nobody calls."""
        self._schedule()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, host: str | None, port: int) -> int:
        """Listen on host:port (port 0 picks a free one); returns the bound port."""
        if self.http_enabled:
            from .http_app import make_http_runner

            runner = await make_http_runner(self)
            self._http_runner = runner
            self.http_factory = runner.server  # type: ignore[attr-defined]
        shared = self.listeners > 1
        if shared:
            check_port_free(host, port)  # SO_REUSEPORT alone would let us share a taken port
        try:
            for _ in range(self.listeners):
                self._servers.append(await self._listen(host, port, shared))
                port = self.port  # the others join the first one's port (port 0 picked it)
        except BaseException:
            self._close_listeners()
            raise
        return self.port

    async def _listen(self, host: str | None, port: int, shared: bool) -> asyncio.Server:
        server = await asyncio.get_running_loop().create_server(
            self._make_connection,
            host=host or None,
            port=port,
            backlog=65535,  # the kernel caps it at net.core.somaxconn: ask for all it allows
            reuse_address=True,
            reuse_port=shared or None,
            ssl=self.tls,
            # A handshake happens before connection_made, so before the hello timer starts.
            ssl_handshake_timeout=self.hello_timeout if self.tls is not None else None,
        )
        if not server.sockets or any(sock is None for sock in server.sockets):
            # uvloop hands the loser of a race for a port a server with no real socket
            # instead of raising: report it as the port being taken.
            server.close()
            raise OSError(errno.EADDRINUSE, f"port {port} is already in use")
        return server

    def _close_listeners(self) -> None:
        for server in self._servers:
            server.close()

    @property
    def port(self) -> int:
        assert self._servers and self._servers[0].sockets
        return self._servers[0].sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening, close every connection and the HTTP side."""
        self._close_listeners()
        for c in list(self._conns.values()):
            c.close()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        servers, self._servers = self._servers, []
        for server in servers:
            await server.wait_closed()
        if self._http_runner is not None:
            await self._http_runner.cleanup()  # type: ignore[attr-defined]
            self._http_runner = None
        self._closed.set()

    # -- connections -----------------------------------------------------------------------

    def _admit(self, conn: _Connection) -> bool:
        """Caps on open connections, in all and per address, so no one peer can exhaust us."""
        peer = conn.transport.get_extra_info("peername") if conn.transport is not None else None
        host = peer[0] if isinstance(peer, tuple) else str(peer)
        if self._open >= self.max_connections or self._per_host.get(host, 0) >= self.max_per_address:
            logger.warning("refusing a connection from %s: connection limit reached", host)
            return False
        conn.admitted, conn.host = True, host
        self._open += 1
        self._per_host[host] = self._per_host.get(host, 0) + 1
        return True

    def _lacks_client_cert(self, conn: _Connection) -> bool:
        """With --tls-client-ca the handshake lets a certificate-less peer in; we refuse it."""
        if self.tls is None or self.tls.verify_mode == ssl.CERT_NONE or conn.transport is None:
            return False
        return not conn.transport.get_extra_info("peercert")

    def _release(self, conn: _Connection) -> None:
        if not conn.admitted:
            return
        conn.admitted = False
        self._open -= 1
        left = self._per_host[conn.host] - 1
        if left:
            self._per_host[conn.host] = left
        else:
            del self._per_host[conn.host]

    def _make_connection(self) -> _Connection:
        self._next_id += 1
        return _Connection(self, self._next_id)

    def _agent_connected(self, conn: _Connection) -> None:
        self._conns[conn.conn_id] = conn
        self._idle.clear()
        conn._magic_due = True
        challenge = os.urandom(16).hex() if self.tokens is not None else ""
        self._dispatch(Connected(conn.conn_id, conn.peer, challenge))

    def _agent_disconnected(self, conn: _Connection, reason: str) -> None:
        if self._conns.pop(conn.conn_id, None) is not None:
            self._dispatch(Disconnected(conn.conn_id, reason))
        if not self._conns:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Until no agent is connected."""
        await self._idle.wait()

    def job_nodes(self, job_id: str) -> set[str]:
        """The node ids in job ``job_id`` (members and spares); empty when there is no such job."""
        job = self.machine.jobs.get(job_id)
        return set() if job is None else {*job.members, *job.spares}

    async def wait_job_gone(self, job_id: str) -> None:
        """Until the machine forgets job ``job_id`` (its last node left): an agent that hosts
        the rendezvous waits for its own job's peers, not for other jobs it happens to serve."""
        while job_id in self.machine.jobs:
            waiter = asyncio.get_running_loop().create_future()
            self._change_waiters.append(waiter)
            await waiter

    def _hand_to_http(self, conn: _Connection, preface: bytes) -> None:
        assert self.http_factory is not None and conn.transport is not None
        transport = conn.transport
        proto = self.http_factory()
        transport.set_protocol(proto)
        proto.connection_made(transport)
        proto.data_received(preface)

    # -- operations ------------------------------------------------------------------------

    def drain(self, job_id: str, node_id: str, reason: str = "") -> None:
        """Ask one node to leave its job cleanly; KeyError names what does not exist."""
        now = self.clock()
        effects = self.machine.drain(job_id, node_id, reason, now)
        if self.state_log is not None:
            self.state_log.append({"k": "drain", "job": job_id, "node": node_id, "why": reason}, now)
        self._carry_out(effects)
        self._schedule()
        if self._change_waiters:
            waiters, self._change_waiters = self._change_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def go_away(self, reason: str, grace: float = 5.0) -> None:
        """SIGTERM's policy: stop taking connections and joins, flush, tell the agents, close.

        Agents keep their workers and reconnect (to the next server process on this port);
        with a state dir that server resumes their rounds. The state log ends in a snapshot,
        so a newer server (an upgrade) starts from the state this one had, not from a replay
        of its inputs under its own rules. Each step is logged once.
        """
        self._close_listeners()
        logger.info("draining (%s): no new connections or joins", reason)
        now = self.clock()
        effects = self.machine.going_away(reason, now)
        told = sum(1 for e in effects if isinstance(e, Send))
        if self.state_log is not None:
            self.state_log.append({"k": "going_away", "why": reason}, now)
            await self._commit_all()
            try:
                # The next server on this dir (an upgrade, say) then loads the state as it is,
                # rather than replaying inputs under rules that may have changed since.
                self.state_log.compact()
            except OSError as exc:
                logger.warning("no snapshot at shutdown (%s); the next server replays the log", exc)
            logger.info(
                "state log flushed: record %d in %s (%d fsyncs by this process, %.2f s)",
                self.state_log.seq,
                self.state_log.dir,
                self.state_log.syncs,
                self.state_log.sync_seconds,
            )
        self._gone = True  # what follows (connections closing) is not a change of job state
        self._apply(effects)
        logger.info("told %d agent connection(s) the server is going away; closing them", told)
        for c in list(self._conns.values()):
            c.close()  # after the buffered GoingAway is written
        if self._conns:
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except asyncio.TimeoutError:
                logger.warning("%d agent connection(s) still open after %g s", len(self._conns), grace)

    # -- the machine -----------------------------------------------------------------------

    def _heartbeat(self, conn_id: int) -> bool:
        """A heartbeat frame, alone in its read: just note the agent is alive."""
        return not self._gone and self.machine.heartbeat(conn_id, self.clock())

    def _dispatch(self, event: Connected | Received | Disconnected | Tick) -> None:
        if self._gone:
            return
        if (
            isinstance(event, Received)
            and self.state_log is not None
            and event.conn not in self.machine.conns
        ):
            return  # the machine closed it; the Close waits for the batch's fsync
        now = self.clock()
        effects = self.machine.handle(event, now)
        if self.state_log is not None:
            self.state_log.record(event, effects, now)
        self._carry_out(effects)
        self._schedule()

    def _carry_out(self, effects: list[Effect]) -> None:
        """Now, or with a state log once the batch's records are durable."""
        if self.state_log is None:
            self._apply(effects)
            return
        self._pending.extend(effects)
        if not self._flush_soon and (self._pending or self.state_log.pending):
            self._flush_soon = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Commit the batch: write its records, fsync them (in a thread), then carry out its
        effects in order. One batch is committed at a time; the next gathers meanwhile."""
        self._flush_soon = False
        log = self.state_log
        if log is None or self._inflight is not None or self._gone:
            return  # the fsync in flight flushes again when it is done
        try:
            urgent = log.write()
        except OSError as exc:
            self._log_failed(exc)
            return
        effects, self._pending = self._pending, []
        if not urgent:
            self._apply(effects)
            return
        fut = asyncio.get_running_loop().run_in_executor(None, log.fsync_written)
        self._inflight = fut
        fut.add_done_callback(lambda f: self._committed(f, effects))

    def _committed(self, fut: asyncio.Future[None], effects: list[Effect]) -> None:
        self._inflight = None
        exc = None if fut.cancelled() else fut.exception()
        if fut.cancelled() or exc is not None:
            self._log_failed(exc if isinstance(exc, OSError) else OSError(str(exc or "cancelled")))
            return
        self._apply(effects)
        assert self.state_log is not None
        try:
            self.state_log.maybe_compact()
        except OSError as exc:
            self._log_failed(exc)
            return
        if self._pending or self.state_log.pending:
            self._flush()

    async def _commit_all(self) -> None:
        """Until every record so far is durable and its effects carried out (for shutdown)."""
        while self._inflight is not None:
            await asyncio.wait({self._inflight})
            await asyncio.sleep(0)  # let its done-callback carry out its batch
        if self.state_log is not None and not self._gone:
            try:
                self.state_log.sync()
            except OSError as exc:
                self._log_failed(exc)
                return
            effects, self._pending = self._pending, []
            self._apply(effects)

    def _log_failed(self, exc: OSError) -> None:
        # Nothing may be acknowledged that is not durable: stop serving.
        assert self.state_log is not None
        why = f"cannot write the state log in {self.state_log.dir}: {exc.strerror or exc}"
        logger.error("%s; stopping", why)
        self._pending.clear()
        self._gone = True
        if self.on_fatal is not None:
            self.on_fatal(why)

    def _apply(self, effects: list[Effect]) -> None:
        # A broadcast (Restart, JobFailed) is one message object sent to every member: encode
        # it once, not once per node.
        last_msg, frame = None, b""
        for eff in effects:
            if isinstance(eff, Send):
                c = self._conns.get(eff.conn)
                if c is not None:
                    if eff.msg is not last_msg:
                        last_msg, frame = eff.msg, encode(eff.msg)
                    c.write(frame)
            elif isinstance(eff, Close):
                c = self._conns.pop(eff.conn, None)
                if c is not None:
                    c.close()
                if not self._conns:
                    self._idle.set()
            elif isinstance(eff, Log):
                logger.log(_LEVELS.get(eff.level, logging.INFO), "%s", eff.text)

    def _schedule(self) -> None:
        at = self.machine.next_deadline()
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = at
        if at is not None:
            delay = max(0.0, at - self.clock())
            self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self._dispatch(Tick())


_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
