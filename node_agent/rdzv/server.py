"""``--rdzv-backend c10d``: the agent's connection to a rendezvous server (``rdzv-server``, or
one an agent hosts: ``hosting.py``): connect, say hello, exchange frames.

Connecting retries with capped exponential backoff and jitter until a deadline, printing what
it waits for once per distinct problem (not once per attempt). After the TCP connect the
server has ``handshake_timeout`` to answer our hello with its magic and a welcome; a listener
that answers anything else, or nothing, is named as not being a rendezvous server.

A listener that closes the connection without a word is either a rendezvous server at its
connection cap (whose "busy" replies were crowded out: it closes the excess at once) or one
that speaks the other of plain TCP and TLS (TLS on one side only shows up as that close). A
second connection tells them apart: it speaks the other protocol to the listener (a TLS
ClientHello, or our plain hello), and an answer in it names the flag that is missing, at once;
no answer either is taken as a full server, tried again like a busy one until the deadline.

With a TLS context the handshake follows the TCP connect (so refused connections are still
retried, but a certificate that does not verify fails at once) and the server's certificate
must name the endpoint host we dialled.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from protocol import (
    MAGIC,
    SERVER_MESSAGES,
    SUPPORTED_VERSIONS,
    Error,
    FrameDecoder,
    Hello,
    Message,
    ProtocolError,
    Standbys,
    Welcome,
    encode,
)
from protocol.tls import verify_failure

from ..agent_log import shown
from . import NotARendezvousServer, RendezvousError, RendezvousRefused, RendezvousUnreachable
from .takeover import TRY_EACH, Target, newer, probe, release, reserve_port, walk

if TYPE_CHECKING:
    from ..config import AgentConfig
    from .hosting import HostedServer

SOFTWARE = "node-agent/0.1"
READ_CHUNK = 1 << 16
HANDSHAKE_TIMEOUT_CAP = 10.0


class TokenNotAsked(RendezvousRefused):
    """We hold a token, and the server asks for none: an open server (or the wrong one)."""


class TLSFailed(RendezvousRefused):
    """TLS cannot work with this server: its certificate does not verify, or a handshake alert."""


_TLS_ALERT = b"\x15\x03"  # a TLS alert record: what some TLS servers send a plain client


class Connection:
    """A link to a rendezvous server, past the hello (made by :func:`connect`)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, version: int) -> None:
        self.reader = reader
        self.writer = writer
        self.version = version
        self.challenge = ""  # the server's nonce for token proofs, from its welcome
        self._decoder: FrameDecoder | None = None
        self._pending: list[Message] = []
        # Where the job goes if the agent hosting the rendezvous is lost: the link's own
        # business (``takeover.py``), never the agent machine's.
        self.on_standbys: Callable[[Standbys], None] | None = None

    @property
    def local_ip(self) -> str:
        """The address of our end: the interface that routes to the server."""
        return self.writer.get_extra_info("sockname")[0]

    def send(self, msg: Message) -> None:
        if not self.writer.is_closing():
            self.writer.write(encode(msg))

    async def receive(self) -> Message:
        """The next message; raises ConnectionError when the server is gone."""
        assert self._decoder is not None
        while True:
            while not self._pending:
                data = await self.reader.read(READ_CHUNK)
                if not data:
                    raise ConnectionError("the server closed the connection")
                self._pending.extend(self._decoder.feed(data))
            msg = self._pending.pop(0)
            if not isinstance(msg, Standbys):
                return msg
            if self.on_standbys is not None:
                self.on_standbys(msg)

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass


class ServerBackend:
    """Links to the rendezvous server at the endpoint, which may be one this agent hosts."""

    reconnects = True
    shares_joins = False
    snapshots = True

    def __init__(
        self,
        config: AgentConfig,
        *,
        port: int,
        log: Callable[..., None],
        clock: Callable[[], float],
        tls: ssl.SSLContext | None = None,
        hosted: HostedServer | None = None,
        node_id: str = "",
        reserved: socket.socket | None = None,
    ) -> None:
        self.config = config
        self.endpoint = (config.rdzv_host, port)
        self.log = log
        self.clock = clock
        self.tls = tls  # to a rdzv-server; what we host is plain TCP
        self.hosted = hosted
        self.node_id = node_id
        # Issue 45: the port held to host on should the host be lost (our Join offers it), and
        # the standbys the rendezvous last named (None: it named none; a rdzv-server never does).
        self._reserved = reserved
        self.standby_port = reserved.getsockname()[1] if reserved is not None else 0
        self.standbys: Standbys | None = None

    @classmethod
    async def open(
        cls, config: AgentConfig, *, node_id: str, log: Callable[..., None], clock: Callable[[], float]
    ) -> ServerBackend:
        """The TLS context, and the rendezvous we host when we are the one to (``hosting.py``)."""
        tls = None
        if config.tls_ca is not None and not config.hosts_rendezvous:
            from edge.tls import TLSConfigError, client_context

            try:
                tls = client_context(config.tls_ca, config.tls_cert, config.tls_key)
            except TLSConfigError as exc:
                raise RendezvousError(str(exc)) from None
        from .hosting import host_if_ours

        # With TLS we wait for a rdzv-server: we could only host plain TCP.
        hosted = await host_if_ours(config, node_id=node_id, log=log, may_guess=tls is None)
        port = config.rdzv_port if hosted is None else hosted.port
        reserved = None
        # A standby hosts plain TCP, as any agent: not where the job uses TLS (a rdzv-server's).
        if hosted is None and tls is None and config.rdzv_conf.is_host is not False and not config.standalone:
            reserved = reserve_port(config.rdzv_port)
        return cls(
            config,
            port=port,
            log=log,
            clock=clock,
            tls=tls,
            hosted=hosted,
            node_id=node_id,
            reserved=reserved,
        )

    async def connect(self, deadline: float) -> Connection:
        """The first link, or one after a lost link: to where the rendezvous was, or, once it
        named standbys, to the first of them alive (hosting it ourselves at our turn)."""
        conn = await (
            self._connect_to(*self.endpoint, deadline) if self.standbys is None else self._walk(deadline)
        )
        conn.on_standbys = self._heard
        return conn

    def _heard(self, msg: Standbys) -> None:
        if not newer(self.standbys, msg):
            return
        old, self.standbys = self.standbys, msg
        if old is None or (old.host_node, old.nodes, old.endpoints) != (
            msg.host_node,
            msg.nodes,
            msg.endpoints,
        ):
            named = ", ".join(f"node {n} at {e}" for n, e in zip(msg.nodes, msg.endpoints, strict=True))
            self.log(
                f"should the rendezvous host (node {msg.host_node}) be lost, it moves to: {named or 'none'}"
            )

    async def _walk(self, deadline: float) -> Connection:
        assert self.standbys is not None
        problem = ""
        while True:
            passed: list[str] = []  # the standbys before our turn that did not answer
            for t in walk(self.standbys, self.endpoint, self.node_id):
                if t.mine:
                    if self._reserved is None:
                        continue  # we could not host before: the next walk tries the others
                    return await self._take_over(t, deadline, tuple(passed))
                standby = t.node != self.standbys.host_node
                if await probe(t.host, t.port, 1.0) == "refused":
                    # Nothing listens there: its agent is gone (a hosted server, and a standby's
                    # reserved port, live as long as their agent). No point in retrying it.
                    problem = f"nothing listens at {t.host}:{t.port} any more (node {t.node})"
                    if standby:
                        passed.append(t.node)
                    continue
                # The host may be back in a moment; a standby that is alive (it listens on its
                # reserved port) hosts at its turn: wait for it, never host beside it.
                until = deadline if standby else min(deadline, self.clock() + TRY_EACH)
                try:
                    conn = await self._connect_to(t.host, t.port, until)
                except (RendezvousUnreachable, NotARendezvousServer) as exc:
                    problem = str(exc)
                    if standby:
                        passed.append(t.node)
                    continue
                if (t.host, t.port) != self.endpoint:
                    self.log(
                        f"the rendezvous moved: node {t.node} hosts it now, at {t.host}:{t.port}", "warning"
                    )
                    self.endpoint = (t.host, t.port)
                return conn
            if self.clock() >= deadline:
                raise RendezvousUnreachable(
                    f"neither the rendezvous host nor its standbys answered: {problem}"
                )
            # Every place refused at once (nobody hosts yet): walk again shortly, not in a spin.
            await asyncio.sleep(min(0.2, max(0.0, deadline - self.clock())))

    async def _take_over(self, t: Target, deadline: float, passed: tuple[str, ...]) -> Connection:
        assert self.standbys is not None
        from .hosting import host_as_standby

        term = self.standbys.term + 1
        assert self._reserved is not None
        sock, self._reserved = self._reserved, None  # the service's now (or closed below)
        self.standby_port = 0  # we host now: not a standby any more
        try:
            self.hosted = await host_as_standby(
                self.config,
                node_id=self.node_id,
                sock=sock,
                standbys=self.standbys,
                passed=passed,
                log=self.log,
            )
        except OSError as exc:
            release(sock)
            self.log(
                f"cannot host the rendezvous on port {t.port} as its standby: {exc.strerror or exc}", "error"
            )
            return await self._walk(deadline)
        self.log(
            f"the rendezvous host (node {self.standbys.host_node}) is gone: this node hosts the rendezvous "
            f"now, on port {t.port} of every interface (take-over {term})",
            "warning",
        )
        self.endpoint = (t.host, t.port)
        return await self._connect_to(t.host, t.port, deadline)

    async def _connect_to(self, host: str, port: int, deadline: float) -> Connection:
        return await connect(
            host,
            port,
            deadline=deadline,
            handshake_timeout=min(self.config.rdzv_conf.read_timeout, HANDSHAKE_TIMEOUT_CAP),
            log=self.log,
            clock=self.clock,
            tls=self.tls,
            # Holding a token, we refuse a server that asks for none: whoever reaches it can
            # join our job, or it is not the server the token was meant for.
            need_token=bool(self.config.token),
        )

    async def close(self, *, linger: bool) -> None:
        release(self._reserved)
        self._reserved = None
        if self.hosted is not None:
            await self.hosted.close(linger=linger)


