"""The agent's private, node-local directory: what only this agent and its workers share.

    <base>/node-agent-<agent pid>-<random>/.lock  (held by the agent while it lives)
    <base>/node-agent-<agent pid>-<random>/attempt_<k>/<local_rank>/progress.page[.stacks]
    <base>/node-agent-<agent pid>-<random>/attempt_<k>/fr_pipe_rank_<rank>.pipe  (torch makes it)

The progress pages are memory-mapped by the agent and its workers at once; they do not belong
in ``--log-dir``: that is torchrun's layout (byte for byte, see ``logs.py``) and often a shared
file system (NFS, Lustre), where a shared mapping is slow or unsupported. ``<base>`` is
``/dev/shm`` (memory, always node-local) where it is usable, else ``$XDG_RUNTIME_DIR``, else the
temporary directory. The folder is 0700 and removed when the agent ends; after a SIGKILL of the
agent, the orphan watchdog removes it (``procutil``), and failing that the next agent on the
node does (:func:`sweep`: folders of dead agents of the same user).

Whether an agent is alive is told by a lock, not by its pid: agents in other PID namespaces
share ``/dev/shm`` (containers with ``--ipc=host`` or a shared-memory volume, a Slurm step in
its own PID namespace), and there the pid in a folder's name is nobody's, or somebody else's.
The agent holds an exclusive ``flock`` on ``<folder>/.lock`` from the folder's creation to its
end; the kernel drops it when the process ends, however it ends (SIGKILL too), and a lock on
the file's inode is seen from every namespace. The descriptor is close-on-exec and not in any
``pass_fds``, so no worker, warm interpreter or watchdog keeps it held after the agent. The lock
file appears already locked (made under a temporary name, locked, then renamed), so a sweep
never finds a live agent's lock free. A folder is swept only when its lock can be taken.

A folder without a lock file was made by an older agent (or by a new one in the instant before
its lock is in place). An older agent's liveness cannot be told across PID namespaces; such a
folder is swept only when both the old rule says its agent is dead (no process has its pid
here) and nothing changed in it for :data:`LOCKLESS_AFTER_S` (a day: an attempt folder is made
at each restart, which refreshes it): a live old agent in another namespace is spared for a day
after its last restart, a dead one's leftovers go the next day, a new agent's never.

An agent whose folder was removed while it ran (by an older agent's sweep, by a cleaner of
``/dev/shm``) makes it again, with its lock, when it next needs it (:meth:`RuntimeDir.attempt`,
:func:`ensure_dir`), and says so once on its log.

Only the agent's own process reads or removes what is here; nothing follows a symlink.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "LOCKLESS_AFTER_S",
    "LOCK_NAME",
    "PREFIX",
    "RuntimeDir",
    "base_dir",
    "ensure_dir",
    "make_temp_dir",
    "remove_tree",
    "sweep",
    "temp_root",
]

PREFIX = "node-agent-"
LOCK_NAME = ".lock"  # in each private folder: its agent holds an exclusive flock on it
LOCKLESS_AFTER_S = 24 * 3600.0  # a folder without a lock file: swept only this long unchanged
_MAX_SWEEP = 4096  # entries of <base> looked at per start: a crowded /dev/shm costs no more
_MAX_DEPTH = 8  # our layout is 3 deep
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def temp_root() -> str:
    """The temporary directory, as ``tempfile.gettempdir`` picks it (from TMPDIR, TEMP, TMP)."""
    for name in ("TMPDIR", "TEMP", "TMP"):
        folder = os.environ.get(name)
        if folder and os.path.isdir(folder):
            return folder
    return "/tmp"


def make_temp_dir(prefix: str, parent: str) -> str:
    """A new directory ``parent/<prefix><random>``, private to us (0700), as mkdtemp makes.

    Our own mkdtemp: importing ``tempfile`` imports ``shutil`` and with it zlib, bz2 and lzma,
    about 10 ms of every launch."""
    for _ in range(100):
        path = os.path.join(parent, prefix + os.urandom(6).hex())
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        return os.path.abspath(path)
    raise FileExistsError(f"no free temporary directory name under {parent!r}")


def base_dir() -> str:
    """Where private folders go: ``/dev/shm``, else ``$XDG_RUNTIME_DIR``, else the temp dir."""
    for folder in ("/dev/shm", os.environ.get("XDG_RUNTIME_DIR", "")):
        if folder and os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK):
            return folder
    return temp_root()


def remove_tree(path: str, depth: int = 0) -> None:
    """Remove ``path`` and what is in it; symlinks are removed, never followed. Best effort."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        entries = []
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False) and depth < _MAX_DEPTH:
                remove_tree(entry.path, depth + 1)
            else:
                os.unlink(entry.path)
        except OSError:
            pass
    try:
        os.rmdir(path)
    except OSError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _take_lock(path: str) -> int:
    """Lock the folder ``path`` as ours: a descriptor holding an exclusive flock on its
    ``.lock``. The file is made and locked under a temporary name, then renamed: nobody ever
    sees it unlocked. OSError if it cannot be."""
    dfd = os.open(path, _DIR_FLAGS)
    try:
        tmp = f"{LOCK_NAME}.{os.urandom(6).hex()}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, LOCK_NAME, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError:
            os.close(fd)
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
        return fd
    finally:
        os.close(dfd)


