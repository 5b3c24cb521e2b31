"""Where an agent goes when the agent hosting its rendezvous is lost (issue 45).

A rendezvous an agent hosts (``hosting.py``) dies with that agent. The server it hosted names,
with every round, the job's standbys (``rdzv_server/machine/standbys.py``): agents that reserved
a port to host on. After a lost connection every agent walks the same list in the same order:
the host first, then each standby, each tried for ``TRY_EACH`` seconds. A standby that comes to
its own name before reaching anyone hosts the rendezvous itself; the others find it there, and
the job's agents resume into it (``rdzv_server/machine/recovery.py`` rebuilds the round from
what they hold, without the lost node).

Why this is safe without a quorum: every agent walks the list in one order and hosts only at
its own turn, after the ones before it were found dead; so where the network lets the agents
reach each other they meet at the first standby alive. Dead, not slow: a standby listens on its
reserved port from the start (the kernel accepts; it answers once it hosts), so a connection
that is refused means its agent is gone, and one that is accepted means it is alive and will
host at its turn: the others wait for it however loaded its machine is, rather than host too.
``term`` (one more at each take-over) keeps a late list from an older host from sending an
agent back. What it cannot settle is a
partition: two halves that cannot reach each other may each end at a host of their own (a job
of two nodes has no majority to decide). Each half then runs only if it meets ``--nnodes``'s
minimum on its own; torchrun's c10d rendezvous, hosted on node 0, has no way back at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Literal

from protocol import Standbys
from protocol.records import record

TRY_EACH = 3.0  # seconds to reach the host before the standbys (a blip, not its loss)


@record(frozen=True, slots=True)
class Target:
    """One place to try: ``mine`` when it is this agent's own turn to host."""

    host: str
    port: int
    node: str  # "" for the endpoint the agent was started with
    mine: bool = False


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """ "host:port" or "[v6]:port" as (host, port)."""
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def newer(held: Standbys | None, heard: Standbys) -> bool:
    """Whether ``heard`` replaces what the agent holds: never a list from an older host."""
    return held is None or heard.term >= held.term


def walk(standbys: Standbys, first: tuple[str, int], node_id: str) -> list[Target]:
    """The places to try, in order: where the agent last reached the rendezvous, then each
    standby up to (and including) this agent's own turn."""
    order = [Target(first[0], first[1], standbys.host_node)]
    for endpoint, node in zip(standbys.endpoints, standbys.nodes, strict=True):
        host, port = split_endpoint(endpoint)
        if node == node_id:
            order.append(Target(host, port, node, mine=True))
            break
        if node != standbys.host_node:
            order.append(Target(host, port, node))
    return order


def reserve_port(preferred: int) -> socket.socket | None:
    """A port this agent could host the rendezvous on, held so nothing else takes it: the
    endpoint's own port where it is free on this machine (an agent on another machine than the
    host then hosts at the port everyone was given), else any. Listening, never accepting: a
    peer's connection is accepted by the kernel (this agent is alive) until it hosts there."""
    for port in (preferred, 0):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            # No SO_REUSEADDR: two agents of one machine must not both hold the same port.
            sock.bind(("", port))
            sock.listen(16)
        except OSError:
            sock.close()
            continue
        return sock
    return None


async def probe(host: str, port: int, timeout: float) -> Literal["listens", "refused", "unknown"]:
    """One TCP connect to ``host:port``, closed at once: accepted, refused (a machine that
    answers with nothing listening there), or neither (a timeout, no route)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout=timeout)
    except ConnectionRefusedError:
        return "refused"
    except (OSError, asyncio.TimeoutError):
        return "unknown"
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return "listens"


def release(sock: socket.socket | None) -> None:
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.close()
