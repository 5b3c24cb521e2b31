"""Tell our protocol from HTTP (and TLS) by a connection's first bytes.

The server listens on one port for both agents and HTTP clients (health checks,
status pages). It peeks at the first bytes of each connection and routes it:
``MAGIC`` to the frame protocol, an HTTP request line to aiohttp. The two cannot
be confused because MAGIC's first byte, 0x89, is not a letter, and every HTTP
method is upper-case letters followed by a space.

A TLS ClientHello (record type 0x16, then major version 0x03) is recognised too,
so that a later TLS listener can be routed the same way, and a client that
speaks TLS to a plaintext port gets a clear error instead of "unknown".

``"more"`` means the bytes so far are a strict prefix of something recognisable:
peek again once more arrived. PREFACE_LEN bytes are always enough to decide.
"""

from __future__ import annotations

from typing import Literal, TypeAlias

from protocol.codec import MAGIC

__all__ = ["HTTP_METHODS", "PREFACE_LEN", "PrefaceKind", "classify_preface"]

PrefaceKind: TypeAlias = Literal["rdzv", "http", "tls", "unknown", "more"]

HTTP_METHODS: tuple[bytes, ...] = (
    b"GET",
    b"HEAD",
    b"POST",
    b"PUT",
    b"DELETE",
    b"OPTIONS",
    b"PATCH",
    b"CONNECT",
    b"TRACE",
)
_HTTP_TOKENS = tuple(method + b" " for method in HTTP_METHODS)

_TLS_HANDSHAKE = 0x16
_TLS_MAJOR = 0x03

# The longest prefix classify_preface ever needs to see: MAGIC, and "OPTIONS "
# or "CONNECT ", are all eight bytes.
PREFACE_LEN = max(len(MAGIC), *(len(token) for token in _HTTP_TOKENS))


def classify_preface(data: bytes) -> PrefaceKind:
    """Classify the first bytes of a connection; ``"more"`` asks for more bytes."""
    data = bytes(data[:PREFACE_LEN])
    if data.startswith(MAGIC):
        return "rdzv"
    if MAGIC.startswith(data):  # includes b"": nothing seen yet
        return "more"
    for token in _HTTP_TOKENS:
        if data.startswith(token):
            return "http"
    for token in _HTTP_TOKENS:
        if token.startswith(data):
            return "more"
    if data[0] == _TLS_HANDSHAKE:
        if len(data) == 1:
            return "more"
        if data[1] == _TLS_MAJOR:
            return "tls"
    return "unknown"
