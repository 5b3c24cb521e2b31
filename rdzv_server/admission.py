"""Admission: the server's port, and who may hold a place on it.

The ``Gate`` is the door between the port and the service (``service.py``): the listening
sockets, the caps on open connections, the "server busy" answer of a connection over them,
the frame limit of each stage, and the client certificate a ``--tls-client-ca`` server
demands. What a connection says is the connection's (``connection.py``) and the machine's;
whether it may stay is decided here, before the machine sees it.

**The listening sockets: enough accept queue for a join storm of every node at once.** When
thousands of agents connect within a fraction of a second, the kernel queues each finished
handshake until the server accepts it. The queue holds at most ``net.core.somaxconn``
connections (4096 on most Linux machines) whatever backlog we ask for; a SYN that finds it
full is dropped and the client sends it again only after a second (then after 3 s, 7 s, ...).
Measured with 10,000 simulated agents on 2 cores: 6,000 to 13,000 drops and retransmitted
SYNs per storm, and the last agent connected 1.3 to 2.4 s after the first instead of 0.5 s.

Several sockets bound to one port with ``SO_REUSEPORT`` have a queue each, and the kernel
spreads new connections over them by a hash of the peer's address and port; one event loop
accepts from all of them. ``SO_REUSEPORT`` would also let a second server of the same user
bind the port and silently take a share of the agents, so before binding we check the port
is free with a socket that does not set it: a port held by our sockets (or anyone's) refuses
that bind with EADDRINUSE, exactly as a single socket would. Embedded servers keep one
socket: agents racing to host one must see a plain bind fail.

**Connection caps that fit under the process's file descriptor limit.** Every open connection
holds a file descriptor. Caps above the limit do not bind: the server runs out of descriptors
first, ``accept`` fails with EMFILE, and a new agent sees its connection reset, which it
reports as "not a rendezvous server". So a server raises its soft limit to the hard one at
start (``raise_fd_limit``), and its caps leave room under it (``caps_for``) for what else
needs a descriptor: the state log and its snapshots, the listening sockets, the event loop's
own, and the connections it is refusing with a "server busy" reply.

An agent's embedded server keeps its soft limit (its workers would inherit a raised one, and
programs that use select() break on descriptors above 1024) and fits its caps under it.

Every connection holds its place from the accept (after its TLS handshake, which
``hello_timeout`` bounds) until it closes, HTTP ones too. A connection over a cap is told
"server busy" in its own protocol (an ``Error`` frame, or a 503), not just closed.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import logging
import socket
import ssl
import time
from collections.abc import Callable
from typing import NamedTuple

from protocol import MAX_FRAME_SIZE, frame_limits

from .machine.state import ConnPhase

logger = logging.getLogger("rdzv_server")

MAX_CONNECTIONS = 60_000  # open sockets in all, however many descriptors we may have
RESERVE_MIN = 32  # descriptors kept for the state log, listeners, the loop, stdio
BUSY_TIMEOUT = 2.0  # a connection over the caps that has not said what it speaks by then
REFUSED_LOG_EVERY = 10.0  # one line about refused connections per this many seconds, at most
ACCEPT_QUEUE = 16384  # pending connections to hold between two turns of a busy loop
MAX_LISTENERS = 8
SOMAXCONN_PATH = "/proc/sys/net/core/somaxconn"
_monotonic = time.monotonic

# --- the caps -------------------------------------------------------------------------------


class Caps(NamedTuple):
    max_connections: int  # open connections in all (framed, HTTP, TLS handshakes)
    max_per_address: int  # from one peer address
    max_refusing: int  # connections held open briefly to be told "server busy"


def fd_limit() -> int | None:
    """The soft limit on open file descriptors, or None where there is none to read."""
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def raise_fd_limit() -> int | None:
    """Raise the soft limit on open files to the hard one; returns the soft limit now."""
    try:
        import resource
    except ImportError:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft and (hard == resource.RLIM_INFINITY or hard > soft):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:  # e.g. macOS refuses RLIM_INFINITY
            logger.warning("cannot raise the open-files limit from %d to %d: %s", soft, hard, exc)
    return fd_limit()


def caps_for(limit: int | None) -> Caps:
    """The caps for a process that may hold ``limit`` descriptors (None: no limit)."""
    if limit is None:
        limit = MAX_CONNECTIONS * 2
    reserve = RESERVE_MIN + limit // 16
    total = max(1, min(MAX_CONNECTIONS, limit - reserve))
    # One address may hold half: a NAT can put a whole cluster behind one address, but no
    # single peer should be able to lock out everyone else.
    return Caps(total, max(1, total // 2), max(1, min(reserve // 2, 1024)))


# --- the listening sockets ------------------------------------------------------------------


def kernel_accept_cap(path: str = SOMAXCONN_PATH) -> int | None:
    """The kernel's limit on one socket's accept queue, or None where we cannot read it."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def listeners_for(want: int = ACCEPT_QUEUE, cap: int | None = None) -> int:
    """How many sockets sharing a port hold ``want`` pending connections under ``cap`` each."""
    if cap is None or cap <= 0 or not hasattr(socket, "SO_REUSEPORT"):
        return 1
    return max(1, min(MAX_LISTENERS, -(-want // cap)))


def check_port_free(host: str | None, port: int) -> None:
    """Raise OSError(EADDRINUSE) if anything listens on host:port (every address it names)."""
    if port == 0:
        return  # the kernel picks a port nobody holds, and never shares a picked one
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            # As the listeners do: a connection in TIME_WAIT is no conflict.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise OSError(errno.EADDRINUSE, f"port {port} is already in use") from None
                raise


# --- the gate -------------------------------------------------------------------------------


class Place(enum.Enum):
    """What the gate gave an accepted connection."""

    NONE = "none"  # no place: closed at once (over the caps, and enough are being told so)
    HELD = "held"  # a place in the caps, until it closes
    REFUSING = "refusing"  # over the caps: held a moment (``busy_timeout``) to be told "busy"


class Gate:
    """The port's door: the listening sockets, the caps on open connections (in all, per
    address, and those held to be told "server busy"), each stage's frame limit and the client
    certificate check. A connection asks it for a place when accepted (``admit``) and gives
    the place back when closed (``release``)."""

    def __init__(
        self,
        *,
        max_connections: int | None = None,
        max_per_address: int | None = None,
        max_frame_size: int = MAX_FRAME_SIZE,
        tls: ssl.SSLContext | None = None,
        listeners: int = 1,
        raise_fd_limit: bool = False,
        hello_timeout: float,
    ) -> None:
        """``max_connections``/``max_per_address``: None fits them under the open-files limit,
        which ``listen`` first raises to the hard limit when ``raise_fd_limit``."""
        self.tls = tls  # None: plain TCP; else the port speaks only TLS
        self.listeners = listeners  # sockets sharing the port (SO_REUSEPORT)
        self.max_frame_size = max_frame_size
        self.hello_timeout = hello_timeout  # a TLS handshake's deadline too
        self.busy_timeout = min(BUSY_TIMEOUT, hello_timeout)
        self._raise_fd_limit = raise_fd_limit
        self._given_caps = (max_connections, max_per_address)
        self._set_caps(fd_limit())
        self.connections = 0  # holding a place
        self.refusing = 0  # held only to be told "server busy"
        self._per_host: dict[str, int] = {}
        self._refused = 0  # connections refused since the last warning about it
        self._refused_logged = -1e9
        self._servers: list[asyncio.Server] = []
        self._frame_limits = frame_limits()

    def _set_caps(self, fd_limit: int | None) -> None:
        derived = caps_for(fd_limit)
        given_total, given_per_address = self._given_caps
        self.max_connections = derived.max_connections if given_total is None else given_total
        self.max_per_address = derived.max_per_address if given_per_address is None else given_per_address
        self.max_refusing = derived.max_refusing
        self.fd_limit = fd_limit

    def raise_limit(self) -> None:
        """Before listening: a standalone server's open-files limit raised, and its caps with it."""
        if self._raise_fd_limit:
            self._set_caps(raise_fd_limit())

    # -- the listening sockets -------------------------------------------------------------

    async def listen(
        self,
        host: str | None,
        port: int,
        accept: Callable[[], asyncio.Protocol],
        sock: socket.socket | None = None,
    ) -> int:
        """Listen on host:port (port 0 picks a free one) with ``listeners`` sockets, each
        accepted connection ``accept()``'s; returns the bound port. ``sock``: a socket already
        bound (and maybe listening: what waits in its queue is served) to serve on instead."""
        if sock is not None:
            try:
                self._servers.append(await self._adopt(sock, accept))
            except BaseException:
                self.close()
                raise
            return self.port
        shared = self.listeners > 1
        if shared:
            check_port_free(host, port)  # SO_REUSEPORT alone would let us share a taken port
        try:
            for _ in range(self.listeners):
                self._servers.append(await self._listen(host, port, shared, accept))
                port = self.port  # the others join the first one's port (port 0 picked it)
        except BaseException:
            self.close()
            raise
        return self.port

    async def _listen(
        self, host: str | None, port: int, shared: bool, accept: Callable[[], asyncio.Protocol]
    ) -> asyncio.Server:
        server = await asyncio.get_running_loop().create_server(
            accept,
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

    async def _adopt(self, sock: socket.socket, accept: Callable[[], asyncio.Protocol]) -> asyncio.Server:
        return await asyncio.get_running_loop().create_server(
            accept,
            sock=sock,
            backlog=65535,
            ssl=self.tls,
            ssl_handshake_timeout=self.hello_timeout if self.tls is not None else None,
        )

    @property
    def port(self) -> int:
        assert self._servers and self._servers[0].sockets
        return self._servers[0].sockets[0].getsockname()[1]

    def close(self) -> None:
        """Stop listening (the connections accepted stay)."""
        for server in self._servers:
            server.close()

    async def wait_closed(self) -> None:
        servers, self._servers = self._servers, []
        for server in servers:
            await server.wait_closed()

    # -- places ----------------------------------------------------------------------------

    def admit(self, host: str) -> Place:
        """Caps on open connections, in all and per address, so no one peer can exhaust us.

        Over a cap, a connection is held a moment (``busy_timeout``) to be told "server
        busy", while few enough are (``max_refusing``); beyond that it is closed at once.
        """
        if self.connections < self.max_connections and self._per_host.get(host, 0) < self.max_per_address:
            self.connections += 1
            self._per_host[host] = self._per_host.get(host, 0) + 1
            return Place.HELD
        self._refused += 1
        now = _monotonic()
        if now - self._refused_logged >= REFUSED_LOG_EVERY:  # one line, not one per connection
            logger.warning(
                "refusing connections: at the connection limit (%d open, at most %d, %d per address; "
                "open-files limit %s); %d refused since the last such line, the latest from %s",
                self.connections,
                self.max_connections,
                self.max_per_address,
                self.fd_limit if self.fd_limit is not None else "none",
                self._refused,
                host,
            )
            self._refused, self._refused_logged = 0, now
        if self.refusing >= self.max_refusing:
            return Place.NONE
        self.refusing += 1
        return Place.REFUSING

    def release(self, host: str, place: Place) -> None:
        """A connection ``admit`` gave ``place`` closed: its place is free."""
        if place is Place.REFUSING:
            self.refusing -= 1
        elif place is Place.HELD:
            self.connections -= 1
            left = self._per_host[host] - 1
            if left:
                self._per_host[host] = left
            else:
                del self._per_host[host]

    def busy_text(self) -> str:
        return (
            f"the rendezvous server is at its connection limit ({self.max_connections} connections, "
            f"{self.max_per_address} per address); try again later"
        )

    # -- what a connection may send --------------------------------------------------------

    def frame_limit(self, phase: ConnPhase) -> int:
        """The largest frame a connection in ``phase`` may send."""
        fl = self._frame_limits
        stage = fl.hello if phase is ConnPhase.HELLO else fl.join if phase is ConnPhase.READY else fl.member
        return min(stage, self.max_frame_size)

    def lacks_client_cert(self, transport: asyncio.BaseTransport | None) -> bool:
        """With --tls-client-ca the handshake lets a certificate-less peer in; we refuse it."""
        if self.tls is None or self.tls.verify_mode == ssl.CERT_NONE or transport is None:
            return False
        return not transport.get_extra_info("peercert")
