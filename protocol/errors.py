"""Errors raised when a peer breaks the wire protocol.

Every error is a ``ProtocolError`` carrying two things a reply needs: ``code``, a
stable machine-readable string that goes into an ``Error`` message unchanged, and
``field``, the dotted path of the offending field (``"join.nproc"``,
``"workers_failed.failure.rank"``) or ``None`` when no single field is to blame.
``str(exc)`` is the human-readable sentence, and it always names that path.

Each subclass is named after the contract that broke, so the server can tell a
frame it could not parse from a well-formed message that came at the wrong time,
and tests can assert on the exact class. ``messages.error_message`` turns any of them into
the ``Error`` reply the server sends before closing the connection.

Values from the peer are quoted through ``describe`` so an error message stays
short even when the offending value is a megabyte string or a deeply nested list.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    pass

__all__ = [
    "BadMagic",
    "FrameTooLarge",
    "InvalidField",
    "MalformedFrame",
    "MissingField",
    "ProtocolError",
    "UnexpectedMessage",
    "UnknownMessageType",
    "VersionMismatch",
    "describe",
]

_QUOTE_LEN = 60


def describe(value: object) -> str:
    """A short, always-safe rendering of a value for an error message.

    Containers are summarised by type and length rather than repr'd: a repr of a
    10,000-deep list would raise RecursionError, and a repr of a huge int would
    raise ValueError (Python's int-to-str digit limit).
    """
    if value is None or isinstance(value, bool | float):
        return repr(value)
    if isinstance(value, int):
        if value.bit_length() > 64:
            return f"an int of {value.bit_length()} bits"
        return repr(value)
    if isinstance(value, str | bytes | bytearray):
        kind = type(value).__name__
        if len(value) <= _QUOTE_LEN:
            return repr(value)
        return f"{value[:_QUOTE_LEN]!r}... ({kind} of length {len(value)})"
    if isinstance(value, list | tuple | dict):
        return f"a {type(value).__name__} of length {len(value)}"
    return f"a value of type {type(value).__name__}"


class ProtocolError(Exception):
    """The peer sent something this protocol does not allow."""

    code: ClassVar[str] = "protocol_error"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # Subclasses take different constructor arguments than ``self.args``, so the
        # default reduce (``cls(*args)``) would fail; rebuild from the attributes.
        return (_rebuild, (type(self), self.__dict__.copy()))


def _rebuild(cls: type[ProtocolError], state: dict[str, Any]) -> ProtocolError:
    exc = cls.__new__(cls)
    Exception.__init__(exc, state.get("message", ""))
    exc.__dict__.update(state)
    return exc


class MalformedFrame(ProtocolError):
    """The payload is not a msgpack map with a string ``"t"`` key."""

    code = "malformed_frame"

    def __init__(self, reason: str) -> None:
        super().__init__(f"malformed frame: {reason}")
        self.reason = reason


class FrameTooLarge(ProtocolError):
    """A length header announced more bytes than the receiver accepts."""

    code = "frame_too_large"

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.limit = limit


class BadMagic(ProtocolError):
    """The connection did not open with ``MAGIC``."""

    code = "bad_magic"

    def __init__(self, got: bytes) -> None:
        super().__init__(f"connection did not start with the rdzv magic bytes: got {describe(bytes(got))}")
        self.got = bytes(got)


class UnknownMessageType(ProtocolError):
    """The ``"t"`` tag names no message, or one this side does not accept."""

    code = "unknown_type"

    def __init__(self, message_type: str, *, accepted: Iterable[str] = ()) -> None:
        accepted = sorted(accepted)
        text = f"unknown message type {describe(message_type)}"
        if accepted:
            text += f" (accepted here: {', '.join(accepted)})"
        super().__init__(text, field="t")
        self.message_type = message_type
        self.accepted = tuple(accepted)


class MissingField(ProtocolError):
    """A required field is absent from a message map."""

    code = "missing_field"

    def __init__(self, field: str) -> None:
        super().__init__(f"{field}: required field is missing", field=field)


class InvalidField(ProtocolError):
    """A field has the wrong type or is out of range."""

    code = "invalid_field"

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}", field=field)
        self.reason = reason


class VersionMismatch(ProtocolError):
    """The two sides share no protocol version."""

    code = "version_mismatch"

    def __init__(self, *, ours: Sequence[int], theirs: Sequence[int], field: str | None = None) -> None:
        ours_t, theirs_t = tuple(ours), tuple(theirs)
        super().__init__(
            f"no common protocol version: we speak {list(ours_t)}, the peer speaks {list(theirs_t)}",
            field=field,
        )
        self.ours = ours_t
        self.theirs = theirs_t


class UnexpectedMessage(ProtocolError):
    """A valid message that the receiver's state does not allow right now.

    The codec never raises this; the state machines do, naming the message, the
    phase and the node in ``reason``.
    """

    code = "unexpected_message"

    def __init__(self, reason: str, *, field: str | None = None) -> None:
        super().__init__(reason, field=field)
        self.reason = reason
