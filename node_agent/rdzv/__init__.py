"""The rendezvous backends: where an agent finds its job's other nodes (``--rdzv-backend``).

Every backend gives the runner the same two things, so the runner never asks which one it has:

- a :class:`RendezvousLink`: a connection that sends the agent's messages and receives the
  rendezvous's answers, as if from a rdzv-server (``protocol`` messages both ways);
- a :class:`RendezvousBackend`: what opens those links (first at start-up, then again after
  a lost connection) and what outlives them (a rendezvous server this agent hosts).

What a backend is, apart from its code, is one row of :data:`BACKENDS` (its :class:`Traits`:
its default port, whether ranks come from the command line, whether it keeps the rendezvous
itself, whether an agent may host the workers' store, what it does with ``--node-rank``,
whether TLS applies): the command line, the config and the store read the row, never the
name. :func:`open_backend` is the only code that looks at the name, to import the one chosen.
The backends, each imported only when chosen (a launch pays for none it does not use):

==================  ===============================================================================
``server.py``       ``c10d`` (the default): a connection to ``rdzv-server`` over TCP or TLS
``hosting.py``      ``c10d``'s embedded server: a standalone run, ``is_host=true``, or the first
                    agent on the endpoint's machine (torchrun's c10d) serves the rendezvous itself
``static.py``       ``static``: no rendezvous; every rank comes from the command line
``etcd.py``         ``etcd``/``etcd-v2``: the server's machine, replicated through a log in etcd
``etcd_client.py``  etcd's v3 JSON gateway, for ``etcd.py``
``fake.py``         tests: the server's real machine in this process, on a clock the test moves
==================  ===============================================================================

Adding a backend takes three files: its module (a link and a backend class that satisfy the
two protocols below), its row in :data:`BACKENDS` and its branch in :func:`open_backend` (both
here), and its test.

A backend that cannot be used raises a :class:`RendezvousError`; the agent then exits with
``EXIT_RDZV`` and the error's text as its last line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from protocol import Message

    from ..config import AgentConfig

__all__ = [
    "BACKENDS",
    "NotARendezvousServer",
    "RendezvousBackend",
    "RendezvousError",
    "RendezvousLink",
    "RendezvousRefused",
    "RendezvousUnreachable",
    "Traits",
    "open_backend",
]


class Traits(NamedTuple):
    """What one ``--rdzv-backend`` is, for the code that is not the backend's own."""

    default_port: int  # the endpoint's port when none is given
    # No rendezvous: every rank comes from the command line (--node-rank, and the master from
    # --master-addr/--master-port or the endpoint; worker rank 0 hosts torch's store there).
    static_ranks: bool
    # The rendezvous lives in a service of its own (etcd): no agent ever hosts it.
    keeps_rendezvous: bool
    # An agent may host the workers' TCPStore: the nodes agree through the rendezvous on who does.
    agent_store: bool
    # --node-rank is used (torchrun's etcd backends ignore it, and so do we, saying so).
    takes_node_rank: bool
    # A given --node-rank goes in the Join: the server orders a fixed-size job's group ranks by it.
    joins_node_rank: bool
    tls: bool  # --tls-* apply: the rendezvous is a rdzv-server


_ETCD = Traits(
    default_port=2379,  # etcd's client port, as torch's etcd backends default to
    static_ranks=False,
    keeps_rendezvous=True,
    agent_store=True,
    takes_node_rank=False,
    joins_node_rank=False,
    tls=False,
)

# Every --rdzv-backend, by name (c10d first: the default).
BACKENDS: dict[str, Traits] = {
    "c10d": Traits(
        default_port=29500,
        static_ranks=False,
        keeps_rendezvous=False,
        agent_store=True,
        takes_node_rank=True,
        joins_node_rank=True,
        tls=True,
    ),
    "static": Traits(
        default_port=29500,  # torchrun's --master-port default
        static_ranks=True,
        keeps_rendezvous=False,
        agent_store=False,  # no rendezvous to agree through: worker rank 0 hosts it, as torchrun's
        takes_node_rank=True,
        joins_node_rank=False,
        tls=False,
    ),
    "etcd": _ETCD,
    "etcd-v2": _ETCD,  # both names use etcd's v3 API
}


class RendezvousError(Exception):
    """The rendezvous cannot be used; ``str()`` says why, for the agent's last line."""


class RendezvousUnreachable(RendezvousError):
    """Nothing answered at the endpoint before the deadline."""


class NotARendezvousServer(RendezvousError):
    """Something answers at the endpoint, but it does not speak our protocol (or not yet)."""


class RendezvousRefused(RendezvousError):
    """The rendezvous answered with a refusal (e.g. no common protocol version, a bad token)."""


class RendezvousLink(Protocol):
    """One open connection to the job's rendezvous."""

    @property
    def local_ip(self) -> str:
        """This node's address as its peers should reach it (the interface towards them)."""
        ...

    @property
    def challenge(self) -> str:
        """The rendezvous's nonce for token proofs; empty when it asks for no token."""
        ...

    def send(self, msg: Message) -> None:
        """Queue a message; never blocks. After the link is lost it may be dropped silently."""
        ...

    async def receive(self) -> Message:
        """The next message; raises ``ConnectionError`` once the link is lost (and after)."""
        ...

    async def close(self) -> None:
        """Close the link; safe to call twice."""
        ...


class RendezvousBackend(Protocol):
    """Opens links to one job's rendezvous, and owns whatever must outlive them."""

    @property
    def reconnects(self) -> bool:
        """Whether a lost link is worth opening again (False: the loss ends the run)."""
        ...

    # Whether the backend's server picks restore steps and relays replica keys (issue 35): our
    # rendezvous server does; the static backend has no server, etcd's is not covered yet.
    snapshots: bool
    # The port this agent would host the rendezvous on, were the agent hosting it lost (issue
    # 45, ``takeover.py``; 0: it would not). Our Join says it.
    standby_port: int

    @property
    def shares_joins(self) -> bool:
        """Whether every agent of the job can read our ``Join`` (then it carries no node secret)."""
        ...

    async def connect(self, deadline: float) -> RendezvousLink:
        """A new link, trying until ``deadline`` (the backend's clock); raises RendezvousError."""
        ...

    async def close(self, *, linger: bool) -> None:
        """Release what the backend holds; with ``linger``, after the run ended normally, a
        hosted rendezvous first serves the job's other nodes until they are gone."""
        ...


async def open_backend(
    config: AgentConfig, *, node_id: str, log: Callable[..., None], clock: Callable[[], float]
) -> RendezvousBackend:
    """The backend ``--rdzv-backend`` names, ready to connect (a server we host is listening).

    Raises :class:`RendezvousError` when it cannot be set up (a TLS file that does not load,
    a port we were told to host on that is taken)."""
    backend = config.rdzv_backend
    if backend == "static":
        from .static import StaticBackend

        return StaticBackend(config, log=log, clock=clock)
    if backend in ("etcd", "etcd-v2"):
        from .etcd import EtcdBackend

        return EtcdBackend(config, log=log, clock=clock)
    if backend == "c10d":
        from .server import ServerBackend

        return await ServerBackend.open(config, node_id=node_id, log=log, clock=clock)
    raise ValueError(f"unknown rendezvous backend {backend!r}")  # not in BACKENDS: the CLI admits none
