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
bytes arrive, before any body is buffered. The limit can change as a connection
moves on (``FrameLimits``: a peer that has not said hello may send 2 KiB, not the
size of the largest message of a joined member). msgpack's own limits fit our
schema rather than the frame (``MAX_MAP_LEN``, ``MAX_ARRAY_LEN``, ``MAX_STR_BYTES``,
no bin or ext), and a payload may hold at most ``MAX_CONTAINERS`` maps and arrays
in all, so a frame of a million empty maps is refused after a few dozen, in
microseconds, instead of costing 55 ms and 73 MB to decode. Anything at all that
goes wrong inside msgpack, a RecursionError included, becomes a MalformedFrame:
the caller only ever sees messages or a ProtocolError. After an error the
decoder is dead, because the stream is no longer aligned on frame boundaries; it
raises the same error on every feed.

Buffering. ``feed`` appends to one bytearray and walks it with an offset kept
between calls, so a chunk holding thousands of frames is cut without re-copying
the tail after each frame, and a caller may take them a few at a time
(``limit``); it compacts only once the consumed part is large, so a large frame
arriving a byte at a time is not copied again and again.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, fields
from typing import Any, NamedTuple

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
from protocol.messages import (
    CLIENT_MESSAGES,
    MAX_ADDR_LEN,
    MAX_CODE_LEN,
    MAX_COUNT,
    MAX_DURABLE_STEPS,
    MAX_HELD,
    MAX_HUNG_RANKS,
    MAX_ID_LEN,
    MAX_NODES,
    MAX_NPROC,
    MAX_PATH_LEN,
    MAX_PHASE_LEN,
    MAX_RESTORE_SOURCES,
    MAX_STACK_LEN,
    MAX_STACK_RANKS,
    MAX_TEXT_LEN,
    MAX_TIMEOUT,
    MAX_VERSIONS,
    MESSAGE_TYPES,
    Armed,
    Assignment,
    Failure,
    HangDetected,
    Heartbeat,
    Hello,
    Join,
    Leave,
    LeaveAfterCommit,
    Message,
    Progress,
    Resume,
    SnapshotsHeld,
    Stacks,
    WorkersCommitted,
    WorkersFailed,
    WorkersSucceeded,
    negotiate_version,
)

__all__ = [
    "HEADER",
    "MAGIC",
    "MAX_FRAME_SIZE",
    "FrameDecoder",
    "FrameLimits",
    "decode_payload",
    "encode",
    "encode_many",
    "frame_limits",
    "negotiate_version",
]

# The first byte is not ASCII, so no HTTP request (and no TLS record) can start
# with it; the CR LF and ^Z catch a transfer that mangles line endings, as PNG's do.
MAGIC = b"\x89RDZV\r\n\x1a"
MAX_FRAME_SIZE = 1 << 20
HEADER = struct.Struct("!I")

# msgpack's limits, sized to the schema. The widest map is a message's fields plus "t"; the
# slack lets a newer minor revision of version 1 add fields (which we then ignore). The
# longest array is Progress.compute_ms (one number per local rank). A text field holds up to
# MAX_TEXT_LEN characters, each at most 4 bytes of UTF-8. No message holds bytes or ext
# types: a short one is let through to be refused by its field's rule, which names the field.
_MOST_FIELDS = max(len(fields(cls)) for cls in (*MESSAGE_TYPES.values(), Failure)) + 1
MAX_MAP_LEN = _MOST_FIELDS + 32
MAX_ARRAY_LEN = max(MAX_VERSIONS, MAX_NPROC, MAX_HUNG_RANKS, MAX_STACK_RANKS) + 48
MAX_STR_BYTES = 4 * max(MAX_TEXT_LEN, MAX_PATH_LEN, MAX_ID_LEN, MAX_ADDR_LEN)
# Maps and arrays in one payload, nested ones included: the most any message has is six
# (Stacks: itself and its five lists), so at most 32 arrays of MAX_ARRAY_LEN items are decoded.
MAX_CONTAINERS = 32
_MAX_BIN_LEN = 256
_MAX_EXT_LEN = 16


