"""The rendezvous server an agent hosts itself, in its own event loop (no second process).

An agent hosts when it is told to (``--standalone``, port 0, ``--rdzv-conf is_host=true``) and,
like torchrun's c10d backend, when nobody told it either way and it is the first agent on the
endpoint's machine to find the port free: several agents may race there; the one whose bind
wins hosts, the others connect to it as clients. What it hosts is the daemon's own
:class:`rdzv_server.service.RendezvousService`, with its HTTP side (status, ``/v1/jobs``, the
dashboard) set up only at the first HTTP request: a launch nobody asks about never imports aiohttp.

An agent that hosts because it guessed it should (not because it was told) keeps serving after
its own run until its job's other nodes are gone, so its early exit does not strand them.

Where it listens: on every interface, as torchrun's c10d store does (its ``TCPStore`` server
binds the wildcard address whatever host the endpoint names), even when the endpoint names
loopback: SkyPilot's recipe gives node 0 ``localhost:29500`` and the other nodes
``HEAD_IP:29500``, so the others must reach what node 0 hosts on its network address. Only a
rendezvous nobody else can find stays on the endpoint's own address: ``--standalone`` and a
port-0 endpoint (one node; the port is picked at random). The address node 0 then reports
(127.0.0.1) is replaced by the server with the one the others reached it on
(``rdzv_server/machine/addresses.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import RendezvousError

if TYPE_CHECKING:
    from protocol import Standbys
    from protocol.auth import TokenTable
    from rdzv_server.machine.standbys import TakeOver
    from rdzv_server.service import RendezvousService

    from ..config import AgentConfig


class HostedServer:
    """A rendezvous server this agent runs, and how it ends."""

    def __init__(
        self,
        service: RendezvousService,
        port: int,
        config: AgentConfig,
        node_id: str,
        log: Callable[..., None],
    ) -> None:
        self.service = service
        self.port = port
        self.config = config
        self.node_id = node_id
        self.log = log

    async def close(self, *, linger: bool) -> None:
        try:
            if linger and not self.config.hosts_rendezvous:
                await self._linger()
        finally:
            await self.service.close()

    async def _linger(self) -> None:
        """Keep serving until our job's other nodes are gone, so our early exit does not strand
        them. Other jobs that found our server are not ours to wait for."""
        job = self.config.rdzv_id
        if self.service.job_nodes(job) - {self.node_id}:
            timeout = self.config.rdzv_conf.close_timeout
            self.log(f"waiting up to {timeout:g} s for the job's other nodes to leave the rendezvous we host")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.service.wait_job_gone(job), timeout)


async def host_if_ours(
    config: AgentConfig, *, node_id: str, log: Callable[..., None], may_guess: bool
) -> HostedServer | None:
    """The server this agent hosts, listening; None when it connects to someone else's.

    ``may_guess``: whether, not told either way, it may host as the first agent on the
    endpoint's machine (not with TLS: it could only host plain TCP)."""
    host, port = config.rdzv_host, config.rdzv_port
    if config.hosts_rendezvous:
        service = _service(config, node_id)
        private = config.standalone or port == 0  # nobody else can find it: keep it local
        try:
            bound = await service.start(host if private else None, port)
        except OSError as exc:
            raise RendezvousError(
                f"cannot host the rendezvous on {host}:{port}: {exc.strerror or exc}"
            ) from None
        return HostedServer(service, bound, config, node_id, log)
    if may_guess and config.rdzv_conf.is_host is None and is_this_machine(host):
        return await _host_if_nobody_does(config, node_id=node_id, log=log)
    return None


async def _host_if_nobody_does(
    config: AgentConfig, *, node_id: str, log: Callable[..., None]
) -> HostedServer | None:
    host, port = config.rdzv_host, config.rdzv_port
    from .takeover import probe

    if await probe(host, port, 2.0) == "listens":
        return None
    service = _service(config, node_id)
    try:
        # Every interface, as torchrun's store, even for a loopback endpoint: peers on other
        # machines must reach it (node 0 of SkyPilot's recipe names localhost, the others it).
        await service.start(None, port)
    except OSError:
        return None  # another agent won the race, or the port is taken: connect as a client
    log(f"no rendezvous server was listening on port {port}: this agent hosts it, on every interface")
    return HostedServer(service, port, config, node_id, log)


async def host_as_standby(
    config: AgentConfig,
    *,
    node_id: str,
    sock: socket.socket,
    standbys: Standbys,
    passed: tuple[str, ...],
    log: Callable[..., None],
) -> HostedServer:
    """The rendezvous this agent hosts as the standby whose turn came (``takeover.py``), on
    its reserved socket (every interface), which never stops listening meanwhile: a peer that
    finds it refused knows the agent is gone. ``passed``: the standbys before it found gone.
    Raises OSError when it cannot serve there."""
    from rdzv_server.machine.standbys import TakeOver

    host = standbys.host_node if standbys.host_in_round else ""
    lost = TakeOver(job=config.rdzv_id, host=host, passed=passed)
    service = _service(config, node_id, term=standbys.term + 1, taken_over=lost)
    port = await service.start(None, 0, sock=sock)
    return HostedServer(service, port, config, node_id, log)


def _service(
    config: AgentConfig, node_id: str, *, term: int = 0, taken_over: TakeOver | None = None
) -> RendezvousService:
    from rdzv_server.service import RendezvousService

    # The agent imports aiohttp only if someone asks for the status (HTTP on demand); with a
    # token, what we host asks for it too. It names each job's standbys, should this agent be
    # lost (``takeover.py``).
    return RendezvousService(
        http=False,
        http_on_demand=True,
        tokens=hosted_tokens(config.token),
        host_node=node_id,
        standby_term=term,
        taken_over=taken_over,
    )


def hosted_tokens(token: str | None) -> TokenTable | None:
    """The tokens of a rendezvous this agent hosts: none without a token, else ours.

    An agent that holds a token never hosts an open rendezvous (anyone could join it, and
    the real rdzv-server could no longer bind its port). It hosts one that asks for the
    same token, rather than not hosting at all: a job started with a token then runs as
    one started without (torchrun's c10d hosting) and gains the gate. The token is every
    job's (a default line), as ``RDZV_TOKEN=... rdzv-server`` would have it: whoever holds
    it may join, as on a real server given that token, and nobody else."""
    if not token:
        return None
    from protocol.auth import TokenTable

    return TokenTable(default=token)


def _is_loopback(host: str) -> bool:
    from rdzv_server.machine.addresses import is_loopback

    return is_loopback(host)  # all of 127.0.0.0/8 (a Debian host name's 127.0.1.1) and ::1


def is_this_machine(host: str) -> bool:
    """Whether host names this machine: loopback, our hostname, or an address we can bind."""
    if _is_loopback(host) or host in (socket.gethostname(), socket.getfqdn()):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    for family, _, _, _, addr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr[0], 0))  # succeeds only for an address of this machine
            except OSError:
                continue
            return True
    return False
