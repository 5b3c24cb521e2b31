"""What this node holds: the in-memory snapshots under ``<runtime dir>/snapshots/``.

    <root>/r<rank>/<step:020d>.snap        complete; made only by an atomic rename, never changed
    <root>/r<rank>/<step:020d>.snap.part   being written (by a worker, or by our receiver)
    <root>/r<rank>/.pin                    the steps the agent wants kept, decimals (atomic write)

The layout is a contract with the workers (they write and prune their own rank's folder) and
with the peers' agents (which push replicas of their ranks here). This module is plain file
operations, no asyncio: the agent calls it between events and the replica server calls it per
connection. Only names that match the layout exactly are ever counted or removed; nothing here
follows a symlink, so a link planted in the folder cannot point a removal elsewhere.

Bounds: a scan looks at most at ``MAX_RANK_DIRS`` rank folders and ``MAX_FILES`` entries of each.
A worker keeps at most three complete files and one ``.part``; more than 64 names means something
is wrong, and the agent, which scans after every snapshot event, must not pay for it unbounded.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from ..runtime_dir import remove_tree

__all__ = [
    "MAX_FILES",
    "MAX_RANK",
    "MAX_RANK_DIRS",
    "MAX_STEP",
    "Busy",
    "Holdings",
    "HoldingsError",
    "NoRoom",
    "file_sha256",
    "hash_fd",
    "part_name",
    "snap_name",
    "write_all",
]

MAX_RANK = 2**31  # ranks are below it (torch's ranks are 32-bit ints)
MAX_STEP = 2**63  # steps are below it: 19 digits, so %020d always has exactly 20
MAX_RANK_DIRS = 4096
MAX_FILES = 64
PIN = ".pin"

_RANK_DIR = re.compile(r"r(0|[1-9][0-9]{0,9})")
_SNAP = re.compile(r"([0-9]{20})\.snap")
_PART = re.compile(r"([0-9]{20})\.snap\.part")


class HoldingsError(Exception):
    """A snapshot cannot be taken in here (say why)."""


class NoRoom(HoldingsError):
    """The file is over the per-file limit, or would take the node over its memory bound."""


class Busy(HoldingsError):
    """This rank's snapshot at this step is already being received."""


def snap_name(step: int) -> str:
    return f"{step:020d}.snap"


def part_name(step: int) -> str:
    return f"{step:020d}.snap.part"


