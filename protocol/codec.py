"""Bytes <-> messages: the only place the wire format lives.

The codec is sans-IO, in the manner of h11: it never touches a socket. The caller
reads whatever bytes arrived and hands them to ``FrameDecoder.feed``, which
returns the complete messages and keeps the rest; to send, the caller writes
``encode(msg)``. The asyncio layer, the tests and a fuzzer all drive the same
object.

Wire form. A client opens with ``MAGIC`` (once), then both sides send frames:

    HEADER (4-byte big-endian payload length) + payload
    payload = msgpack map {"t": <TYPE>, <field>: <value>, ...}

Every field is always encoded, defaults included, so a frame is self-describing.
On decode, unknown keys are ignored (a peer on a newer minor revision of the same
version may add fields), a missing field with a default takes the default, and a
missing required field is a MissingField; ``messages.py`` says which revisions
version 1 has had and why each needs no new version. Failure travels as a nested map under
the same rules.

Hostile input. A length header above the limit is refused as soon as its four
bytes arrive, before any body is buffered. msgpack's own length limits are set
to the payload size, so a five-byte frame cannot announce a four-billion-entry
array. Anything at all that goes wrong inside msgpack, a RecursionError
included, becomes a MalformedFrame: the caller only ever sees messages or a
ProtocolError. After an error the decoder is dead, because the stream is no
longer aligned on frame boundaries; it raises the same error on every feed.

Buffering. ``feed`` appends to one bytearray and walks it with an offset, so a
chunk holding thousands of frames is cut without re-copying the tail after each
frame, and it compacts once per call, only when it consumed something, so a large
frame arriving a byte at a time is not copied again and again.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, fields
from typing import Any

import msgpack

from protocol.errors import (
    BadMagic,
    FrameTooLarge,
    InvalidField,
    MalformedFrame,
    MissingField,
    ProtocolError,
    UnknownMessageType,
    describe,
)
from protocol.messages import MESSAGE_TYPES, Failure, Heartbeat, Join, Message, negotiate_version

__all__ = [
    "HEADER",
    "MAGIC",
    "MAX_FRAME_SIZE",
    "FrameDecoder",
    "decode_payload",
    "encode",
    "encode_many",
    "negotiate_version",
]

# The first byte is not ASCII, so no HTTP request (and no TLS record) can start
# with it; the CR LF and ^Z catch a transfer that mangles line endings, as PNG's do.
MAGIC = b"\x89RDZV\r\n\x1a"
MAX_FRAME_SIZE = 1 << 20
HEADER = struct.Struct("!I")


# --- per-class plans, computed once ------------------------------------------

# For encode: field names, and which of them hold a nested record.
_ENCODE: dict[type, tuple[str, tuple[str, ...], tuple[str, ...]]] = {}
# For decode: (name, required, nested class or None) per field.
_DECODE: dict[type, tuple[tuple[str, bool, type | None], ...]] = {}


def _plan(cls: type) -> None:
    names = tuple(f.name for f in fields(cls))
    nested = tuple(f.name for f in fields(cls) if f.metadata["nested"] is not None)
    _ENCODE[cls] = (getattr(cls, "TYPE", ""), names, nested)
    _DECODE[cls] = tuple(
        (f.name, f.default is MISSING and f.default_factory is MISSING, f.metadata["nested"])
        for f in fields(cls)
    )


_plan(Failure)
for _cls in MESSAGE_TYPES.values():
    _plan(_cls)
del _cls


# --- encoding ----------------------------------------------------------------


def _to_map(obj: Any, d: dict[str, Any]) -> dict[str, Any]:
    # Attribute by attribute from the precomputed names: dataclasses.asdict would
    # deep-copy every value, and this runs for every frame to 10,000 agents.
    _, names, nested = _ENCODE[type(obj)]
    for name in names:
        d[name] = getattr(obj, name)
    for name in nested:
        value = d[name]
        if value is not None:
            d[name] = _to_map(value, {})
    return d


def encode(msg: Message) -> bytes:
    """The complete frame for ``msg``: length header, then the msgpack payload."""
    plan = _ENCODE.get(type(msg))
    if plan is None or not plan[0]:
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    # The field limits keep every message well under MAX_FRAME_SIZE, so there is
    # no size check here (tests/protocol/test_codec.py proves the largest fits).
    payload = msgpack.packb(_to_map(msg, {"t": plan[0]}), use_bin_type=True)
    return HEADER.pack(len(payload)) + payload


def encode_many(msgs: Iterable[Message]) -> bytes:
    """The frames for several messages, concatenated for a single write."""
    return b"".join(encode(msg) for msg in msgs)


# Every agent sends one a second, and it has no fields: a frame of exactly these bytes decodes
# to one shared instance (frozen, so sharing is safe) without msgpack or a constructor.
_HEARTBEAT = Heartbeat()
_HEARTBEAT_PAYLOAD = encode(_HEARTBEAT)[HEADER.size :]


# --- decoding ----------------------------------------------------------------


def _build(cls: type, m: dict[Any, Any], path: str) -> Any:
    kwargs: dict[str, Any] = {}
    for name, required, nested in _DECODE[cls]:
        if name not in m:
            if required:
                raise MissingField(f"{path}.{name}")
            continue  # the constructor supplies the default
        value = m[name]
        if nested is not None and value is not None:
            if not isinstance(value, dict):
                raise InvalidField(f"{path}.{name}", f"must be a map, got {describe(value)}")
            value = _build(nested, value, f"{path}.{name}")
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except InvalidField as exc:
        own = cls._PATH
        if path == own or exc.field is None or not exc.field.startswith(own):
            raise
        # A nested record names itself ("failure.rank"); say where it sat in the
        # message instead ("workers_failed.failure.rank").
        raise InvalidField(path + exc.field[len(own) :], exc.reason) from None


def decode_payload(payload: bytes, *, allowed: Mapping[str, type] | None = None) -> Message:
    """Decode one frame's payload (without its header) into a message.

    ``allowed`` maps tags to the classes this side accepts (``CLIENT_MESSAGES`` on
    the server); any other tag is an UnknownMessageType. Default: every message.
    """
    n = len(payload)
    try:
        obj = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=n,
            max_map_len=n,
            max_ext_len=n,
        )
    except Exception as exc:  # any failure inside msgpack, RecursionError included
        raise MalformedFrame(f"payload is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise MalformedFrame(f"payload must be a msgpack map, got {describe(obj)}")
    if "t" not in obj:
        raise MalformedFrame('payload has no "t" (message type) key')
    tag = obj["t"]
    if not isinstance(tag, str):
        raise MalformedFrame(f'"t" must be a string, got {describe(tag)}')
    table = MESSAGE_TYPES if allowed is None else allowed
    cls = table.get(tag)
    if cls is None:
        raise UnknownMessageType(tag, accepted=table.keys())
    return _build(cls, obj, tag)


class FrameDecoder:
    """Turns a byte stream into messages; see the module docstring."""

    def __init__(
        self,
        *,
        max_frame_size: int = MAX_FRAME_SIZE,
        allowed: Mapping[str, type] | None = None,
        expect_magic: bool = False,
    ) -> None:
        # These are our own settings, so mistakes are ValueErrors, not ProtocolErrors.
        if isinstance(max_frame_size, bool) or not isinstance(max_frame_size, int):
            raise TypeError(f"max_frame_size must be an int, got {type(max_frame_size).__name__}")
        if not 0 < max_frame_size <= 2**32 - 1:
            raise ValueError(f"max_frame_size must be in 1..{2**32 - 1}, got {max_frame_size}")
        if allowed is not None:
            for tag, cls in allowed.items():
                if MESSAGE_TYPES.get(tag) is not cls:
                    raise ValueError(f"allowed maps {tag!r} to {cls!r}, which is not that message class")
        self._max = max_frame_size
        self._allowed = allowed
        self._heartbeat_allowed = allowed is None or allowed.get(Heartbeat.TYPE) is Heartbeat
        # A node sends the same Join every round: its bytes again decode to the same (frozen)
        # message, without msgpack or validation; in a 10,000-node re-rendezvous that was a
        # fifth of the server's CPU.
        self._join_payload: bytes | None = None
        self._join: Message | None = None
        self._need_magic = expect_magic
        self._buf = bytearray()
        self._error: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Message]:
        """Add received bytes; return every message they complete (maybe none).

        Raises ProtocolError on the first bad frame. Messages that came before it
        in the same ``data`` are dropped with the stream: the caller is about to
        reply with an Error and close the connection anyway.
        """
        if self._error is not None:
            raise self._error.with_traceback(None)
        try:
            return self._feed(data)
        except ProtocolError as exc:
            # Keep the error but not what it was raised through: the inner frames hold the
            # whole buffer and whatever msgpack decoded (up to a frame's worth, and more as
            # objects), and through ``self._error`` they would live on in a reference cycle
            # until a full garbage collection; a flood of bad frames grew memory that way.
            exc.__context__ = None
            self._error = exc
            self._buf = bytearray()
            raise exc.with_traceback(None) from None

    def _feed(self, data: bytes) -> list[Message]:
        buf = self._buf
        buf += data
        pos = 0
        if self._need_magic:
            head = bytes(buf[: len(MAGIC)])
            # Refuse as soon as the bytes so far differ, so an HTTP client that
            # sent "GET" is told at once rather than after eight bytes.
            if not MAGIC.startswith(head):
                raise BadMagic(head)
            if len(head) < len(MAGIC):
                return []
            self._need_magic = False
            pos = len(MAGIC)

        out: list[Message] = []
        end = len(buf)
        size = HEADER.size
        while end - pos >= size:
            (length,) = HEADER.unpack_from(buf, pos)
            if length > self._max:
                raise FrameTooLarge(length, self._max)
            start = pos + size
            if end - start < length:
                break
            payload = buf[start : start + length]
            if payload == _HEARTBEAT_PAYLOAD and self._heartbeat_allowed:
                out.append(_HEARTBEAT)
            elif payload == self._join_payload:
                out.append(self._join)
            else:
                msg = decode_payload(payload, allowed=self._allowed)
                if type(msg) is Join:
                    self._join_payload, self._join = bytes(payload), msg
                out.append(msg)
            pos = start + length
        if pos:
            del buf[:pos]
        return out
