"""The server's state log (``rdzv-server --state-dir DIR``): a write-ahead log of the machine's inputs.

Why inputs. The rendezvous machine is pure and deterministic with time passed in, so the
events fed to it, with the time each was handled, rebuild its state exactly: jobs, rounds,
rank order, failures, exclusions, restart counts, history and counters, with no second
description of each state change to keep in step with ``machine/state.py``. Three kinds of input
are rewritten so that replay needs nothing but the log:

- heartbeats, and any event the machine marks ``unchanged`` (a stale or ignored message),
  are not logged: they change nothing replay needs (at most a connection's "last seen" time),
  so a member repeating such frames cannot grow the log; nor are training ``Progress`` and
  ``Stacks``, which change only volatile views (not in snapshots). A decision the machine
  takes from those views (a straggler noted, a node left out of a round) is kept as the
  ``facts`` (``x``) of the record of the event that took it, and replay takes it from there
  (``Rendezvous.facts``, ``logged_facts``), never from its own partial view;
- a Tick's heartbeat sweep depends on those times, so the log keeps the Tick and, as
  separate disconnections, the silent nodes the sweep dropped; replay runs the machine with
  ``expire_silent=False`` and gets the same drops from the log;
- a join refused for its token, or while the disk is nearly full (its ``Close`` says
  ``by_config``), is logged as the disconnection it caused (replay has no tokens and no disk:
  configuration, not state).

Every input reaches the machine as an event of ``handle`` (an operator's drain, a shutdown
and a restart too), and ``RECORDS`` is the one table between events and record kinds: each
kind names the event it is read back as, how an event is written and how a record is read.

Order. The service appends the records of every event it handled in one turn of the loop,
writes and fsyncs them once, and only then carries out their effects: nothing an agent is
told can be lost by a crash (``Journal.sync``).

Files in DIR::

    state.log   HEADER, then records: 4-byte length, 4-byte CRC32 of (length + payload), payload
    state.snap  one such record holding a snapshot (``state_image.py``), replaced atomically
    lock        flock'd while a server uses DIR

A payload is a msgpack map (never pickle): ``k`` (kind), ``t`` (the machine's clock),
``w`` (wall clock), and the event's fields; a message travels as its protocol payload and
is decoded by the protocol codec, with its validation. The log's header names the sequence
number it starts after; the snapshot names the last record it includes. Every
``snapshot_every`` records, or once the log since the last snapshot holds more than
``max(COMPACT_MIN_BYTES, COMPACT_RATIO x the snapshot's size)`` bytes, the state is
snapshotted (tmp, fsync, rename, fsync the directory) and the log starts again; a crash
between the two steps leaves records the snapshot already holds, which replay skips by
number. Replay reads the log a record at a time, so restarting on a large log needs the
memory of the state it rebuilds, not of the file.

Disk space. Nothing may be acknowledged that is not durable. So before the disk is full,
the log checks the free space of DIR's file system (``statvfs``; every ``SPACE_CHECK_BYTES``
written or ``SPACE_CHECK_SECONDS``, not per record) and, below ``min_free``
(``--state-min-free-mib``, and at least twice the last snapshot, which compaction rewrites),
sets the machine's ``refuse_joins``: new nodes are refused with a clear error while running
jobs are served. It is cleared when space returns.

A full disk. When a write of the log or of a snapshot fails for want of room all the same
(ENOSPC, or EDQUOT: another process filled the file system, or a quota ran out), the server
does not stop: it goes read-only, as etcd does on its NOSPACE alarm (``enter_read_only``).
The events whose records failed were handled by the machine already (records are written
after ``handle``), but their effects wait for the write (see Order), so nothing of them was
acknowledged: they stay applied in memory with their effects held, and the file is cut back
to its last durable record (a server that dies now restarts from exactly what was
acknowledged). While read-only nothing is written: each event that changes state is counted
(``held``), not logged, and the service holds its effects too. ``recover`` (the service tries
it every second or so) writes a snapshot of the machine as it is, which holds every held
change, and starts a new log after it; only then are the held effects carried out. A
snapshot rather than the held records: it is what compaction writes anyway, it is exactly the
state the server serves, and nothing is ever appended after a torn record. Any other write
error (EIO, EROFS) still stops the server: the disk is failing, and after a failed fsync Linux
may drop the pages it could not write and call the next fsync clean, so what the file holds
past its last good fsync is unknown and no retry makes it right.

A crash mid-write leaves a torn last record: too short for its length, or (on a file system
that extended the file before writing its data) complete but failing its CRC. Either is
detected, never misread (the CRC covers the length too, and zero-filled space fails it), and
dropped: the file is truncated to the last good record, and the server says so. A bad
record *followed by more data* is not a torn write but damage: the server refuses to start
rather than drop acknowledged state silently.

Time. The machine's clock is monotonic and does not survive a restart. The log records the
wall clock beside it; a restarted server continues the machine's clock from the last
record, plus the wall-clock time it was down, so deadlines and "N seconds ago" stay right.
Both clocks are given to ``StateLog.open`` (tests pass fake ones); nothing here reads another.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from protocol import (
    HEADER,
    Heartbeat,
    Hello,
    Progress,
    ProtocolError,
    SnapshotsHeld,
    Stacks,
    decode_payload,
    encode,
)
from protocol.auth import TokenTable
from protocol.records import record

from . import state_image
from .machine.state import (
    AUTH_TIMEOUT,
    HELLO_TIMEOUT,
    Close,
    Connected,
    Disconnected,
    DrainRequested,
    Effect,
    Event,
    LocalError,
    Received,
    Rendezvous,
    Restarted,
    ShuttingDown,
    Tick,
)
from .wal import (
    DISK,
    FILE_HEADER,
    LOG_MAGIC,
    NOFOLLOW,
    SNAP_MAGIC,
    Damage,
    Disk,
    RecordReader,
    StateLogError,
    file_size,
    frame,
    lock_dir,
    no_space,
    open_read,
    private_dir,
    read_file,
    replace_file,
    scan,
)

logger = logging.getLogger("rdzv_server")

LOG_NAME = "state.log"
SNAP_NAME = "state.snap"
SNAPSHOT_EVERY = 50_000  # records between snapshots
COMPACT_MIN_BYTES = 16 << 20  # the log may grow to this much after a snapshot...
COMPACT_RATIO = 4  # ...or to this many times the snapshot's size, before it is compacted
MIN_FREE_BYTES = 128 << 20  # below this much free space in DIR, new nodes are refused
SPACE_CHECK_BYTES = 1 << 20  # statvfs after this much was written...
SPACE_CHECK_SECONDS = 1.0  # ...or this long after the last check (when an event comes)


# --- events as records --------------------------------------------------------------------


Record = dict[str, Any]


def _write_received(event: Received, effects: list[Effect]) -> Record | None:
    if isinstance(event.msg, Heartbeat):
        return None
    for eff in effects:
        # Refused for the server's configuration (tokens, free disk), which replay has not.
        if isinstance(eff, Close) and eff.conn == event.conn and eff.by_config:
            return {"k": "disconnected", "conn": event.conn, "why": eff.reason}
    return {"k": "received", "conn": event.conn, "msg": encode(event.msg)[HEADER.size :]}


def _write_tick(event: Tick, effects: list[Effect]) -> Record:
    # A tick's closes (the heartbeat sweep, late hellos and joins) depend on times replay does
    # not have (heartbeats are not logged): the log keeps them, replayed as disconnections.
    return {"k": "tick", "drops": [[e.conn, e.reason] for e in effects if isinstance(e, Close)]}


def _read_tick(rec: Record) -> list[Event]:
    return [Tick(), *(Disconnected(int(conn), str(why)) for conn, why in rec["drops"])]


@record(frozen=True, slots=True)
class RecordKind:
    """One row of the table between the machine's events and the log's records."""

    event: type
    write: Callable[[Any, list[Effect]], Record | None]  # the record of a handled event, or None
    read: Callable[[Record], list[Event]]  # the events a record replays as, in order


RECORDS: dict[str, RecordKind] = {
    "connected": RecordKind(
        Connected,
        lambda e, _: (
            {"k": "connected", "conn": e.conn, "peer": e.peer} | ({"local": e.local} if e.local else {})
        ),
        lambda r: [Connected(int(r["conn"]), str(r["peer"]), local=str(r.get("local", "")))],
    ),
    "received": RecordKind(
        Received,
        _write_received,
        lambda r: [Received(int(r["conn"]), decode_payload(r["msg"]))],
    ),
    "disconnected": RecordKind(
        Disconnected,
        lambda e, _: {"k": "disconnected", "conn": e.conn, "why": e.reason},
        lambda r: [Disconnected(int(r["conn"]), str(r["why"]))],
    ),
    "tick": RecordKind(Tick, _write_tick, _read_tick),
    "drain": RecordKind(
        DrainRequested,
        lambda e, _: {"k": "drain", "job": e.job_id, "node": e.node_id, "why": e.reason},
        lambda r: [DrainRequested(str(r["job"]), str(r["node"]), str(r["why"]))],
    ),
    "going_away": RecordKind(
        ShuttingDown,
        lambda e, _: {"k": "going_away", "why": e.reason},
        lambda r: [ShuttingDown(str(r["why"]))],
    ),
    "recover": RecordKind(Restarted, lambda e, _: {"k": "recover"}, lambda r: [Restarted()]),
}
_KIND_OF: dict[type, RecordKind] = {row.event: row for row in RECORDS.values()}


def event_record(
    event: Event,
    effects: list[Effect],
    *,
    unchanged: bool = False,
    facts: dict[str, list[Any]] | None = None,
) -> Record | None:
    """What the log keeps of one handled event (None: nothing that replay needs).

    ``unchanged``: the machine said the event changed no state (``Rendezvous.unchanged``).
    ``facts``: what the machine derived from volatile state while handling it
    (``Rendezvous.facts``), kept in the record (``x``) for replay to take instead.
    """
    if unchanged and not facts:
        return None
    if (
        isinstance(event, Received)
        and isinstance(event.msg, _VOLATILE)
        and not facts
        and not any(isinstance(e, Close) for e in effects)  # (a refusal: a connection dropped)
    ):
        return None
    row = _KIND_OF.get(type(event))
    if row is None:
        raise TypeError(f"not a machine event: {event!r}")
    rec = row.write(event, effects)
    if rec is not None and facts:
        rec["x"] = facts
    return rec


# Training progress and stacks change only the machine's volatile views (not in snapshots, not
# needed by replay); a node sends one Progress a second, so they are not logged. A decision
# taken from them (a straggler noted, a node left out of a round) is: as the facts of the
# event that took it; and so is one that was refused (from a connection that had not joined:
# its connection is dropped).
_VOLATILE = (Progress, Stacks, SnapshotsHeld)


def apply_record(machine: Rendezvous, rec: Record) -> None:
    """Feed one logged input to a machine built with ``expire_silent=False`` (replay).

    The record's facts (``x``; none: {}) stand in, for this record's events, for what the
    live machine derived from volatile state, so replay never decides from its own."""
    row = RECORDS.get(rec["k"])
    if row is None:
        raise StateLogError(f"unknown record kind {rec['k']!r} (written by a newer server?)")
    now = float(rec["t"])
    facts = rec.get("x", {})
    if not isinstance(facts, dict):
        raise StateLogError(f"a record's facts are a {type(facts).__name__}, not a map")
    machine.logged_facts = dict(facts)  # the machine takes facts out as it uses them: a copy
    try:
        for event in row.read(rec):
            machine.handle(event, now)
    finally:
        machine.logged_facts = None


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


@record(frozen=True, slots=True)
class LogHealth:
    """Whether the state log is being written, for ``/healthz`` and ``/metrics``."""

    read_only: str  # why it is not ("" while it is): a write failed for want of room
    since: float | None  # the wall clock when it went read-only
    held: int  # changes of state since then, applied in memory and not yet written
    entered: int  # times it went read-only in this process
    refused: int  # agent connections refused since then (the service counts them)


class StateLog:
    """The open state dir of a running server: the log writer, its snapshots, its clock.

    ``read_only``: why nothing is written (a write failed for want of room; "" while it is
    written), until ``recover`` succeeds (the module's docstring, "A full disk")."""

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
        min_free: int = MIN_FREE_BYTES,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        disk: Disk = DISK,
    ) -> None:
        self.dir = directory
        self._monotonic = monotonic  # the process's clocks: every reading here is of these
        self._wall = wall
        self.disk = disk  # the writes and fsyncs (a test's fails them)
        self.machine = machine
        self.seq = seq  # records written so far, over the life of the state dir
        self.snapshot_every = snapshot_every
        self.fsync = fsync
        self._offset = clock_offset
        self._lock_fd = lock_fd
        self._buf: list[bytes] = []
        self._since_snapshot = 0
        self._fd = os.open(directory / LOG_NAME, os.O_WRONLY | os.O_APPEND | NOFOLLOW)
        self._urgent = False  # the buffer holds a record whose effects need it durable first
        self.syncs = 0  # fsyncs done, and the time they took (for operators and benchmarks)
        self.sync_seconds = 0.0
        size = file_size(directory / LOG_NAME)
        self.log_bytes = max(0, size - FILE_HEADER.size)  # records since the snapshot
        # The log file's end, and how much of it is durable (fsync'd, or written without
        # fsync): a failed write cuts the file back to the durable end.
        self._end = self._durable_end = size
        self._unsynced = 0  # records written past the durable end
        self.snapshot_bytes = file_size(directory / SNAP_NAME)
        self.min_free = min_free
        self._unchecked_bytes = 0  # written since the last free-space check
        self._space_checked = -float("inf")  # the monotonic clock at that check
        self.read_only = ""
        self.read_only_since: float | None = None  # the wall clock when it went read-only
        self.held = 0  # records not written since then: their changes are in memory only
        self.read_only_entered = 0
        self.broken = ""  # a write failed otherwise (EIO...): nothing more is written
        self.check_space(force=True)

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        directory: Path,
        *,
        tokens: TokenTable | None = None,
        hello_timeout: float = HELLO_TIMEOUT,
        auth_timeout: float = AUTH_TIMEOUT,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        snapshot_every: int = SNAPSHOT_EVERY,
        fsync: bool = True,
        min_free: int = MIN_FREE_BYTES,
        disk: Disk = DISK,
    ) -> tuple[StateLog, Restored, list[Effect]]:
        """Lock DIR, load its snapshot, replay its log, drop a torn tail; then ``Restarted``.

        Returns the log (whose ``machine`` is ready to serve), what was found, and the
        effects of recovery (log lines). StateLogError when DIR cannot be used, OSError when
        it cannot be written (a full disk included: a server must be able to log its start).
        The handshake timeouts are the serving process's (the service must be given the same
        ones): they are not state, and replay sets no handshake deadline.
        """
        private_dir(directory)
        lock_fd = lock_dir(directory)
        try:
            # Replay: drops come from the log.
            machine = Rendezvous(
                None, expire_silent=False, hello_timeout=hello_timeout, auth_timeout=auth_timeout
            )
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
                min_free=min_free,
                monotonic=monotonic,
                wall=wall,
                disk=disk,
            )
        except BaseException:
            os.close(lock_fd)
            raise
        log._since_snapshot = seq - snap_seq
        restored = Restored(snap_seq, replayed, dropped, len(machine.jobs))
        now = log.clock()
        event = Restarted()
        effects = machine.handle(event, now)
        log.record(event, effects, now)
        try:
            log.sync()
        except BaseException:
            log._close_files()
            raise
        return log, restored, effects

    # -- writing ---------------------------------------------------------------------------

    def clock(self) -> float:
        """The machine's clock: monotonic, continued across restarts."""
        return self._monotonic() + self._offset

    def record(self, event: Event, effects: list[Effect], now: float) -> bool:
        """Log one event the machine just handled, unless it changed nothing (``unchanged``).
        True when it changed state (read-only: it is counted in ``held``, not written)."""
        self.check_space()
        rec = event_record(event, effects, unchanged=self.machine.unchanged, facts=self.machine.facts)
        if rec is None:
            return False
        # A connection and its hello change no job state, and what they are told (the
        # welcome) promises nothing: their records ride on the next fsync. Replay needs
        # them before the join that follows, and the file keeps that order.
        urgent = not (
            isinstance(event, Connected) or (isinstance(event, Received) and isinstance(event.msg, Hello))
        )
        self.append(rec, now, urgent=urgent)
        return True

    def append(self, rec: dict[str, Any], now: float, *, urgent: bool = True) -> None:
        """Buffer one record; it is durable after the next ``sync``. Read-only: counted only
        (``recover``'s snapshot holds its change)."""
        if self.read_only:
            self.held += 1
            return
        rec["t"], rec["w"] = now, self._wall()
        framed = frame(msgpack.packb(rec, use_bin_type=True))
        self._buf.append(framed)
        self.log_bytes += len(framed)
        self._unchecked_bytes += len(framed)
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
        """Write the buffered records, without fsync; True if their effects must wait for one.
        Nothing while read-only (or after a failure that stops the server)."""
        if self.read_only or self.broken:
            return False
        if self._buf:
            data = b"".join(self._buf)
            if self.fsync:
                self._unsynced += len(self._buf)
            self._buf.clear()
            view = memoryview(data)
            while view:  # _end follows each write: a failure cuts the file back from there
                n = self.disk.write(self._fd, view)
                self._end += n
                view = view[n:]
            if not self.fsync:
                self._durable_end = self._end
        urgent, self._urgent = self._urgent and self.fsync, False
        return urgent

    def fsync_written(self) -> None:
        """fsync what ``write`` wrote. The service runs this in a worker thread, so the loop
        gathers the next batch meanwhile (group commit); nothing else uses the file then."""
        t0 = self._monotonic()
        end = self._end
        self.disk.fsync(self._fd)
        self._durable_end, self._unsynced = end, 0  # (no write runs during this fsync)
        self.sync_seconds += self._monotonic() - t0
        self.syncs += 1

    def maybe_compact(self) -> None:
        if self.read_only or self.broken:
            return
        too_big = self.log_bytes > max(COMPACT_MIN_BYTES, COMPACT_RATIO * self.snapshot_bytes)
        if self._since_snapshot >= self.snapshot_every or too_big:
            self.compact()

    def compact(self) -> None:
        """Snapshot the machine (atomically), then start an empty log after it. Read-only,
        this is ``recover``."""
        if self.read_only:
            self.recover()
            return
        self.write()  # the snapshot holds these records' state; no need to fsync them too
        self._snapshot()

    def _snapshot(self) -> None:
        now = self.clock()
        body = msgpack.packb(
            {"seq": self.seq, "t": now, "w": self._wall(), "state": state_image.dump(self.machine)},
            use_bin_type=True,
        )
        snap = FILE_HEADER.pack(SNAP_MAGIC, self.seq) + frame(body)
        replace_file(self.dir / SNAP_NAME, snap, self.fsync, self.disk)
        self.snapshot_bytes = len(snap)
        # The log restarts after the snapshot; a crash before this rename only leaves
        # records that replay skips by number. (Should this one fail, the old log is never
        # appended to again: the next attempt writes both anew.)
        replace_file(self.dir / LOG_NAME, FILE_HEADER.pack(LOG_MAGIC, self.seq), self.fsync, self.disk)
        os.close(self._fd)
        self._fd = os.open(self.dir / LOG_NAME, os.O_WRONLY | os.O_APPEND | NOFOLLOW)
        self._end = self._durable_end = FILE_HEADER.size
        self._unsynced = 0
        self._since_snapshot = 0
        self.log_bytes = 0
        self.check_space(force=True)

    # -- a full disk -------------------------------------------------------------------------

    def enter_read_only(self, exc: BaseException) -> bool:
        """A write or fsync of the log, or a snapshot, failed with ``exc``. For want of room
        (ENOSPC, EDQUOT): read-only (again), True. The records not yet durable are dropped
        (their events' effects were never carried out; their changes are in the machine, and
        ``recover``'s snapshot will hold them) and the file is cut back to its last durable
        record. Any other failure: False, and nothing is written any more (the server stops)."""
        if not no_space(exc):
            self.broken = str(exc)
            return False
        if not self.read_only:
            self.read_only = f"{getattr(exc, 'strerror', None) or exc} in {self.dir}"
            self.read_only_since = self._wall()
            self.read_only_entered += 1
        self.held += len(self._buf) + self._unsynced
        self._buf.clear()
        self._unsynced, self._urgent = 0, False
        if self._end != self._durable_end:
            try:  # a torn or unsynced tail: never acknowledged, and it frees what it took
                os.ftruncate(self._fd, self._durable_end)
                self._end = self._durable_end
            except OSError as cut:
                logger.warning("state log: cannot cut %s back to its last durable record: %s", self.dir, cut)
        return True

    def recover(self) -> int:
        """Leave read-only mode: a snapshot of the machine as it is (every held change in it),
        then a new log after it. Returns the changes it held; OSError if there is still no room
        (``enter_read_only`` says whether to wait on)."""
        self._snapshot()
        held, self.held = self.held, 0
        self.read_only, self.read_only_since = "", None
        return held

    def health(self, refused: int = 0) -> LogHealth:
        return LogHealth(self.read_only, self.read_only_since, self.held, self.read_only_entered, refused)

    def check_space(self, *, force: bool = False) -> None:
        """Refuse new nodes (``machine.refuse_joins``) while DIR's disk is nearly full.

        Cheap to call per event: it runs ``statvfs`` only after ``SPACE_CHECK_BYTES`` were
        written or ``SPACE_CHECK_SECONDS`` passed. The margin is ``min_free`` and at least two
        snapshots' worth, since compaction writes a new snapshot beside the old one.
        """
        mono = self._monotonic()
        if (
            not force
            and self._unchecked_bytes < SPACE_CHECK_BYTES
            and mono - self._space_checked < SPACE_CHECK_SECONDS
        ):
            return
        self._unchecked_bytes, self._space_checked = 0, mono
        try:
            st = os.statvfs(self.dir)
        except OSError as exc:
            logger.warning("cannot check the free space of %s: %s", self.dir, exc.strerror or exc)
            return
        free = st.f_bavail * st.f_frsize
        need = max(self.min_free, 2 * self.snapshot_bytes)
        if free < need:
            text = (
                f"the server's state disk is nearly full ({free / (1 << 20):.1f} MiB free in {self.dir}): "
                "no new nodes until space is freed"
            )
            if not self.machine.refuse_joins:
                logger.warning(
                    "%s (running jobs are still served; want %.0f MiB free)", text, need / (1 << 20)
                )
            self.machine.refuse_joins = text
        elif self.machine.refuse_joins:
            logger.info(
                "state disk: %.1f MiB free in %s again: new nodes are accepted", free / (1 << 20), self.dir
            )
            self.machine.refuse_joins = ""

    def close(self) -> None:
        """Write what is buffered (not while read-only: what it held is lost, never having
        been acknowledged) and release DIR. A write that fails here is logged, not raised."""
        try:
            self.sync()
        except OSError as exc:
            logger.warning(
                "state log: the last records could not be written at close: %s", exc.strerror or exc
            )
        self._close_files()

    def _close_files(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _load_snapshot(path: Path, machine: Rendezvous) -> tuple[int, float | None, float | None]:
    """Fill the machine from the snapshot; (its sequence number, its times); (0, None, None)."""
    if not os.path.lexists(path):  # a symlink is refused by read_file, not taken for no file
        return 0, None, None
    data = read_file(path)
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
        state_image.load(body["state"], machine)
        if body["seq"] != seq:
            raise StateLogError(f"{path}: header says record {seq}, body says {body['seq']}")
        return seq, float(body["t"]), float(body["w"])
    except (state_image.StateImageError, KeyError, TypeError, ValueError) as exc:
        raise StateLogError(f"{path}: {exc}") from None


def replay_log(
    path: Path, machine: Rendezvous, snap_seq: int
) -> tuple[int, int, int, tuple[float, float] | None]:
    """Replay the log after the snapshot: (last seq, records replayed, bytes dropped, last times).

    The log is read a record at a time: replaying a large log costs the memory of the state
    it rebuilds, not of the file.
    """
    if not os.path.lexists(path):  # a symlink is refused by open_read, not taken for no file
        replace_file(path, FILE_HEADER.pack(LOG_MAGIC, snap_seq), True)
        return snap_seq, 0, 0, None
    with open_read(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(FILE_HEADER.size)
        if len(head) < FILE_HEADER.size:
            # Torn while being created (compaction writes it whole, so only a first start).
            if snap_seq:
                raise StateLogError(f"{path} has no header but a snapshot exists")
            replace_file(path, FILE_HEADER.pack(LOG_MAGIC, snap_seq), True)
            return snap_seq, 0, 0, None
        magic, base = FILE_HEADER.unpack(head)
        if magic != LOG_MAGIC:
            raise StateLogError(f"{path} is not a rdzv-server state log")
        if base > snap_seq:
            raise StateLogError(f"{path} starts after record {base}, but the snapshot ends at {snap_seq}")
        reader = RecordReader(f, size, FILE_HEADER.size)
        seq, replayed, last = base, 0, None
        try:
            for payload in reader:
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
        except Damage as exc:
            raise StateLogError(f"{path}: {exc}; refusing to drop the records after it") from None
    dropped = size - reader.good_end
    if reader.torn:
        logger.warning(
            "state log: dropped a torn last record (%d bytes at offset %d, a crash mid-write)",
            dropped,
            reader.good_end,
        )
        os.truncate(path, reader.good_end)
    return max(seq, snap_seq), replayed, dropped, last
