"""The listening sockets: enough accept queue for a join storm of every node at once.

When thousands of agents connect within a fraction of a second, the kernel queues each
finished handshake until the server accepts it. The queue holds at most
``net.core.somaxconn`` connections (4096 on most Linux machines) whatever backlog we ask
for; a SYN that finds it full is dropped and the client sends it again only after a second
(then after 3 s, 7 s, ...). Measured with 10,000 simulated agents on 2 cores: 6,000 to
13,000 drops and retransmitted SYNs per storm, and the last agent connected 1.3 to 2.4 s
after the first instead of 0.5 s.

Several sockets bound to one port with ``SO_REUSEPORT`` have a queue each, and the kernel
spreads new connections over them by a hash of the peer's address and port; one event loop
accepts from all of them. ``SO_REUSEPORT`` would also let a second server of the same user
bind the port and silently take a share of the agents, so before binding we check the port
is free with a socket that does not set it: a port held by our sockets (or anyone's) refuses
that bind with EADDRINUSE, exactly as a single socket would.
"""

from __future__ import annotations

import errno
import socket

ACCEPT_QUEUE = 16384  # pending connections to hold between two turns of a busy loop
MAX_LISTENERS = 8
SOMAXCONN_PATH = "/proc/sys/net/core/somaxconn"


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
