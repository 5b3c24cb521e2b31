"""The I/O side of watching the training: one round's pages, their poll, and stack dumps.

The decisions are :mod:`node_agent.machine.training`'s and :mod:`node_agent.machine.watch`'s (pure); this
module only reads what they need and carries out what they ask: it creates each rank's page
before the worker starts (``node_agent.worker`` attaches to it), reads every page each poll
interval into a :class:`~node_agent.machine.training.ProgressRead` (every :data:`ARMING_POLL_S` while a
commit point waits for its ranks' acknowledgements), writes the stop records a
:class:`~node_agent.machine.training.WriteStop` asks for, and on
:class:`~node_agent.machine.training.DumpStacks` collects every local rank's stacks (bounded in time),
pokes torch's flight recorder, writes the node's hang report into the attempt's log dir and
answers :class:`~node_agent.machine.training.StacksDumped`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any

from protocol import Stacks
from protocol.messages import MAX_PHASE_LEN, MAX_STACK_LEN, MAX_STACK_RANKS, MAX_TIMEOUT

from ..machine.events import DumpStacks, Effect, JobHangReport, ProgressRead, StacksDumped, WriteStop
from ..parts import RoundPart, RoundStart
from .pages import PageSet, create_page

if TYPE_CHECKING:
    from protocol import Assignment

    from ..machine.training import Training
    from ..supervisor.spec import GroupResult
    from .pages import RankSample

STACKS_TIMEOUT = 5.0  # every rank's stacks, in all
# The poll while an armed commit step waits for every local rank to see it: the server's
# choice of the step allows for one such poll (a read costs about a microsecond a page).
ARMING_POLL_S = 0.02


class RoundPages:
    """The progress pages of one round's workers (created before the workers start)."""

    def __init__(self, paths: list[str], rank_offset: int, fr_pipe_stem: str, report_path: str) -> None:
        for path in paths:
            create_page(path)
        self.paths = paths
        self.rank_offset = rank_offset
        self.fr_pipe_stem = fr_pipe_stem
        self.report_path = report_path
        self.pages = PageSet(paths)
        self.wake = asyncio.Event()  # a stop record was written: poll now, not at the next interval

    def read(self) -> ProgressRead:
        return ProgressRead(self.pages.check())

    def write_stop(self, eff: WriteStop) -> None:
        """Write every page's stop record and have the poll read the pages at once."""
        self.pages.write_stop(eff.step, eff.state)
        self.wake.set()

    def close(self) -> None:
        self.pages.close()


async def poll(pages: RoundPages, interval: Callable[[], float], put: Callable[[ProgressRead], None]) -> None:
    """Read every page each ``interval()`` seconds (asked anew each time) and hand the
    machine what was read; a stop record written meanwhile cuts the wait short."""
    while True:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(pages.wake.wait(), interval())
        pages.wake.clear()
        put(pages.read())