# --- per-class plans, computed once ------------------------------------------

# For encode: field names, and which of them hold a nested record.
_ENCODE: dict[type, tuple[str, tuple[str, ...], tuple[str, ...]]] = {}
# For decode: (name, required, nested class or None) per field.
_DECODE: dict[type, tuple[tuple[str, bool, type | None], ...]] = {}


def _plan_fields(cls: type) -> None:
    names = tuple(f.name for f in fields(cls))
    nested = tuple(f.name for f in fields(cls) if f.metadata["nested"] is not None)
    _ENCODE[cls] = (getattr(cls, "TYPE", ""), names, nested)
    _DECODE[cls] = tuple(
        (f.name, f.default is MISSING and f.default_factory is MISSING, f.metadata["nested"])
        for f in fields(cls)
    )


# For decode, a class with no nested record: (the keys it may have, with "t"; the required
# ones). A map of those keys only is its constructor's keywords as it is (see _build).
_FLAT: dict[type, tuple[frozenset[str], frozenset[str]]] = {}


def _plan(cls: type) -> None:
    _plan_fields(cls)
    decode = _DECODE[cls]
    if all(nested is None for _, _, nested in decode):
        known = frozenset(name for name, _, _ in decode)
        assert "t" not in known, f"{cls.__name__} has a field named t"
        _FLAT[cls] = (known | {"t"}, frozenset(name for name, required, _ in decode if required))


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


# --- frame limits per stage of a connection --------------------------------------------

# The widest character UTF-8 has (4 bytes): the largest legal message fills every text field
# with it. Printable, so no rule about control characters refuses it.
_WIDE = "\U0001f600"
_BIG_INT = MAX_COUNT  # msgpack's largest int encoding (9 bytes)


def _largest_join() -> Join:
    return Join(
        job_id=_WIDE * MAX_ID_LEN,
        node_id=_WIDE * MAX_ID_LEN,
        addr=_WIDE * MAX_ADDR_LEN,
        nproc=MAX_NPROC,
        min_nodes=MAX_NODES,
        max_nodes=MAX_NODES,
        entrypoint=_WIDE * MAX_TEXT_LEN,
        master_port=65535,
        max_restarts=_BIG_INT,
        last_call_timeout=MAX_TIMEOUT,
        heartbeat_interval=MAX_TIMEOUT,
        heartbeat_timeout=MAX_TIMEOUT,
        spare=False,
        exclude_after=_BIG_INT,
        proof="f" * 128,
        node_rank=MAX_NODES - 1,
        node_secret="f" * 128,
        straggler_threshold=1.0,
        exclude_stragglers=True,
        crash_loop_restarts=1_000_000,
        commit_timeout=MAX_TIMEOUT,
        commit_steps=1_000_000,
        hosts_store=True,
        replica_port=65535,
        replica_key="f" * 128,
        replica_cert="f" * 64,
        standby_port=65535,
        durable_world=_BIG_INT,
        durable_steps=(_BIG_INT,) * MAX_DURABLE_STEPS,
    )


