"""Where a worker's output goes: the route of each stream (torchrun's --redirects/--tee, the
console), the sinks that carry what passes through the agent (file, prefixed console, filtered
copies, the stderr tail of a failure report), and the worker's error file."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import IO, Any, BinaryIO, Literal

from node_agent.config import Std
from node_agent.supervisor.console import Console, LineFilter
from protocol.records import record

from .spec import WorkerSpec

_logger = logging.getLogger(__name__)
# The stderr tail kept for the failure message.
TAIL_BYTES = 8 * 1024
TAIL_LINES = 20


class SharedFile:
    """A file several workers' sinks write (the filtered lines of an attempt); the group closes it."""

    def __init__(self, path: str, log: Callable[[str], None]) -> None:
        self.path = path
        self._log = log
        self._file: IO[bytes] | None = open(path, "wb")

    def write(self, data: bytes) -> None:
        if self._file is None or not data:
            return
        try:
            self._file.write(data)
            self._file.flush()
        except (OSError, ValueError) as e:
            self._log(f"cannot write {self.path} ({e}); filtered output stops here")
            self.close()

    def close(self) -> None:
        _close_quietly(self._file)
        self._file = None


def _close_quietly(f: IO[bytes] | None) -> None:
    if f is not None:
        try:
            f.close()
        except OSError:  # a failed flush of what we already reported lost
            pass


class StreamSink:
    """Where one worker stream that passes through the agent goes: its file, the console (at
    once, framed), the filtered file, the stderr tail."""

    def __init__(
        self,
        *,
        label: str,
        file: BinaryIO | None,
        console: Console | None,
        prefix: bytes = b"",
        keep_tail: bool,
        log: Callable[[str], None],
        line_filter: LineFilter | None = None,
        filtered: SharedFile | None = None,
    ) -> None:
        self._label = label
        self._file = file
        self._console = console
        self._prefix = prefix
        self._tail: bytearray | None = bytearray() if keep_tail else None
        self._log = log
        self._filter = line_filter if filtered is not None else None
        self._filtered = filtered

    def feed(self, data: bytes) -> None:
        if self._file is not None:
            try:
                self._file.write(data)
                self._file.flush()  # so that `tail -f` and a crash of the agent see it all
            except (OSError, ValueError) as e:  # ENOSPC and friends: the console copy goes on
                self._log(f"{self._label}: cannot write its log file ({e}); file output stops here")
                self._close_file()
        if self._tail is not None:
            self._tail += data
            if len(self._tail) > 2 * TAIL_BYTES:
                del self._tail[:-TAIL_BYTES]
        if self._console is not None:
            self._console.write(self, data, self._prefix)
        if self._filter is not None and self._filtered is not None:
            self._filtered.write(self._filter.feed(data))

    def retarget(self, file: BinaryIO | None, filtered: SharedFile | None) -> None:
        """A worker kept across a restart (issue 44): what it writes from now on goes to the
        new attempt's log file and filtered file; the old ones are left complete."""
        if self._filter is not None and self._filtered is not None:
            self._filtered.write(self._filter.finish())
        self._close_file()
        self._file = file
        if self._filter is not None:
            self._filtered = filtered
            if filtered is None:
                self._filter = None

    def close(self) -> None:
        if self._console is not None:
            self._console.end(self)
            self._console = None
        if self._filter is not None and self._filtered is not None:
            self._filtered.write(self._filter.finish())
            self._filter = None
        self._close_file()

    def _close_file(self) -> None:
        _close_quietly(self._file)
        self._file = None

    def tail_text(self) -> str:
        if self._tail is None:
            return ""
        return _last_lines(bytes(self._tail[-TAIL_BYTES:]), trimmed=len(self._tail) > TAIL_BYTES)


def _last_lines(data: bytes, *, trimmed: bool) -> str:
    lines = data.decode("utf-8", "replace").splitlines()
    if trimmed and lines:
        lines = lines[1:]  # the first line was cut by the byte bound
    return "\n".join(lines[-TAIL_LINES:]).strip()


def file_tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - TAIL_BYTES))
            return _last_lines(f.read(), trimmed=size > TAIL_BYTES)
    except OSError:
        return ""


@record(frozen=True)
class _Route:
    file: str | None  # the log file, if this stream is redirected or tee'd
    console: bool
    prefixed: bool
    piped: bool  # passes through the agent (else the worker writes the file or /dev/null itself)


