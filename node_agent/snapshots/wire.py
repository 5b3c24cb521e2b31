"""The agent-to-agent snapshot channel's wire (pure): the bytes a replica server and its peers
exchange, the MACs that bind them, and the checks of a request. No I/O here: ``server.py``
serves the wire, ``client.py`` speaks it (push, pull, the background replication), and this
module is table-testable as ``protocol/codec.py`` is.

One request per connection (TLS first, when the server has a certificate)::

    server: MAGIC (8 bytes) + challenge (32 random bytes, fresh per connection)
    client: len (4, big-endian) + header (JSON, <= 4 KiB) + HMAC-SHA256(key, "request" + challenge + header)
    server: reply frames: len + body (JSON) + HMAC-SHA256(key, "reply" + n + challenge + header + body)
    push:   header {v, op: "push", rank, step, size, sha256, nonce}
            -> {ok, go} then the client streams exactly ``size`` bytes -> {ok} | {ok: false, error}
            -> {ok, held}: the peer has it already, nothing is sent
    pull:   header {v, op: "pull", rank, step, nonce} -> {ok, size, sha256} then ``size`` bytes

**Keys per round.** ``key`` is a random secret of the receiving agent (``server.new_key``) that
the rendezvous relays only to the round's other members; the agent picks a new one at every
Join (``ReplicaServer.set_key``), so a node that left the job, or was left out of the round, can
neither read nor write here with the key it was given: its requests are refused as "stale key".
A connection already authenticated finishes its transfer. The client proves it holds the key
over the server's fresh challenge, so a recorded request cannot be replayed; the server proves
it back over the client's fresh nonce, so a stranger cannot pose as a peer. Each MAC covers the
header, and the header (or the authenticated pull reply) carries the data's sha256: an on-path
attacker can cut a transfer but not change its bytes unnoticed.

Everything a peer sends is bounded: the header's size and every field (:func:`parse_request`),
a file's size (the holdings' per-file limit), and a reply's text (:data:`MAX_REASON`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import dataclass
from typing import Any, TypeGuard

from .holdings import MAX_RANK, MAX_STEP  # the layout's bounds (constants only: no I/O here)

__all__ = [
    "CHALLENGE_BYTES",
    "CHUNK",
    "LEN",
    "MAC_BYTES",
    "MAGIC",
    "MAX_HEADER",
    "MAX_REASON",
    "VERSION",
    "BadRequest",
    "Request",
    "is_hex",
    "parse_request",
    "reply_mac",
    "request_mac",
]

VERSION = 1
MAGIC = b"PETSNAP1"
CHALLENGE_BYTES = 32
MAC_BYTES = 32
MAX_HEADER = 4096
CHUNK = 1 << 20  # bytes per read and write: a connection's memory stays near this
LEN = struct.Struct(">I")
MAX_REASON = 200  # an error reply's text is cut here: a peer's words go into our logs
_HEX = frozenset("0123456789abcdef")


class BadRequest(Exception):
    """A peer's request is malformed, unauthenticated or cannot be served (the reply's text)."""


def request_mac(key: str, challenge: bytes, header: bytes) -> bytes:
    return hmac.new(key.encode(), b"request\0" + challenge + header, hashlib.sha256).digest()


def reply_mac(key: str, index: int, challenge: bytes, header: bytes, body: bytes) -> bytes:
    # The length of the header is bound in too: no byte can move between header and body.
    msg = b"reply\0" + bytes([index]) + challenge + LEN.pack(len(header)) + header + body
    return hmac.new(key.encode(), msg, hashlib.sha256).digest()


# -- requests --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Request:
    op: str  # "push" | "pull"
    rank: int
    step: int
    size: int = 0  # push only
    sha256: str = ""  # push only


def is_hex(value: object, lo: int, hi: int) -> TypeGuard[str]:
    """A string of ``lo`` to ``hi`` lowercase hex digits."""
    return isinstance(value, str) and lo <= len(value) <= hi and set(value) <= _HEX


def _int_field(doc: dict[str, Any], name: str, below: int) -> int:
    value = doc.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < below:
        raise BadRequest(f"{name}: not an integer in [0, {below})")
    return value


def parse_request(raw: bytes, file_limit: int) -> Request:
    """A request header, every field checked; unknown fields are ignored (a newer peer's)."""
    if len(raw) > MAX_HEADER:
        raise BadRequest(f"header over {MAX_HEADER} bytes")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise BadRequest("header: not JSON") from None
    if not isinstance(doc, dict):
        raise BadRequest("header: not an object")
    if doc.get("v") != VERSION:
        raise BadRequest(f"v: this agent speaks version {VERSION}")
    if not is_hex(doc.get("nonce"), 32, 128):
        raise BadRequest("nonce: not 32 to 128 hex digits")
    op = doc.get("op")
    rank = _int_field(doc, "rank", MAX_RANK)
    step = _int_field(doc, "step", MAX_STEP)
    if op == "pull":
        return Request(op=op, rank=rank, step=step)
    if op != "push":
        raise BadRequest("op: not 'push' or 'pull'")
    size = _int_field(doc, "size", 2**63)
    if size > file_limit:
        raise BadRequest(f"size: {size} bytes is over this node's per-file limit of {file_limit}")
    sha = doc.get("sha256")
    if not is_hex(sha, 64, 64):
        raise BadRequest("sha256: not 64 lowercase hex digits")
    return Request(op=op, rank=rank, step=step, size=size, sha256=sha)