async def dump(eff: DumpStacks, pages: RoundPages, pids: Mapping[int, int], node: str) -> StacksDumped:
    """Every local rank's stacks (hung ranks first), the node's report written, the message
    for the server built; bounded by ``STACKS_TIMEOUT`` whatever the ranks do."""
    from protocol.hang_report import Entry, compact, merge, render, render_raw

    from .stacks import Target, collect, poke_flight_recorder, write_report

    samples = pages.pages.read()
    read_ns = time.monotonic_ns()  # the workers' progress clock (node_agent.worker)
    hung = {h.local_rank: h for h in eff.hung}
    order = sorted(range(len(pages.paths)), key=lambda lr: (lr not in hung, lr))
    targets = []
    for lr in order:
        s = samples[lr] if lr < len(samples) else None
        pid = pids.get(lr, 0)
        targets.append(
            Target(
                local_rank=lr,
                rank=pages.rank_offset + lr,
                pid=pid,
                stack_signal=s.stack_signal if s is not None and s.pid == pid else 0,
                page_path=pages.paths[lr],
            )
        )
    poke_flight_recorder(pages.fr_pipe_stem, [t.rank for t in targets])
    got = await collect(targets, timeout=STACKS_TIMEOUT)
    by_rank = {g.rank: g for g in got}
    entries = []
    for t in targets:
        s = samples[t.local_rank] if t.local_rank < len(samples) else None
        h = hung.get(t.local_rank)
        silent = h.silent_s if h is not None else _silence(s, read_ns)
        step = h.step if h is not None else (s.step if s is not None else -1)
        phase = h.phase if h is not None else (s.phase if s is not None else "")
        g = by_rank.get(t.rank)
        entries.append(
            Entry(
                rank=t.rank,
                step=step,
                phase=phase,
                silent_s=silent,
                text=g.text if g is not None else "",
                hung=h is not None,
                source=g.source if g is not None else "",
                node=node,
            )
        )
    report = merge(entries, hung=[pages.rank_offset + lr for lr in hung])
    # Our ranks only: when they all wait in a collective, the rank they wait for is another
    # node's, which only the job-wide report (the server's, added here once it comes) names.
    text = f"node {node}'s hang report (its own ranks only; the job-wide one merges every node's)\n"
    text += render(report)
    full = f"{text}\n\nEach rank's stacks as collected:\n\n{render_raw(entries)}"
    path = pages.report_path if write_report(pages.report_path, full) else ""
    sent = entries[:MAX_STACK_RANKS]
    stacks = Stacks(
        round=eff.round,
        ranks=tuple(e.rank for e in sent),
        steps=tuple(e.step for e in sent),
        phases=tuple(e.phase[:MAX_PHASE_LEN] for e in sent),
        silent_s=tuple(min(e.silent_s, MAX_TIMEOUT) for e in sent),
        stacks=tuple(compact(e.text, MAX_STACK_LEN) for e in sent),
    )
    return StacksDumped(stacks=stacks, report=text, path=path)


def _silence(s: RankSample | None, now_ns: int) -> float:
    """Seconds since a rank not found hung (another node's hang) last made progress: the
    job-wide report compares it with the hung ones (0: it reported none)."""
    if s is None or s.step < 0:
        return 0.0
    return min(max(0, now_ns - s.progress_ns) / 1e9, MAX_TIMEOUT)


def add_job_report(path: str, text: str) -> bool:
    """Add the server's job-wide hang report (escaped) after what ``path`` holds; False if it
    could not be written."""
    from ..machine.training import JOB_REPORT_TITLE
    from .stacks import append_report

    return append_report(path, f"\n\n{JOB_REPORT_TITLE}:\n\n{text}\n")