T = TypeVar("T")


async def retry_until(
    attempt: Callable[[], Awaitable[T]],
    *,
    retry_on: tuple[type[BaseException], ...],
    describe: Callable[[BaseException], str],
    deadline: float,
    clock: Callable[[], float],
    waiting: Callable[[str], None],
    give_up: Callable[[str], Exception],
) -> T:
    """Call attempt until it succeeds, with capped, jittered exponential backoff until deadline.

    ``waiting`` hears each distinct problem once (not once per attempt); past the deadline the
    exception ``give_up`` makes of the last problem is raised.
    """
    delay = 0.05
    last_problem = ""
    while True:
        try:
            return await attempt()
        except retry_on as exc:
            problem = describe(exc)
            if problem != last_problem:
                waiting(problem)
                last_problem = problem
            if clock() + delay > deadline:
                raise give_up(problem) from None
            import random  # here: only a retry needs it, and it costs every launch 2 ms

            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 2.0)


async def connect(
    host: str,
    port: int,
    *,
    deadline: float,
    handshake_timeout: float,
    log: Callable[[str], None],
    clock: Callable[[], float] = time.monotonic,
    tls: ssl.SSLContext | None = None,
    need_token: bool = False,
) -> Connection:
    """Connect and exchange hellos, retrying refused or unreachable endpoints until deadline.

    With ``tls``, the handshake verifies the server's certificate against ``host``. With
    ``need_token`` (the agent holds one), a server whose welcome asks for no token is refused.
    A server that answers the hello with a non-fatal error (at its connection limit: busy), or
    closes it without a word while speaking our protocol (full: its busy replies crowded out),
    is tried again, with the same backoff as an unreachable one, until the deadline.
    """
    once = functools.partial(
        _connect_once, host, port, deadline=deadline, handshake_timeout=handshake_timeout,
        log=log, clock=clock, tls=tls, need_token=need_token,
    )  # fmt: skip

    async def attempt() -> Connection:
        try:
            return await once()
        except _RoomForOthers:
            return await once()  # a second such close is the answer (raised as it is)

    last: list[BaseException] = []

    def describe(exc: BaseException) -> str:
        last[:] = [exc]
        return str(exc)

    def give_up(problem: str) -> Exception:
        why = f"{problem}; gave up when the time to connect ran out"
        if last and isinstance(last[0], _Full):
            why += (
                " (it closed every connection without answering: a rendezvous server at its "
                "connection cap, or a listener that is not a rendezvous server)"
            )
        return RendezvousRefused(why)

    return await retry_until(
        attempt,
        retry_on=(_Busy,),
        describe=describe,
        deadline=deadline,
        clock=clock,
        waiting=lambda problem: log(f"{problem}; retrying"),
        give_up=give_up,
    )


