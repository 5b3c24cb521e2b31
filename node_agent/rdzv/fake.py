"""A rendezvous in this process, for tests: the server's real machine on a clock the test moves.

:class:`FakeRendezvous` holds one :class:`rdzv_server.machine.state.Rendezvous`, the machine the daemon
runs, and plays the daemon's part around it: each link is a connection (``Connected``, the
hello, ``Received`` for each message, ``Disconnected`` when closed), and the machine's effects
are carried out at once (``Send`` to the link's inbox, ``Close`` ends the link). Every message
goes through the wire codec both ways, so what a real server would refuse to decode is refused
here too. Time is the fake clock's: nothing times out in the machine until the test calls
:meth:`FakeRendezvous.advance`, which delivers exactly the ticks the machine asks for on the way.

An agent under test gets a link through :meth:`FakeRendezvous.backend` (a
:class:`~node_agent.rdzv.RendezvousBackend`); the test can open more links itself and script
other nodes on them (:meth:`FakeRendezvous.link`, :meth:`FakeLink.take`), and wait until the
machine reaches a state (:meth:`FakeRendezvous.wait_until`). Nothing here touches a socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable

from protocol import (
    CLIENT_MESSAGES,
    SERVER_MESSAGES,
    SUPPORTED_VERSIONS,
    Error,
    Heartbeat,
    Hello,
    Message,
    Welcome,
)
from protocol.codec import decode_payload, encode
from rdzv_server.machine.state import Close, Connected, Disconnected, Effect, Received, Rendezvous, Send, Tick

from . import RendezvousRefused

SOFTWARE = "node-agent/0.1 (fake)"


class FakeRendezvous:
    """The rendezvous machine and its fake clock; links to it are connections."""

    def __init__(self, machine: Rendezvous | None = None, *, now: float = 0.0) -> None:
        self.machine = machine if machine is not None else Rendezvous()
        self.now = now
        self.logs: list[str] = []  # the machine's log lines, as the daemon would print them
        self.links: dict[int, FakeLink] = {}  # open connections by id
        self._next = 0
        self._changed = asyncio.Event()

    # -- for the agent ---------------------------------------------------------------------

    def backend(self, *, local_ip: str = "127.0.0.1", reconnects: bool = True) -> FakeBackend:
        return FakeBackend(self, local_ip=local_ip, reconnects=reconnects)

    # -- for the test ----------------------------------------------------------------------

    def link(self, local_ip: str = "127.0.0.1") -> FakeLink:
        """A new connection, past the hello (raises RendezvousRefused if the machine says no)."""
        self._next += 1
        conn = self._next
        challenge = os.urandom(16).hex() if self.machine.tokens is not None else ""
        link = FakeLink(self, conn, local_ip)
        self.links[conn] = link
        self.handle(Connected(conn, f"{local_ip}:{40000 + conn}", challenge))
        link.send(Hello(versions=SUPPORTED_VERSIONS, software=SOFTWARE))
        first = link.take()
        if not first or not isinstance(first[0], Welcome):
            link.lost = "refused during the hello"
            self.links.pop(conn, None)
            why = first[0].message if first and isinstance(first[0], Error) else f"{first!r:.200}"
            raise RendezvousRefused(f"the fake rendezvous refused the hello: {why}")
        link.challenge = first[0].challenge
        link.inbox[:0] = first[1:]
        return link

    def handle(self, event: Connected | Received | Disconnected | Tick) -> None:
        """Feed the machine one event at the fake clock's time, and carry out its effects."""
        self.apply(self.machine.handle(event, self.now))

    def apply(self, effects: list[Effect]) -> None:
        for eff in effects:
            if isinstance(eff, Send):
                link = self.links.get(eff.conn)
                if link is not None:
                    link.deliver(eff.msg)
            elif isinstance(eff, Close):
                link = self.links.pop(eff.conn, None)
                if link is not None:
                    link.lose(f"the server closed the connection: {eff.reason}")
            else:
                self.logs.append(eff.text)
        self._changed.set()

    def advance(self, dt: float) -> None:
        """Move the clock by ``dt``, delivering every tick the machine asked for on the way."""
        end = self.now + dt
        while (due := self.machine.next_deadline()) is not None and due <= end:
            self.now = max(self.now, due)
            self.handle(Tick())
        self.now = end

    def cut(self, link: FakeLink, reason: str = "connection reset by peer") -> None:
        """The connection breaks under both ends (a reset): the machine sees it disconnect and
        the link's reader gets a ConnectionError."""
        if self.links.pop(link.conn, None) is not None:
            link.lose(reason)
            self.handle(Disconnected(link.conn, reason))

    def link_of(self, node_id: str) -> FakeLink:
        """The open link of the node that joined as ``node_id``."""
        for job in self.machine.jobs.values():
            member = job.members.get(node_id) or job.spares.get(node_id)
            if member is not None and member.conn in self.links:
                return self.links[member.conn]
        raise KeyError(f"no open link for node {node_id!r}")

    async def wait_until(
        self, predicate: Callable[[], bool], *, timeout: float = 30.0, what: str = ""
    ) -> None:
        """Until ``predicate()`` holds: checked after each event the machine handles (and every
        0.1 s, for predicates about other processes); TimeoutError after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while not predicate():
            left = end - loop.time()
            if left <= 0:
                raise TimeoutError(f"waited {timeout:g} s for {what or predicate}")
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 0.1))


class FakeLink:
    """One connection to a :class:`FakeRendezvous` (a :class:`~node_agent.rdzv.RendezvousLink`)."""

    def __init__(self, hub: FakeRendezvous, conn: int, local_ip: str) -> None:
        self.hub = hub
        self.conn = conn
        self.local_ip = local_ip
        self.challenge = ""
        self.inbox: list[Message] = []  # what the machine sent, not yet received
        self.sent: list[Message] = []  # everything this link sent, for assertions
        self.lost: str | None = None  # why the link ended, once it has
        self._arrived = asyncio.Event()

    def send(self, msg: Message) -> None:
        if self.lost is not None:
            return  # as a write to a closed socket: the reader finds out
        self.sent.append(msg)
        if isinstance(msg, Heartbeat) and self.hub.machine.heartbeat(self.conn, self.hub.now):
            return  # the daemon's fast path
        wire = decode_payload(encode(msg)[4:], allowed=CLIENT_MESSAGES)
        self.hub.handle(Received(self.conn, wire))

    async def receive(self) -> Message:
        while not self.inbox:
            if self.lost is not None:
                raise ConnectionError(self.lost)
            self._arrived.clear()
            await self._arrived.wait()
        return self.inbox.pop(0)

    async def close(self) -> None:
        if self.lost is not None:
            return
        self.lost = "closed by this side"
        self._arrived.set()
        if self.hub.links.pop(self.conn, None) is not None and self.conn in self.hub.machine.conns:
            self.hub.handle(Disconnected(self.conn, "connection closed"))

    def take(self) -> list[Message]:
        """What arrived and was not received yet (for a node the test scripts)."""
        out, self.inbox = self.inbox, []
        return out

    # -- the hub's side --------------------------------------------------------------------

    def deliver(self, msg: Message) -> None:
        self.inbox.append(decode_payload(encode(msg)[4:], allowed=SERVER_MESSAGES))
        self._arrived.set()

    def lose(self, reason: str) -> None:
        self.lost = reason
        self._arrived.set()


class FakeBackend:
    """Links to a :class:`FakeRendezvous` (a :class:`~node_agent.rdzv.RendezvousBackend`)."""

    snapshots = False
    standby_port = 0  # never hosts as a standby (issue 45: server.py's links only)
    shares_joins = False

    def __init__(self, hub: FakeRendezvous, *, local_ip: str, reconnects: bool) -> None:
        self.hub = hub
        self.local_ip = local_ip
        self.reconnects = reconnects
        self.opened: list[FakeLink] = []  # every link this backend made, newest last

    async def connect(self, deadline: float) -> FakeLink:
        link = self.hub.link(self.local_ip)
        self.opened.append(link)
        return link

    async def close(self, *, linger: bool) -> None:
        return None
