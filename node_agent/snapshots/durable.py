"""The snapshot directory (``--snapshot-dir``, issue 35): the newest consistent snapshot, on disk.

    <dir>/<job>/command.json                             the command line the job's snapshots are of
    <dir>/<job>/w<world>/r<rank>/<step:020d>.snap        complete: fsynced, then renamed into place
    <dir>/<job>/w<world>/r<rank>/<step:020d>.snap.part   being written

- **Whose.** ``<job>`` is the ``--rdzv-id`` (:func:`job_folder`), or for ``--standalone``
  (whose id is new at every launch) ``standalone-<digest of the command line>``
  (:func:`standalone_job`): two scripts, or one script with other arguments, never share a
  folder. ``command.json`` records the command line (:func:`command_of`); a folder that
  records another one (the same ``--rdzv-id`` reused for another script or arguments) is
  refused whole: neither read nor written (:meth:`DurableDir.claim`).
- **Trusted.** ``<dir>`` is refused when every user can write it (:func:`refuse_root`, checked
  when the flag is parsed and again at each use); below it every folder and file the agent
  makes or reads must be ours (our uid) and writable by nobody else, and is never a symlink:
  one that is not is skipped, said once (``warn``), and never restored. The agent makes its
  folders 0700 one level at a time (whatever the umask) and walks them by descriptor
  (``O_NOFOLLOW`` at every level), so a link planted anywhere below ``<dir>`` is not followed.
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
exactly, and a scan reads at most ``MAX_WORLDS`` world folders and ``MAX_SCAN_RANKS`` rank
folders.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shlex
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.messages import MAX_DURABLE_STEPS

from .holdings import Holdings, snap_name

if TYPE_CHECKING:
    from ..config import AgentConfig

__all__ = [
    "COMMAND_FILE",
    "DurableDir",
    "Offer",
    "Refused",
    "command_of",
    "job_folder",
    "refuse_root",
    "standalone_job",
]

MAX_WORLDS = 16  # world-size folders one scan looks at
MAX_SCAN_RANKS = 65536  # a world larger than this is never offered (a scan lists every rank)
MAX_FILES = 64  # names one rank folder may hold before the rest are ignored
MAX_COMMAND_BYTES = 1 << 20  # a command record longer than this is not one of ours
CHUNK = 8 << 20
COMMAND_FILE = "command.json"

_WORLD = re.compile(r"w([1-9][0-9]{0,9})")
_SNAP = re.compile(r"([0-9]{20})\.snap")
_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Folders are opened one level at a time, never through a symlink.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH

log_ = logging.getLogger(__name__)


class Refused(OSError):
    """The directory, or a folder or file in it, is not to be trusted (another user could have
    planted or changed it), or the job's folder is another command line's. Say why."""


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


def command_of(config: AgentConfig) -> tuple[str, ...]:
    """What identifies the job's work: the entrypoint (a script by its absolute path, ``-m``
    and a module, or ``--no-python`` and a command) and its arguments."""
    script = config.training_script
    if config.module:
        head: tuple[str, ...] = ("-m", script)
    elif config.no_python and os.sep not in script:
        head = ("--no-python", script)  # a command found on PATH
    else:
        path = os.path.abspath(script)
        head = ("--no-python", path) if config.no_python else (path,)
    return (*head, *config.training_script_args)


def standalone_job(command: Sequence[str]) -> str:
    """A ``--standalone`` job's folder name: its id is new at every launch, so its relaunch
    finds its folder by its command line, and another command line never does."""
    digest = hashlib.sha256(json.dumps(list(command)).encode()).hexdigest()[:16]
    return f"standalone-{digest}"


def refuse_root(path: str | Path) -> str:
    """Why ``path`` may not be the snapshot directory ("": it may; a missing one too, which the
    agent makes 0700). As ``--state-dir`` (rdzv_server/wal.py ``private_dir``), a directory
    every user may write is refused, the sticky ``/tmp`` included (anyone could make the job's
    folder first), and so is a symlink. A directory writable by the group, or another user's,
    is not: each folder below it must be ours and private, or it is not read."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink: give the directory itself"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_mode & stat.S_IWOTH:
        return _everyone(st.st_mode)
    return ""