def _claim(path: str, pid: int, uid: int, now: float) -> int | None:
    """Whether the folder ``path`` may be swept: None, leave it; else a descriptor holding its
    lock until it is removed (-1: it has no lock file, and the rule for those says so)."""
    try:
        dfd = os.open(path, _DIR_FLAGS)
    except OSError:  # gone, or a symlink put in its place since the listing
        return None
    try:
        st = os.fstat(dfd)
        if st.st_uid != uid:
            return None
        try:
            fd = os.open(LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        except FileNotFoundError:  # an older agent's folder (see the header)
            if now - st.st_mtime >= LOCKLESS_AFTER_S and not _pid_alive(pid):
                return -1
            return None
        except OSError:  # a symlink (ELOOP), or not ours to open: leave it
            return None
        try:
            # Not a file (a FIFO, a folder): not ours either. BlockingIOError: its agent holds
            # the lock, in whatever PID namespace it runs.
            if stat.S_ISREG(os.fstat(fd).st_mode):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
        except OSError:
            pass
        os.close(fd)
        return None
    finally:
        os.close(dfd)


def sweep(base: str) -> list[str]:
    """Remove the private folders under ``base`` of this user's agents that are gone (killed
    with SIGKILL before their watchdog could): those whose lock nobody holds, and those
    without a lock file that the old pid rule and a day's quiet both give up (see the header);
    returns what was removed."""
    removed: list[str] = []
    uid = os.getuid()
    now = time.time()
    try:
        with os.scandir(base) as it:
            for n, entry in enumerate(it):
                if n >= _MAX_SWEEP:
                    break
                if not entry.name.startswith(PREFIX):
                    continue
                pid_text = entry.name[len(PREFIX) :].split("-", 1)[0]
                if not pid_text.isdigit():
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
                    continue
                fd = _claim(entry.path, int(pid_text), uid, now)
                if fd is None:
                    continue
                try:
                    remove_tree(entry.path)  # the lock held meanwhile: no other sweep races us
                finally:
                    if fd >= 0:
                        os.close(fd)
                removed.append(entry.path)
    except OSError:
        pass
    return removed


# This process's live private folders, by path: ensure_dir makes one again with its lock.
_live: dict[str, RuntimeDir] = {}


def _make_levels(root: str, path: str) -> bool:
    """Make each missing level of ``path`` below the directory ``root``, 0700, one by one;
    NotADirectoryError where a level is there but no directory (a symlink is never followed).
    True if one was made."""
    made = False
    rel = os.path.relpath(path, root)
    if rel == ".":
        return made
    level = root
    for name in rel.split(os.sep):
        level = os.path.join(level, name)
        try:
            os.mkdir(level, 0o700)
            made = True
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(level).st_mode):
                raise NotADirectoryError(
                    f"{level!r} is not a directory (symlinks are not followed)"
                ) from None
    return made


