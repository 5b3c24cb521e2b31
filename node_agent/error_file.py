"""The launcher's own ``TORCHELASTIC_ERROR_FILE``: why this node's launch failed, for its scheduler.

torchrun's ``main`` is wrapped in torch's ``@record``; when the launch fails, the file the
variable names (in the launcher's environment at start; each worker gets its own) receives:

* the root-cause worker's ``@record`` error file, copied, with ``"errorCode"`` (the worker's
  exit code) added inside its ``"message"`` object;
* nothing, when that worker wrote no error file;
* the launcher's own exception otherwise (a rendezvous timeout, a signal): ``{"message":
  {"message": "Type: text", "extraInfo": {"py_callstack": traceback, "timestamp": "secs"}}}``.

TorchX's local scheduler sets the variable for every replica and shows the file in ``torchx
status``. Ours writes the same file in the same places, in the same shape, with two additions:
the root cause is the job's (the rendezvous server knows it), so when it was on another node, or
wrote no error file, the record is built from the failure we report (what the worker's error
file or stderr tail said, its time and exit code) where torchrun would write nothing or only
this node's own first failure; and a launch that ended without a Python exception (the agent
gave up, or was stopped) records the reason it printed, its ``py_callstack`` being that reason.

A worker's own error file is read here too, by :func:`read_worker_file`, the one reader of it:
when the worker fails (``supervisor/output.py``, for the failure's message), and again for the
launcher's file or ``launch()``'s ``ProcessFailure`` (:func:`worker_record`), which get the
record parsed the first time (kept by path while the file is unchanged) instead of reading it
again. The file is the user's, so it is read with bounds: at most :data:`MAX_BYTES` (1 MiB;
torch's records are a message and a traceback, a few KiB), never more than that from a file
that claims less (a link to ``/dev/zero``), without blocking (a FIFO), JSON nested at most
:data:`MAX_DEPTH` levels (torch's are 3), checked before parsing so no parser recursion
happens. A file that breaks a bound, is not JSON (half-written by a dying worker) or is not a
JSON object is not used: the failure is reported as for a worker that wrote no error file
(its exit code or signal, its stderr tail), with one line added to its message saying why the
error file was not used (too large, nested too deep, not JSON), and the agent logs the same.
Such a failure has no ``error_file`` (``<N/A>`` in the report), so nothing copies it into the
launcher's error file either.

The launcher's error file is written by :func:`edge.atomic_write.replace_file`: a new file
with an unpredictable name beside it, renamed over it, never through a planted link.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from edge.atomic_write import replace_file
from protocol import Failure
from protocol.failure_text import describe_failure

__all__ = [
    "ENV",
    "MAX_BYTES",
    "MAX_DEPTH",
    "exception_record",
    "failure_record",
    "launcher_error_file",
    "outcome_record",
    "read_worker_file",
    "worker_record",
    "write",
]

ENV = "TORCHELASTIC_ERROR_FILE"
# What torch's ProcessFailure says of a worker that exited with no error file and no signal.
TRACEBACK_HINT = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"

Record = dict[str, Any]
Log = Callable[[str, str], None]

MAX_BYTES = 1 << 20  # the most of a worker's error file read; a larger one is not used
MAX_DEPTH = 32  # the deepest nesting of its JSON (torch's record: 3 levels)
_CACHE_FILES = 64  # records kept by path for the second reader, newest last
_CACHE_BYTES = 16 << 20  # and at most this much of their files' sizes
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_PAIR = re.compile(rb"\[\]|\{\}")
# path -> (the file's identity when read, its record, why it was not used)
_read: OrderedDict[str, tuple[tuple[int, ...], Record | None, str]] = OrderedDict()


def launcher_error_file(environ: Mapping[str, str]) -> str | None:
    """The path the launcher was started with (absolute, so no later chdir moves it)."""
    path = environ.get(ENV)
    return os.path.abspath(path) if path else None


def _stamp(ts: float | None = None) -> str:
    return str(int(time.time() if ts is None else ts))


def exception_record(exc: BaseException) -> Record:
    """What torch's ``ErrorHandler.record_exception`` writes for ``exc``."""
    callstack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": callstack, "timestamp": _stamp()},
        }
    }


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _too_deep(data: bytes, limit: int) -> bool:
    """Whether the JSON text ``data`` nests more than ``limit`` levels, found without recursion:
    strings dropped, then the innermost empty pairs removed once per level. Unbalanced brackets
    are left for the parser to name."""
    rest = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    run = re.compile(rb"[\[{]{%d}" % (limit + 1))  # that many opened in a row: too deep already
    for _ in range(limit):
        if not rest:
            return False
        if run.search(rest):
            return True
        peeled = _PAIR.sub(b"", rest)
        if peeled == rest:
            return False
        rest = peeled
    return bool(rest)


