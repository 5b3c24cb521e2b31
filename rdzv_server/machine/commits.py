"""Commit points (issue 20): a planned change stops every rank at one step, so no work is lost.

A layer of the rendezvous machine, between :class:`~rdzv_server.machine.rounds.RoundRules` (which
calls it where a planned change happens) and :class:`~rdzv_server.machine.training_rules.TrainingRules`.

Planned changes are newcomers let into a running job (once their settle window closes), a
drain (``rdzv-server drain``, or SIGTERM to an elastic agent: ``LeaveAfterCommit``) and, through
a drain, a spare taking a drained node's place. Today's behaviour (and torchrun's) is to stop
every worker wherever it is. Instead, when every node of the running round reports progress
and that its ranks call ``worker.should_stop()`` (``Progress.checks``):

1. the server picks a stop step S a few steps ahead of the highest step it estimates any rank
   is at (``_choose_stop``) and sends ``StopAt(arm, S)`` to every node of the round;
2. each agent writes S into its ranks' pages; each rank acknowledges it at its next
   ``should_stop()`` call, saying whether it was still below S (in time) or had passed it
   (late); the agent answers ``Armed`` once all its ranks have;
3. every node armed in time: ``StopAt(go, S)``. A late rank: the server asks for a later step
   (at most ``MAX_ARMS`` times). Since a rank that acknowledged in time waits at S until go
   or a later step, and go comes only when every rank acknowledged in time, all ranks
   decide alike at S: no rank waits in a collective for a peer that stopped;
4. each rank's ``should_stop()`` is True at S: it checkpoints and exits 0; the agents report
   ``WorkersCommitted``; once every node has, the change happens (the job regathers, drained
   nodes are told to leave). A commit uses no restart and counts as no node's failure.

A rank that calls ``should_stop()`` only every few steps stops at its first call at or past
S; every rank must call it at the same steps (the same script does), so they all stop at one
step T >= S and the job resumes from T. Ranks that stop at different steps make the change a
hard restart (the fallback below); a worker exit during a commit is never the job's success.

Early in a round the server may not know yet whether the ranks call ``should_stop()`` or how
long a step takes: a change then waits ``PENDING_WAIT_S`` for every node's word before it
gives up on a commit (``_may_wait``), and without a step time yet it aims a few
steps ahead and bounds the commit by the round's age instead.

It is bounded, by one deadline set when S is first chosen (the steps to S at the slowest step
time, ``COMMIT_LEAD``, and the job's ``commit_timeout``, the checkpoint budget; a re-ask for a
later step keeps it, and ``StopAt`` tells the agents how long is left): past it the change
happens as a hard restart, as it did before. A failure or a lost node during a commit is handled as always
(the commit is dropped with the round). Jobs whose ranks do not call ``should_stop``, or
that report no progress, never see a commit.

S and the deadline come from Progress, which the state log does not keep: they are logged
as a fact of the event that chose them, and a replay takes them from there.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import TYPE_CHECKING

from protocol import (
    COMMIT_EARLY_S,
    COMMIT_LEAD,
    Armed,
    Drain,
    LeaveAfterCommit,
    Progress,
    StopAt,
    WorkersCommitted,
)
from protocol.messages import MAX_COUNT, MAX_TIMEOUT, clip_text

from . import history as said
from .events import Effect, Log, Send
from .faults import from_volatile
from .history import LOG_TEXT_LEN, escape
from .jobs import PEER_TEXT_LEN, REASON_LEN, Commit, Job, JobPhase, Member, MemberState
from .progress import MAX_STEP
from .training_rules import TrainingRules

MIN_STEPS_AHEAD = 2  # a rank acknowledges at its next step: S must be at least two ahead
MAX_ARMS = 3  # late ranks make the server ask for a later step at most this often
# How long a change early in a round waits for every node to report that its ranks call
# should_stop() (agents send a summary at most once per heartbeat interval, 1 s by default).
PENDING_WAIT_S = COMMIT_EARLY_S


class CommitRules(TrainingRules):
    """The commit-point layer of :class:`~rdzv_server.machine.state.Rendezvous` (see ``RoundRules``)."""

    if TYPE_CHECKING:  # the round rules above this layer, which it calls back

        def _regather(
            self, job: Job, reason: str, now: float, out: list[Effect], *, quiet: Collection[str] = ()
        ) -> None: ...

    # -- starting one ----------------------------------------------------------------------

    def _plan_change(
        self,
        job: Job,
        reason: str,
        now: float,
        out: list[Effect],
        *,
        drain: Member | None = None,
        told: str | None = None,
    ) -> None:
        """A planned change of a running job: at a commit point when its ranks can stop at one,
        else at once as before (a regather, or the node's ``Drain``, which says ``told`` when
        given: an operator's own words, as before commits)."""
        reason = clip_text(reason, REASON_LEN)
        c = job.commit
        if c is not None:
            # One commit at a time: a second join waits for it (the regather after it takes
            # every member in); a drain joins it (its ranks stop at S with the others').
            if drain is not None and drain.node_id not in c.drains:
                c.drains.append(drain.node_id)
                c.reason = clip_text(f"{c.reason}; {reason}", REASON_LEN)
            return  # (the same node asking again changes nothing, but is logged: harmless)
        choice = self._stop_choice(job, now)
        if choice is None and not self._may_wait(job, now):
            if drain is not None:
                words = reason if told is None else told
                out.append(Send(drain.conn, Drain(reason=clip_text(words, PEER_TEXT_LEN))))
            else:
                self._regather(job, reason, now, out)
            return
        job.commit = c = Commit(
            round=job.round,
            step=Commit.PENDING,
            reason=reason,
            deadline=now + PENDING_WAIT_S,
            started_at=now,
            drains=[drain.node_id] if drain is not None else [],
        )
        if choice is None:
            line = f"job {job.id}: {reason}: waiting for every node's progress to choose a commit point"
            out.append(Log("info", escape(clip_text(line, LOG_TEXT_LEN))))
            return
        self._arm(job, c, choice, now, out)

    def _arm(self, job: Job, c: Commit, choice: tuple[int, float], now: float, out: list[Effect]) -> None:
        """Ask every node of the round to stop at S (the commit's one deadline is set here)."""
        c.step, c.deadline = choice
        said.note(job, said.commit_asked(now, job.round, c.step, c.reason, c.deadline - now), out)
        self._send_round(job, self._stop_at(c, "arm", now), out)

    @staticmethod
    def _stop_at(c: Commit, state: str, now: float) -> StopAt:
        # Clamped as well as the deadline is (_choose_stop): float rounding, an older log's fact.
        left = min(MAX_TIMEOUT, max(0.0, c.deadline - now))
        return StopAt(round=c.round, step=c.step, state=state, deadline_s=left)

    @from_volatile("commit_wait")
    def _may_wait(self, job: Job, now: float) -> bool:
        """No S can be chosen now, but one may be soon: commits are on, the round runs, the job
        reports progress (this round or an earlier one: a job that never does behaves as
        before, without waiting), and no node has said for long that its ranks do not call
        should_stop(): a node yet to send its first summary of the round, or whose first came
        less than ``PENDING_WAIT_S`` ago (a rank's first call may follow its first steps), may
        still say they do. (Early in a round is early in its training, not since it formed:
        the workers' imports and loads can take minutes.)"""
        if self.logged_facts is not None:  # replaying: the live server's decision (from Progress)
            logged = self.logged_facts.get("commit_wait", [])
            mine = [e for e in logged if e[0] == job.id]
            if not mine:
                return False
            self.logged_facts["commit_wait"] = [e for e in logged if e is not mine[0]]  # used once
            return True
        s, p = job.settings, job.progress
        this_round = p.nodes if p.round == job.round else {}
        if s.commit_timeout <= 0 or job.phase is not JobPhase.RUNNING or (p.max_step < 0 and not this_round):
            return False
        for nid in job.order:
            m, n = job.members.get(nid), this_round.get(nid)
            if m is None or m.state is not MemberState.RUNNING:
                return False
            if n is not None and not n.checks and now - n.first_at >= PENDING_WAIT_S:
                return False  # its ranks have reported a while without calling should_stop()
        self._add_fact("commit_wait", [job.id])
        return True

    def _on_progress(self, job: Job, member: Member, msg: Progress, now: float, out: list[Effect]) -> None:
        super()._on_progress(job, member, msg, now, out)
        if not self.unchanged and job.commit is not None:
            self._commit_progress(job, now, out)

    def _commit_progress(self, job: Job, now: float, out: list[Effect]) -> None:
        """A node's summary came in while a commit waits for one: choose S if it now can."""
        c = job.commit
        if c is None or not c.pending:
            return
        choice = self._stop_choice(job, now)
        if choice is not None:
            self._arm(job, c, choice, now, out)

    @from_volatile("commit")
    def _stop_choice(
        self, job: Job, now: float, *, past: int = -1, arms: int = 1
    ) -> tuple[int, float] | None:
        """(S, deadline) for a commit of the running round, or None when it cannot have one.

        Live, from the job's Progress (and logged as a fact); replaying, from the fact."""
        if self.logged_facts is not None:
            logged = self.logged_facts.get("commit", [])
            mine = [e for e in logged if e[0] == job.id]
            if not mine:
                return None
            self.logged_facts["commit"] = [e for e in logged if e is not mine[0]]  # used once
            return int(mine[0][1]), float(mine[0][2])
        choice = self._choose_stop(job, now, past, arms)
        if choice is not None:
            self._add_fact("commit", [job.id, *choice])
        return choice

    def _choose_stop(self, job: Job, now: float, past: int, arms: int = 1) -> tuple[int, float] | None:
        """S = the highest step any rank is estimated at now (its last report plus the steps
        since, at the job's rate) + k, and the commit's deadline; None when the job's ranks
        cannot stop at one (commits off, a node not reporting, or not calling should_stop).

        k = ``commit_steps``, or enough steps to cover ``COMMIT_LEAD`` at the slowest node's
        median step time (at least ``MIN_STEPS_AHEAD``), doubled at each re-ask (``arms``): a
        rank that checks only every few steps was late, and is in time once k covers its
        cadence. ``past``: S must also be beyond it (a step a late rank had already passed).
        No step time yet (the round's first steps): k steps past the highest reported, and the
        round's age stands in for a step's time in the deadline.

        In range whatever the agents sent: the steps and step times it reads are bounded
        where they come in (``progress.py``: at most 2**53, at least 1 µs; a node at 2**53
        gets no commit), so S stays far below MAX_COUNT (still checked), and the time to S is
        clamped to MAX_TIMEOUT (what ``StopAt.deadline_s`` carries; a job may ask for a
        commit_timeout of that much alone)."""
        s, p = job.settings, job.progress
        if s.commit_timeout <= 0 or job.phase is not JobPhase.RUNNING or p.round != job.round:
            return None
        step_s = p90_s = 0.0
        estimate = float(past)
        for nid in job.order:
            m, n = job.members.get(nid), p.nodes.get(nid)
            if m is None or m.state is not MemberState.RUNNING or n is None or not n.checks or n.max_step < 0:
                return None
            if n.max_step >= MAX_STEP:
                return None  # past the steps the server counts exactly: no step to stop at
            step_s = max(step_s, n.step_p50_ms / 1000.0)
            p90_s = max(p90_s, n.step_p90_ms / 1000.0)
        if step_s <= 0.0:
            step_s = 1.0 / p.steps_per_s if p.steps_per_s > 0 else 0.0
        for nid in job.order:
            n = p.nodes[nid]
            since = min(max(0.0, now - n.received_at) / step_s, MAX_STEP) if step_s > 0.0 else 0.0
            estimate = max(estimate, n.max_step + since)
        if step_s > 0.0:
            k = s.commit_steps or max(MIN_STEPS_AHEAD, math.ceil(COMMIT_LEAD / step_s))
        else:
            k = max(s.commit_steps, MIN_STEPS_AHEAD)
        step = math.floor(estimate) + k * 2 ** (arms - 1)
        if step > MAX_COUNT:
            return None  # no later step can be asked for
        slowest = (
            max(step_s, p90_s) if step_s > 0.0 else min(max(0.0, now - job.running_since), s.commit_timeout)
        )
        lead = (step - estimate) * slowest + COMMIT_LEAD + s.commit_timeout
        return step, now + min(lead, MAX_TIMEOUT)

    def _send_round(self, job: Job, msg: StopAt, out: list[Effect]) -> None:
        for nid in job.order:
            m = job.members.get(nid)
            if m is not None:
                out.append(Send(m.conn, msg))

    # -- the agents' answers ---------------------------------------------------------------

    def _on_armed(self, job: Job, member: Member, msg: Armed, now: float, out: list[Effect]) -> None:
        c = job.commit
        if (
            c is None
            or c.go
            or c.pending
            or msg.round != c.round
            or msg.step != c.step
            or not self._in_round(job, member, msg.round)
        ):
            self.unchanged = True  # an answer to a step asked for before, or for another round
            return
        if msg.late:
            self._ask_later(job, c, member, msg, now, out)
            return
        c.armed.add(member.node_id)
        if all(nid in c.armed for nid in job.order):
            c.go = True
            out.append(Log("info", f"job {job.id}: every rank armed in time; stopping at step {c.step}"))
            self._send_round(job, self._stop_at(c, "go", now), out)

    def _ask_later(
        self, job: Job, c: Commit, member: Member, msg: Armed, now: float, out: list[Effect]
    ) -> None:
        """A rank of ``member`` had passed S before its page said S: ask every node for a later
        step (the ranks in time wait at S only until go, which cannot come for this S)."""
        late = f"a rank of node {member.node_id} was at step {msg.checked} when asked to stop at {c.step}"
        if c.arms >= MAX_ARMS:
            self._abandon(job, f"{late}, the {MAX_ARMS}th step asked for", now, out)
            return
        choice = self._stop_choice(job, now, past=max(msg.checked, c.step), arms=c.arms + 1)
        if choice is None:
            self._abandon(job, f"{late}, and no later step can be chosen", now, out)
            return
        c.step = choice[0]  # the deadline stays: one bound for the whole commit
        c.arms += 1
        c.armed.clear()
        line = f"job {job.id}: {late}; asking for step {c.step} instead"
        out.append(Log("warning", escape(clip_text(line, LOG_TEXT_LEN))))
        self._send_round(job, self._stop_at(c, "arm", now), out)

    def _on_committed(
        self, job: Job, member: Member, msg: WorkersCommitted, now: float, out: list[Effect]
    ) -> None:
        """A node's workers all stopped at one step (the commit step, or their first check
        past it) and exited 0."""
        if not self._in_round(job, member, msg.round):
            self.unchanged = True
            return
        c = job.commit
        if c is None or not c.go or msg.step < c.step:
            # Stopped at a step nobody asked for (a commit dropped meanwhile, e.g. by a server
            # that lost its state): the round cannot go on without those ranks.
            why = (
                f"node {member.node_id}'s workers stopped at step {msg.step}, "
                "a commit point no longer asked for"
            )
            self._regather(job, why, now, out)
            return
        c.stopped[member.node_id] = msg.step
        if not all(nid in c.stopped for nid in job.order):
            return
        steps = sorted({c.stopped[nid] for nid in job.order})
        if len(steps) > 1:
            # Ranks checking should_stop() at different steps: no one step to resume from.
            where = ", ".join(f"{nid} at {c.stopped[nid]}" for nid in job.order[:8])
            self._abandon(job, f"the ranks stopped at different steps ({where})", now, out)
            return
        step = steps[0]
        said.note(job, said.committed(now, c.round, step, c.reason, now - c.started_at), out)
        job.goodput.committing = True  # the stop that follows is at a commit point (goodput.py)
        self._carry_out(job, c, f"{c.reason}; committed at step {step}", now, out)

    def _carry_out(self, job: Job, c: Commit, reason: str, now: float, out: list[Effect]) -> None:
        """The planned change itself: drained nodes are told to leave (their place is kept, not
        ready, until they have), and the others regather."""
        job.commit = None
        drains = [job.members[nid] for nid in c.drains if nid in job.members]
        self._regather(job, reason, now, out, quiet={m.node_id for m in drains})
        for m in drains:
            out.append(Send(m.conn, Drain(reason=clip_text(c.reason, PEER_TEXT_LEN))))

    def _abandon(self, job: Job, why: str, now: float, out: list[Effect]) -> None:
        """No commit: the change happens now, as a hard restart (as before commits)."""
        c = job.commit
        if c is None:
            return
        if c.pending:
            line = f"job {job.id}: round {c.round}: no commit point: {why}"
            out.append(Log("warning", escape(clip_text(line, LOG_TEXT_LEN))))
        else:
            said.note(job, said.commit_abandoned(now, c.round, c.step, why), out, "warning")
        self._carry_out(job, c, f"{c.reason} (no commit: {why})", now, out)

    def _on_leave_after_commit(
        self, job: Job, member: Member, msg: LeaveAfterCommit, now: float, out: list[Effect]
    ) -> None:
        """SIGTERM to an elastic agent whose ranks can stop at a commit point."""
        why = f" ({clip_text(msg.reason, PEER_TEXT_LEN)})" if msg.reason else ""
        self._start_drain(job, member, f"node {member.node_id} ({member.addr}) is leaving{why}", now, out)

    def _start_drain(
        self, job: Job, member: Member, reason: str, now: float, out: list[Effect], *, told: str | None = None
    ) -> None:
        """A node is to leave (``reason``: the change, in the history's words): at a commit point
        when it runs ranks of the round, else at once (its ``Drain`` says ``told`` if given)."""
        if self._in_round(job, member, job.round):
            self._plan_change(job, reason, now, out, drain=member, told=told)
        else:
            words = reason if told is None else told
            out.append(Send(member.conn, Drain(reason=clip_text(words, PEER_TEXT_LEN))))

    def _commit_due(self, job: Job, now: float, out: list[Effect]) -> None:
        """The tick: a commit past its deadline becomes a hard restart."""
        c = job.commit
        if c is not None and now >= c.deadline:
            if c.pending:
                why = "no commit point could be chosen in time (not every node said its ranks check)"
                self._abandon(job, why, now, out)
                return
            stage = "stopped" if c.go else "acknowledged the step"
            self._abandon(job, f"not every rank {stage} within {c.deadline - c.started_at:.0f} s", now, out)

    def _newcomer_gone(self, job: Job, now: float, out: list[Effect]) -> None:
        """A newcomer left before it was let in: a commit for admitting nobody is called off
        (unless its ranks already stop, which the regather after it then follows)."""
        c = job.commit
        if c is None or c.go or c.drains or any(nid not in job.order for nid in job.members):
            return
        job.commit = None
        if c.pending:  # nothing was asked of the agents
            out.append(Log("info", f"job {job.id}: no commit point: the node(s) joining left"))
            return
        said.note(job, said.commit_abandoned(now, c.round, c.step, "the node(s) joining left"), out)
        self._send_round(job, self._stop_at(c, "cancel", now), out)
