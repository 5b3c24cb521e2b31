"""One worker process and its guards: its exit and output callbacks (pipes, ptys), the orphan
watchdog the agent keeps beside its workers, and waiting for processes to die by pidfd."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

from node_agent.supervisor import procutil
from node_agent.supervisor.signal_witness import SignalWitness

from .output import StreamSink, file_tail, read_error_file
from .spec import WorkerExit, WorkerSpec

_logger = logging.getLogger(__name__)

# After a worker exits, how long its pipes may take to reach EOF before its exit is reported.
# The worker's own copies close before it is reaped, so this bound matters only when a child of
# the worker still holds them; the output already in the pipe is read within that time.
OUTPUT_SETTLE = 0.2
# One read of a pty master (a pipe's reads are the event loop's).
PTY_READ_SIZE = 64 * 1024


class Worker:
    """One worker's process, pipes and bookkeeping; its protocol feeds it."""

    def __init__(self, spec: WorkerSpec, loop: asyncio.AbstractEventLoop) -> None:
        self.spec = spec
        self.loop = loop
        self.transport: asyncio.SubprocessTransport | None = None
        self.pid = 0
        self.sinks: dict[int, StreamSink] = {}
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
        # Restarts in place (parking.py): the serial of the last place given (a state the worker
        # wrote before it is stale), and its state file's identity when last read with whether
        # it said "committed" (the file is read again only when it changed).
        self.place_serial = -1
        self.state_seen: tuple[tuple[int, int, int], bool] | None = None

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
        message = problem = ""
        if self.returncode != 0:
            if self.spec.error_file:
                record, message, problem = read_error_file(self.spec.error_file, log)
            if not message:
                sink = self.sinks.get(2)
                if sink is not None:
                    message = sink.tail_text()
                elif self.stderr_file is not None:
                    message = file_tail(self.stderr_file)
            if problem:  # last: the report's headline stays the stderr tail's first line
                note = f"(the error file {self.spec.error_file} is not used: {problem})"
                tail = message.rstrip("\n")
                message = f"{tail}\n{note}" if tail.strip() else note
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

    def __init__(self, worker: Worker, fd: int) -> None:
        self._worker = worker
        self._fd = fd

    def data_received(self, data: bytes) -> None:
        self._worker.feed(self._fd, data)

    def eof_received(self) -> bool:
        return False  # the transport closes: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._worker.on_eof(self._fd)


class WorkerProtocol(asyncio.SubprocessProtocol):
    """A cold worker's process (its pipes are ours: :class:`_PipeReader`)."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self._transport: asyncio.SubprocessTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.SubprocessTransport, transport)  # what subprocess_exec makes

    def process_exited(self) -> None:
        assert self._transport is not None
        returncode = self._transport.get_returncode()
        assert returncode is not None
        self._worker.on_exited(returncode)


class Watchdog:
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
    ) -> Watchdog | None:
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
        if self.proc.poll() is None and await wait_pids_dead([self.proc.pid], timeout):
            log("orphan watchdog did not exit; killing it")
            self.proc.kill()
            await wait_pids_dead([self.proc.pid], timeout)
        if self.proc.poll() is None:
            log(f"orphan watchdog (pid {self.proc.pid}) could not be reaped")
        self._close_report()


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


async def wait_futures(futures: Iterable[asyncio.Future[Any]], timeout: float) -> None:
    """Wait until all are done or ``timeout`` passes; never cancels them."""
    pending = [f for f in futures if not f.done()]
    if pending:
        await asyncio.wait(pending, timeout=max(0.0, timeout))


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def wait_pids_dead(pids: Iterable[int], timeout: float) -> list[int]:
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
        await wait_futures(futures.values(), timeout)
        return [pid for pid, fut in futures.items() if not fut.done()]
    finally:
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)