def _check(rank: int, step: int | None = None) -> None:
    """Ranks and steps come from our own code (the server validates the wire): a bad one is ours."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < MAX_RANK:
        raise ValueError(f"rank {rank!r} is not in [0, 2**31)")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < MAX_STEP):
        raise ValueError(f"step {step!r} is not in [0, 2**63)")


def _number(pattern: re.Pattern[str], name: str, below: int) -> int | None:
    m = pattern.fullmatch(name)
    if m is None:
        return None
    value = int(m.group(1))
    return value if value < below else None


@dataclass
class _Reserved:
    """A ``.part`` our receiver is writing: counted at its announced size from the start, so two
    pushes at once cannot both be admitted into the same free memory."""

    path: Path
    size: int


class Holdings:
    """The snapshots this node holds; see the module's header."""

    def __init__(self, root: str | Path, *, memory: int, file_limit: int) -> None:
        if memory < 0 or file_limit < 0:
            raise ValueError("memory and file_limit are byte counts, >= 0")
        self.root = Path(root)
        self.memory = memory
        self.file_limit = file_limit
        self.pinned: frozenset[int] = frozenset()
        self._reserved: dict[tuple[int, int], _Reserved] = {}
        os.makedirs(self.root, 0o700, exist_ok=True)

    # -- the layout --------------------------------------------------------------------------

    def rank_dir(self, rank: int) -> Path:
        """``<root>/r<rank>``, made (0700) when missing; a new one gets the current pin."""
        _check(rank)
        path = self.root / f"r{rank}"
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            if self._is_dir(path):
                return path
            os.unlink(path)  # a link or a file in its place: never written through
            os.mkdir(path, 0o700)
        if self.pinned:
            self._write_pin(path, self.pinned)
        return path

    @staticmethod
    def _is_dir(path: Path) -> bool:
        try:
            return stat.S_ISDIR(os.lstat(path).st_mode)
        except OSError:
            return False

    def _rank_dirs(self) -> list[tuple[int, Path]]:
        found: list[tuple[int, Path]] = []
        try:
            with os.scandir(self.root) as it:
                for n, entry in enumerate(it):
                    if n >= MAX_RANK_DIRS * 2:  # odd names count too: the scan itself is bounded
                        break
                    rank = _number(_RANK_DIR, entry.name, MAX_RANK)
                    if rank is None or not entry.is_dir(follow_symlinks=False):
                        continue
                    found.append((rank, Path(entry.path)))
                    if len(found) >= MAX_RANK_DIRS:
                        break
        except OSError:
            pass
        return found

    def _entries(self, folder: Path) -> list[os.DirEntry[str]]:
        out: list[os.DirEntry[str]] = []
        try:
            with os.scandir(folder) as it:
                for entry in it:
                    out.append(entry)
                    if len(out) >= MAX_FILES:
                        break
        except OSError:
            pass
        return out

    def _steps(self, folder: Path) -> list[int]:
        """Complete steps in ``folder`` (regular files only), newest first."""
        steps = [
            step
            for entry in self._entries(folder)
            if (step := _number(_SNAP, entry.name, MAX_STEP)) is not None
            and entry.is_file(follow_symlinks=False)
        ]
        return sorted(steps, reverse=True)

    # -- what is held ------------------------------------------------------------------------

    def inventory(self) -> dict[int, tuple[int, ...]]:
        """rank -> the complete steps held, newest first (ranks with none left out)."""
        held: dict[int, tuple[int, ...]] = {}
        for rank, folder in self._rank_dirs():
            steps = self._steps(folder)
            if steps:
                held[rank] = tuple(steps)
        return dict(sorted(held.items()))

    def path(self, rank: int, step: int) -> Path | None:
        """The complete snapshot of ``rank`` at ``step``, when held as a regular file."""
        _check(rank, step)
        folder = self.root / f"r{rank}"
        if not self._is_dir(folder):
            return None
        path = folder / snap_name(step)
        try:
            st = os.lstat(path)
        except OSError:
            return None
        return path if stat.S_ISREG(st.st_mode) else None

    def used_bytes(self) -> int:
        """Bytes under the root, per file ``max(st_size, st_blocks * 512)``: tmpfs charges whole
        pages (st_blocks), and a file made sparse by ``ftruncate`` before its writes will grow to
        st_size. Our receiver's parts count at their announced size instead (see ``_Reserved``)."""
        mine = {r.path for r in self._reserved.values()}
        total = sum(r.size for r in self._reserved.values())
        for _, folder in self._rank_dirs():
            for entry in self._entries(folder):
                if Path(entry.path) in mine:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    total += max(st.st_size, st.st_blocks * 512)
        return total

    def room_for(self, size: int) -> bool:
        return 0 <= size <= self.file_limit and self.used_bytes() + size <= self.memory

    # -- keeping and dropping ----------------------------------------------------------------

    @staticmethod
    def _write_pin(folder: Path, steps: frozenset[int]) -> None:
        tmp = folder / f"{PIN}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, " ".join(map(str, sorted(steps))).encode())
            finally:
                os.close(fd)
            os.rename(tmp, folder / PIN)  # a worker reading .pin sees the old step or the new one
        except OSError:
            pass  # the folder went away (cleared): nothing there to keep

    def pin(self, *steps: int) -> None:
        """Keep ``steps`` (negative ones: none) in every rank's folder, present and future, in
        place of those pinned before: the step kept on two nodes and the one being copied."""
        for step in steps:
            if step >= 0:
                _check(0, step)
        self.pinned = frozenset(s for s in steps if s >= 0)
        for _, folder in self._rank_dirs():
            self._write_pin(folder, self.pinned)

    def prune(self, keep: int = 2, *, rank: int | None = None) -> list[Path]:
        """Remove complete files but each rank's newest ``keep`` and the pinned step; returns
        what was removed. A worker pruning its folder at the same time is harmless."""
        removed: list[Path] = []
        folders = self._rank_dirs() if rank is None else [(rank, self.root / f"r{rank}")]
        for _, folder in folders:
            for step in self._steps(folder)[keep:]:
                if step in self.pinned:
                    continue
                path = folder / snap_name(step)
                try:
                    os.unlink(path)
                except OSError:
                    continue
                removed.append(path)
        return removed

    def drop_partials(self) -> list[Path]:
        """Remove the ``.part`` files no writer will finish (no worker runs now); the parts our
        receiver is writing stay."""
        mine = {r.path for r in self._reserved.values()}
        removed: list[Path] = []
        for _, folder in self._rank_dirs():
            for entry in self._entries(folder):
                path = Path(entry.path)
                if _number(_PART, entry.name, MAX_STEP) is None or path in mine:
                    continue
                try:
                    os.unlink(path)  # unlink never follows: a link named *.part goes, not its target
                except OSError:
                    continue
                removed.append(path)
        return removed

    def clear(self) -> None:
        """Remove everything under the root (the world size changed: no old snapshot can be
        restored). Links and odd files are unlinked, never followed; the pin is forgotten."""
        self.pinned = frozenset()
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            return
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    remove_tree(entry.path)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass

    # -- the receiver ------------------------------------------------------------------------

    def admit(self, rank: int, step: int, size: int) -> Path:
        """The ``.part`` path to receive ``rank``'s snapshot of ``step`` into, its ``size`` bytes
        counted as used until :meth:`complete` or :meth:`abandon`."""
        _check(rank, step)
        if (rank, step) in self._reserved:
            raise Busy(f"rank {rank} step {step} is already being received")
        if not 0 <= size <= self.file_limit:
            raise NoRoom(f"{size} bytes is over the per-file limit of {self.file_limit}")
        if not self.room_for(size):
            raise NoRoom(f"no room for {size} bytes: {self.used_bytes()} of {self.memory} used")
        part = self.rank_dir(rank) / part_name(step)
        self._reserved[(rank, step)] = _Reserved(part, size)
        return part

    def complete(self, rank: int, step: int, part_path: Path) -> Path:
        """The received file is whole and checked: rename it into place and prune its rank."""
        self._reserved.pop((rank, step), None)
        final = self.root / f"r{rank}" / snap_name(step)
        try:
            os.rename(part_path, final)
        except OSError:  # the folder was cleared meanwhile: leave no part behind
            try:
                os.unlink(part_path)
            except OSError:
                pass
            raise
        self.prune(rank=rank)
        return final

    def abandon(self, rank: int, step: int) -> None:
        """The receive failed: remove its ``.part`` and give its room back."""
        reserved = self._reserved.pop((rank, step), None)
        if reserved is not None:
            try:
                os.unlink(reserved.path)
            except OSError:
                pass


# -- the files' bytes (the replica channel's server and client) -------------------------------


def hash_fd(fd: int, size: int, chunk: int) -> str:
    """sha256 of the first ``size`` bytes of ``fd`` (in a thread: a large file takes seconds).
    Closes ``fd``: the caller hands over a dup, so a cancelled caller never closes it under us."""
    import hashlib  # here: a node that only holds snapshots never initialises OpenSSL

    try:
        digest = hashlib.sha256()
        offset = 0
        while offset < size:
            data = os.pread(fd, min(chunk, size - offset), offset)
            if not data:
                raise OSError(f"the file ended {size - offset} bytes short")
            digest.update(data)
            offset += len(data)
        return digest.hexdigest()
    finally:
        os.close(fd)


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """sha256 of a held file, read ``chunk`` bytes at a time (never whole; no symlink followed).
    Blocking: call it in a thread from an event loop. Raises OSError."""
    import hashlib

    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        digest = hashlib.sha256()
        while data := os.read(fd, chunk):
            digest.update(data)
        return digest.hexdigest()
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """``data`` into ``fd`` whole (a write may take less)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
