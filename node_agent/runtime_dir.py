"""The agent's private, node-local directory: what only this agent and its workers share.

    <base>/node-agent-<agent pid>-<random>/attempt_<k>/<local_rank>/progress.page[.stacks]
    <base>/node-agent-<agent pid>-<random>/attempt_<k>/fr_pipe_rank_<rank>.pipe  (torch makes it)

The progress pages are memory-mapped by the agent and its workers at once; they do not belong
in ``--log-dir``: that is torchrun's layout (byte for byte, see ``logs.py``) and often a shared
file system (NFS, Lustre), where a shared mapping is slow or unsupported. ``<base>`` is
``/dev/shm`` (memory, always node-local) where it is usable, else ``$XDG_RUNTIME_DIR``, else the
temporary directory. The folder is 0700 and removed when the agent ends; after a SIGKILL of the
agent, the orphan watchdog removes it (``procutil``), and failing that the next agent on the
node does (:func:`sweep`: folders of dead agents of the same user).

Only the agent's own process reads or removes what is here; nothing follows a symlink.
"""

from __future__ import annotations

import os
import stat

__all__ = ["PREFIX", "RuntimeDir", "base_dir", "make_temp_dir", "remove_tree", "sweep", "temp_root"]

PREFIX = "node-agent-"
_MAX_SWEEP = 4096  # entries of <base> looked at per start: a crowded /dev/shm costs no more
_MAX_DEPTH = 8  # our layout is 3 deep


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


def sweep(base: str) -> list[str]:
    """Remove the private folders under ``base`` of this user's agents that are gone (killed
    with SIGKILL before their watchdog could); returns what was removed."""
    removed: list[str] = []
    uid = os.getuid()
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
                if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or _pid_alive(int(pid_text)):
                    continue
                remove_tree(entry.path)
                removed.append(entry.path)
    except OSError:
        pass
    return removed


class RuntimeDir:
    """This agent's private folder (created at once, 0700) and its attempts' subfolders."""

    def __init__(self, base: str | None = None) -> None:
        self.base = base if base is not None else base_dir()
        self.swept = sweep(self.base)
        self.path = make_temp_dir(f"{PREFIX}{os.getpid()}-", self.base)

    def attempt(self, index: int) -> str:
        """``attempt_<index>``, fresh; the previous attempts' folders are removed (their workers
        are gone: nobody maps their pages any more)."""
        for entry in list(os.scandir(self.path)):
            if entry.name.startswith("attempt_"):
                remove_tree(entry.path)
        path = os.path.join(self.path, f"attempt_{index}")
        os.makedirs(path, 0o700, exist_ok=True)
        return path

    def close(self) -> None:
        """The agent ends: remove the whole folder."""
        remove_tree(self.path)
