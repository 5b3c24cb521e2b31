"""The worker supervisor: start a node's workers, carry their output, notice the first failure,
stop them all, and never leave one behind.

How it works.

* Each worker is spawned with ``loop.subprocess_exec`` into its own session, so that a signal to
  its process group (pgid == pid) also reaches what it starts: DataLoader workers, shells,
  compilers.  ``PR_SET_PDEATHSIG`` and a per-group watchdog process make sure the groups die
  with the agent, even when the agent is SIGKILLed (see ``procutil``).
* A ``SubprocessProtocol`` per worker, rather than ``create_subprocess_exec``: on Python 3.11
  ``Process.wait()`` resolves only once every pipe of the child is closed, so a grandchild that
  inherited stdout would hide the worker's exit.  ``process_exited`` fires when the worker is
  reaped, whatever holds its pipes.  Output arrives in ``pipe_data_received`` callbacks and is
  written synchronously, so there are no reader tasks at all: the group owns futures (one exit
  and one EOF per pipe per worker) and ``wait()``/``stop()`` await them.
* Output routing follows torchrun.  A stream that is neither redirected nor tee'd goes to the
  console unprefixed; a tee'd one goes to its file and to the console with the rank's prefix; a
  redirected one goes only to its file; ``console=False`` drops the console copy.  A stream whose
  only destination is a file is handed to the worker as that file (the agent copies nothing).
  An unprefixed console stream is handed to the worker as the agent's own descriptor when the
  console has a real one (stdout: exactly torchrun, the worker sees what the agent sees), except
  that stderr's last lines are the failure message when there is no error file, so stderr
  always passes through the agent: through a pty when the agent's stderr is a terminal (the
  worker still sees one), else through a pipe.  A pty's master is read with ``add_reader``; EIO
  on it means every holder of the slave closed it, our EOF.  Whatever passes through the agent
  is written to the console at once, partial lines included, framed by ``console.ConsoleFramer``
  (prefixes at line starts only; a prefixed rank's line is never continued by another rank).
  ``--duplicate-*-filters`` copy the matching lines of tee'd streams, prefixed, to one file per
  attempt, as torchrun does.
* Shutdown policy (``stop``): the stop signal (SIGTERM) to every process group still alive, wait
  up to ``grace`` for the workers to exit, SIGKILL the groups of those that did not, wait up to
  ``reap_timeout`` for them to be reaped, then SIGKILL whatever is left in any worker's process
  group (children that ignored the signal or outlived their parent) and wait for those to die.
  Then pipes get ``DRAIN_TIMEOUT`` to reach EOF (only a process that left its group can hold
  one open longer), files are closed and the watchdog is told to exit.  Each step is logged once.
  If ``stop()`` (or ``start()``) is cancelled, every group is SIGKILLed on the spot and the
  cancellation propagates; a later ``stop()`` finishes the reaping.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import IO, Any, BinaryIO, Literal, TextIO, cast

from node_agent import procutil
from node_agent.config import Std
from node_agent.console import Console, ConsoleFramer, LineFilter, open_pty
from node_agent.signal_witness import SignalWitness
from node_agent.warm import WarmHandoffError, WarmInterpreter, WarmPool
from protocol.records import record

__all__ = [
    "DRAIN_TIMEOUT",
    "REAP_TIMEOUT",
    "ConsoleFramer",  # re-exported from node_agent.console
    "GroupResult",
    "SupervisorError",
    "WorkerExit",
    "WorkerGroup",
    "WorkerSpawnError",
    "WorkerSpec",
]

_logger = logging.getLogger(__name__)

# After a worker exits, how long its pipes may take to reach EOF before its exit is reported.
# The worker's own copies close before it is reaped, so this bound matters only when a child of
# the worker still holds them; the output already in the pipe is read within that time.
OUTPUT_SETTLE = 0.2
# In stop(), once every process of the group is dead: how long a pipe may stay open (a process
# that left the worker's group holds it) before we stop reading it.
DRAIN_TIMEOUT = 1.0
# After SIGKILL: how long to wait for the kernel to let a process go.  Only a process stuck in
# uninterruptible sleep (a wedged GPU or NFS call) takes longer; we report it and move on.
REAP_TIMEOUT = 10.0
# One read of a pty master (a pipe's reads are the event loop's).
PTY_READ_SIZE = 64 * 1024
# The stderr tail kept for the failure message.
TAIL_BYTES = 8 * 1024
TAIL_LINES = 20


class SupervisorError(Exception):
    """Base of the supervisor's errors."""


class WorkerSpawnError(SupervisorError):
    """A worker could not be started (missing executable, bad cwd, ...); none is left running."""

    def __init__(self, local_rank: int, argv0: str, error: OSError) -> None:
        self.local_rank = local_rank
        self.argv0 = argv0
        self.errno = error.errno
        self.strerror = error.strerror or str(error)
        super().__init__(f"cannot start local_rank {local_rank}: {argv0}: {self.strerror}")