def _everyone(mode: int) -> str:
    return (
        f"is writable by every user (mode {stat.S_IMODE(mode):o}): anyone could plant snapshots "
        "there for the job to restore; give a folder of yours (the agent makes a missing one "
        "0700) or chmod o-w it"
    )


def _check(st: os.stat_result, what: str) -> None:
    """A folder or file below the directory: ours, and writable by nobody else."""
    if st.st_uid != os.geteuid():
        raise Refused(f"{what} belongs to uid {st.st_uid}, not to this agent's ({os.geteuid()})")
    if st.st_mode & _OTHERS_WRITE:
        raise Refused(f"{what} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})")


def _open_dir(name: str, parent: int, what: str, *, create: bool = False) -> int:
    """Open the folder ``name`` in ``parent`` (a descriptor), not through a symlink, checked;
    made 0700 first when ``create`` and missing (chmod'ed: the umask has no say)."""
    made = False
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
            made = True
        except FileExistsError:
            pass
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise Refused(f"{what} is not a folder (a symlink or a file)") from None
        raise
    try:
        if made:
            os.fchmod(fd, 0o700)
        _check(os.fstat(fd), what)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _closing(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def _make_root(root: Path) -> None:
    """Make the missing levels of ``root``, each 0700 whatever the umask."""
    missing = []
    path = root
    while not os.path.lexists(path) and path.parent != path:
        missing.append(path)
        path = path.parent
    for level in reversed(missing):
        try:
            os.mkdir(level, 0o700)
        except FileExistsError:
            continue
        with _closing(os.open(level, _DIR_FLAGS)) as fd:
            os.fchmod(fd, 0o700)


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


def _shown(command: Sequence[str]) -> str:
    """A command line for the console: quoted, control characters escaped, at most 300."""
    from ..agent_log import shown

    return shown(shlex.join(command), limit=300)


class DurableDir:
    """One job's folder in the snapshot directory.

    ``command``: the job's command line (:func:`command_of`), recorded in the folder and
    compared at :meth:`claim`. ``warn``: says (once each) a folder or file below the directory
    that is skipped because it is not to be trusted (by default a ``logging`` warning)."""

    def __init__(
        self,
        root: str | Path,
        job_id: str,
        *,
        rate: float | None = None,
        command: Sequence[str] = (),
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.root = Path(root)
        self.name = job_folder(job_id)
        self.job = self.root / self.name
        self.rate = rate
        self.command = tuple(command)
        self.record = {"job": job_id, "command": list(self.command)}
        self._warn = warn
        self._said: set[str] = set()
        self._claimed = False

    def rank_dir(self, world: int, rank: int) -> Path:
        return self.job / f"w{world}" / f"r{rank}"

    def _skipped(self, exc: Refused) -> None:
        text = f"--snapshot-dir: {exc}: not read, nothing restored from it"
        if text in self._said:
            return
        self._said.add(text)
        if self._warn is not None:
            self._warn(text)
        else:
            log_.warning("%s", text)

    # -- the folders -----------------------------------------------------------------------

    def _open_root(self, *, create: bool) -> int:
        """The directory, opened (not through a symlink) and checked as :func:`refuse_root`."""
        if create:
            _make_root(self.root)
        try:
            fd = os.open(self.root, _DIR_FLAGS)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(self.root):
                raise Refused(f"{self.root} is a symlink: give the directory itself") from None
            raise
        try:
            mode = os.fstat(fd).st_mode
            if mode & stat.S_IWOTH:
                raise Refused(f"{self.root} {_everyone(mode)}")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_job(self, *, create: bool) -> int:
        """The job's folder, checked, its record compared (and written when ``create`` and new)
        at the first use. FileNotFoundError: nothing there yet."""
        with _closing(self._open_root(create=create)) as root:
            fd = _open_dir(self.name, root, str(self.job), create=create)
        try:
            if not self._claimed:
                self._claimed = self._compare(fd, create=create)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _compare(self, job: int, *, create: bool) -> bool:
        """The job folder's record is this job's command line; a new folder's is written
        (when ``create``). Whether a record is there now."""
        try:
            src = os.open(COMMAND_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=job)
        except FileNotFoundError:
            if any(_WORLD.fullmatch(e.name) for e in _entries(job)):
                raise Refused(
                    f"{self.job} holds snapshots but no record of the command line they are of "
                    f"({COMMAND_FILE}): this job's ({_shown(self.command)}) may be another's"
                ) from None
            if create:
                self._write_record(job)
            return create
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise Refused(f"{self.job / COMMAND_FILE} is a symlink") from None
            raise
        with _closing(src):
            st = os.fstat(src)
            if not stat.S_ISREG(st.st_mode):
                raise Refused(f"{self.job / COMMAND_FILE} is not a regular file")
            _check(st, str(self.job / COMMAND_FILE))
            data = os.read(src, MAX_COMMAND_BYTES + 1)
        try:
            found = json.loads(data) if len(data) <= MAX_COMMAND_BYTES else None
        except ValueError:
            found = None
        if found == self.record:
            return True
        was = found.get("command") if isinstance(found, dict) else None
        if isinstance(was, list) and all(isinstance(a, str) for a in was) and was != list(self.command):
            raise Refused(
                f"{self.job} holds the snapshots of another command line ({_shown(was)}), "
                f"not this job's ({_shown(self.command)})"
            )
        raise Refused(f"{self.job / COMMAND_FILE} is not this job's record of its command line")

    def _write_record(self, job: int) -> None:
        """``command.json``, atomically: a private new file (no link followed), renamed."""
        part = f".{COMMAND_FILE}.{os.getpid()}.{secrets.token_hex(4)}.part"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(part, flags, 0o600, dir_fd=job)
        try:
            try:
                os.write(fd, json.dumps(self.record).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(part, COMMAND_FILE, src_dir_fd=job, dst_dir_fd=job)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(part, dir_fd=job)
            raise
        os.fsync(job)

    def claim(self) -> None:
        """At start: make the directory (each missing level 0700) and the job's folder, check
        them, and record this job's command line there, or compare it with the one recorded.
        Refused: the directory is not to be trusted, or the folder is another command line's
        (then it is neither read nor written); other OSErrors: it cannot be used now."""
        os.close(self._open_job(create=True))

    def _rank(self, job: int, world: int, rank: int, *, create: bool = False) -> int:
        """``rank``'s folder of the ``world``-rank job, checked (Refused: not to be trusted)."""
        with _closing(_open_dir(f"w{world}", job, str(self.job / f"w{world}"), create=create)) as w:
            return _open_dir(f"r{rank}", w, str(self.rank_dir(world, rank)), create=create)

    def _steps(self, folder: int, where: Path) -> list[int]:
        """The complete snapshots' steps in a rank folder: regular files of ours that nobody else
        can write (the others are said, once), at most MAX_FILES names."""
        found = []
        with os.scandir(folder) as it:
            for i, e in enumerate(it):
                if i >= MAX_FILES:
                    break
                m = _SNAP.fullmatch(e.name)
                if m:
                    found.append((int(m.group(1)), e))
        out = []
        for step, e in found:
            try:
                st = e.stat(follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    raise Refused(f"{where / e.name} is not a regular file")
                _check(st, str(where / e.name))
            except FileNotFoundError:
                continue
            except Refused as exc:
                self._skipped(exc)
                continue
            out.append(step)
        return out

    # -- offering --------------------------------------------------------------------------

    def complete_steps(self, world: int) -> list[int]:
        """The steps every rank of a ``world``-rank job has, newest first."""
        try:
            with _closing(self._open_job(create=False)) as job:
                return self._complete(job, world)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _complete(self, job: int, world: int) -> list[int]:
        if not 1 <= world <= MAX_SCAN_RANKS:
            return []
        common: set[int] | None = None
        for rank in range(world):
            try:
                with _closing(self._rank(job, world, rank)) as folder:
                    have = set(self._steps(folder, self.rank_dir(world, rank)))
            except FileNotFoundError:
                return []
            except Refused as exc:
                self._skipped(exc)
                return []
            common = have if common is None else common & have
            if not common:
                return []
        return sorted(common or (), reverse=True)

    def offer(self) -> Offer:
        """The world size whose newest complete step is the newest, with its newest steps."""
        try:
            job = self._open_job(create=False)
        except (FileNotFoundError, NotADirectoryError):
            return Offer()
        with _closing(job):
            worlds = []
            for e in _entries(job):
                m = _WORLD.fullmatch(e.name)
                if m:  # a link or a file of that name is said (once) and skipped
                    worlds.append(int(m.group(1)))
            best = Offer()
            for world in sorted(worlds)[:MAX_WORLDS]:
                steps = self._complete(job, world)
                if steps and (not best.steps or steps[0] > best.steps[0]):
                    best = Offer(world, tuple(steps[:MAX_DURABLE_STEPS]))
        return best

    # -- persisting ------------------------------------------------------------------------

    def persist(self, world: int, rank: int, step: int, src_fd: int) -> int:
        """Copy ``src_fd`` (an open, complete in-memory snapshot: opened before a newer step
        may unpin it) into place as ``rank``'s file of ``step``: written to a ``.part``,
        fsynced, renamed, the folder fsynced. Its size."""
        with (
            _closing(self._open_job(create=True)) as job,
            _closing(self._rank(job, world, rank, create=True)) as folder,
        ):
            final, part = snap_name(step), snap_name(step) + ".part"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part, dir_fd=folder)  # an earlier attempt's (a link is removed, not followed)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            dst_fd = os.open(part, flags, 0o600, dir_fd=folder)
            try:
                os.lseek(src_fd, 0, os.SEEK_SET)
                size = _copy(src_fd, dst_fd, self.rate)
                os.fsync(dst_fd)
            except BaseException:
                os.close(dst_fd)
                with contextlib.suppress(OSError):
                    os.unlink(part, dir_fd=folder)
                raise
            os.close(dst_fd)
            os.rename(part, final, src_dir_fd=folder, dst_dir_fd=folder)
            os.fsync(folder)
        return size

    def prune(self, world: int, ranks: range) -> None:
        """Each of ``ranks``' folders keeps its newest two steps and the newest complete one
        (a node that lags persists the newest kept step next, which the others still have)."""
        try:
            job = self._open_job(create=False)
        except (FileNotFoundError, NotADirectoryError):
            return
        with _closing(job):
            complete = self._complete(job, world)
            for rank in ranks:
                try:
                    folder = self._rank(job, world, rank)
                except FileNotFoundError:
                    continue
                except Refused as exc:
                    self._skipped(exc)
                    continue
                with _closing(folder):
                    steps = sorted(self._steps(folder, self.rank_dir(world, rank)), reverse=True)
                    keep = set(steps[:2]) | ({complete[0]} if complete else set())
                    for s in steps:
                        if s not in keep:
                            with contextlib.suppress(OSError):
                                os.unlink(snap_name(s), dir_fd=folder)

    def forget(self) -> None:
        """The job finished: its folder goes (a later job of the same id starts afresh). Only
        a folder of ours whose record is this job's."""
        import shutil

        with contextlib.suppress(OSError):
            os.close(self._open_job(create=False))
            with _closing(self._open_root(create=False)) as root:
                shutil.rmtree(self.name, dir_fd=root)

    # -- reading back ----------------------------------------------------------------------

    def read_into(self, holdings: Holdings, world: int, rank: int, step: int) -> int:
        """Copy ``rank``'s file of ``step`` into the in-memory holdings. Its size. Refused: the
        file, or a folder above it, is not to be trusted."""
        path = self.rank_dir(world, rank) / snap_name(step)
        with _closing(self._open_job(create=False)) as job, _closing(self._rank(job, world, rank)) as folder:
            src_fd = os.open(snap_name(step), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
        try:
            st = os.fstat(src_fd)
            if not stat.S_ISREG(st.st_mode):
                raise Refused(f"{path} is not a regular file")
            _check(st, str(path))
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


def _entries(folder: int) -> list[os.DirEntry[str]]:
    """The names in ``folder`` (a descriptor)."""
    with os.scandir(folder) as it:
        return list(it)
