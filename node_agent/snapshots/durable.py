"""The snapshot directory (``--snapshot-dir``, issue 35): the newest consistent snapshot, on disk.

    <dir>/<job>/w<world>/r<rank>/<step:020d>.snap        complete: fsynced, then renamed into place
    <dir>/<job>/w<world>/r<rank>/<step:020d>.snap.part   being written

- **Which step.** The one the server keeps (``KeepSnapshot.step``: every rank has it, on two
  nodes in a job of several): one step for the whole job, so every node persists the same
  steps. Each node writes its own ranks' files, in a thread, one step at a time, paced at the
  replication's rate, skipping to the newest kept step when it falls behind.
- **Complete.** A step is complete when every rank ``0..world-1`` has its file. In a directory
  the nodes share (as they share a checkpoint directory) every node sees them all; a directory
  local to each node is complete only in a job of one node.
- **Pruned.** A rank's folder keeps its newest two steps and the newest complete one (never
  removed before a newer one is complete). A node that lags persists the newest kept step
  next, skipping the others, and the nodes ahead still have that one among their newest two.
- **Offered.** Each Join names the newest complete steps of the world size with the newest
  complete step (``Join.durable_world/durable_steps``); a round that finds nothing newer in
  memory restores from the newest step every member offers (``Assignment.restore_durable``).
- **Read back.** Before that round's workers start, each local rank's file is copied into the
  in-memory holdings, from where the workers restore as from any snapshot.

Plain file operations, no asyncio (the agent runs them in a thread). Names are matched
exactly, files are opened without following symlinks, folders are made private (0700), and a
scan reads at most ``MAX_WORLDS`` world folders and ``MAX_SCAN_RANKS`` rank folders.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from protocol.messages import MAX_DURABLE_STEPS

from .holdings import Holdings, snap_name

__all__ = ["DurableDir", "Offer", "job_folder"]

MAX_WORLDS = 16  # world-size folders one scan looks at
MAX_SCAN_RANKS = 65536  # a world larger than this is never offered (a scan lists every rank)
MAX_FILES = 64  # names one rank folder may hold before the rest are ignored
CHUNK = 8 << 20

_WORLD = re.compile(r"w([1-9][0-9]{0,9})")
_SNAP = re.compile(r"([0-9]{20})\.snap")
_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class Offer:
    """What a Join offers: the world size and its newest complete steps, newest first."""

    world: int = -1
    steps: tuple[int, ...] = ()


def job_folder(job_id: str) -> str:
    """The job's folder name: its id when that is a plain name, else a digest of it."""
    if _SAFE_ID.fullmatch(job_id) and job_id not in (".", ".."):
        return job_id
    return "job-" + hashlib.sha256(job_id.encode()).hexdigest()[:24]


