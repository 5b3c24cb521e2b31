"""The agent's view of its ranks' training: progress summaries and hang verdicts (pure).

Part of :class:`~node_agent.machine.agent.AgentMachine`: the machine hands it what the I/O layer read
from the ranks' progress pages (:class:`ProgressRead`) and the stacks it collected
(:class:`StacksDumped`); this module decides when the server hears a summary, when a rank is
hung, and what the failure report of a hang says. The budgets are :mod:`node_agent.machine.watch`'s.

A hang, step by step (the README's "Progress, hangs and stragglers" tells it for users):

1. the watch says local ranks R made no progress past their deadline: the agent tells the
   server (``HangDetected``, which asks every node of the job for its stacks) and collects its
   own ranks' stacks (``DumpStacks``), all of them, bounded in time;
2. the stacks are in (``StacksDumped``): they go to the server (``Stacks``), the node's report
   is in the attempt's log dir, and the hang becomes this node's worker failure: the workers
   are stopped (SIGTERM, grace, SIGKILL) and the server decides, as for any failure, whether
   the job restarts (a hang uses the restart budget). Unless every hung rank made progress
   again while its stacks were collected (:meth:`Training.moved_on`): then it was slow, not
   hung (a node starved of CPU, a step past a tight ``--hang-timeout``), which is said, and
   the round goes on: a restart would cost more than it saves.

Another node's hang reaches us as the server's ``CollectStacks``: we collect and send ours,
and our workers run on until the server's ``Restart``.

A commit point (issue 20), this node's part:

1. ``Progress.checks``: every local rank calls ``worker.should_stop()`` (its page's CHECK
   record is valid); only then may the server ask the job to stop at a common step;
2. ``StopAt(arm, S)``: S goes into every local page (``WriteStop``); each rank acknowledges
   in its CHECK record when it first sees S (``seen``), with the step it was at (``seen_at``).
   Once every local rank has, the server hears ``Armed`` (``late`` when a rank was already at
   or past S: it decided not to stop there, so the job cannot; ``checked``: the highest step);
3. ``StopAt(go, S)`` (every node armed in time) or ``StopAt(cancel)``: written into the pages;
4. the workers exit 0 and every page says one ``stopped`` step T >= S (S itself, or, for
   ranks that call ``should_stop()`` every few steps, their first call past S):
   :meth:`Training.commit_stop` is T, and the machine says ``WorkersCommitted(T)`` instead of
   ``WorkersSucceeded``. Ranks that stopped at different steps (or some that did not stop) are
   no commit and no success: a failure of this node, so the job restarts (never a job that
   "finished" early).
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from protocol import COMMIT_EARLY_S, Armed, Assignment, Failure, HangDetected, Progress, StopAt
from protocol.failure_text import HUNG
from protocol.messages import MAX_HUNG_RANKS, MAX_PHASE_LEN, MAX_TIMEOUT
from protocol.records import record

from .events import (
    BadPage,
    DumpStacks,
    Effect,
    JobHangReport,
    Log,
    PageWarning,
    ProgressRead,
    RankSample,
    WriteStop,
)

if TYPE_CHECKING:
    from .events import Hung
    from .link import Link
    from .watch import HangPolicy, NodeWatch


def job_hang_report(report: str, *, restart: bool) -> list[Effect]:
    """A hang ended the round, and the server sent the job's report (``Restart.report``,
    ``JobFailed.report``: every node's stacks merged; an older server sends none): the effect
    that files it beside ours, after the console's text of it on a restart. A job that failed
    prints its root cause, which names the rank the report points at, in the failure banner; a
    restart has no banner, so the console gets the report itself."""
    if not report:
        return []
    from ..agent_log import shown

    text = shown(report.rstrip(), multiline=True)
    filed = JobHangReport(text)
    return [Log("warning", f"{JOB_REPORT_TITLE}:\n{text}"), filed] if restart else [filed]


JOB_REPORT_TITLE = "the job-wide hang report (every node's stacks, merged by the rendezvous server)"


@record
class Training:
    policy: HangPolicy
    nproc: int
    node_id: str
    addr: str
    interval: float  # the least time between two Progress summaries (the heartbeat interval)
    wall_offset: float = 0.0  # the wall clock minus the machine's (a Failure's timestamp is wall time)
    watch: NodeWatch | None = None
    round: int = -1
    rank_offset: int = 0
    collecting: bool = False
    hung: tuple[Hung, ...] = ()  # our own hang, once detected (until the round ends)
    _hung_counts: tuple[int, ...] = ()  # each hung rank's progress count when found hung
    _sent_at: float | None = None
    _again: bool = False  # our hang came while collecting for another's: collect once more
    # Commit points: the step armed and not yet acknowledged by every local rank (the runner
    # polls the pages fast meanwhile), and the step the server said go for.
    arming: int | None = None
    go: int | None = None
    first_progress: float | None = None  # when a local rank of the round first reported a step
    _samples: tuple[RankSample | None, ...] = ()  # each local rank's last whole sample
    _sent_checks: bool = False  # what the last Progress said of should_stop()
    # Local ranks whose page was bad this round: from then on they count as not reporting
    # (not watched, not in the summary, no should_stop), whatever their page says later.
    _bad: frozenset[int] = frozenset()

    def start(self, a: Assignment) -> None:
        """New workers of round ``a.round`` start (with fresh pages)."""
        from .watch import NodeWatch

        self.first_progress = None
        self.watch = NodeWatch(self.policy, self.nproc)
        self.round, self.rank_offset = a.round, a.rank_offset
        self.collecting, self.hung, self._sent_at, self._again = False, (), None, False
        self._hung_counts = ()
        self.arming, self.go, self._samples, self._sent_checks = None, None, (None,) * self.nproc, False
        self._bad = frozenset()

    def stop(self) -> None:
        """The workers are being stopped: their silence from now on is no hang."""
        self.watch = None
        self.arming = None

    def checks(self) -> bool:
        """Every local rank calls ``worker.should_stop()`` (as its last whole sample says)."""
        return bool(self._samples) and all(s is not None and s.checks for s in self._samples)

    def may_check(self, now: float) -> bool:
        """Whether the ranks may still turn out to call ``should_stop()``: they do, or their
        training has only just begun (no step yet, or the first less than ``COMMIT_EARLY_S``
        ago: a rank's first call can follow its first steps)."""
        first = self.first_progress
        return self.checks() or first is None or now - first < COMMIT_EARLY_S

    def commit_stop(self) -> int | str | None:
        """How the workers' exit 0 ends the round, once the server said go for a commit step:
        the step every local rank stopped at (``should_stop()`` said True there: S, or each
        rank's first check past S), or, when some ranks stopped and others did not or at other
        steps, why that is no commit (the rule: every rank calls ``should_stop()`` at the same
        steps). None: no go, or no rank stopped for it (the training ended by itself)."""
        go = self.go
        if go is None or not self._samples:
            return None
        stopped = [s.stopped if s is not None else -1 for s in self._samples]
        if all(x < go for x in stopped):
            return None
        # A rank that ended on its own at the very step the others stopped at (the training's
        # last step) is no obstacle: the job resumes there and ends again at once.
        ends = {
            x if x >= go else (s.step if s is not None else -1)
            for x, s in zip(stopped, self._samples, strict=True)
        }
        if len(ends) == 1:
            return ends.pop()
        where = ", ".join(
            f"local rank {lr} {'stopped at step ' + str(x) if x >= go else 'did not stop'}"
            for lr, x in enumerate(stopped[:8])
        )
        return (
            f"the ranks did not all stop at one step for the commit point at step {go} ({where}); "
            "every rank must call worker.should_stop() at the same steps"
        )

    def on_stop(self, msg: StopAt) -> tuple[list[WriteStop], str]:
        """The server's ``StopAt`` for our round: what to write into the pages, and a log line.
        Another round's, or one while the workers stop, is ignored (no write, "")."""
        from ..worker import layout as L

        if self.watch is None or msg.round != self.round:
            return [], ""
        if msg.state == "arm":
            self.arming, self.go = msg.step, None
            return [WriteStop(msg.step, L.STOP_ARMED)], (
                f"the job is to stop at step {msg.step} (a commit point); waiting for every local "
                "rank to see it"
            )
        if msg.state == "go":
            self.arming, self.go = None, msg.step
            return [WriteStop(msg.step, L.STOP_GO)], f"every rank stops at step {msg.step} (a commit point)"
        self.arming, self.go = None, None
        return [WriteStop(L.NO_STEP, L.STOP_NONE)], f"the commit point at step {msg.step} was called off"

    def _armed(self) -> Armed | None:
        """Once every local rank has seen the armed step: the answer to send (clears arming)."""
        step = self.arming
        if step is None or not self._samples:
            return None
        if not all(s is not None and s.seen == step for s in self._samples):
            return None  # a rank not attached, not calling should_stop, or not there yet
        ats = [s.seen_at for s in self._samples if s is not None]
        self.arming = None
        return Armed(round=self.round, step=step, late=any(at >= step for at in ats), checked=max(ats))

    def max_step(self) -> int:
        return self.watch.max_step() if self.watch is not None else -1

    def idle_ms(self, now: float) -> float:
        """How long ago this node's most recent step was (ms; 0: none), for WorkersSucceeded."""
        return self.watch.idle_ms(int(now * 1e9)) if self.watch is not None else 0.0

    def seconds_to(self, step: int) -> float:
        """The slowest local rank's time to reach ``step``, as its step times go (0: unknown)."""
        return self.watch.seconds_to(step) if self.watch is not None else 0.0

    def read(self, event: ProgressRead, now: float, link: Link) -> list[Effect]:
        """A page read, as effects: :meth:`on_read`'s messages sent through ``link``, its
        warnings and line said, the stacks to collect; an ``Armed`` answer that cannot be said
        now (the connection is down, our Resume unanswered) is said on a read once we are back."""
        out, line = self.on_read(event, now)
        effects: list[Effect] = [Log("error", line)] if line else []
        for item in out:
            if isinstance(item, PageWarning):
                effects.append(Log("warning", item.text))
                continue
            if isinstance(item, Armed) and link.quiet:
                self.arming = item.step  # not said yet: said on a read once we are back
                continue
            effects.extend([item] if isinstance(item, DumpStacks) else link.send(item))
        return effects

    def on_read(
        self, event: ProgressRead, now: float
    ) -> tuple[list[Progress | HangDetected | DumpStacks | Armed | PageWarning], str]:
        """A page read: the summary to send (at most one per ``interval``, only on change),
        the answer to an armed commit point once every local rank saw it, and on a new hang
        the notice and the stacks to collect; plus a log line ("" if none)."""
        if self.watch is None:
            return [], ""
        out: list[Progress | HangDetected | DumpStacks | Armed | PageWarning] = []
        samples = self._screen(event.samples, out)
        # A torn or missing read keeps the rank's last whole sample (a CHECK record, once
        # written, stays valid: a rank does not stop calling should_stop); a bad page's rank
        # keeps none.
        self._samples = tuple(
            None if lr in self._bad else new if new is not None else old
            for lr, (new, old) in enumerate(zip(samples, self._samples, strict=True))
        )
        if self.first_progress is None and any(s is not None and s.count > 0 for s in self._samples):
            self.first_progress = now
        armed = self._armed()
        if armed is not None:
            out.append(armed)
        now_ns = int(now * 1e9)
        hung = self.watch.observe(samples, now_ns) if not self.hung else []
        due = self._sent_at is None or now - self._sent_at >= self.interval
        checks = self.checks()
        if due and (self.watch.changed() or checks != self._sent_checks):
            self._sent_at, self._sent_checks = now, checks
            out.append(Progress(round=self.round, checks=checks, **self.watch.summary(now_ns)))
        if not hung:
            return out, ""
        self.hung = tuple(hung)
        self._hung_counts = tuple(self._count(h.local_rank) for h in hung)
        first = hung[0]
        out.append(
            HangDetected(
                round=self.round,
                ranks=tuple(self.rank_offset + h.local_rank for h in hung[:MAX_HUNG_RANKS]),
                step=first.step,
                phase=first.phase[:MAX_PHASE_LEN],
                silent_s=min(first.silent_s, MAX_TIMEOUT),
            )
        )
        reason = self.headline()
        if not self.collecting:
            self.collecting = True
            out.append(DumpStacks(round=self.round, hung=self.hung, reason=reason))
        else:
            self._again = True  # the report must mark our hung ranks: collect again after
        return out, f"{reason}; collecting every rank's stacks before stopping the workers"

    def _screen(
        self,
        samples: tuple[RankSample | BadPage | None, ...],
        out: list[Progress | HangDetected | DumpStacks | Armed | PageWarning],
    ) -> tuple[RankSample | None, ...]:
        """Exactly ``nproc`` samples, None for a rank whose page was bad this round; a rank's
        first bad page is said (``PageWarning``) and the watch forgets it."""

        screened: list[RankSample | None] = []
        for lr, s in enumerate(_padded(samples, self.nproc)):
            if isinstance(s, BadPage):
                if lr not in self._bad and self.watch is not None:
                    self._bad |= {lr}
                    self.watch.forget(lr)
                    out.append(
                        PageWarning(
                            f"local rank {lr} (rank {self.rank_offset + lr}): its progress page holds "
                            f"{s.why}; the rank counts as not reporting progress (no hang detection, "
                            "no straggler score, no commit point) until the workers restart"
                        )
                    )
                s = None
            screened.append(None if lr in self._bad else s)
        return tuple(screened)

    def on_collect(self, round_: int, reason: str) -> DumpStacks | None:
        """The server asks for our stacks (another node's rank hung): collect, unless we are."""
        if self.watch is None or round_ != self.round or self.collecting:
            return None
        self.collecting = True
        return DumpStacks(round=self.round, hung=(), reason=reason)

    def _count(self, local_rank: int) -> int:
        """The progress count of a local rank's last whole sample (-1: none)."""
        s = self._samples[local_rank] if local_rank < len(self._samples) else None
        return s.count if s is not None else -1

    def moved_on(self) -> str:
        """Once our stacks are in: if every hung rank made progress since it was found hung
        (the pages are read meanwhile), it was slow, not hung: the hang is withdrawn (the
        round goes on, its ranks watched again) and the line that says so is returned; else
        "". A rank found hung again later is a new hang."""
        if not self.hung or self.watch is None:
            return ""
        counts = [self._count(h.local_rank) for h in self.hung]
        if not all(now > then for now, then in zip(counts, self._hung_counts, strict=True)):
            return ""
        ranks = ", ".join(f"rank {self.rank_offset + h.local_rank}" for h in self.hung[:8])
        more = " ..." if len(self.hung) > 8 else ""
        line = (
            f"{ranks}{more} made progress again while the stacks were collected: slow, not hung "
            "(a node short of CPU, or a step past --hang-timeout); no failure, the round goes on"
        )
        self.hung, self._hung_counts, self._again = (), (), False
        return line

    def on_dumped(self) -> bool | DumpStacks:
        """The stacks are in. True: this node's own hang now becomes its failure; a
        DumpStacks: collect once more first (our hang was found while collecting for another
        node's, so that report does not mark our hung ranks); False: nothing more to do."""
        self.collecting = False
        if not self.hung or self.watch is None:
            return False
        if self._again:
            self._again, self.collecting = False, True
            return DumpStacks(round=self.round, hung=self.hung, reason=self.headline())
        return True

    def headline(self) -> str:
        """One line naming our hung ranks, their last step, phase and silence."""
        parts = []
        for h in self.hung[:8]:
            phase = f", phase {h.phase}" if h.phase else ""
            step = f"last step {h.step}" if h.step >= 0 else "no step reported"
            parts.append(
                f"rank {self.rank_offset + h.local_rank} (local {h.local_rank}): no progress for "
                f"{h.silent_s:.0f} s ({step}{phase}; budget {h.budget_s:g} s)"
            )
        more = f" and {len(self.hung) - 8} more" if len(self.hung) > 8 else ""
        return "hang: " + "; ".join(parts) + more

    def failure(self, now: float, report: str, path: str) -> Failure:
        """The worker failure this node reports for its hang (the first hung rank)."""
        first = self.hung[0]
        where = f"\nhang report: {path}" if path else ""
        return Failure(
            node_id=self.node_id,
            addr=self.addr,
            rank=self.rank_offset + first.local_rank,
            local_rank=first.local_rank,
            exitcode=-int(signal.SIGTERM),  # what we do to it next
            signal=HUNG,
            timestamp=now + self.wall_offset,
            message=_clip(f"{self.headline()}{where}\n{report}"),
        )


def _padded(
    samples: tuple[RankSample | BadPage | None, ...], n: int
) -> tuple[RankSample | BadPage | None, ...]:
    """Exactly ``n`` samples (a read of another size is cut or filled with "no sample")."""
    return samples[:n] + (None,) * (n - len(samples))


def _clip(text: str, limit: int = 60000) -> str:
    return text if len(text) <= limit else text[: limit - 20] + "\n... (cut; see the file)"
