"""The rendezvous machine's inputs (events) and outputs (effects).

The asyncio layer (``service.py``), the state log's replay (``journal.py``) and the etcd
backend's replicas turn what happens (a connection, a frame, a timer) into these events, feed
them to :meth:`rdzv_server.state.Rendezvous.handle`, and carry out the effects it returns.
They are here, apart from the machine, so that each of its modules can name them; import them
from ``rdzv_server.state`` as before.
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


Event = Connected | Received | Disconnected | Tick


# --- effects ------------------------------------------------------------------------------


@record(frozen=True, slots=True)
class Send:
    conn: int
    msg: Message


@record(frozen=True, slots=True)
class Close:
    conn: int
    reason: str


@record(frozen=True, slots=True)
class Log:
    level: str  # "info" | "warning" | "error"
    text: str


Effect = Send | Close | Log