def largest_client_messages() -> dict[type, Message]:
    """The largest legal message of each kind an agent sends (every field at its limit).

    tests/protocol/test_codec.py proves each is the largest (no field may grow) and fits the
    frame limit of the stages in which it is sent.
    """
    join = _largest_join()
    assignment = Assignment(
        job_id=join.job_id,
        round=_BIG_INT,
        group_rank=MAX_NODES - 1,
        group_world_size=MAX_NODES,
        rank_offset=_BIG_INT - 1,
        world_size=_BIG_INT,
        master_addr=_WIDE * MAX_ADDR_LEN,
        master_port=65535,
        restart_count=_BIG_INT,
        max_restarts=_BIG_INT,
        agent_store=True,
        restore_step=_BIG_INT,
        restore_source=(MAX_RESTORE_SOURCES - 1,) * MAX_NPROC,
        restore_addrs=(_WIDE * MAX_ADDR_LEN,) * MAX_RESTORE_SOURCES,
        restore_keys=("f" * 128,) * MAX_RESTORE_SOURCES,
        replica_to=_WIDE * MAX_ADDR_LEN,
        replica_key="f" * 128,
        restore_durable=True,
        restore_alt=(MAX_RESTORE_SOURCES - 1,) * MAX_NPROC,
        restore_digests=(),  # a Resume never echoes them (Resume's rule)
        restore_certs=("f" * 64,) * MAX_RESTORE_SOURCES,
        replica_cert="f" * 64,
        replica_from=_BIG_INT,
        replica_count=MAX_NPROC,
    )
    failure = Failure(
        node_id=_WIDE * MAX_ID_LEN,
        addr=_WIDE * MAX_ADDR_LEN,
        rank=_BIG_INT,
        local_rank=_BIG_INT,
        exitcode=-(2**63),
        signal=_WIDE * MAX_CODE_LEN,
        timestamp=float(2**53),
        message=_WIDE * MAX_TEXT_LEN,
        pid=_BIG_INT,
        error_file=_WIDE * MAX_PATH_LEN,
    )
    return {
        Hello: Hello(versions=(_BIG_INT,) * MAX_VERSIONS, software=_WIDE * MAX_ID_LEN),
        Join: join,
        Resume: Resume(join=join, assignment=assignment, succeeded=True),
        Heartbeat: Heartbeat(),
        WorkersFailed: WorkersFailed(round=_BIG_INT, failure=failure, step=_BIG_INT, restore_failed=_BIG_INT),
        WorkersSucceeded: WorkersSucceeded(round=_BIG_INT, idle_ms=MAX_TIMEOUT * 1000),
        Leave: Leave(reason=_WIDE * MAX_TEXT_LEN, workers_stopping=True),
        Progress: Progress(
            round=_BIG_INT,
            min_step=_BIG_INT,
            max_step=_BIG_INT,
            step_p50_ms=MAX_TIMEOUT * 1000,
            step_p90_ms=MAX_TIMEOUT * 1000,
            phase=_WIDE * MAX_PHASE_LEN,
            age_ms=MAX_TIMEOUT * 1000,
            compute_ms=(MAX_TIMEOUT * 1000,) * MAX_NPROC,
            checks=True,
        ),
        HangDetected: HangDetected(
            round=_BIG_INT,
            ranks=(_BIG_INT,) * MAX_HUNG_RANKS,
            step=_BIG_INT,
            phase=_WIDE * MAX_PHASE_LEN,
            silent_s=MAX_TIMEOUT,
        ),
        Stacks: Stacks(
            round=_BIG_INT,
            ranks=(_BIG_INT,) * MAX_STACK_RANKS,
            steps=(_BIG_INT,) * MAX_STACK_RANKS,
            phases=(_WIDE * MAX_PHASE_LEN,) * MAX_STACK_RANKS,
            silent_s=(MAX_TIMEOUT,) * MAX_STACK_RANKS,
            stacks=(_WIDE * MAX_STACK_LEN,) * MAX_STACK_RANKS,
        ),
        Armed: Armed(round=_BIG_INT, step=_BIG_INT, late=True, checked=_BIG_INT),
        WorkersCommitted: WorkersCommitted(round=_BIG_INT, step=_BIG_INT),
        LeaveAfterCommit: LeaveAfterCommit(round=_BIG_INT, reason=_WIDE * MAX_TEXT_LEN),
        SnapshotsHeld: SnapshotsHeld(
            world_size=_BIG_INT,
            ranks=(_BIG_INT,) * MAX_HELD,
            steps=(_BIG_INT,) * MAX_HELD,
            digests=("f" * 64,) * MAX_HELD,
        ),
    }