def _parse(fd: int, size: int) -> tuple[Record | None, str]:
    if size > MAX_BYTES:
        return None, f"{size} bytes, over the {MAX_BYTES} bytes read of an error file"
    chunks: list[bytes] = []
    got = 0
    while got <= MAX_BYTES:
        chunk = os.read(fd, MAX_BYTES + 1 - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    if got > MAX_BYTES:  # it grew, or claims a size it does not have
        return None, f"over the {MAX_BYTES} bytes read of an error file"
    data = b"".join(chunks)
    if _too_deep(data, MAX_DEPTH):
        return None, f"JSON nested more than {MAX_DEPTH} levels deep"
    try:
        parsed = json.loads(data.decode("utf-8", "replace"))
    except (ValueError, RecursionError, UnicodeError) as exc:  # half-written by a dying worker
        return None, f"not JSON ({str(exc)[:200]})"
    if not isinstance(parsed, dict):
        return None, f"a JSON {type(parsed).__name__}, not torch's record (an object)"
    return parsed, ""


def read_worker_file(path: str) -> tuple[Record | None, str]:
    """A worker's ``@record`` error file: ``(its JSON object, "")``, ``(None, why it is not
    used)``, or ``(None, "")`` when there is none. Read once while unchanged (the module's
    docstring); never raises."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        return None, f"cannot be opened ({exc.strerror or exc})"
    try:
        st = os.fstat(fd)
        key = _identity(st)
        known = _read.get(path)
        if known is not None and known[0] == key:
            _read.move_to_end(path)
            return known[1], known[2]
        if not stat.S_ISREG(st.st_mode):
            return None, "not a regular file"
        record, problem = _parse(fd, st.st_size)
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror or exc})"
    finally:
        os.close(fd)
    _read[path] = (key, record, problem)
    _read.move_to_end(path)
    while len(_read) > _CACHE_FILES or sum(k[2] for k, _, _ in _read.values()) > _CACHE_BYTES:
        _read.popitem(last=False)
    return record, problem


def worker_record(path: str) -> Record | None:
    """The JSON object of a worker's error file, or None (none, or not used)."""
    return read_worker_file(path)[0]


def _copied(path: str, exitcode: int) -> Record | None:
    """The worker's error file with ``errorCode`` set, as torch's ``dump_error_file``; None
    when there is none to copy (never written, removed, or not used). A copy: the record read
    stays as it was."""
    data = worker_record(path)
    if data is None:
        return None
    data = dict(data)
    message = data.get("message")
    if exitcode and isinstance(message, dict):  # torch leaves a flat (str) message as it is
        data["message"] = {**message, "errorCode": exitcode}
    return data


def _made_up_text(f: Failure) -> str:
    """torch's message for a failure without an error file."""
    if f.exitcode < 0:
        return f"Signal {-f.exitcode} ({f.signal or '<N/A>'}) received by PID {f.pid}"
    return TRACEBACK_HINT


def failure_record(f: Failure) -> Record:
    """A root cause whose error file is not here, in the shape of a copied one.

    ``message``: which rank failed and how, plus the error's first line when the worker wrote an
    error file (on its node); ``py_callstack``: what we report of it (that file's message and
    traceback, else the worker's stderr tail, else torch's own text for such a failure)."""
    what = describe_failure(f)
    text = f.message.strip("\n")
    if f.error_file:
        first = next((line.strip() for line in text.splitlines() if line.strip()), "")
        if first:
            what = f"{what}: {first}"
    return {
        "message": {
            "message": what,
            "extraInfo": {
                "py_callstack": f"{text}\n" if text else _made_up_text(f),
                "timestamp": _stamp(f.timestamp),
            },
            "errorCode": f.exitcode,
        }
    }


def outcome_record(code: int, reason: str, root: Failure | None, local: tuple[Failure, ...]) -> Record | None:
    """What the launcher's error file receives when the agent exits with ``code``."""
    if code == 0:
        return None
    if root is None and local:
        root = min(local, key=lambda f: f.timestamp)
    if root is None:  # no worker failed: the agent's own reason, as torchrun's own exception
        text = reason or f"the agent exited with {code}"
        return {
            "message": {"message": text, "extraInfo": {"py_callstack": f"{text}\n", "timestamp": _stamp()}}
        }
    # The root cause is this node's when it is one of this node's failures (each carries our id).
    here = root in local or any(f.node_id == root.node_id for f in local)
    if here and root.error_file:
        copied = _copied(root.error_file, root.exitcode)
        if copied is not None:
            return copied
    return failure_record(root)


def write(path: str, record: Record, log: Log) -> None:
    """Replace ``path`` with ``record`` (torch removes an existing file first, as here), through
    a new file beside it (:func:`edge.atomic_write.replace_file`: an unpredictable name, never
    through a link planted there)."""
    body = json.dumps(record)
    try:
        replace_file(path, body, mode=0o644)
    except OSError:
        try:  # a folder we may not create files in, but the file itself is writable
            with open(path, "w", encoding="utf-8") as f:
                f.write(body)
        except OSError as exc:
            log(f"could not write {ENV}={path}: {exc}", "warning")
            return
    log(f"wrote the launch's error to {ENV}={path}", "debug")
