"""The state log's bytes and files (``--state-dir``), apart from what the records mean
(``journal.py``): a file is a header (magic, the sequence number it starts after) and records,
each a length and a CRC32 over length and payload; ``scan`` finds the whole records of a buffer
and tells a torn tail (a crash mid-write: zeros or a cut record, truncated) from damage (a bad
record followed by whole ones: refused); the directory is private, locked, and nothing in it is
opened through a symlink; files are replaced atomically. The system calls that put bytes on the
disk go through a ``Disk`` (a test's fails them: a full disk, a failing one).

It imports nothing of the machine: the torn-tail and damage tests are byte tests of this file.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from protocol.records import record

LOCK_NAME = "lock"  # held (flock) by the one server using the directory
LOG_MAGIC = b"RDZVLOG1"
SNAP_MAGIC = b"RDZVSNP1"
FILE_HEADER = struct.Struct("!8sQ")  # magic, sequence number the file starts after
RECORD_HEADER = struct.Struct("!II")  # payload length, CRC32 of (length bytes + payload)
MAX_RECORD = 256 << 20  # a length above this is damage, not a record


class StateLogError(Exception):
    """The state dir cannot be used: damaged, from a newer server, or in use by another."""


# A write that failed for want of room (the file system full, or the user's quota), which the
# server waits out in read-only mode (``journal.py``, "A full disk"). Any other failure (EIO,
# EROFS...) stops it: the disk is failing, and what it holds past the last fsync is unknown.
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def no_space(exc: BaseException) -> bool:
    """Whether a failed write failed for want of room (ENOSPC, EDQUOT)."""
    return isinstance(exc, OSError) and exc.errno in NO_SPACE


class Disk:
    """The system calls that put the state log's bytes on disk. Tests give a subclass that
    fails them (ENOSPC, EIO) when told to; the server uses ``DISK``."""

    def write(self, fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def write_all(self, fd: int, data: bytes) -> int:
        """Write all of ``data``; returns the bytes written (all of them, or OSError)."""
        view = memoryview(data)
        while view:
            view = view[self.write(fd, view) :]
        return len(data)


DISK = Disk()


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


# --- files --------------------------------------------------------------------------------


# Files in the state dir are opened without following a symlink: a link planted there (by
# whoever could write the directory before it was checked) must not redirect our writes.
NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def private_dir(directory: Path) -> None:
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


def file_size(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return 0


def read_file(path: Path) -> bytes:
    with open_read(path) as f:
        return f.read()


def lock_dir(directory: Path) -> int:
    try:
        fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o600)
    except OSError as exc:
        raise StateLogError(f"cannot open {directory / LOCK_NAME}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StateLogError(f"state dir {directory} is in use by another rdzv-server") from None
    return fd


def replace_file(path: Path, data: bytes, fsync: bool, disk: Disk = DISK) -> None:
    """Write a file whole or not at all: tmp, fsync, rename, fsync the directory. A tmp file
    that could not be written whole is removed, giving back the space it took (the failure
    is usually a full disk)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        os.unlink(tmp)  # a leftover of a crash, or something planted: never written through
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600)
    try:
        try:
            disk.write_all(fd, data)
            if fsync:
                disk.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.replace(tmp, path)
    if fsync:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            disk.fsync(dfd)
        finally:
            os.close(dfd)


class Damage(Exception):
    """A bad record followed by more data: damage, not a torn write."""


class RecordReader:
    """The record payloads of an open log file, one at a time (``scan``'s rules, streamed).

    After iteration: ``good_end`` is the offset just past the last good record, and ``torn``
    says the bytes after it are a torn last record (to be dropped). Raises Damage.
    """

    def __init__(self, f: Any, size: int, start: int) -> None:
        self._f, self._size = f, size
        self.good_end = start
        self.torn = False

    def __iter__(self) -> Iterator[bytes]:
        f, size = self._f, self._size
        pos = self.good_end
        while pos < size:
            head = f.read(RECORD_HEADER.size)
            if len(head) < RECORD_HEADER.size:
                self.torn = True
                return
            length, crc = RECORD_HEADER.unpack(head)
            body = pos + RECORD_HEADER.size
            if length == 0 or length > MAX_RECORD:
                if self._rest_is_filler(pos):
                    self.torn = True
                    return
                raise Damage(f"bad record length {length} at offset {pos}")
            if size - body < length:
                self.torn = True  # runs past the end of the file
                return
            payload = f.read(length)
            if len(payload) < length:  # the file shrank under us
                self.torn = True
                return
            if zlib.crc32(payload, zlib.crc32(head[:4])) != crc:
                if body + length == size or self._rest_is_filler(body + length):
                    self.torn = True
                    return
                raise Damage(f"record at offset {pos} fails its checksum and more records follow")
            pos = body + length
            self.good_end = pos
            yield payload

    def _rest_is_filler(self, pos: int) -> bool:
        """Whether everything from ``pos`` to the end is zeros (read in chunks)."""
        self._f.seek(pos)
        while chunk := self._f.read(1 << 20):
            if chunk.count(0) != len(chunk):
                return False
        return True


def open_read(path: Path) -> Any:
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW)
    except OSError as exc:
        why = "it is a symlink" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
        raise StateLogError(f"cannot read {path}: {why}") from None
    return os.fdopen(fd, "rb", buffering=1 << 20)