def ensure_dir(path: str) -> bool:
    """Make ``path`` a directory again where it is missing: each missing level 0700, never
    through a symlink (NotADirectoryError where a level is not a directory). Where ``path`` is
    in a private folder of this process (a live :class:`RuntimeDir`) that was removed, the
    folder is made again with its lock, and the agent's log told once (:meth:`RuntimeDir.ensure`).
    True: something had to be made (what was there is gone)."""
    path = os.path.abspath(path)
    for folder, rt in _live.items():
        if path == folder or path.startswith(folder + os.sep):
            made = rt.ensure()
            return _make_levels(folder, path) or made
    root = path
    while not os.path.lexists(root) and os.path.dirname(root) != root:
        root = os.path.dirname(root)
    return _make_levels(root, path)


class RuntimeDir:
    """This agent's private folder (created at once, 0700, locked as long as we live) and its
    attempts' subfolders. ``log``: the agent's log (``AgentLog``), told when the folder had to
    be made again."""

    def __init__(self, base: str | None = None, *, log: Callable[[str, str], None] | None = None) -> None:
        self.base = base if base is not None else base_dir()
        self.log = log
        self.swept = sweep(self.base)
        self.path = make_temp_dir(f"{PREFIX}{os.getpid()}-", self.base)
        self.remade = 0  # times the folder was found removed and made again
        self._lock = -1
        self._lock_id = (0, 0)
        self._relock(warn=True)
        _live[self.path] = self

    def _relock(self, warn: bool) -> None:
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1
        try:
            self._lock = _take_lock(self.path)
        except OSError as exc:
            # Not fatal: the folder is judged as an older agent's (pid, and a day's quiet).
            if warn and self.log is not None:
                self.log(
                    f"cannot lock the private folder {self.path} ({exc}): it is not safe from sweeps",
                    "warning",
                )
            return
        st = os.fstat(self._lock)
        self._lock_id = (st.st_dev, st.st_ino)

    def _locked(self) -> bool:
        """Our lock is the folder's lock file (not one of a folder since removed)."""
        if self._lock < 0:
            return False
        try:
            st = os.stat(os.path.join(self.path, LOCK_NAME), follow_symlinks=False)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._lock_id

    def ensure(self) -> bool:
        """The folder is here, 0700, and its lock file is the one we hold: if it was removed
        (by another agent's sweep, a cleaner), it is made again, locked, and the log told. True
        if it had to be. NotADirectoryError or PermissionError where something that is not our
        directory (a symlink, another user's folder) took its place."""
        try:
            st = os.lstat(self.path)
            gone = False
        except FileNotFoundError:
            try:
                os.mkdir(self.path, 0o700)
            except FileExistsError:  # made meanwhile (a makedirs below it): checked below
                pass
            st = os.lstat(self.path)
            gone = True
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(
                f"the agent's private folder {self.path!r} was replaced by a non-directory"
            )
        if st.st_uid != os.getuid():
            raise PermissionError(
                f"the agent's private folder {self.path!r} was replaced by uid {st.st_uid}'s"
            )
        if self._locked():
            return False
        if self._lock < 0 and not gone:
            self._relock(warn=False)  # it was never locked: try again; nothing was lost
            return False
        # Removed (and perhaps made again by a makedirs below it, with the umask's mode).
        if stat.S_IMODE(st.st_mode) != 0o700:
            fd = os.open(self.path, _DIR_FLAGS)
            try:
                os.fchmod(fd, 0o700)
            finally:
                os.close(fd)
        self._relock(warn=False)
        self.remade += 1
        if self.log is not None:
            self.log(
                f"this agent's private folder {self.path} was removed while it ran (by a cleaner of "
                f"{self.base}, or by an older node-agent's sweep in another PID namespace); made "
                "again: what it held (the progress pages, in-memory snapshots) is lost",
                "warning",
            )
        return True

    def attempt(self, index: int) -> str:
        """``attempt_<index>``, fresh; the previous attempts' folders are removed (their workers
        are gone: nobody maps their pages any more). The private folder is made again first
        (:meth:`ensure`) if it was removed meanwhile."""
        self.ensure()
        for entry in list(os.scandir(self.path)):
            if entry.name.startswith("attempt_"):
                remove_tree(entry.path)
        path = os.path.join(self.path, f"attempt_{index}")
        _make_levels(self.path, path)
        return path

    def close(self) -> None:
        """The agent ends: remove the whole folder, then let its lock go."""
        _live.pop(self.path, None)
        remove_tree(self.path)
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1
