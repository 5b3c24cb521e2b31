"""Worker events: one JSON line per event, appended to $BENCH_EVENTS in a single write.

Each line is one ``os.write`` on a descriptor opened with ``O_APPEND``, so lines from many
workers never interleave. The worker passes its own start stamp (its first statement), so
the cost of importing this module and ``json`` is outside every measured interval.
"""

import json
import os
import time

_PATH = os.environ.get("BENCH_EVENTS", "")


def _int_env(name: str) -> int:
    try:
        return int(os.environ.get(name, "-1"))
    except ValueError:
        return -1


def emit(ev: str, t: float | None = None, **fields: object) -> None:
    rec = {
        "ev": ev,
        "t": time.time() if t is None else t,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "rank": _int_env("RANK"),
        "ws": _int_env("WORLD_SIZE"),
        "group_rank": _int_env("GROUP_RANK"),
        "restart": _int_env("TORCHELASTIC_RESTART_COUNT"),
        **fields,
    }
    if not _PATH:
        return
    fd = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(rec) + "\n").encode())
    finally:
        os.close(fd)


def idle(cap: float) -> None:
    """Sleep until a signal ends the process, or ``cap`` seconds (so nothing runs for ever)."""
    deadline = time.monotonic() + cap
    while time.monotonic() < deadline:
        time.sleep(0.5)