@record(frozen=True, kw_only=True)
class WorkerSpec:
    """Everything needed to start one worker; ``env`` is its whole environment."""

    local_rank: int
    rank: int  # the global rank, for reports
    argv: Sequence[str]
    env: Mapping[str, str]
    cwd: str | None = None
    redirect: Std = Std.NONE  # streams written only to their files
    tee: Std = Std.NONE  # streams written to their files and, prefixed, to the console
    stdout_path: str | None = None
    stderr_path: str | None = None
    console: bool = True  # False: the console copy is dropped (--local-ranks-filter)
    prefix: str = ""  # put before each tee'd console line, e.g. "[default0]:"
    error_file: str | None = None  # TORCHELASTIC_ERROR_FILE, read when the worker fails
    # --duplicate-stdout-filters/--duplicate-stderr-filters: lines of a tee'd stream (of a rank
    # shown on the console) that contain any of these strings are copied, with ``prefix``, to
    # the filtered file; torchrun's <attempt dir>/filtered_stdout.log and filtered_stderr.log,
    # shared by every rank of the attempt.  The file is created whenever filters are given.
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    filtered_stdout_path: str | None = None
    filtered_stderr_path: str | None = None
    # --numa-binding: the CPUs the worker runs on, set before it runs anything (None: unbound)
    cpus: frozenset[int] | None = None

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError(f"local_rank {self.local_rank}: empty argv")
        object.__setattr__(self, "redirect", Std(int(self.redirect)))
        object.__setattr__(self, "tee", Std(int(self.tee)))
        for name in ("duplicate_stdout_filters", "duplicate_stderr_filters"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise TypeError(f"local_rank {self.local_rank}: {name} must be a sequence of strings")
            object.__setattr__(self, name, tuple(value))
        if self.duplicate_stdout_filters and not self.filtered_stdout_path:
            raise ValueError(
                f"local_rank {self.local_rank}: duplicate_stdout_filters without filtered_stdout_path"
            )
        if self.duplicate_stderr_filters and not self.filtered_stderr_path:
            raise ValueError(
                f"local_rank {self.local_rank}: duplicate_stderr_filters without filtered_stderr_path"
            )
        to_file = self.redirect | self.tee
        if to_file & Std.OUT and not self.stdout_path:
            raise ValueError(f"local_rank {self.local_rank}: stdout is redirected but stdout_path is not set")
        if to_file & Std.ERR and not self.stderr_path:
            raise ValueError(f"local_rank {self.local_rank}: stderr is redirected but stderr_path is not set")


@record(frozen=True, kw_only=True)
class WorkerExit:
    local_rank: int
    rank: int
    pid: int
    exitcode: int  # as Popen.returncode: negative means killed by that signal
    signal_name: str  # "SIGKILL" etc.; "" for a normal exit
    timestamp: float  # time.time() when reaped (for reports only)
    error_message: str  # error file's message and traceback, else the stderr tail, else ""
    error_record: Mapping[str, Any] | None  # the error file's JSON, if there was one
    error_file: str = ""  # its path, when the worker wrote one

    @property
    def failed(self) -> bool:
        return self.exitcode != 0


@record(frozen=True)
class GroupResult:
    state: Literal["succeeded", "failed"]
    exits: tuple[WorkerExit, ...]  # every worker reaped so far, by local rank
    first_failure: WorkerExit | None  # the earliest failure: torchrun's root cause


class _SharedFile:
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


class _StreamSink:
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
        filtered: _SharedFile | None = None,
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


def _file_tail(path: str) -> str:
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


def _route(spec: WorkerSpec, stream: Std) -> _Route:
    teed = bool(spec.tee & stream)
    to_file = teed or bool(spec.redirect & stream)
    console = spec.console and (teed or not to_file)
    path = spec.stdout_path if stream is Std.OUT else spec.stderr_path
    piped = console or (stream is Std.ERR and not to_file)  # stderr's tail is always kept
    return _Route(file=path if to_file else None, console=console, prefixed=console and teed, piped=piped)


def _read_error_file(path: str, log: Callable[[str], None]) -> tuple[Mapping[str, Any] | None, str]:
    """torch's @record file: {"message": {"message": ..., "extraInfo": {"py_callstack": ...}}}."""
    try:
        import json  # only a failure reads an error file

        with open(path, encoding="utf-8", errors="replace") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError) as e:  # half-written by a dying worker, or not ours
        log(f"error file {path} is unreadable ({e}); using the stderr tail instead")
        return None, ""
    if not isinstance(data, dict):
        return None, ""
    message = data.get("message")
    if isinstance(message, str):  # the newer flat format
        return data, message
    if not isinstance(message, dict):
        return data, ""
    text = str(message.get("message", ""))
    extra = message.get("extraInfo")
    callstack = extra.get("py_callstack") if isinstance(extra, dict) else None
    if isinstance(callstack, str) and callstack.strip():
        text = f"{text}\n{callstack.rstrip()}" if text else callstack.rstrip()
    return data, text