class FrameLimits(NamedTuple):
    """The largest frame the server accepts from a connection at each stage."""

    hello: int  # before its hello is accepted: it has proved nothing yet
    join: int  # after the hello, until it joined: a Join or a Resume (or a Leave)
    member: int  # once joined: any message an agent sends


def _room(size: int) -> int:
    # A quarter more than the largest legal frame (for fields a newer minor revision adds),
    # rounded up to a power of two.
    return 1 << (size + size // 4 - 1).bit_length()


# What computed_frame_limits() gives, written down: computing it builds and encodes the
# largest legal message of each kind (3 ms), at every server start, an agent's embedded one (a
# standalone launch) included. tests/protocol/test_codec.py checks that the schema still gives it.
FRAME_LIMITS = FrameLimits(hello=2048, join=524288, member=524288)


def frame_limits() -> FrameLimits:
    """The largest frame the server accepts at each stage (the schema's, as computed below)."""
    return FRAME_LIMITS


@functools.cache
def computed_frame_limits() -> FrameLimits:
    """Frame limits computed from the schema's field limits (once, on first use: ~3 ms)."""
    sizes = {cls: len(encode(msg)) for cls, msg in largest_client_messages().items()}
    assert set(sizes) == set(CLIENT_MESSAGES.values()), "a client message has no largest example"
    return FrameLimits(
        hello=_room(sizes[Hello]),
        join=_room(max(sizes[Join], sizes[Resume], sizes[Leave], sizes[Heartbeat])),
        member=_room(max(sizes.values())),
    )


# Every agent sends one a second, and it has no fields: a frame of exactly these bytes decodes
# to one shared instance (frozen, so sharing is safe) without msgpack or a constructor.
_HEARTBEAT = Heartbeat()
_HEARTBEAT_PAYLOAD = encode(_HEARTBEAT)[HEADER.size :]


# --- decoding ----------------------------------------------------------------


def _build(cls: type[Any], m: dict[Any, Any], path: str) -> Any:
    flat = _FLAT.get(cls)
    keys = m.keys()
    if flat is not None and keys <= flat[0] and keys >= flat[1]:
        # The common case (every Progress, every second from every node): the map holds the
        # class's fields (all required ones) and nothing else but "t": its keywords as they are.
        kwargs = m.copy()
        kwargs.pop("t", None)
    else:
        kwargs = {}
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


class _TooManyContainers(Exception):
    pass


def decode_payload(payload: bytes | bytearray, *, allowed: Mapping[str, type] | None = None) -> Message:
    """Decode one frame's payload (without its header) into a message.

    ``allowed`` maps tags to the classes this side accepts (``CLIENT_MESSAGES`` on
    the server); any other tag is an UnknownMessageType. Default: every message.
    """
    left = MAX_CONTAINERS

    def count(obj: Any) -> Any:
        # Called by msgpack for each map and array as it completes: a payload of a million
        # tiny containers is stopped after a few dozen, not decoded in full.
        nonlocal left
        left -= 1
        if left < 0:
            raise _TooManyContainers
        return obj

    try:
        obj = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_STR_BYTES,
            max_bin_len=_MAX_BIN_LEN,
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN,
            max_ext_len=_MAX_EXT_LEN,
            object_hook=count,
            list_hook=count,
        )
    except _TooManyContainers:
        raise MalformedFrame(f"payload holds more than {MAX_CONTAINERS} maps and arrays") from None
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
        if allowed is not None:
            for tag, cls in allowed.items():
                if MESSAGE_TYPES.get(tag) is not cls:
                    raise ValueError(f"allowed maps {tag!r} to {cls!r}, which is not that message class")
        self.max_frame_size = max_frame_size
        self._allowed = allowed
        self._heartbeat_allowed = allowed is None or allowed.get(Heartbeat.TYPE) is Heartbeat
        # A node sends the same Join every round: its bytes again decode to the same (frozen)
        # message, without msgpack or validation; in a 10,000-node re-rendezvous that was a
        # fifth of the server's CPU.
        self._join_payload: bytes | None = None
        self._join: Message | None = None
        self._need_magic = expect_magic
        self._buf = bytearray()
        self._pos = 0  # where the next frame starts in _buf
        self._error: ProtocolError | None = None

    @property
    def max_frame_size(self) -> int:
        """The largest payload accepted; a caller may change it between frames (per stage)."""
        return self._max

    @max_frame_size.setter
    def max_frame_size(self, value: int) -> None:
        # These are our own settings, so mistakes are ValueErrors, not ProtocolErrors.
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"max_frame_size must be an int, got {type(value).__name__}")
        if not 0 < value <= 2**32 - 1:
            raise ValueError(f"max_frame_size must be in 1..{2**32 - 1}, got {value}")
        self._max = value

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as messages."""
        return len(self._buf) - self._pos

    def feed(self, data: bytes = b"", *, limit: int | None = None) -> list[Message]:
        """Add received bytes; return the messages they complete (maybe none).

        With ``limit``, at most that many: the rest stay buffered for the next call (which
        may bring no new bytes), so a caller can spread a burst over several turns and
        change ``max_frame_size`` between frames.

        Raises ProtocolError on the first bad frame. Messages that came before it
        in the same call are dropped with the stream: the caller is about to
        reply with an Error and close the connection anyway.
        """
        if self._error is not None:
            raise self._error.with_traceback(None)
        try:
            if not self._buf and limit != 0 and not self._need_magic and len(data) > HEADER.size:
                # The common case: nothing buffered (a buffer all taken is emptied) and a read
                # of exactly one frame, decoded from the read's bytes, not through the buffer.
                (length,) = HEADER.unpack_from(data)
                if length + HEADER.size == len(data) and length <= self._max:
                    self._pos = 0
                    return [self._decode(data[HEADER.size :])]
            return self._feed(data, limit)
        except ProtocolError as exc:
            # Keep the error but not what it was raised through: the inner frames hold the
            # whole buffer and whatever msgpack decoded (up to a frame's worth, and more as
            # objects), and through ``self._error`` they would live on in a reference cycle
            # until a full garbage collection; a flood of bad frames grew memory that way.
            exc.__context__ = None
            self._error = exc
            self._buf = bytearray()
            self._pos = 0
            raise exc.with_traceback(None) from None

    def _feed(self, data: bytes, limit: int | None) -> list[Message]:
        buf = self._buf
        pos = self._pos
        if pos and (pos >= len(buf) or pos > 65536):
            # Drop what was consumed: at once when it is all of it, otherwise only when it is
            # large, so frames taken a few at a time do not copy the tail each time.
            del buf[:pos]
            pos = 0
        if data:
            buf += data
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
        room = -1 if limit is None else limit
        while end - pos >= size and room != 0:
            (length,) = HEADER.unpack_from(buf, pos)
            if length > self._max:
                raise FrameTooLarge(length, self._max)
            start = pos + size
            if end - start < length:
                break
            out.append(self._decode(buf[start : start + length]))
            pos = start + length
            room -= 1
        if pos == end and pos:
            # All of it taken: let it go now, not at the next read (a node's last Stacks frame
            # would stay with its connection until then: 16 KB a node after a hang).
            buf.clear()
            pos = 0
        self._pos = pos
        return out

    def _decode(self, payload: bytes | bytearray) -> Message:
        if payload == _HEARTBEAT_PAYLOAD and self._heartbeat_allowed:
            return _HEARTBEAT
        if payload == self._join_payload and self._join is not None:
            return self._join
        msg = decode_payload(payload, allowed=self._allowed)
        if type(msg) is Join:
            self._join_payload, self._join = bytes(payload), msg
        return msg