def route_of(spec: WorkerSpec, stream: Std) -> _Route:
    teed = bool(spec.tee & stream)
    to_file = teed or bool(spec.redirect & stream)
    console = spec.console and (teed or not to_file)
    path = spec.stdout_path if stream is Std.OUT else spec.stderr_path
    piped = console or (stream is Std.ERR and not to_file)  # stderr's tail is always kept
    return _Route(file=path if to_file else None, console=console, prefixed=console and teed, piped=piped)


StreamHow = Literal["devnull", "file", "console", "pty", "pipe"]


@record(frozen=True, slots=True, kw_only=True)
class StreamPlan:
    """Where one of a worker's streams goes, decided before anything is opened.

    ``how``: ``devnull``; ``file`` (the worker writes ``file`` itself, the agent copies nothing);
    ``console`` (the worker writes the agent's own descriptor, torchrun's way for stdout);
    ``pty`` or ``pipe`` (it passes through the agent: a pty when the console is a terminal, so
    the worker still sees one; a pipe if no pty can be opened). What passes through goes to
    ``file``, to the console when ``console`` (with the rank's prefix when ``prefixed``), its
    tail is kept for a failure report when ``keep_tail``, and its matching lines go to the
    attempt's filtered file when ``filtered``."""

    fd: int
    how: StreamHow
    file: str | None = None
    console: bool = False
    prefixed: bool = False
    keep_tail: bool = False
    filtered: bool = False


def plan_stdio(
    spec: WorkerSpec, console_fds: Mapping[int, int | None], ttys: Mapping[int, bool]
) -> tuple[StreamPlan, StreamPlan]:
    """The plan for the worker's stdout and stderr (pure: the caller says which console
    descriptors exist, ``console_fds``, and which are terminals, ``ttys``)."""
    plans = []
    for fd, stream in ((1, Std.OUT), (2, Std.ERR)):
        route = route_of(spec, stream)
        filters = spec.duplicate_stdout_filters if fd == 1 else spec.duplicate_stderr_filters
        filtered_path = spec.filtered_stdout_path if fd == 1 else spec.filtered_stderr_path
        if not route.piped:
            how: StreamHow = "devnull" if route.file is None else "file"
            plans.append(StreamPlan(fd=fd, how=how, file=route.file))
            continue
        how = "pipe"
        if route.console and not route.prefixed and route.file is None:
            own = console_fds.get(fd)
            if own is not None and fd == 1:
                how = "console"
            elif own is not None and ttys.get(own, False):
                how = "pty"
        if how == "console":
            plans.append(StreamPlan(fd=fd, how=how))
            continue
        plans.append(
            StreamPlan(
                fd=fd,
                how=how,
                file=route.file,
                console=route.console,
                prefixed=route.prefixed,
                keep_tail=fd == 2,
                # torchrun filters the tee'd streams of the ranks it shows, with their prefix.
                filtered=bool(filters and filtered_path) and route.prefixed,
            )
        )
    return plans[0], plans[1]


def read_error_file(path: str, log: Callable[[str], None]) -> tuple[Mapping[str, Any] | None, str, str]:
    """torch's @record file: {"message": {"message": ..., "extraInfo": {"py_callstack": ...}}}.

    ``(record, its message and traceback, "")``; ``(None, "", "")`` when the worker wrote none;
    ``(None, "", why)`` when it is not used (too large, too deep, not JSON: the bounds of
    :func:`node_agent.error_file.read_worker_file`, the one reader of a worker's error file)."""
    from ..error_file import read_worker_file  # only a failure reads an error file

    data, problem = read_worker_file(path)
    if problem:
        log(f"error file {path} is not used ({problem}); using the stderr tail instead")
        return None, "", problem
    if data is None:
        return None, "", ""
    message = data.get("message")
    if isinstance(message, str):  # the newer flat format
        return data, message, ""
    if not isinstance(message, dict):
        return data, "", ""
    text = str(message.get("message", ""))
    extra = message.get("extraInfo")
    callstack = extra.get("py_callstack") if isinstance(extra, dict) else None
    if isinstance(callstack, str) and callstack.strip():
        text = f"{text}\n{callstack.rstrip()}" if text else callstack.rstrip()
    return data, text, ""
