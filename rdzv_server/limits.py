"""Connection caps that fit under the process's file descriptor limit.

Every open connection holds a file descriptor. Caps above the limit do not bind: the server
runs out of descriptors first, ``accept`` fails with EMFILE, and a new agent sees its
connection reset, which it reports as "not a rendezvous server". So a server raises its soft
limit to the hard one at start (``raise_fd_limit``), and its caps leave room under it
(``caps_for``) for what else needs a descriptor: the state log and its snapshots, the
listening sockets, the event loop's own, and the connections it is refusing with a "server
busy" reply.

An agent's embedded server keeps its soft limit (its workers would inherit a raised one, and
programs that use select() break on descriptors above 1024) and fits its caps under it.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

logger = logging.getLogger("rdzv_server")

MAX_CONNECTIONS = 60_000  # open sockets in all, however many descriptors we may have
RESERVE_MIN = 32  # descriptors kept for the state log, listeners, the loop, stdio


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