class _Busy(Exception):
    """The server answered the hello with a non-fatal error: try again later."""


class _Full(_Busy):
    """The server closed the connection without a word, and answers neither protocol on a
    second one: at its connection cap (it closes the excess without the busy reply once too
    many wait for one). Try again later."""


class _RoomForOthers(NotARendezvousServer):
    """Our TLS connection was closed without a word while one without a certificate was
    answered: our certificate was not accepted, unless a place freed meanwhile (try once more)."""


def _full(host: str, port: int) -> _Full:
    return _Full(
        f"the rendezvous server at {host}:{port} is full (connection cap): it closed the connection "
        "without answering"
    )


async def _connect_once(
    host: str,
    port: int,
    *,
    deadline: float,
    handshake_timeout: float,
    log: Callable[[str], None],
    clock: Callable[[], float],
    tls: ssl.SSLContext | None,
    need_token: bool,
) -> Connection:
    reader, writer = await retry_until(
        lambda: asyncio.wait_for(asyncio.open_connection(host, port), timeout=max(0.1, deadline - clock())),
        retry_on=(OSError, asyncio.TimeoutError),
        describe=_describe_os_error,
        deadline=deadline,
        clock=clock,
        waiting=lambda why: log(f"waiting for the rendezvous server at {host}:{port}: {why}; retrying"),
        give_up=lambda problem: RendezvousUnreachable(
            f"no rendezvous server answered at {host}:{port} ({problem}); gave up after the join "
            f"timeout. Is `rdzv-server` running there, or did you mean --standalone?"
        ),
    )
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls is not None:
        await _start_tls(writer, tls, host, port, handshake_timeout)
    conn = Connection(reader, writer, version=0)
    try:
        if writer.transport.is_closing():
            # Reset between connect and hello (a server dying, or one still starting): uvloop
            # raises RuntimeError on the write below, plain asyncio drops it. A closed hello.
            raise ConnectionResetError("the connection was reset before the hello")
        writer.write(MAGIC + encode(Hello(versions=SUPPORTED_VERSIONS, software=SOFTWARE)))
        first = await _answer_or_probe(conn, host, port, handshake_timeout, probe=tls is None)
    except _TCPStoreFound:
        await conn.close()
        raise NotARendezvousServer(
            f"{host}:{port} is a torch TCPStore (torchrun's c10d rendezvous, or a job's MASTER_PORT), "
            "not a rendezvous server: point --rdzv-endpoint at `rdzv-server` (node-agent's default "
            "port is 29500), or give --rdzv-backend static with torchrun's --master-addr/--master-port"
        ) from None
    except asyncio.TimeoutError:
        await conn.close()
        raise NotARendezvousServer(
            f"{host}:{port} accepted the connection but did not answer as a rendezvous server "
            f"within {handshake_timeout:g} s"
        ) from None
    except _Garbage as exc:
        await conn.close()
        if tls is None and exc.sample.startswith(_TLS_ALERT):
            raise NotARendezvousServer(
                f"{host}:{port} answered our hello with a TLS alert: it speaks TLS; give --tls-ca FILE"
            ) from None
        raise NotARendezvousServer(
            f"{host}:{port} does not speak the rendezvous protocol (it answered {exc.sample!r})"
        ) from None
    except (ConnectionError, ssl.SSLError) as exc:
        await conn.close()
        if tls is None:
            # A TLS server cannot answer a plain hello in TLS: all we see is the close, as from
            # a full server. A TLS ClientHello on a second connection tells them apart.
            if await _speaks_tls(host, port, timeout=min(PROBE_AFTER, handshake_timeout)):
                raise NotARendezvousServer(
                    f"{host}:{port} closed the connection during the hello, and answers TLS: it is a "
                    "rendezvous server that uses TLS; give --tls-ca FILE (the CA of its certificate)"
                ) from None
            raise _full(host, port) from None
        refused = (
            f"{host}:{port} closed the TLS connection during the hello: it is not a rendezvous "
            "server, or it did not accept our client certificate (--tls-cert)"
        )
        if isinstance(exc, ssl.SSLError):
            raise NotARendezvousServer(refused) from None
        # Past the handshake a full server closes without a word, and so does one that did not
        # accept our certificate (asyncio's server drops the alert). A hello without a
        # certificate on a second connection tells: answered, the server has room (so try
        # once more at once, and a second such close is the answer); not, it is full.
        if await _speaks_rdzv(host, port, timeout=min(PROBE_AFTER, handshake_timeout), tls=True):
            raise _RoomForOthers(refused) from None
        raise _full(host, port) from None
    if isinstance(first, Error):
        await conn.close()
        if not first.fatal:
            raise _Busy(f"the rendezvous server at {host}:{port} is busy: {shown(first.message)}")
        raise RendezvousRefused(f"the rendezvous server at {host}:{port} refused us: {shown(first.message)}")
    if not isinstance(first, Welcome):
        await conn.close()
        raise NotARendezvousServer(f"{host}:{port} answered the hello with {first.TYPE}")
    if need_token and not first.challenge:
        await conn.close()
        raise TokenNotAsked(
            f"the rendezvous server at {host}:{port} does not ask for a token, but this agent holds "
            "one (--token-file, RDZV_TOKEN_FILE or RDZV_TOKEN): refusing it, since anyone who reaches "
            "it can join the job. Start that rdzv-server with the job's token (--token-file), or run "
            "this agent without one"
        )
    conn.version = first.version
    conn.challenge = first.challenge
    return conn


