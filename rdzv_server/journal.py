"""The server's state log (``rdzv-server --state-dir DIR``): a write-ahead log of the machine's inputs.

Why inputs. The rendezvous machine is pure and deterministic with time passed in, so the
events fed to it, with the time each was handled, rebuild its state exactly: jobs, rounds,
rank order, failures, exclusions, restart counts, history and counters, with no second
description of each state change to keep in step with ``state.py``. Three kinds of input
are rewritten so that replay needs nothing but the log:

- heartbeats are not logged: they only move a connection's "last seen" time;
- a Tick's heartbeat sweep depends on those times, so the log keeps the Tick and, as
  separate disconnections, the silent nodes the sweep dropped; replay runs the machine with
  ``expire_silent=False`` and gets the same drops from the log;
- a join refused for its token is logged as the disconnection it caused (replay has no
  tokens, which are configuration, not state).

Order. The service appends the records of every event it handled in one turn of the loop,
writes and fsyncs them once, and only then carries out their effects: nothing an agent is
told can be lost by a crash (``Journal.sync``).

Files in DIR::

    state.log   HEADER, then records: 4-byte length, 4-byte CRC32 of (length + payload), payload
    state.snap  one such record holding a snapshot (``snapshot.py``), replaced atomically
    lock        flock'd while a server uses DIR

A payload is a msgpack map (never pickle): ``k`` (kind), ``t`` (the machine's clock),
``w`` (wall clock), and the event's fields; a message travels as its protocol payload and
is decoded by the protocol codec, with its validation. The log's header names the sequence
number it starts after; the snapshot names the last record it includes. Every
``snapshot_every`` records the state is snapshotted (tmp, fsync, rename, fsync the
directory) and the log starts again; a crash between the two steps leaves records the
snapshot already holds, which replay skips by number.

A crash mid-write leaves a torn last record: too short for its length, or (on a file system
that extended the file before writing its data) complete but failing its CRC. Either is
detected, never misread (the CRC covers the length too, and zero-filled space fails it), and
dropped: the file is truncated to the last good record, and the server says so. A bad
record *followed by more data* is not a torn write but damage: the server refuses to start
rather than drop acknowledged state silently.

Time. The machine's clock is monotonic and does not survive a restart. The log records the
wall clock beside it; a restarted server continues the machine's clock from the last
record, plus the wall-clock time it was down, so deadlines and "N seconds ago" stay right.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import struct
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from protocol import HEADER, Error, Heartbeat, Hello, ProtocolError, decode_payload, encode
from protocol.auth import TokenTable
from protocol.records import record

from . import snapshot
from .state import (
    Close,
    Connected,
    Disconnected,
    Effect,
    Event,
    LocalError,
    Received,
    Rendezvous,
    Send,
    Tick,
)

logger = logging.getLogger("rdzv_server")

LOG_NAME = "state.log"
SNAP_NAME = "state.snap"
LOCK_NAME = "lock"
LOG_MAGIC = b"RDZVLOG1"
SNAP_MAGIC = b"RDZVSNP1"
FILE_HEADER = struct.Struct("!8sQ")  # magic, sequence number the file starts after
RECORD_HEADER = struct.Struct("!II")  # payload length, CRC32 of (length bytes + payload)
MAX_RECORD = 256 << 20  # a length above this is damage, not a record
SNAPSHOT_EVERY = 50_000  # records between snapshots


class StateLogError(Exception):
    """The state dir cannot be used: damaged, from a newer server, or in use by another."""


# --- framing ------------------------------------------------------------------------------


def frame(payload: bytes) -> bytes:
    """One record: its length, a CRC32 over the length and the payload, the payload."""
    head = struct.pack("!I", len(payload))
    return head + struct.pack("!I", zlib.crc32(payload, zlib.crc32(head))) + payload


@record(frozen=True, slots=True)
class Scan:
    records: list[bytes]
    good_end: int  # offset just past the last good record
    torn: bool  # the bytes after good_end are a torn last record (to be dropped)


def scan(data: bytes | memoryview, start: int) -> Scan:
    """Split ``data[start:]`` into record payloads; StateLogError on damage before the end."""
    view = memoryview(data)
    out: list[bytes] = []
    pos, end = start, len(view)
    while pos < end:
        if end - pos < RECORD_HEADER.size:
            return Scan(out, pos, torn=True)
        length, crc = RECORD_HEADER.unpack_from(view, pos)
        body = pos + RECORD_HEADER.size
        if length == 0 or length > MAX_RECORD:
            # Zero-filled or garbage space: torn if nothing else follows it, else damage.
            if _rest_is_filler(view, pos):
                return Scan(out, pos, torn=True)
            raise StateLogError(f"bad record length {length} at offset {pos}")
        if end - body < length:
            return Scan(out, pos, torn=True)
        payload = view[body : body + length]
        if zlib.crc32(payload, zlib.crc32(view[pos : pos + 4])) != crc:
            if body + length == end or _rest_is_filler(view, body + length):
                return Scan(out, pos, torn=True)
            raise StateLogError(f"record at offset {pos} fails its checksum and more records follow")
        out.append(bytes(payload))
        pos = body + length
    return Scan(out, pos, torn=False)


def _rest_is_filler(view: memoryview, pos: int) -> bool:
    return not any(view[pos:])


# --- events as records --------------------------------------------------------------------


def event_record(event: Event, effects: list[Effect]) -> dict[str, Any] | None:
    """What the log keeps of one handled event (None: nothing that replay needs)."""
    if isinstance(event, Received):
        if isinstance(event.msg, Heartbeat):
            return None
        for eff in effects:
            if isinstance(eff, Send) and isinstance(eff.msg, Error) and eff.msg.code == "auth_failed":
                why = next((e.reason for e in effects if isinstance(e, Close) and e.conn == event.conn), "")
                return {"k": "disconnected", "conn": event.conn, "why": why}
        return {"k": "received", "conn": event.conn, "msg": encode(event.msg)[HEADER.size :]}
    if isinstance(event, Connected):
        return {"k": "connected", "conn": event.conn, "peer": event.peer}
    if isinstance(event, Disconnected):
        return {"k": "disconnected", "conn": event.conn, "why": event.reason}
    if isinstance(event, Tick):
        # Only the heartbeat sweep closes connections on a tick.
        return {"k": "tick", "drops": [[e.conn, e.reason] for e in effects if isinstance(e, Close)]}
    raise TypeError(f"not a machine event: {event!r}")


def apply_record(machine: Rendezvous, rec: dict[str, Any]) -> None:
    """Feed one logged input to a machine built with ``expire_silent=False`` (replay)."""
    kind, now = rec["k"], float(rec["t"])
    if kind == "received":
        machine.handle(Received(int(rec["conn"]), decode_payload(rec["msg"])), now)
    elif kind == "connected":
        machine.handle(Connected(int(rec["conn"]), str(rec["peer"])), now)
    elif kind == "disconnected":
        machine.handle(Disconnected(int(rec["conn"]), str(rec["why"])), now)
    elif kind == "tick":
        machine.handle(Tick(), now)
        for conn, why in rec["drops"]:
            machine.handle(Disconnected(int(conn), str(why)), now)
    elif kind == "drain":
        machine.drain(str(rec["job"]), str(rec["node"]), str(rec["why"]), now)
    elif kind == "going_away":
        machine.going_away(str(rec["why"]), now)
    elif kind == "recover":
        machine.recover(now)
    else:
        raise StateLogError(f"unknown record kind {kind!r} (written by a newer server?)")


def _unpack(payload: bytes) -> dict[str, Any]:
    rec = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    if not isinstance(rec, dict) or "k" not in rec or "t" not in rec or "w" not in rec:
        raise StateLogError("a record is not a state-log map")
    return rec


# --- the log ------------------------------------------------------------------------------


@record(frozen=True, slots=True)
class Restored:
    """What ``StateLog.open`` found, for the start-up log line."""

    snapshot_seq: int
    replayed: int
    dropped_bytes: int  # a torn last record, truncated away
    jobs: int


class StateLog:
    """The open state dir of a running server: the log writer, its snapshots, its clock."""

    def __init__(
        self,
        directory: Path,
        machine: Rendezvous,
        *,
        seq: int,
        clock_offset: float,
        snapshot_every: int = SNAPSHOT_EVERY,
        fsync: bool = True,
        lock_fd: int = -1,
    ) -> None:
        self.dir = directory
        self.machine = machine
        self.seq = seq  # records written so far, over the life of the state dir
        self.snapshot_every = snapshot_every
        self.fsync = fsync
        self._offset = clock_offset
        self._lock_fd = lock_fd
        self._buf: list[bytes] = []
        self._since_snapshot = 0
        self._fd = os.open(directory / LOG_NAME, os.O_WRONLY | os.O_APPEND | _NOFOLLOW)
        self._urgent = False  # the buffer holds a record whose effects need it durable first
        self.syncs = 0  # fsyncs done, and the time they took (for operators and benchmarks)
        self.sync_seconds = 0.0

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        directory: Path,
        *,
        tokens: TokenTable | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        snapshot_every: int = SNAPSHOT_EVERY,
        fsync: bool = True,
    ) -> tuple[StateLog, Restored, list[Effect]]:
        """Lock DIR, load its snapshot, replay its log, drop a torn tail; then ``recover``.

        Returns the log (whose ``machine`` is ready to serve), what was found, and the
        effects of recovery (log lines). StateLogError when DIR cannot be used.
        """
        _private_dir(directory)
        lock_fd = _lock(directory)
        try:
            machine = Rendezvous(None, expire_silent=False)  # replay: drops come from the log
            snap_seq, last_t, last_w = _load_snapshot(directory / SNAP_NAME, machine)
            seq, replayed, dropped, last = replay_log(directory / LOG_NAME, machine, snap_seq)
            if last is not None:
                last_t, last_w = last
            # Continue the machine's clock: its last reading plus the wall-clock downtime.
            now_mono = monotonic()
            resume_at = now_mono if last_t is None else last_t + max(0.0, wall() - float(last_w or 0.0))
            offset = resume_at - now_mono
            machine.tokens = tokens
            machine.expire_silent = True
            log = cls(
                directory,
                machine,
                seq=seq,
                clock_offset=offset,
                snapshot_every=snapshot_every,
                fsync=fsync,
                lock_fd=lock_fd,
            )
        except BaseException:
            os.close(lock_fd)
            raise
        log._since_snapshot = seq - snap_seq
        restored = Restored(snap_seq, replayed, dropped, len(machine.jobs))
        now = log.clock()
        effects = machine.recover(now)
        log.append({"k": "recover"}, now)
        log.sync()
        return log, restored, effects

    # -- writing ---------------------------------------------------------------------------

    def clock(self) -> float:
        """The machine's clock: monotonic, continued across restarts."""
        return time.monotonic() + self._offset

    def record(self, event: Event, effects: list[Effect], now: float) -> None:
        rec = event_record(event, effects)
        if rec is not None:
            # A connection and its hello change no job state, and what they are told (the
            # welcome) promises nothing: their records ride on the next fsync. Replay needs
            # them before the join that follows, and the file keeps that order.
            urgent = not (
                isinstance(event, Connected) or (isinstance(event, Received) and isinstance(event.msg, Hello))
            )
            self.append(rec, now, urgent=urgent)

    def append(self, rec: dict[str, Any], now: float, *, urgent: bool = True) -> None:
        """Buffer one record; it is durable after the next ``sync``."""
        rec["t"], rec["w"] = now, time.time()
        self._buf.append(frame(msgpack.packb(rec, use_bin_type=True)))
        self._urgent = self._urgent or urgent
        self.seq += 1
        self._since_snapshot += 1

    @property
    def pending(self) -> int:
        return len(self._buf)

    def sync(self) -> None:
        """Write and fsync what was appended (one fsync for the batch); then maybe compact."""
        if self.write():
            self.fsync_written()
        self.maybe_compact()

    def write(self) -> bool:
        """Write the buffered records, without fsync; True if their effects must wait for one."""
        if self._buf:
            data = b"".join(self._buf)
            self._buf.clear()
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
        urgent, self._urgent = self._urgent and self.fsync, False
        return urgent

    def fsync_written(self) -> None:
        """fsync what ``write`` wrote. The service runs this in a worker thread, so the loop
        gathers the next batch meanwhile (group commit); nothing else uses the file then."""
        t0 = time.perf_counter()
        os.fsync(self._fd)
        self.sync_seconds += time.perf_counter() - t0
        self.syncs += 1

    def maybe_compact(self) -> None:
        if self._since_snapshot >= self.snapshot_every:
            self.compact()

    def compact(self) -> None:
        """Snapshot the machine (atomically), then start an empty log after it."""
        self.write()  # the snapshot holds these records' state; no need to fsync them too
        now = self.clock()
        body = msgpack.packb(
            {"seq": self.seq, "t": now, "w": time.time(), "state": snapshot.dump(self.machine)},
            use_bin_type=True,
        )
        _replace(self.dir / SNAP_NAME, FILE_HEADER.pack(SNAP_MAGIC, self.seq) + frame(body), self.fsync)
        # The log restarts after the snapshot; a crash before this rename only leaves
        # records that replay skips by number.
        _replace(self.dir / LOG_NAME, FILE_HEADER.pack(LOG_MAGIC, self.seq), self.fsync)
        os.close(self._fd)
        self._fd = os.open(self.dir / LOG_NAME, os.O_WRONLY | os.O_APPEND | _NOFOLLOW)
        self._since_snapshot = 0

    def close(self) -> None:
        self.sync()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