class _Worker:
    """One worker's process, pipes and bookkeeping; its protocol feeds it."""

    def __init__(self, spec: WorkerSpec, loop: asyncio.AbstractEventLoop) -> None:
        self.spec = spec
        self.loop = loop
        self.transport: asyncio.SubprocessTransport | None = None
        self.pid = 0
        self.sinks: dict[int, _StreamSink] = {}
        self.eof: dict[int, asyncio.Future[None]] = {}
        self.ptys: dict[int, int] = {}  # worker fd -> the pty master we read it from
        self.pipes: dict[int, asyncio.BaseTransport] = {}  # worker fd -> the pipe we read it from
        self.warm = False  # a warm interpreter (--preload) became this worker
        self.exited: asyncio.Future[None] = loop.create_future()
        self.returncode: int | None = None
        self.reaped_at = 0.0
        self.group_gone = False  # no process, not even a zombie, has this pgid any more
        self.stderr_file: str | None = None  # stderr written straight to a file: its tail is there
        self.exit: WorkerExit | None = None

    @property
    def label(self) -> str:
        return f"local_rank {self.spec.local_rank} (pid {self.pid})"

    def on_exited(self, returncode: int) -> None:
        self.returncode = returncode
        self.reaped_at = time.time()
        if not self.exited.done():
            self.exited.set_result(None)

    def read_pty(self, fd: int, master: int) -> None:
        """Start carrying what the worker writes to the pty behind its ``fd``."""
        self.ptys[fd] = master
        self.loop.add_reader(master, self._pty_readable, fd, master)

    def _pty_readable(self, fd: int, master: int) -> None:
        try:
            data = os.read(master, PTY_READ_SIZE)
        except BlockingIOError:
            return
        except OSError as e:
            if e.errno != errno.EIO:  # EIO: every holder of the slave closed it
                _logger.warning("reading the pty of %s: %s", self.label, e)
            data = b""
        if data:
            self.feed(fd, data)
        else:
            self.on_eof(fd)

    async def read_pipe(self, fd: int, read_end: int) -> None:
        """Start carrying what the worker writes to the pipe behind its ``fd``."""
        pipe = open(read_end, "rb", buffering=0)
        try:
            transport, _ = await self.loop.connect_read_pipe(lambda: _PipeReader(self, fd), pipe)
        except BaseException:
            pipe.close()
            raise
        self.pipes[fd] = transport

    def feed(self, fd: int, data: bytes) -> None:
        sink = self.sinks.get(fd)
        if sink is not None:
            sink.feed(data)

    def on_eof(self, fd: int) -> None:
        pipe = self.pipes.pop(fd, None)
        if pipe is not None:
            pipe.close()
        master = self.ptys.pop(fd, None)
        if master is not None:
            self.loop.remove_reader(master)
            os.close(master)  # a process still holding the slave now gets EIO
        sink = self.sinks.get(fd)
        if sink is not None:
            sink.close()
        fut = self.eof.get(fd)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def finalize(self, log: Callable[[str], None]) -> WorkerExit:
        if self.exit is not None:
            return self.exit
        assert self.returncode is not None
        record: Mapping[str, Any] | None = None
        message = ""
        if self.returncode != 0:
            if self.spec.error_file:
                record, message = _read_error_file(self.spec.error_file, log)
            if not message:
                sink = self.sinks.get(2)
                if sink is not None:
                    message = sink.tail_text()
                elif self.stderr_file is not None:
                    message = _file_tail(self.stderr_file)
        self.exit = WorkerExit(
            local_rank=self.spec.local_rank,
            rank=self.spec.rank,
            pid=self.pid,
            exitcode=self.returncode,
            signal_name=procutil.signal_name(self.returncode),
            timestamp=self.reaped_at,
            error_message=message,
            error_record=record,
            error_file=self.spec.error_file if record is not None and self.spec.error_file else "",
        )
        return self.exit


class _PipeReader(asyncio.Protocol):
    """The read end of one worker stream's pipe (cold and warm workers alike)."""

    def __init__(self, worker: _Worker, fd: int) -> None:
        self._worker = worker
        self._fd = fd

    def data_received(self, data: bytes) -> None:
        self._worker.feed(self._fd, data)

    def eof_received(self) -> bool:
        return False  # the transport closes: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._worker.on_eof(self._fd)