async def _start_tls(
    writer: asyncio.StreamWriter, tls: ssl.SSLContext, host: str, port: int, timeout: float
) -> None:
    """The TLS handshake on a connected stream; each failure named for the user."""
    try:
        await asyncio.wait_for(writer.start_tls(tls, server_hostname=host), timeout=timeout)
        return
    except ssl.SSLCertVerificationError as exc:
        problem: Exception = TLSFailed(
            f"cannot verify the rendezvous server at {host}:{port}: {verify_failure(exc)} (check "
            f"--tls-ca; the server's certificate must be signed by it and name {host!r})"
        )
    except (ConnectionError, ssl.SSLEOFError, ssl.SSLZeroReturnError):
        # What a plain server does with a ClientHello, and a full one with any connection: it
        # closes it. Our plain hello on a second connection tells them apart.
        writer.transport.abort()
        if await _speaks_rdzv(host, port, timeout=min(PROBE_AFTER, timeout)):
            raise NotARendezvousServer(
                f"{host}:{port} closed the connection during the TLS handshake: it does not speak TLS "
                "(a rdzv-server without --tls-cert? then drop --tls-ca)"
            ) from None
        raise _full(host, port) from None
    except ssl.SSLError as exc:
        problem = TLSFailed(f"the TLS handshake with {host}:{port} failed: {exc.reason or exc}")
    except asyncio.TimeoutError:
        problem = NotARendezvousServer(
            f"{host}:{port} accepted the connection but did not complete a TLS handshake within {timeout:g} s"
        )
    # No wait_closed(): a stream whose handshake failed never reports being closed.
    writer.transport.abort()
    raise problem from None


# A rendezvous server answers a hello in milliseconds. A listener silent for this long is
# asked, on a second connection, whether it is torch's TCPStore (the usual tenant of 29500).
PROBE_AFTER = 1.0
# TCPStore's wire: a VALIDATE command (0) with its magic number, then PING (13) with a nonce that
# a TCPStore echoes back. Anything else than the echo leaves the question open.
_STORE_VALIDATE = b"\x00" + (0x3C85F7CE).to_bytes(4, "little")
_STORE_PING = 13


class _TCPStoreFound(Exception):
    pass


