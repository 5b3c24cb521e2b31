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
import contextlib
import errno
import functools
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import BinaryIO, Literal, TextIO, cast

from node_agent.supervisor import procutil
from node_agent.supervisor.console import Console, LineFilter, open_pty
from node_agent.supervisor.signal_witness import SignalWitness
from node_agent.supervisor.warm import WarmInterpreter, WarmPool, hand_off

from .output import SharedFile, StreamPlan, StreamSink, plan_stdio
from .parking import COMMIT_POLL_S, RELEASE_S, Parking, folder_of
from .process import (
    OUTPUT_SETTLE,
    Watchdog,
    Worker,
    WorkerProtocol,
    wait_futures,
    wait_pids_dead,
)
from .spec import DRAIN_TIMEOUT, REAP_TIMEOUT, GroupResult, WorkerSpawnError, WorkerSpec

_logger = logging.getLogger(__name__)


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
        self._filtered: dict[str, SharedFile] = {}  # this attempt's filtered-lines files, by path
        self._pty_failed = False  # a pty could not be opened (logged once; pipes instead)
        self._guard_orphans = guard_orphans
        self._remove_on_death = remove_on_death  # the watchdog removes it if the agent dies
        self._workers: list[Worker] = []
        self._watchdog: Watchdog | None = None
        self._witness = SignalWitness()  # the watchdog's reports of the signals it received
        self._started = False  # start() was called at least once
        self._stop_lock = asyncio.Lock()
        self._stopped: GroupResult | None = None
        # Survivors of the last attempt that run under worker.run, parked by stop(park=True)
        # for the next start to give their next place (parking.py), by local rank.
        self._parked: dict[int, Worker] = {}
        self._parking = Parking()

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
            await self.stop(grace=0.0, keep_watchdog=True, park=True)  # (those parked at a commit stay)
        self._started = True
        self._workers = []
        self._stopped = None
        loop = asyncio.get_running_loop()
        in_place = await self._place_parked(specs)
        try:
            preexec = None
            if self._guard_orphans:
                if self._watchdog is None or not self._watchdog.usable:
                    if self._watchdog is not None:
                        await self._watchdog.wait_closed(REAP_TIMEOUT, self._log)
                    self._watchdog = Watchdog.start(self._log, self._remove_on_death, self._witness)
                preexec = procutil.pdeathsig_preexec()
            for spec in specs:
                if spec.local_rank in in_place:
                    continue
                worker = await self._warm_worker(spec, loop, preexec)
                if worker is None:
                    worker = Worker(spec, loop)
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
        self._workers.sort(key=lambda w: w.spec.local_rank)
        warm = [w.spec.local_rank for w in self._workers if w.warm and w.spec.local_rank not in in_place]
        how = f" ({len(warm)} warm: local ranks {warm})" if warm else ""
        if in_place:
            how += f" ({len(in_place)} in place: local ranks {sorted(in_place)})"
        self._log(f"started {len(self._workers)} worker(s){how}, local_rank->pid {self.pids}")

    async def wait(self) -> GroupResult:
        """Return once every worker exited 0, or as soon as one exits non-zero (the rest keep
        running: call ``stop()``). A worker whose ``worker.run`` attempt ended at a commit
        point counts as exited 0 and is kept, parked, for the next start (parking.py)."""
        if not self._started:
            raise RuntimeError("WorkerGroup.wait() before start()")
        if self._stopped is not None:
            return self._stopped
        while True:
            live = [w for w in self._workers if not w.exited.done()]
            failed = any(w.returncode for w in self._workers if w.exited.done())
            if failed or not live:
                break
            if self._all_committed(live):
                break
            # A worker may call worker.run only after its imports: look every poll.
            poll = COMMIT_POLL_S if any(folder_of(w) for w in live) else None
            await asyncio.wait([w.exited for w in live], timeout=poll, return_when=asyncio.FIRST_COMPLETED)
        exited = [w for w in self._workers if w.exited.done()]
        await wait_futures((f for w in exited for f in w.eof.values()), OUTPUT_SETTLE)
        return self._result()

    async def stop(
        self,
        *,
        grace: float,
        sig: int = signal.SIGTERM,
        reap_timeout: float = REAP_TIMEOUT,
        keep_watchdog: bool = False,
        park: bool = False,
    ) -> GroupResult:
        """Stop every worker and everything in their process groups (policy: module header).
        Idempotent; the second call returns the first call's result (and, without
        ``keep_watchdog``, releases a watchdog the first one kept).

        ``park``: the job restarts; workers running under ``worker.run`` leave their attempt
        and wait, alive, for the next ``start`` to give them their place (parking.py); the
        rest stop as above. A stop without ``park`` stops parked workers too."""
        async with self._stop_lock:
            if self._parked and not park:
                released = [w for w in self._parked.values() if self._parking.release(w)]
                if released:  # a commit's survivors the job goes on without: they end cleanly
                    await wait_futures((w.exited for w in released), RELEASE_S)
                self._workers = [*self._workers, *self._parked.values()]
                self._parked = {}
                self._stopped = None
            if self._stopped is None:
                if park:
                    await self._park()
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
        worker: Worker,
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
            consoles = {1: self._stdout, 2: self._stderr}
            own = {fd: c.fileno() for fd, c in consoles.items()}
            for plan in self._plans(spec):
                fd = plan.fd
                console = consoles[fd]
                filtered_path = spec.filtered_stdout_path if fd == 1 else spec.filtered_stderr_path
                filters = spec.duplicate_stdout_filters if fd == 1 else spec.duplicate_stderr_filters
                # The attempt's filtered file exists whenever filters are given (torchrun's).
                shared = self._filtered_file(filtered_path) if filters and filtered_path else None
                if plan.how == "devnull":
                    stdio[fd] = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
                    ours.append(stdio[fd])
                    continue
                if plan.how == "file":
                    assert plan.file is not None
                    f = open(plan.file, "wb")
                    opened.append(f)
                    stdio[fd] = f.fileno()
                    direct[fd] = f
                    if fd == 2:
                        worker.stderr_file = plan.file
                    continue
                if plan.how == "console":
                    console.flush()
                    stdio[fd] = direct[fd] = cast(int, own[fd])  # the worker writes our stdout
                    continue
                if plan.how == "pty":
                    pty = self._open_pty(cast(int, own[fd]))
                    if pty is not None:
                        masters[fd], slave = pty
                        ours.append(slave)
                        stdio[fd] = slave
                if fd not in stdio:
                    reads[fd], stdio[fd] = os.pipe()
                    ours.append(stdio[fd])
                worker.sinks[fd] = StreamSink(
                    label=f"local_rank {spec.local_rank} {'stdout' if fd == 1 else 'stderr'}",
                    file=open(plan.file, "wb") if plan.file else None,
                    console=console if plan.console else None,
                    prefix=spec.prefix.encode() if plan.prefixed else b"",
                    keep_tail=plan.keep_tail,
                    log=self._log,
                    line_filter=LineFilter(filters, spec.prefix.encode()) if plan.filtered else None,
                    filtered=shared if plan.prefixed else None,
                )
                worker.eof[fd] = loop.create_future()
            if warm is None:
                if preexec is not None or spec.cpus:  # (none: measuring the bare spawn)
                    preexec = procutil.worker_preexec(spec.cpus, preexec)
                try:
                    transport, _ = await loop.subprocess_exec(
                        lambda: WorkerProtocol(worker),
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
                transport = await hand_off(worker, warm, stdio, direct, self._log)
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

    async def _warm_worker(
        self, spec: WorkerSpec, loop: asyncio.AbstractEventLoop, preexec: Callable[[], None] | None
    ) -> Worker | None:
        """The worker made from this rank's warm interpreter (warm.py), or None: start it cold."""
        if self._warm is None:
            return None

        async def become(interp: WarmInterpreter) -> Worker:
            worker = Worker(spec, loop)
            await self._spawn(worker, loop, preexec, interp)
            return worker

        return await self._warm.become(spec, become)

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

    def _plans(self, spec: WorkerSpec) -> tuple[StreamPlan, StreamPlan]:
        own = {fd: c.fileno() for fd, c in ((1, self._stdout), (2, self._stderr))}
        ttys = {d: os.isatty(d) for d in own.values() if d is not None}
        return plan_stdio(spec, own, ttys)

    def _move_logs(self, w: Worker, spec: WorkerSpec) -> dict[str, str]:
        """A survivor's output goes to the new attempt's files, as a new worker's would (issue
        44): the streams that pass through us are switched here; the files it writes itself
        (``--redirects`` without ``--tee``) come back, by descriptor, for it to reopen."""
        if spec.error_file:
            with contextlib.suppress(OSError):
                os.unlink(spec.error_file)  # not an earlier run's, read as this worker's error
        reopen: dict[str, str] = {}
        for plan in self._plans(spec):
            fd = plan.fd
            if plan.how == "file" and plan.file is not None:
                reopen[str(fd)] = plan.file
                if fd == 2:
                    w.stderr_file = plan.file
            sink = w.sinks.get(fd)
            if sink is None or plan.how not in ("pipe", "pty"):
                continue
            file: BinaryIO | None = None
            if plan.file:
                try:
                    file = open(plan.file, "wb")
                except OSError as e:
                    self._log(f"local_rank {spec.local_rank}: cannot open {plan.file} ({e}); no file output")
            filtered_path = spec.filtered_stdout_path if fd == 1 else spec.filtered_stderr_path
            shared = self._filtered_file(filtered_path) if plan.filtered and filtered_path else None
            sink.retarget(file, shared)
        return reopen

    def _filtered_file(self, path: str) -> SharedFile:
        shared = self._filtered.get(path)
        if shared is None:
            shared = self._filtered[path] = SharedFile(path, self._log)
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
            await wait_futures((w.exited for w in live), grace)
        stubborn = [w for w in live if not w.exited.done()]
        if stubborn:
            if sig != signal.SIGKILL:
                self._log(
                    f"{len(stubborn)} worker(s) still running after {grace:g}s: SIGKILL "
                    f"{', '.join(w.label for w in stubborn)}"
                )
            for w in stubborn:
                procutil.killpg(w.pid, signal.SIGKILL)
            await wait_futures((w.exited for w in stubborn), reap_timeout)
            for w in stubborn:
                if not w.exited.done():
                    self._log(f"{w.label} survived SIGKILL for {reap_timeout:g}s (uninterruptible sleep?)")
        await self._kill_leftovers(reap_timeout)

        eofs = [f for w in workers for f in w.eof.values()]
        await wait_futures(eofs, DRAIN_TIMEOUT)
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
        survivors = await wait_pids_dead(pids, timeout)
        if survivors:
            self._log(f"process(es) {survivors} survived SIGKILL for {timeout:g}s (uninterruptible sleep?)")
        self._forget_gone_groups()

    async def _park(self) -> None:
        """Park the survivors that can be (they leave ``_workers``: the stop leaves them be)."""
        live = [w for w in self._workers if not w.exited.done()]
        if not live:
            return
        parked = await self._parking.park(live)
        if parked:
            self._parked = {w.spec.local_rank: w for w in parked}
            self._workers = [w for w in self._workers if w not in parked]
            ranks = sorted(self._parked)
            self._log(
                f"{len(parked)} worker(s) left their attempt and wait for the next round: local ranks {ranks}"
            )

    def _all_committed(self, live: list[Worker]) -> bool:
        """Every live worker's attempt ended at a commit point: they leave ``_workers``, parked
        (the next start places them; a stop without ``park`` stops them)."""
        if not all(self._parking.committed(w) for w in live):
            return False
        self._parked = {w.spec.local_rank: w for w in live}
        self._workers = [w for w in self._workers if w not in live]
        self._log(
            f"{len(live)} worker(s) stopped at a commit point and wait for the next round: "
            f"local ranks {sorted(self._parked)}"
        )
        return True

    async def _place_parked(self, specs: Sequence[WorkerSpec]) -> set[int]:
        """Give parked survivors their place in this start; the local ranks placed. One that
        died meanwhile, or has no place now, is stopped (its rank starts afresh)."""
        parked, self._parked = self._parked, {}
        placed: set[int] = set()
        wanted = {s.local_rank: s for s in specs}
        for lr, w in parked.items():
            spec = wanted.get(lr)
            if spec is None or w.exited.done():
                continue
            if self._parking.place(w, spec.env, self._move_logs(w, spec)):
                w.spec = spec
                self._workers.append(w)
                placed.add(lr)
        leftover = [w for lr, w in parked.items() if lr not in placed]
        if leftover:
            workers, self._workers = self._workers, leftover
            try:
                await self._stop(0.0, signal.SIGKILL, REAP_TIMEOUT)
            finally:
                self._workers = workers
        return placed

    def _kill_now(self) -> None:
        """Cancellation path: SIGKILL every group at once, without waiting for anything."""
        for w in [*self._workers, *self._parked.values()]:
            if w.pid and not w.group_gone:
                procutil.killpg(w.pid, signal.SIGKILL)
        if self._watchdog is not None:
            self._watchdog.fire()