class _WorkerProtocol(asyncio.SubprocessProtocol):
    """A cold worker's process (its pipes are ours: :class:`_PipeReader`)."""

    def __init__(self, worker: _Worker) -> None:
        self._worker = worker
        self._transport: asyncio.SubprocessTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.SubprocessTransport, transport)  # what subprocess_exec makes

    def process_exited(self) -> None:
        assert self._transport is not None
        returncode = self._transport.get_returncode()
        assert returncode is not None
        self._worker.on_exited(returncode)


class _Watchdog:
    """The agent's end of the watchdog (see procutil): a pipe to write pgids into.

    Spawned with plain ``subprocess.Popen`` (vfork, 0.5 ms) rather than through the event loop
    (3 ms, measured): it has no pipes for asyncio to carry, and its exit is awaited via a pidfd.
    """

    def __init__(
        self, fd: int, proc: subprocess.Popen[bytes], report_fd: int, witness: SignalWitness | None
    ) -> None:
        self._fd: int | None = fd
        self.proc = proc
        self.guarded: set[int] = set()  # process groups it would kill if we died now
        # The signals it receives (signal_witness.py), read in the loop until its EOF.
        self._report_fd: int | None = report_fd
        self._witness = witness
        os.set_blocking(report_fd, False)
        asyncio.get_running_loop().add_reader(report_fd, self._on_report)

    @property
    def witnessing(self) -> bool:
        """Its reports of signals can be had (it runs and its report pipe is open)."""
        return self._report_fd is not None and self.proc.poll() is None

    def _on_report(self) -> None:
        assert self._report_fd is not None
        try:
            data = os.read(self._report_fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close_report()
        elif self._witness is not None:
            self._witness.feed(data)

    def _close_report(self) -> None:
        if self._report_fd is not None:
            asyncio.get_running_loop().remove_reader(self._report_fd)
            os.close(self._report_fd)
            self._report_fd = None

    @property
    def usable(self) -> bool:
        """It can guard more groups: we hold its pipe and it has not exited."""
        return self._fd is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def start(
        cls, log: Callable[[str], None], remove_on_death: str = "", witness: SignalWitness | None = None
    ) -> _Watchdog | None:
        read_fd, write_fd = os.pipe()  # both close-on-exec: no worker inherits the write end
        report_read, report_write = os.pipe()
        try:
            proc = subprocess.Popen(
                procutil.watchdog_argv(read_fd, remove_on_death, report_write),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(read_fd, report_write),
                # Its own session, as every worker's: a Ctrl-C or a kill of the agent's process
                # group spares it, and a signal that reaches it reached the workers too.
                start_new_session=True,
            )
        except OSError as e:
            os.close(write_fd)
            os.close(report_read)
            log(f"cannot start the orphan watchdog ({e}); only PDEATHSIG protects against agent death")
            return None
        finally:
            os.close(read_fd)
            os.close(report_write)
        return cls(write_fd, proc, report_read, witness)

    def _send(self, message: bytes, log: Callable[[str], None]) -> None:
        if self._fd is None:
            return
        try:
            os.write(self._fd, message)
        except OSError as e:  # EPIPE: it died; PDEATHSIG still covers the workers themselves
            log(f"orphan watchdog is gone ({e}); grandchildren are no longer guarded")
            self._close()

    def guard(self, pgid: int, log: Callable[[str], None]) -> None:
        self.guarded.add(pgid)
        self._send(procutil.encode_guard(pgid), log)

    def forget(self, pgid: int, log: Callable[[str], None]) -> None:
        self.guarded.discard(pgid)
        self._send(procutil.encode_forget(pgid), log)

    def release(self, log: Callable[[str], None]) -> None:
        """The groups are gone: let it exit without killing anything."""
        self._send(procutil.WATCHDOG_QUIT, log)
        self._close()

    def fire(self) -> None:
        """Close the pipe without a quit: it SIGKILLs every guarded group, as if we had died."""
        self._close()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    async def wait_closed(self, timeout: float, log: Callable[[str], None]) -> None:
        """Wait for it to exit (it was released or fired) and reap it."""
        if self.proc.poll() is None and await _wait_pids_dead([self.proc.pid], timeout):
            log("orphan watchdog did not exit; killing it")
            self.proc.kill()
            await _wait_pids_dead([self.proc.pid], timeout)
        if self.proc.poll() is None:
            log(f"orphan watchdog (pid {self.proc.pid}) could not be reaped")
        self._close_report()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


async def _wait_futures(futures: Iterable[asyncio.Future[Any]], timeout: float) -> None:
    """Wait until all are done or ``timeout`` passes; never cancels them."""
    pending = [f for f in futures if not f.done()]
    if pending:
        await asyncio.wait(pending, timeout=max(0.0, timeout))


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def _wait_pids_dead(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait for processes that are not our children to die (become zombies); return the survivors.

    A pidfd turns readable when its process exits, so this is event-driven like everything else.
    """
    loop = asyncio.get_running_loop()
    futures: dict[int, asyncio.Future[None]] = {}
    fds: list[int] = []
    try:
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            fds.append(fd)
            fut: asyncio.Future[None] = loop.create_future()
            loop.add_reader(fd, _resolve, fut)
            futures[pid] = fut
        await _wait_futures(futures.values(), timeout)
        return [pid for pid, fut in futures.items() if not fut.done()]
    finally:
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)


class WorkerGroup:
    """A node's workers.  ``start``, then ``wait`` and/or ``stop``; after ``stop`` the group can
    ``start`` the next attempt's workers (each start gets fresh state).

    ``stop(keep_watchdog=True)`` (the agent's stop before a restart) leaves the watchdog running
    for the next ``start``, guarding nothing once the old groups are gone: a fresh one per
    attempt was a third Python interpreter starting beside the two new workers, 8 ms of a
    1-node restart measured on 2 cores.  A plain ``stop()`` (the last) releases it.

    ``guard_orphans=False`` turns off PDEATHSIG and the watchdog (for measuring their cost; a
    real agent keeps them on).
    """

    def __init__(
        self,
        *,
        stdout: TextIO | BinaryIO | None = None,
        stderr: TextIO | BinaryIO | None = None,
        log: Callable[[str], None] | None = None,
        guard_orphans: bool = True,
        warm: WarmPool | None = None,
        remove_on_death: str = "",
    ) -> None:
        self._log: Callable[[str], None] = log or _logger.info
        self._warm = warm  # --preload: where warm interpreters come from (None: always cold)
        # Resolved now, not at import time, so that a replaced sys.stdout (pytest, a wrapper) counts.
        self._stdout = Console(stdout if stdout is not None else sys.stdout, "stdout", self._log)
        self._stderr = Console(stderr if stderr is not None else sys.stderr, "stderr", self._log)
        self._filtered: dict[str, _SharedFile] = {}  # this attempt's filtered-lines files, by path
        self._pty_failed = False  # a pty could not be opened (logged once; pipes instead)
        self._guard_orphans = guard_orphans
        self._remove_on_death = remove_on_death  # the watchdog removes it if the agent dies
        self._workers: list[_Worker] = []
        self._watchdog: _Watchdog | None = None
        self._witness = SignalWitness()  # the watchdog's reports of the signals it received
        self._started = False  # start() was called at least once
        self._stop_lock = asyncio.Lock()
        self._stopped: GroupResult | None = None

    # --- public API ---------------------------------------------------------------------------

    @property
    def pids(self) -> dict[int, int]:
        return {w.spec.local_rank: w.pid for w in self._workers}

    async def start(self, specs: Sequence[WorkerSpec]) -> None:
        """Spawn every worker.  If one cannot be spawned, stop the others and raise WorkerSpawnError.

        A previous start's workers must have been stopped, or have all exited (then they are
        cleaned up here); starting over running workers is a RuntimeError.
        """
        ranks = [s.local_rank for s in specs]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"duplicate local ranks in {ranks}")
        if self._started and self._stopped is None:
            if any(not w.exited.done() for w in self._workers):
                raise RuntimeError("WorkerGroup.start() while the previous workers run; stop() them first")
            await self.stop(grace=0.0, keep_watchdog=True)
        self._started = True
        self._workers = []
        self._stopped = None
        loop = asyncio.get_running_loop()
        try:
            preexec = None
            if self._guard_orphans:
                if self._watchdog is None or not self._watchdog.usable:
                    if self._watchdog is not None:
                        await self._watchdog.wait_closed(REAP_TIMEOUT, self._log)
                    self._watchdog = _Watchdog.start(self._log, self._remove_on_death, self._witness)
                preexec = procutil.pdeathsig_preexec()
            for spec in specs:
                worker = await self._warm_worker(spec, loop, preexec)
                if worker is None:
                    worker = _Worker(spec, loop)
                try:
                    if not worker.warm:
                        await self._spawn(worker, loop, preexec)
                except OSError as e:
                    self._log(f"cannot start local_rank {spec.local_rank}: {spec.argv[0]}: {e.strerror or e}")
                    await self.stop(grace=0.0, sig=signal.SIGKILL)
                    raise WorkerSpawnError(spec.local_rank, spec.argv[0], e) from e
                self._workers.append(worker)
                if self._watchdog is not None:
                    self._watchdog.guard(worker.pid, self._log)
                if self._warm is not None:
                    # A worker that ends makes its rank warm a replacement at once.
                    worker.exited.add_done_callback(functools.partial(self._refill, spec.local_rank))
        except asyncio.CancelledError:
            self._kill_now()
            raise
        warm = [w.spec.local_rank for w in self._workers if w.warm]
        how = f" ({len(warm)} warm: local ranks {warm})" if warm else ""
        self._log(f"started {len(self._workers)} worker(s){how}, local_rank->pid {self.pids}")

    async def wait(self) -> GroupResult:
        """Return once every worker exited 0, or as soon as one exits non-zero (the rest keep
        running: call ``stop()``)."""
        if not self._started:
            raise RuntimeError("WorkerGroup.wait() before start()")
        if self._stopped is not None:
            return self._stopped
        while True:
            running = [w.exited for w in self._workers if not w.exited.done()]
            failed = any(w.returncode for w in self._workers if w.exited.done())
            if failed or not running:
                break
            await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        exited = [w for w in self._workers if w.exited.done()]
        await _wait_futures((f for w in exited for f in w.eof.values()), OUTPUT_SETTLE)
        return self._result()

    async def stop(
        self,
        *,
        grace: float,
        sig: int = signal.SIGTERM,
        reap_timeout: float = REAP_TIMEOUT,
        keep_watchdog: bool = False,
    ) -> GroupResult:
        """Stop every worker and everything in their process groups (policy: module header).
        Idempotent; the second call returns the first call's result (and, without
        ``keep_watchdog``, releases a watchdog the first one kept)."""
        async with self._stop_lock:
            if self._stopped is None:
                try:
                    self._stopped = await self._stop(grace, sig, reap_timeout)
                except asyncio.CancelledError:
                    self._kill_now()
                    raise
            if not keep_watchdog:
                await self._end_watchdog(reap_timeout)
            return self._stopped

    def fresh_line(self) -> None:
        """Call before the agent writes a line of its own to its stderr: end a partial line that
        a worker's output, passed through the agent, left there (or on stdout, when stdout and
        stderr are one file or terminal), so the agent's line starts a line of its own.  Output
        a worker writes straight to the agent's descriptor is not seen, so not ended."""
        self._stderr.break_line()
        if self._stdout.same_file(self._stderr):
            self._stdout.break_line()

    async def delivered(self, sig: int) -> bool:
        """Whether the workers have ``sig`` already from its sender, as the watchdog saw it too
        (signal_witness.py); False at once when there is no watchdog to ask."""
        if self._watchdog is None or not self._watchdog.witnessing:
            return False
        return await self._witness.delivered(sig)

    def send_signal(self, sig: int) -> None:
        """Forward a signal to the process group of every worker still running."""
        live = [w for w in self._workers if not w.exited.done()]
        if live:
            self._log(f"forwarding {procutil.signal_name(-sig)} to {len(live)} worker(s)")
        for w in live:
            procutil.killpg(w.pid, sig)

    # --- internals ----------------------------------------------------------------------------

    async def _spawn(
        self,
        worker: _Worker,
        loop: asyncio.AbstractEventLoop,
        preexec: Callable[[], None] | None,
        warm: WarmInterpreter | None = None,
    ) -> None:
        """Start the worker: a new process, or ``warm`` becoming it; the same descriptors,
        pipes and bookkeeping either way (WarmHandoffError if the warm one could not)."""
        spec = worker.spec
        if spec.error_file:
            # A file left from an earlier run would be read as this worker's error.
            try:
                os.unlink(spec.error_file)
            except FileNotFoundError:
                pass
        opened: list[BinaryIO] = []  # files the worker writes itself: our copies close after spawn
        ours: list[int] = []  # pipe write ends, pty slaves, /dev/null: the worker's now, ours close
        masters: dict[int, int] = {}  # worker fd -> pty master, read once the worker runs
        reads: dict[int, int] = {}  # worker fd -> pipe read end, read once the worker runs
        direct: dict[int, int | BinaryIO] = {}  # what the worker writes itself: our fd or its file
        try:
            stdio: dict[int, int] = {}  # worker fd -> the descriptor it gets there
            for fd, stream in ((1, Std.OUT), (2, Std.ERR)):
                route = _route(spec, stream)
                name = "stdout" if fd == 1 else "stderr"
                console = self._stdout if fd == 1 else self._stderr
                filters = spec.duplicate_stdout_filters if fd == 1 else spec.duplicate_stderr_filters
                filtered_path = spec.filtered_stdout_path if fd == 1 else spec.filtered_stderr_path
                filtered = self._filtered_file(filtered_path) if filters and filtered_path else None
                if not route.piped:
                    if route.file is None:
                        stdio[fd] = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
                        ours.append(stdio[fd])
                    else:
                        f = open(route.file, "wb")
                        opened.append(f)
                        stdio[fd] = f.fileno()
                        direct[fd] = f
                        if fd == 2:
                            worker.stderr_file = route.file
                    continue
                if route.console and not route.prefixed and route.file is None:
                    own = console.fileno()
                    if own is not None and fd == 1:
                        console.flush()
                        stdio[fd] = direct[fd] = own  # torchrun's way: the worker writes our stdout
                        continue
                    if own is not None and os.isatty(own):
                        pty = self._open_pty(own)
                        if pty is not None:
                            masters[fd], slave = pty
                            ours.append(slave)
                            stdio[fd] = slave
                if fd not in stdio:
                    reads[fd], stdio[fd] = os.pipe()
                    ours.append(stdio[fd])
                worker.sinks[fd] = _StreamSink(
                    label=f"local_rank {spec.local_rank} {name}",
                    file=open(route.file, "wb") if route.file else None,
                    console=console if route.console else None,
                    prefix=spec.prefix.encode() if route.prefixed else b"",
                    keep_tail=fd == 2,
                    log=self._log,
                    # torchrun filters the tee'd streams of the ranks it shows, with their prefix.
                    line_filter=LineFilter(filters, spec.prefix.encode())
                    if route.prefixed and filtered
                    else None,
                    filtered=filtered if route.prefixed else None,
                )
                worker.eof[fd] = loop.create_future()
            if warm is None:
                if preexec is not None or spec.cpus:  # (none: measuring the bare spawn)
                    preexec = procutil.worker_preexec(spec.cpus, preexec)
                try:
                    transport, _ = await loop.subprocess_exec(
                        lambda: _WorkerProtocol(worker),
                        *spec.argv,
                        stdin=None,  # inherited, as torchrun does: pdb in a worker still works
                        stdout=stdio[1],
                        stderr=stdio[2],
                        env=dict(spec.env),
                        cwd=spec.cwd,
                        start_new_session=True,
                        preexec_fn=preexec,
                    )
                except subprocess.SubprocessError as e:
                    # Our preexec_fn failed in the child: a --numa-binding the kernel refused.
                    cpus = sorted(spec.cpus or ())
                    raise OSError(errno.EINVAL, f"cannot bind it to CPUs {cpus} ({e})") from e
            else:
                transport = await self._hand_off(worker, warm, stdio, direct)
        except BaseException:
            for sink in worker.sinks.values():
                sink.close()
            for fd in (*masters.values(), *reads.values()):
                os.close(fd)
            raise
        finally:
            for copy in opened:
                copy.close()
            for fd in ours:
                os.close(fd)
        worker.transport = transport
        worker.pid = transport.get_pid()
        for fd, master in masters.items():
            worker.read_pty(fd, master)
        for fd, read_end in reads.items():
            await worker.read_pipe(fd, read_end)

    async def _hand_off(
        self,
        worker: _Worker,
        warm: WarmInterpreter,
        stdio: Mapping[int, int],
        direct: Mapping[int, int | BinaryIO],
    ) -> asyncio.SubprocessTransport:
        """Make a warm interpreter this worker: its warm-up's output first goes where the
        worker's would (so it comes before the worker's own), then it gets the descriptors a
        cold worker would get, stdin being ours as a cold worker inherits it."""
        spec = worker.spec
        for fd in (1, 2):
            data = warm.prelude(fd)
            if not data:
                continue
            if fd in worker.sinks:
                worker.feed(fd, data)
                continue
            target = direct.get(fd)
            try:
                if isinstance(target, int):
                    _write_all(target, data)
                elif target is not None:
                    target.write(data)
                    target.flush()
            except OSError as e:
                self._log(f"local_rank {spec.local_rank}: cannot write its preload output ({e})")
        fds = dict(stdio)
        if _is_open(0):
            fds[0] = 0
        await warm.handoff(
            argv=spec.argv,
            env=spec.env,
            cwd=spec.cwd or os.getcwd(),
            fds=fds,
            on_exit=worker.on_exited,
        )
        assert warm.transport is not None
        worker.warm = True
        return warm.transport

    async def _warm_worker(
        self, spec: WorkerSpec, loop: asyncio.AbstractEventLoop, preexec: Callable[[], None] | None
    ) -> _Worker | None:
        """The worker made from this rank's warm interpreter, or None: start it cold (the
        pool said why).  A failed handoff leaves nothing behind: the pool kills that one."""
        pool = self._warm
        if pool is None:
            return None
        interp = await pool.take(spec.local_rank, spec.argv, spec.env, spec.cpus)
        if interp is None:
            return None
        worker = _Worker(spec, loop)
        try:
            await self._spawn(worker, loop, preexec, interp)
        except (WarmHandoffError, OSError) as e:
            pool.failed(interp, e)
            return None
        except BaseException:
            pool.discard(interp)
            raise
        pool.taken(spec.local_rank)
        return worker

    def _refill(self, local_rank: int, _exited: object = None) -> None:
        if self._warm is not None:
            self._warm.refill(local_rank)

    def _open_pty(self, like_fd: int) -> tuple[int, int] | None:
        try:
            return open_pty(like_fd)
        except OSError as e:  # no /dev/pts in this container, out of ptys
            if not self._pty_failed:
                self._pty_failed = True
                self._log(f"cannot open a pty ({e}); workers' stderr is a pipe, not a terminal")
            return None

    def _filtered_file(self, path: str) -> _SharedFile:
        shared = self._filtered.get(path)
        if shared is None:
            shared = self._filtered[path] = _SharedFile(path, self._log)
        return shared

    def _result(self) -> GroupResult:
        exits = tuple(w.finalize(self._log) for w in self._workers if w.exited.done())
        failures = [e for e in exits if e.failed]
        first = min(failures, key=lambda e: (e.timestamp, e.local_rank)) if failures else None
        state: Literal["succeeded", "failed"] = "failed" if failures else "succeeded"
        return GroupResult(state=state, exits=exits, first_failure=first)

    def _forget_gone_groups(self) -> None:
        for w in self._workers:
            if w.exited.done() and not w.group_gone and not procutil.group_exists(w.pid):
                w.group_gone = True
                if self._watchdog is not None:
                    self._watchdog.forget(w.pid, self._log)

    async def _stop(self, grace: float, sig: int, reap_timeout: float) -> GroupResult:
        workers = self._workers
        live = [w for w in workers if not w.exited.done()]
        if live:
            how = f"with {procutil.signal_name(-sig)}" if sig else "(they have the signal already)"
            self._log(
                f"stopping {len(live)} worker(s) {how}, grace {grace:g}s: "
                f"local ranks {[w.spec.local_rank for w in live]}"
            )
        # The groups of workers that already exited may still hold their children: signal those too.
        self._forget_gone_groups()
        for w in workers:
            if not w.group_gone:
                procutil.killpg(w.pid, sig)
        if sig != signal.SIGKILL:
            await _wait_futures((w.exited for w in live), grace)
        stubborn = [w for w in live if not w.exited.done()]
        if stubborn:
            if sig != signal.SIGKILL:
                self._log(
                    f"{len(stubborn)} worker(s) still running after {grace:g}s: SIGKILL "
                    f"{', '.join(w.label for w in stubborn)}"
                )
            for w in stubborn:
                procutil.killpg(w.pid, signal.SIGKILL)
            await _wait_futures((w.exited for w in stubborn), reap_timeout)
            for w in stubborn:
                if not w.exited.done():
                    self._log(f"{w.label} survived SIGKILL for {reap_timeout:g}s (uninterruptible sleep?)")
        await self._kill_leftovers(reap_timeout)

        eofs = [f for w in workers for f in w.eof.values()]
        await _wait_futures(eofs, DRAIN_TIMEOUT)
        held = [w.label for w in workers if any(not f.done() for f in w.eof.values())]
        if held:
            self._log(
                f"output of {', '.join(held)} still open after its processes died (held by a "
                "process that left the group); no longer read"
            )
        for w in workers:
            for fd in list(w.eof):
                w.on_eof(fd)
            if w.transport is not None:
                w.transport.close()
        for shared in self._filtered.values():
            shared.close()
        self._filtered.clear()
        return self._result()

    async def _end_watchdog(self, reap_timeout: float) -> None:
        """Let the watchdog go, and reap it (a later ``start`` makes a new one)."""
        watchdog = self._watchdog
        if watchdog is None or watchdog.proc.returncode is not None:
            return
        if watchdog.guarded:  # a worker in uninterruptible sleep: let it keep trying when we exit
            watchdog.fire()
        else:
            watchdog.release(self._log)
        await watchdog.wait_closed(reap_timeout, self._log)

    async def _kill_leftovers(self, timeout: float) -> None:
        """SIGKILL whatever is still alive in the workers' process groups and wait for it to die."""
        self._forget_gone_groups()
        pgids = {w.pid for w in self._workers if w.pid and not w.group_gone}
        if not pgids:
            return
        members = procutil.live_group_members(pgids)
        pids = [pid for group in members.values() for pid in group]
        if not pids:
            return
        self._log(f"killing {len(pids)} leftover process(es) in the workers' process groups: {sorted(pids)}")
        for pgid in members:
            procutil.killpg(pgid, signal.SIGKILL)
        survivors = await _wait_pids_dead(pids, timeout)
        if survivors:
            self._log(f"process(es) {survivors} survived SIGKILL for {timeout:g}s (uninterruptible sleep?)")
        self._forget_gone_groups()

    def _kill_now(self) -> None:
        """Cancellation path: SIGKILL every group at once, without waiting for anything."""
        for w in self._workers:
            if w.pid and not w.group_gone:
                procutil.killpg(w.pid, signal.SIGKILL)
        if self._watchdog is not None:
            self._watchdog.fire()
