"""Commit points (issue 20): a planned change stops every rank at one step, so no work is lost.

A layer of the rendezvous machine, between :class:`~rdzv_server.rounds.RoundRules` (which
calls it where a planned change happens) and :class:`~rdzv_server.training_rules.TrainingRules`.

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

It is bounded: past the deadline (the steps to S at the slowest step time, ``COMMIT_LEAD``,
and the job's ``commit_timeout``, the checkpoint budget) the change happens as a hard
restart, as it did before. A failure or a lost node during a commit is handled as always
(the commit is dropped with the round). Jobs whose ranks do not call ``should_stop``, or
that report no progress, never see a commit.

S and the deadline come from Progress, which the state log does not keep: they are logged
as a fact of the event that chose them, and a replay takes them from there.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import TYPE_CHECKING

from protocol import COMMIT_LEAD, Armed, Drain, LeaveAfterCommit, StopAt, WorkersCommitted
from protocol.messages import clip_text

from . import history as said
from .events import Effect, Log, Send
from .history import LOG_TEXT_LEN, escape
from .jobs import PEER_TEXT_LEN, REASON_LEN, Commit, Job, JobPhase, Member, MemberState
from .training_rules import TrainingRules

MIN_STEPS_AHEAD = 2  # a rank acknowledges at its next step: S must be at least two ahead
MAX_ARMS = 3  # late ranks make the server ask for a later step at most this often


class CommitRules(TrainingRules):
    """The commit-point layer of :class:`~rdzv_server.state.Rendezvous` (see ``RoundRules``)."""

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
        if choice is None:
            if drain is not None:
                words = reason if told is None else told
                out.append(Send(drain.conn, Drain(reason=clip_text(words, PEER_TEXT_LEN))))
            else:
                self._regather(job, reason, now, out)
            return
        step, deadline = choice
        job.commit = Commit(
            round=job.round,
            step=step,
            reason=reason,
            deadline=deadline,
            started_at=now,
            drains=[drain.node_id] if drain is not None else [],
        )
        said.note(job, said.commit_asked(now, job.round, step, reason, deadline - now), out)
        self._send_round(job, StopAt(round=job.round, step=step, state="arm"), out)

    def _stop_choice(self, job: Job, now: float, *, past: int = -1) -> tuple[int, float] | None:
        """(S, deadline) for a commit of the running round, or None when it cannot have one.

        Live, from the job's Progress (and logged as a fact); replaying, from the fact."""
        if self.logged_facts is not None:
            logged = self.logged_facts.get("commit", [])
            mine = [e for e in logged if e[0] == job.id]
            if not mine:
                return None
            self.logged_facts["commit"] = [e for e in logged if e is not mine[0]]  # used once
            return int(mine[0][1]), float(mine[0][2])
        choice = self._choose_stop(job, now, past)
        if choice is not None:
            self._add_fact("commit", [job.id, *choice])
        return choice

    def _choose_stop(self, job: Job, now: float, past: int) -> tuple[int, float] | None:
        """S = the highest step any rank is estimated at now (its last report plus the steps
        since, at the job's rate) + k, and the commit's deadline; None when the job's ranks
        cannot stop at one (commits off, a node not reporting, or not calling should_stop).

        k = ``commit_steps``, or enough steps to cover ``COMMIT_LEAD`` at the slowest node's
        median step time (at least ``MIN_STEPS_AHEAD``). ``past``: S must also be beyond it
        (a step a late rank had already passed)."""
        s, p = job.settings, job.progress
        if s.commit_timeout <= 0 or job.phase is not JobPhase.RUNNING or p.round != job.round:
            return None
        step_s = p90_s = 0.0
        estimate = float(past)
        for nid in job.order:
            m, n = job.members.get(nid), p.nodes.get(nid)
            if m is None or m.state is not MemberState.RUNNING or n is None or not n.checks or n.max_step < 0:
                return None
            step_s = max(step_s, n.step_p50_ms / 1000.0)
            p90_s = max(p90_s, n.step_p90_ms / 1000.0)
        if step_s <= 0.0:
            step_s = 1.0 / p.steps_per_s if p.steps_per_s > 0 else 0.0
        if step_s <= 0.0:
            return None  # no step time measured yet
        for nid in job.order:
            n = p.nodes[nid]
            estimate = max(estimate, n.max_step + max(0.0, now - n.received_at) / step_s)
        k = s.commit_steps or max(MIN_STEPS_AHEAD, math.ceil(COMMIT_LEAD / step_s))
        step = math.floor(estimate) + k
        deadline = now + (step - estimate) * max(step_s, p90_s) + COMMIT_LEAD + s.commit_timeout
        return step, deadline

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
            self._send_round(job, StopAt(round=c.round, step=c.step, state="go"), out)

    def _ask_later(
        self, job: Job, c: Commit, member: Member, msg: Armed, now: float, out: list[Effect]
    ) -> None:
        """A rank of ``member`` had passed S before its page said S: ask every node for a later
        step (the ranks in time wait at S only until go, which cannot come for this S)."""
        late = f"a rank of node {member.node_id} was at step {msg.checked} when asked to stop at {c.step}"
        if c.arms >= MAX_ARMS:
            self._abandon(job, f"{late}, the {MAX_ARMS}th step asked for", now, out)
            return
        choice = self._stop_choice(job, now, past=max(msg.checked, c.step))
        if choice is None:
            self._abandon(job, f"{late}, and no later step can be chosen", now, out)
            return
        c.step, c.deadline = choice
        c.arms += 1
        c.armed.clear()
        line = f"job {job.id}: {late}; asking for step {c.step} instead"
        out.append(Log("warning", escape(clip_text(line, LOG_TEXT_LEN))))
        self._send_round(job, StopAt(round=c.round, step=c.step, state="arm"), out)

    def _on_committed(
        self, job: Job, member: Member, msg: WorkersCommitted, now: float, out: list[Effect]
    ) -> None:
        """A node's workers all stopped at the commit step and exited 0."""
        if not self._in_round(job, member, msg.round):
            self.unchanged = True
            return
        c = job.commit
        if c is None or not c.go or msg.step != c.step:
            # Stopped at a step nobody asked for (a commit dropped meanwhile, e.g. by a server
            # that lost its state): the round cannot go on without those ranks.
            why = (
                f"node {member.node_id}'s workers stopped at step {msg.step}, "
                "a commit point no longer asked for"
            )
            self._regather(job, why, now, out)
            return
        c.committed.add(member.node_id)
        if not all(nid in c.committed for nid in job.order):
            return
        said.note(job, said.committed(now, c.round, c.step, c.reason, now - c.started_at), out)
        self._carry_out(job, c, f"{c.reason}; committed at step {c.step}", now, out)

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
            stage = "stopped" if c.go else "acknowledged the step"
            self._abandon(job, f"not every rank {stage} within {c.deadline - c.started_at:.0f} s", now, out)

    def _newcomer_gone(self, job: Job, now: float, out: list[Effect]) -> None:
        """A newcomer left before it was let in: a commit for admitting nobody is called off
        (unless its ranks already stop, which the regather after it then follows)."""
        c = job.commit
        if c is None or c.go or c.drains or any(nid not in job.order for nid in job.members):
            return
        job.commit = None
        said.note(job, said.commit_abandoned(now, c.round, c.step, "the node(s) joining left"), out)
        self._send_round(job, StopAt(round=c.round, step=c.step, state="cancel"), out)
