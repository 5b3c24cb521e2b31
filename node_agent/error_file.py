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
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from protocol import Failure
from protocol.failure_text import describe_failure

__all__ = ["ENV", "exception_record", "failure_record", "launcher_error_file", "outcome_record", "write"]

ENV = "TORCHELASTIC_ERROR_FILE"
# What torch's ProcessFailure says of a worker that exited with no error file and no signal.
TRACEBACK_HINT = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"

Record = dict[str, Any]
Log = Callable[[str, str], None]


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


def _copied(path: str, exitcode: int) -> Record | None:
    """The worker's error file with ``errorCode`` set, as torch's ``dump_error_file``; None
    when there is none to copy (never written, removed, or not JSON)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    message = data.get("message")
    if exitcode and isinstance(message, dict):  # torch leaves a flat (str) message as it is
        message["errorCode"] = exitcode
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
    """Replace ``path`` with ``record`` (torch removes an existing file first, as here)."""
    body = json.dumps(record)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(body)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        try:  # a folder we may not create files in, but the file itself is writable
            with open(path, "w", encoding="utf-8") as f:
                f.write(body)
        except OSError as exc:
            log(f"could not write {ENV}={path}: {exc}", "warning")
            return
    log(f"wrote the launch's error to {ENV}={path}", "debug")
