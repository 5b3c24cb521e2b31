"""The rendezvous machine's inputs (events) and outputs (effects).

The asyncio layer (``service.py``), the state log's replay (``journal.py``) and the etcd
backend's replicas turn what happens (a connection, a frame, a timer, an operator's drain, a
shutdown, a restart) into these events, feed them to
:meth:`rdzv_server.machine.state.Rendezvous.handle` (the machine's one entry point), and
carry out the effects it returns. The state log keeps one record kind per event
(``journal.RECORDS``). They are here, apart from the machine, so that each of its modules can
name them; import them from ``rdzv_server.machine.state`` as well.
"""

from __future__ import annotations

from protocol import Message
from protocol.records import record

# --- events -------------------------------------------------------------------------------


@record(frozen=True, slots=True)
class Connected:
    conn: int
    peer: str
    challenge: str = ""  # a fresh random nonce, when the server asks for tokens
    # When the socket was accepted, on the machine's clock, if before this event (the service
    # reads a connection's first bytes to route it first): the hello deadline counts from it.
    since: float | None = None
    # The server's own address on this connection (the socket's local address): the address
    # the peer reached it on; "" when unknown (replicas, old state logs).
    local: str = ""


@record(frozen=True, slots=True)
class Received:
    conn: int
    msg: Message


@record(frozen=True, slots=True)
class Disconnected:
    conn: int
    reason: str = "connection closed"


@record(frozen=True, slots=True)
class Tick:
    """Delivered at (or after) :meth:`Rendezvous.next_deadline`."""


@record(frozen=True, slots=True)
class DrainRequested:
    """An operator asks one node to leave its job cleanly (``rdzv-server drain``, the HTTP API)."""

    job_id: str
    node_id: str
    reason: str = ""


@record(frozen=True, slots=True)
class ShuttingDown:
    """The server is going away (SIGTERM): no more joins; every agent is told to come back."""

    reason: str


@record(frozen=True, slots=True)
class Restarted:
    """The state was just restored from the log of a previous process, whose sockets are gone."""


Event = Connected | Received | Disconnected | Tick | DrainRequested | ShuttingDown | Restarted


# --- effects ------------------------------------------------------------------------------


@record(frozen=True, slots=True)
class Send:
    conn: int
    msg: Message


@record(frozen=True, slots=True)
class Close:
    conn: int
    reason: str
    # Closed for what the server is configured with (a wrong token, a nearly full state
    # disk), not for job state: replay has neither, so the state log keeps the event that
    # caused it as this disconnection.
    by_config: bool = False


@record(frozen=True, slots=True)
class Log:
    level: str  # "info" | "warning" | "error"
    text: str


@record(frozen=True, slots=True)
class NotFound:
    """A :class:`DrainRequested` named a job or node the server does not have (nothing changed)."""

    text: str


Effect = Send | Close | Log | NotFound