def _folders(path: Path) -> list[os.DirEntry[str]]:
    """The real folders in ``path`` (no symlinks); none when it is missing."""
    try:
        with os.scandir(path) as it:
            return [e for e in it if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _steps(folder: Path) -> list[int]:
    """The complete snapshots' steps in a rank folder (regular files only), at most MAX_FILES names."""
    out = []
    try:
        with os.scandir(folder) as it:
            for i, e in enumerate(it):
                if i >= MAX_FILES:
                    break
                m = _SNAP.fullmatch(e.name)
                if m and e.is_file(follow_symlinks=False):
                    out.append(int(m.group(1)))
    except (FileNotFoundError, NotADirectoryError):
        pass
    return out


def _makedirs(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{path} is not a directory")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy(src_fd: int, dst_fd: int, rate: float | None) -> int:
    """Copy ``src_fd`` to ``dst_fd`` whole; at most ``rate`` bytes a second when given."""
    done, started = 0, time.monotonic()
    while True:
        chunk = os.read(src_fd, CHUNK)
        if not chunk:
            return done
        view = memoryview(chunk)
        while view:
            view = view[os.write(dst_fd, view) :]
        done += len(chunk)
        if rate:
            ahead = done / rate - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)


class DurableDir:
    """One job's folder in the snapshot directory."""

    def __init__(self, root: str | Path, job_id: str, *, rate: float | None = None) -> None:
        self.root = Path(root)
        self.job = self.root / job_folder(job_id)
        self.rate = rate

    def rank_dir(self, world: int, rank: int) -> Path:
        return self.job / f"w{world}" / f"r{rank}"

    # -- offering --------------------------------------------------------------------------

    def complete_steps(self, world: int) -> list[int]:
        """The steps every rank of a ``world``-rank job has, newest first."""
        if not 1 <= world <= MAX_SCAN_RANKS:
            return []
        common: set[int] | None = None
        for rank in range(world):
            have = set(_steps(self.rank_dir(world, rank)))
            common = have if common is None else common & have
            if not common:
                return []
        return sorted(common or (), reverse=True)

    def offer(self) -> Offer:
        """The world size whose newest complete step is the newest, with its newest steps."""
        worlds = []
        for e in _folders(self.job):
            m = _WORLD.fullmatch(e.name)
            if m:
                worlds.append(int(m.group(1)))
        best = Offer()
        for world in sorted(worlds)[:MAX_WORLDS]:
            steps = self.complete_steps(world)
            if steps and (not best.steps or steps[0] > best.steps[0]):
                best = Offer(world, tuple(steps[:MAX_DURABLE_STEPS]))
        return best

    # -- persisting ------------------------------------------------------------------------

    def persist(self, world: int, rank: int, step: int, src_fd: int) -> int:
        """Copy ``src_fd`` (an open, complete in-memory snapshot: opened before a newer step
        may unpin it) into place as ``rank``'s file of ``step``: written to a ``.part``,
        fsynced, renamed, the folder fsynced. Its size."""
        folder = self.rank_dir(world, rank)
        _makedirs(folder)
        final = folder / snap_name(step)
        part = folder / (snap_name(step) + ".part")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part)  # an earlier attempt's
        dst_fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.lseek(src_fd, 0, os.SEEK_SET)
            size = _copy(src_fd, dst_fd, self.rate)
            os.fsync(dst_fd)
        except BaseException:
            os.close(dst_fd)
            with contextlib.suppress(OSError):
                os.unlink(part)
            raise
        os.close(dst_fd)
        os.rename(part, final)
        _fsync_dir(folder)
        return size

    def prune(self, world: int, ranks: range) -> None:
        """Each of ``ranks``' folders keeps its newest two steps and the newest complete one
        (a node that lags persists the newest kept step next, which the others still have)."""
        complete = self.complete_steps(world)
        for rank in ranks:
            folder = self.rank_dir(world, rank)
            steps = sorted(_steps(folder), reverse=True)
            keep = set(steps[:2]) | ({complete[0]} if complete else set())
            for s in steps:
                if s not in keep:
                    with contextlib.suppress(OSError):
                        os.unlink(folder / snap_name(s))

    def forget(self) -> None:
        """The job finished: its folder goes (a later job of the same id starts afresh)."""
        import shutil

        with contextlib.suppress(OSError):
            if stat.S_ISDIR(os.lstat(self.job).st_mode):
                shutil.rmtree(self.job)

    # -- reading back ----------------------------------------------------------------------

    def read_into(self, holdings: Holdings, world: int, rank: int, step: int) -> int:
        """Copy ``rank``'s file of ``step`` into the in-memory holdings. Its size."""
        path = self.rank_dir(world, rank) / snap_name(step)
        src_fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(src_fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(f"{path} is not a regular file")
            part = holdings.admit(rank, step, st.st_size)
            try:
                dst_fd = os.open(
                    part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
                )
                try:
                    size = _copy(src_fd, dst_fd, None)  # the training waits for it: no pacing
                finally:
                    os.close(dst_fd)
                if size != st.st_size:
                    raise OSError(f"{path} changed while it was read ({st.st_size} -> {size} bytes)")
            except BaseException:
                holdings.abandon(rank, step)
                raise
            holdings.complete(rank, step, part)
            return size
        finally:
            os.close(src_fd)
