"""``which``, without ``shutil``: that module pulls in zlib, bz2 and lzma (about 10 ms) on
every launch, and the agent only needs to find a program on PATH."""

from __future__ import annotations

import os


def which(name: str, path: str | None = None) -> str | None:
    """The path of the executable ``name`` would run, as ``shutil.which`` finds it on POSIX."""
    if os.path.dirname(name):
        return name if _runnable(name) else None
    search = os.environ.get("PATH", os.defpath) if path is None else path
    for folder in search.split(os.pathsep):
        candidate = os.path.join(folder or os.curdir, name)
        if _runnable(candidate):
            return candidate
    return None


def _runnable(p: str) -> bool:
    return os.path.isfile(p) and os.access(p, os.X_OK)
