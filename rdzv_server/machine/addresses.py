"""Which address a round hands its nodes for a member that reported a loopback one (pure).

An agent reports the address of its end of the connection to the server (``Join.addr``). An
agent on the server's machine that reached it through ``localhost`` (SkyPilot's recipe gives
node 0 ``--rdzv-endpoint localhost:29500`` and the others ``HEAD_IP:29500``) reports
``127.0.0.1``; as group rank 0 that would be every node's ``MASTER_ADDR``, which the other
machines cannot reach. The server knows better: the others reached it on one of its own
addresses (the local address of their connections), and that is the loopback member's
machine's address as they see it.

The rule, for a round of more than one member where some member connects from elsewhere (its
connection's peer is not loopback): a member whose reported address is loopback gets

- the address it connected from, as the server sees it, when that is not loopback (it
  reported a loopback address, e.g. ``--local-addr``, yet came over the network);
- else (it is on the server's machine) the server's address that the members connecting from
  elsewhere reached, the one most of them used (ties: the smallest);
- else (no such address known, as in the etcd backend's replicas) what it reported.

A round whose members all connect through loopback runs on one machine: loopback is right.
Loopback is all of 127.0.0.0/8 (a Debian/Ubuntu host name resolves to 127.0.1.1), ``::1``,
their IPv4-mapped forms and the name ``localhost``. No name is resolved here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING

from protocol.records import record

if TYPE_CHECKING:
    import ipaddress

_LOCALHOST = ("localhost", "localhost.")


@record(frozen=True, slots=True)
class Seen:
    """What the server knows of one member's address."""

    addr: str  # what the agent reported (Join.addr)
    peer: str = ""  # where its connection comes from, as the server sees it; "" unknown
    local: str = ""  # the server's own address on that connection; "" unknown


def _ip(addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    import ipaddress  # only for an IPv6 form: an agent's launch does not pay for it

    text = addr.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` (an address or a host name) names the loopback interface."""
    if ":" not in addr:  # IPv4 or a name: no parse on the common path (a round of 10,000)
        return addr.startswith("127.") or addr.lower() in _LOCALHOST
    ip = _ip(addr)
    return ip is not None and ip.is_loopback


def plain(addr: str) -> str:
    """An address as a worker's MASTER_ADDR should read it: an IPv4-mapped IPv6 address in its
    IPv4 form, any other as given."""
    if ":" not in addr:
        return addr
    ip = _ip(addr)
    if ip is not None and ip.version == 4:
        return str(ip)
    return addr


def peer_host(peer: str) -> str:
    """The host part of a peer as the service writes it (``host:port``, IPv6 unbracketed), or
    of a bare address (the etcd backend's)."""
    if peer.count(":") == 1:  # IPv4 or a name, and a port: no parse on the common path
        host, _, port = peer.partition(":")
        return host if port.isdigit() else peer
    host, sep, port = peer.rpartition(":")
    if sep and port.isdigit() and _ip(host) is not None:
        return host.strip("[]")
    return peer


def reachable_addrs(seen: Mapping[str, Seen]) -> dict[str, str]:
    """node id -> the address its peers should use instead of its loopback one (only the
    members whose address changes; see the module's rule). Deterministic in ``seen``."""
    if len(seen) < 2:
        return {}
    looped: list[str] = []
    reached: Counter[str] = Counter()
    from_afar = False
    for nid, s in seen.items():
        if is_loopback(s.addr):
            looped.append(nid)
        if s.peer and not is_loopback(s.peer):
            from_afar = True
            if s.local and not is_loopback(s.local):
                reached[plain(s.local)] += 1
    if not looped or not from_afar:
        return {}
    ours = min(reached.items(), key=lambda kv: (-kv[1], kv[0]))[0] if reached else ""
    out: dict[str, str] = {}
    for nid in looped:
        s = seen[nid]
        if s.peer and not is_loopback(s.peer):
            out[nid] = plain(s.peer)
        elif ours:
            out[nid] = ours
    return out