async def _answer_or_probe(conn: Connection, host: str, port: int, timeout: float, *, probe: bool) -> Message:
    """The server's first message within ``timeout``; if it is slow and ``probe``, find out
    whether a torch TCPStore is listening instead (raises _TCPStoreFound)."""
    answer = asyncio.ensure_future(_first_message(conn))
    try:
        if probe and timeout > PROBE_AFTER:
            done, _ = await asyncio.wait({answer}, timeout=PROBE_AFTER)
            if not done and await _is_tcpstore(host, port, timeout=min(1.0, timeout - PROBE_AFTER)):
                raise _TCPStoreFound()
            return await asyncio.wait_for(asyncio.shield(answer), timeout=max(0.0, timeout - PROBE_AFTER))
        return await asyncio.wait_for(asyncio.shield(answer), timeout=timeout)
    finally:
        if not answer.done():
            answer.cancel()
            with contextlib.suppress(BaseException):
                await answer


async def _is_tcpstore(host: str, port: int, *, timeout: float) -> bool:
    nonce = os.urandom(4)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    try:
        writer.write(_STORE_VALIDATE + bytes([_STORE_PING]) + nonce)
        echoed = await asyncio.wait_for(reader.readexactly(4), timeout)
        return echoed == nonce
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
        return False
    finally:
        writer.transport.abort()


async def _first_bytes(
    host: str, port: int, payload: bytes, n: int, *, timeout: float, tls: bool = False
) -> bytes:
    """The first ``n`` bytes a listener answers ``payload`` with on a new connection (over TLS
    that verifies nothing, with ``tls``); b"" for none (refused, closed, reset or silent within
    ``timeout``)."""
    ctx = _unverified() if tls else None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=ctx), timeout)
    except (OSError, asyncio.TimeoutError):  # ssl.SSLError is an OSError
        return b""
    try:
        writer.write(payload)
        return await asyncio.wait_for(reader.readexactly(n), timeout)
    except (OSError, RuntimeError, asyncio.TimeoutError, asyncio.IncompleteReadError):
        return b""  # RuntimeError: uvloop's write on a transport the peer already reset
    finally:
        writer.transport.abort()


def _unverified() -> ssl.SSLContext:
    """A TLS client context for the probes: no certificate, nothing verified."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


async def _speaks_tls(host: str, port: int, *, timeout: float) -> bool:
    """Whether the listener answers a TLS ClientHello with a TLS record (a handshake or an
    alert). Nothing is verified: only what it speaks is asked."""
    out = ssl.MemoryBIO()
    with contextlib.suppress(ssl.SSLWantReadError):
        _unverified().wrap_bio(ssl.MemoryBIO(), out).do_handshake()
    head = await _first_bytes(host, port, out.read(), 2, timeout=timeout)
    return head in (b"\x16\x03", _TLS_ALERT)


async def _speaks_rdzv(host: str, port: int, *, timeout: float, tls: bool = False) -> bool:
    """Whether the listener answers our hello in our protocol (a welcome or a refusal), over
    plain TCP or, with ``tls``, over TLS without a certificate on either side (nothing is
    verified: only whether it answers is asked)."""
    hello = MAGIC + encode(Hello(versions=SUPPORTED_VERSIONS, software=SOFTWARE))
    return await _first_bytes(host, port, hello, len(MAGIC), timeout=timeout, tls=tls) == MAGIC


class _Garbage(Exception):
    def __init__(self, sample: bytes) -> None:
        self.sample = sample


async def _first_message(conn: Connection) -> Message:
    received = bytearray()
    decoder = FrameDecoder(allowed=SERVER_MESSAGES, expect_magic=True)
    while True:
        data = await conn.reader.read(READ_CHUNK)
        if not data:
            if received:
                raise _Garbage(bytes(received[:40]))
            raise ConnectionError("closed during hello")
        if len(received) < 64:
            received += data[:64]
        try:
            msgs = decoder.feed(data)
        except ProtocolError:
            raise _Garbage(bytes(received[:40])) from None
        if msgs:
            conn._decoder = decoder
            conn._pending.extend(msgs[1:])
            return msgs[0]


def _describe_os_error(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "connect timed out"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve host ({exc.strerror})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__