class RoundWatch(RoundPart):
    """The runner's side of watching the training, round after round: this round's pages,
    their poll, a stack dump under way and the server's job-wide report filed into the
    round's report file. ``spawn`` runs a task in the run's task group; ``put`` hands the
    machine an event; ``log`` is the agent's log; ``pids`` the running workers' (by local
    rank) and ``node`` this node's id, for a stack dump.

    One of the agent's parts (``parts.py``): the pages are made before the workers start
    (:meth:`before_start`), polled while they run (:meth:`started`), read once more when they
    exit (:meth:`after_exit`); a stop waits for a dump under way (:meth:`stopping`); the stack
    dump, the stop records and the job's hang report are its effects (:meth:`carry_out`)."""

    name = "watch"

    def __init__(
        self,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
        put: Callable[[Any], None],
        log: Callable[[str], None],
        *,
        pids: Callable[[], Mapping[int, int]] = dict,
        node: str = "",
    ) -> None:
        self._spawn = spawn
        self._put = put
        self._log = log
        self._pids = pids
        self._node = node
        self.pages: RoundPages | None = None
        self._poll_every = 1.0
        self._training: Training | None = None  # the machine's: its arming step picks the poll
        self._poll_task: asyncio.Task[None] | None = None
        self._dump_task: asyncio.Task[None] | None = None
        # The server's job-wide hang report filed (report path, text): a dump that ends after
        # it writes the file anew, and files it again.
        self._job_report: tuple[str, str] | None = None

    def follow(self, training: Training | None) -> None:
        """The machine's view of the training (None: nothing watched; the poll still reads)."""
        self._training = training
        self._poll_every = training.policy.poll_interval_s() if training else 1.0

    # -- the agent's part (parts.py) --------------------------------------------------------

    async def before_start(self, r: RoundStart) -> dict[int, dict[str, str]]:
        attempt = r.attempt
        paths = [attempt.page_path(lr) for lr in range(r.nproc)]
        self.start_round(
            paths, r.assignment.rank_offset, attempt.flight_recorder_stem("pipe"), attempt.hang_report_path()
        )
        return {}

    def started(self, a: Assignment, pids: Mapping[int, int]) -> None:
        self.start_poll()

    def stopping(self) -> asyncio.Task[None] | None:
        return self.stop()

    def after_exit(self, result: GroupResult, *, stopped: bool) -> ProgressRead | None:
        """The workers exited by themselves: the steps reported since the last poll (the
        failure report carries the highest). Nothing after a stop (the poll ended first)."""
        return None if stopped else self.read()

    def carry_out(self, eff: Effect) -> bool:
        if isinstance(eff, DumpStacks):
            self.dump(eff, self._pids(), self._node)
        elif isinstance(eff, WriteStop):
            self.write_stop(eff)
        elif isinstance(eff, JobHangReport):
            self.file_job_report(eff)
        else:
            return False
        return True

    async def close(self, *, succeeded: bool = False) -> None:
        if self.pages is not None:
            self.pages.close()

    # -- round by round ----------------------------------------------------------------------

    def start_round(self, paths: list[str], rank_offset: int, fr_pipe_stem: str, report_path: str) -> None:
        """The round's pages, created before its workers start (the last round's closed)."""
        if self.pages is not None:
            self.pages.close()
        self.pages = RoundPages(paths, rank_offset, fr_pipe_stem, report_path)

    def start_poll(self) -> None:
        assert self.pages is not None
        self._poll_task = self._spawn(poll(self.pages, self._poll_interval, self._put))

    def _poll_interval(self) -> float:
        """Fast while a commit step waits for our ranks to see it, else the watch's interval."""
        t = self._training
        return ARMING_POLL_S if t is not None and t.arming is not None else self._poll_every

    def read(self) -> ProgressRead | None:
        """The pages now (the steps reported since the last poll), or None before any round."""
        return None if self.pages is None else self.pages.read()

    def write_stop(self, eff: WriteStop) -> None:
        if self.pages is not None:
            self.pages.write_stop(eff)

    def dump(self, eff: DumpStacks, pids: Mapping[int, int], node: str) -> None:
        self._dump_task = self._spawn(self._dump(eff, pids, node))

    async def _dump(self, eff: DumpStacks, pids: Mapping[int, int], node: str) -> None:
        assert self.pages is not None
        try:
            done = await dump(eff, self.pages, pids, node)
            if self._job_report is not None and done.path == self._job_report[0]:
                add_job_report(*self._job_report)  # the dump wrote the file anew
        finally:
            self._dump_task = None
        self._put(done)

    def file_job_report(self, eff: JobHangReport) -> None:
        """The job's hang report, from the server, into this round's report file."""
        if self.pages is None:
            return  # no round of ours ran: nothing to add it to
        path = self.pages.report_path
        self._job_report = (path, eff.text)
        if add_job_report(path, eff.text):
            from ..machine.training import JOB_REPORT_TITLE

            self._log(f"{JOB_REPORT_TITLE} is in {path}")

    def stop(self) -> asyncio.Task[None] | None:
        """The workers are being stopped: the poll ends; the dump under way, if any, which
        the stop waits for (a rank signalled mid-dump could die halfway)."""
        if self._poll_task is not None:
            self._poll_task.cancel()
            self._poll_task = None
        return self._dump_task