# --- files --------------------------------------------------------------------------------


# Files in the state dir are opened without following a symlink: a link planted there (by
# whoever could write the directory before it was checked) must not redirect our writes.
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def _private_dir(directory: Path) -> None:
    """Create DIR private (0700), or check an existing one: a real directory of ours (not a
    symlink to one) that no other user can write, so nobody else can plant files in it."""
    try:
        directory.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    except OSError as exc:
        raise StateLogError(f"cannot create state dir {directory}: {exc.strerror or exc}") from None
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode):
        raise StateLogError(f"state dir {directory} is a symlink: give the directory itself")
    if not stat.S_ISDIR(st.st_mode):
        raise StateLogError(f"state dir {directory} is not a directory")
    if st.st_uid != os.geteuid():
        raise StateLogError(f"state dir {directory} belongs to uid {st.st_uid}, not to this server's")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StateLogError(
            f"state dir {directory} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): "
            "anyone could replace the job state; chmod go-w it (the server creates it 0700)"
        )


def _read(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError as exc:
        why = "it is a symlink" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
        raise StateLogError(f"cannot read {path}: {why}") from None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _lock(directory: Path) -> int:
    try:
        fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
    except OSError as exc:
        raise StateLogError(f"cannot open {directory / LOCK_NAME}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StateLogError(f"state dir {directory} is in use by another rdzv-server") from None
    return fd


def _replace(path: Path, data: bytes, fsync: bool) -> None:
    """Write a file whole or not at all: tmp, fsync, rename, fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        os.unlink(tmp)  # a leftover of a crash, or something planted: never written through
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if fsync:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _load_snapshot(path: Path, machine: Rendezvous) -> tuple[int, float | None, float | None]:
    """Fill the machine from the snapshot; (its sequence number, its times); (0, None, None)."""
    if not os.path.lexists(path):  # a symlink is refused by _read, not taken for no file
        return 0, None, None
    data = _read(path)
    if len(data) < FILE_HEADER.size or FILE_HEADER.unpack_from(data)[0] != SNAP_MAGIC:
        raise StateLogError(f"{path} is not a rdzv-server snapshot")
    _, seq = FILE_HEADER.unpack_from(data)
    try:
        found = scan(data, FILE_HEADER.size)
    except StateLogError as exc:
        raise StateLogError(f"{path}: {exc}") from None
    if found.torn or len(found.records) != 1:
        # Snapshots are renamed into place whole, so this is damage, not a crash.
        raise StateLogError(f"{path} is damaged (its checksum fails)")
    try:
        body = msgpack.unpackb(found.records[0], raw=False, strict_map_key=True)
        snapshot.load(body["state"], machine)
        if body["seq"] != seq:
            raise StateLogError(f"{path}: header says record {seq}, body says {body['seq']}")
        return seq, float(body["t"]), float(body["w"])
    except (snapshot.SnapshotError, KeyError, TypeError, ValueError) as exc:
        raise StateLogError(f"{path}: {exc}") from None


def replay_log(
    path: Path, machine: Rendezvous, snap_seq: int
) -> tuple[int, int, int, tuple[float, float] | None]:
    """Replay the log after the snapshot: (last seq, records replayed, bytes dropped, last times)."""
    if not os.path.lexists(path):  # a symlink is refused by _read, not taken for no file
        _replace(path, FILE_HEADER.pack(LOG_MAGIC, snap_seq), True)
        return snap_seq, 0, 0, None
    data = _read(path)
    if len(data) < FILE_HEADER.size:
        # Torn while being created (compaction writes it whole, so only a first start).
        if snap_seq:
            raise StateLogError(f"{path} has no header but a snapshot exists")
        _replace(path, FILE_HEADER.pack(LOG_MAGIC, snap_seq), True)
        return snap_seq, 0, 0, None
    magic, base = FILE_HEADER.unpack_from(data)
    if magic != LOG_MAGIC:
        raise StateLogError(f"{path} is not a rdzv-server state log")
    if base > snap_seq:
        raise StateLogError(f"{path} starts after record {base}, but the snapshot ends at {snap_seq}")
    try:
        found = scan(data, FILE_HEADER.size)
    except StateLogError as exc:
        raise StateLogError(f"{path}: {exc}; refusing to drop the records after it") from None
    dropped = len(data) - found.good_end
    if found.torn:
        logger.warning(
            "state log: dropped a torn last record (%d bytes at offset %d, a crash mid-write)",
            dropped,
            found.good_end,
        )
        os.truncate(path, found.good_end)
    seq, replayed, last = base, 0, None
    for payload in found.records:
        seq += 1
        try:
            rec = _unpack(payload)
            if seq <= snap_seq:
                continue  # already in the snapshot (a crash during compaction)
            last = (float(rec["t"]), float(rec["w"]))
            apply_record(machine, rec)
        except (LocalError, ProtocolError, KeyError, TypeError, ValueError) as exc:
            raise StateLogError(
                f"{path}: record {seq} does not replay: {type(exc).__name__}: {exc}"
            ) from None
        replayed += 1
    return max(seq, snap_seq), replayed, dropped, last
