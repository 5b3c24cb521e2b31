"""Replace a file whole or not at all, never through a link planted at the temporary's name.

:func:`replace_file` writes ``data`` to a new file beside ``path`` and renames it over
``path``, so a reader sees the old contents or the new, never half of them. The new file has
an unpredictable name (``.<name>.<16 random hex digits>.tmp`` in the same folder: a rename
never crosses file systems) and is created with ``O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC``:
whatever already sits at that name (a file, a symbolic link to somewhere else) makes the create
fail, so nothing is ever written through a link, and a name that cannot be guessed cannot be
planted in advance. ``mode`` (default 0600) is given to ``open``, the process's umask applying
as for any new file. ``fsync`` flushes the data before the rename, ``fsync_dir`` the folder
after it (a rename that must survive a power cut needs both). On any error, the temporary is
removed and the exception raised; ``path`` is then as it was (an error syncing the folder
comes after the rename: ``path`` is then already replaced).

Both programs write their few whole files through here (the agent's error file, stack reports,
progress pages, a worker's result). This module imports only ``os``: a worker's import of the
API pays nothing for it.
"""

from __future__ import annotations

import os

__all__ = ["replace_file", "temp_name"]

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_TRIES = 8  # a 64-bit random name taken already: only by something planting names on purpose


def temp_name(path: str) -> str:
    """A fresh, unpredictable name beside ``path``."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.{os.urandom(8).hex()}.tmp")


def _create(path: str, mode: int) -> tuple[int, str]:
    for attempt in range(_TRIES):
        tmp = temp_name(path)
        try:
            return os.open(tmp, _FLAGS, mode), tmp
        except FileExistsError:
            if attempt == _TRIES - 1:
                raise
    raise AssertionError("unreachable")


def replace_file(
    path: str | os.PathLike[str],
    data: bytes | str,
    *,
    mode: int = 0o600,
    fsync: bool = False,
    fsync_dir: bool = False,
) -> None:
    """Make ``path`` hold exactly ``data`` (text is written as UTF-8, anything
    unencodable as ``?``); raises ``OSError``."""
    target = os.fspath(path)
    body = data.encode("utf-8", "replace") if isinstance(data, str) else data
    fd, tmp = _create(target, mode)
    try:
        try:
            view = memoryview(body)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if fsync_dir:
        dfd = os.open(os.path.dirname(target) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
