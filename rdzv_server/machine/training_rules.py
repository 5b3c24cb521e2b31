"""The job rules about training progress (issue 19), as a layer of the rendezvous machine.

Under :class:`~rdzv_server.machine.rounds.RoundRules`, which calls into it: a node's ``Progress`` (the
job's progress view and its straggler flags), ``HangDetected`` (a HANG event, ``CollectStacks``
to every node of the round, once per round), ``Stacks`` (the job's hang report), the verdict
on a hang's failure (held until every node's stacks are in, then naming the rank they point
at: issue 30), leaving stragglers out of a round that forms (``exclude_stragglers``), and the
crash-loop rule, which rests on ``WorkersFailed.step`` only. What is derived from Progress or
Stacks (volatile: the state log keeps neither) and changes state is written into the record
of the event as a fact (``facts``), and a replay takes the decision from there
(``logged_facts``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from protocol import CollectStacks, Failure, HangDetected, Progress, Stacks
from protocol.failure_text import HUNG
from protocol.messages import MAX_TEXT_LEN, clip_text

from . import goodput
from . import history as said
from .events import Effect, Log, Send
from .faults import from_volatile
from .hang_cause import HANG_VERDICT_WAIT_S, all_stacks_in, job_cause
from .history import HISTORY_TEXT_LEN, LOG_TEXT_LEN, EventKind, escape
from .jobs import FAILURE_TEXT_LEN, REASON_LEN, HangVerdict, Job, JobPhase, Member, MemberState, rank_spans
from .progress import (
    HANG_RANKS_KEPT,
    MAX_STEP,
    STRAGGLER_CHECK_EVERY,
    HangState,
    flagged_by_node,
    flagged_scores,
    may_flag,
)

STRAGGLER_RANKS_NOTED = 64  # flagged ranks one STRAGGLER event names


class TrainingRules:
    """The lowest layer of :class:`~rdzv_server.machine.state.Rendezvous` (see ``RoundRules``)."""

    jobs: dict[str, Job]
    unchanged: bool
    # Facts this event's handling derived from volatile state (Progress, which the state log
    # does not keep): the log writes them into the event's record. While replaying, the
    # facts the live server derived for the record's event; decisions are then taken from
    # them, never from the replaying machine's own (partial) progress view.
    facts: dict[str, list[Any]] | None
    logged_facts: dict[str, Any] | None

    if TYPE_CHECKING:  # the round rules above this layer, which it calls back

        def _fail(
            self,
            job: Job,
            reason: str,
            failure: Failure | None,
            now: float,
            out: list[Effect],
            code: str = "",
            report: str = "",
        ) -> None: ...

        def _exclude(self, job: Job, member: Member, why: str, now: float, out: list[Effect]) -> None: ...

        def _verdict(
            self, job: Job, node_id: str, failure: Failure, step: int, now: float, out: list[Effect]
        ) -> None: ...

    def _in_round(self, job: Job, member: Member, rnd: int) -> bool:
        """Whether ``member`` runs workers of the job's running round ``rnd``."""
        return (
            job.phase is JobPhase.RUNNING
            and rnd == job.round
            and member.state is MemberState.RUNNING
            and job.members.get(member.node_id) is member
        )

    def _on_progress(self, job: Job, member: Member, msg: Progress, now: float, out: list[Effect]) -> None:
        """A node's training summary: volatile (the state log keeps no Progress), so it only
        updates the job's progress view and, at most once a second, its straggler flags."""
        if not self._in_round(job, member, msg.round):
            self.unchanged = True  # a stale round's (or a spare's): nothing to show
            return
        p = job.progress
        if p.round != job.round:
            p.start_round(job.round, self._rank_offsets(job))
        reached = goodput.sample(job, p.nodes.get(member.node_id), msg, now)  # O(1)
        p.update(member.node_id, msg, member.nproc, now)
        if reached is not None:  # the round's first step
            self._first_step(job, msg, reached, now)
        if self.logged_facts is not None or now - p.checked_at >= STRAGGLER_CHECK_EVERY:
            self._check_stragglers(job, now, out)  # (due: the common case skips even the call)

    @from_volatile("first_step")
    def _first_step(self, job: Job, msg: Progress, reached: int, now: float) -> None:
        """The running round's first step, for the job's goodput (``goodput.first_step``): the
        step, the highest step of the round before and the step time come from Progress
        (volatile), so the state log keeps them as a fact of this Progress; replay takes them
        from there (a record without it, from an older server: no first step)."""
        if self.logged_facts is not None:
            logged = self.logged_facts.get("first_step", [])
            mine = next((e for e in logged if e[0] == job.id), None)
            if mine is None:
                return
            self.logged_facts["first_step"] = [e for e in logged if e is not mine]  # used once
            first, reached, step_ms = int(mine[1]), int(mine[2]), float(mine[3])
        else:
            first = min(msg.min_step if msg.min_step >= 0 else msg.max_step, MAX_STEP)
            step_ms = job.goodput.step_ms
            self._add_fact("first_step", [job.id, first, reached, step_ms])
        goodput.first_step(job, now, first, reached, step_ms)

    def _rank_offsets(self, job: Job) -> dict[str, int]:
        """Each node's first global rank in the running round (its order, as assigned)."""
        return {nid: span.start for nid, span in rank_spans(job).spans.items()}

    @from_volatile("stragglers")
    def _check_stragglers(self, job: Job, now: float, out: list[Effect]) -> None:
        """Note a STRAGGLER event for each node that has a flagged rank for the first time this
        round. The state log keeps the notes as facts of the Progress that made them."""
        threshold = job.settings.straggler_threshold
        if self.logged_facts is not None:  # replaying: what the live server noted
            for jid, nid, ranks, scores in self.logged_facts.get("stragglers", ()):
                m = job.members.get(nid)
                if jid == job.id and m is not None:
                    event = said.straggler(now, nid, m.addr, job.round, ranks, scores, threshold)
                    said.note(job, event, out, "warning")
            return
        p = job.progress
        if now - p.checked_at < STRAGGLER_CHECK_EVERY:
            return
        p.checked_at = now
        if not may_flag(p, threshold, p.flagged):
            return  # (certainly no node to note: the usual second, stragglers known or none)
        for nid, flagged in flagged_by_node(flagged_scores(p, threshold)).items():
            m = job.members.get(nid)
            if nid in p.flagged or m is None:
                continue
            kept = flagged[:STRAGGLER_RANKS_NOTED]
            ranks, scores = [s.rank for s in kept], [s.score for s in kept]
            event = said.straggler(now, nid, m.addr, job.round, ranks, scores, threshold)
            p.flagged[nid] = tuple(ranks)
            self._add_fact("stragglers", [job.id, nid, ranks, scores])
            said.note(job, event, out, "warning")

    @from_volatile("left_out")
    def _leave_out_stragglers(self, job: Job, now: float, out: list[Effect]) -> bool:
        """``exclude_stragglers``: a round is about to form; exclude the nodes that had a flagged
        rank in the previous round, as long as the job keeps enough nodes. Decided once per
        round, from Progress (volatile), so the state log keeps the decision as a fact of the
        event that formed the round; replay takes it from there. True if any was excluded."""
        if self.logged_facts is not None:  # replaying: the live server's decision
            logged = self.logged_facts.get("left_out", [])
            picks = [(nid, why) for jid, nid, why in logged if jid == job.id]
            self.logged_facts["left_out"] = [e for e in logged if e[0] != job.id]  # used once
        else:
            p = job.progress
            if p.round != job.round - 1 or p.decided_round == job.round:
                return False
            p.decided_round = job.round
            threshold = job.settings.straggler_threshold
            by_node = flagged_by_node(flagged_scores(p, threshold))
            room = len(job.members) + len(job.spares) - job.settings.min_nodes
            picks = []
            for nid, flagged in sorted(by_node.items(), key=lambda kv: min(s.score for s in kv[1])):
                if room <= 0:
                    break
                if nid not in job.members:
                    continue
                worst = min(flagged, key=lambda s: s.score)
                why = (
                    f"straggler: rank {worst.rank} computed at {worst.score:.2f} of the job's median "
                    f"speed in round {p.round} (threshold {threshold:g}; exclude_stragglers=1)"
                )
                picks.append((nid, why))
                room -= 1
            for nid, why in picks:
                self._add_fact("left_out", [job.id, nid, why])
        excluded = False
        for nid, why in picks:
            m = job.members.get(nid)
            if m is None or job.phase is not JobPhase.GATHERING:
                continue
            self._exclude(job, m, why, now, out)
            excluded = True
        return excluded

    def _add_fact(self, key: str, item: list[Any]) -> None:
        if self.facts is None:
            self.facts = {}
        self.facts.setdefault(key, []).append(item)
        self.unchanged = False

    def _on_hang(self, job: Job, member: Member, msg: HangDetected, now: float, out: list[Effect]) -> None:
        """A node's ranks hung: the first report of a round asks every node of the round for
        its stacks (CollectStacks, once) and notes a HANG event; later ones add their ranks.

        Decided from logged state only (``job.hang_round`` and the HANG event's ranks, both in
        snapshots), so a replay from any snapshot agrees; ``job.hang`` (volatile) follows."""
        if not self._in_round(job, member, msg.round):
            self.unchanged = True
            return
        spans = self._rank_spans(job)
        own = self._own_ranks(job, member, spans.get(member.node_id, range(0)), msg.ranks, "a hang", out)
        if not own:
            self.unchanged = True  # a hang must name a rank of the sender's own
            return
        msg = replace(msg, ranks=own)
        if job.hang_round == msg.round:
            self._more_hung_ranks(job, msg, out)
            return
        reason = said.hang_reason(
            msg.ranks[0] if msg.ranks else None, member.node_id, msg.step, msg.phase, msg.silent_s
        )
        collect = CollectStacks(round=msg.round, reason=clip_text(reason, REASON_LEN))
        new = HangState(
            round=msg.round,
            node=member.node_id,
            addr=member.addr,
            ranks=[],
            step=msg.step,
            phase=msg.phase,
            silent_s=msg.silent_s,
            detected_at=now,
            reason=collect.reason,
            spans=spans,
        )
        new.add_ranks(msg.ranks)
        event = said.hang(
            now, member.node_id, member.addr, msg.round, new.ranks, msg.step, msg.phase, msg.silent_s
        )
        job.hang, job.hang_round = new, msg.round  # the latest round's hang replaces an older one
        said.note(job, event, out, "warning")
        for nid in job.order:
            m = job.members.get(nid)
            if m is not None:
                out.append(Send(m.conn, collect))

    def _rank_spans(self, job: Job) -> Mapping[str, range]:
        """Each member's global ranks in the running round (from its place in ``job.order``);
        O(1) while the round's members stay (``jobs.rank_spans``)."""
        return rank_spans(job).spans

    def _own_ranks(
        self, job: Job, member: Member, span: range, ranks: tuple[int, ...], what: str, out: list[Effect]
    ) -> tuple[int, ...]:
        """The ranks of ``ranks`` in ``span``, the ones ``member`` ran: a node reports hangs and
        stacks of its own ranks only, never another node's, nor ranks the job does not have.
        The others are dropped, said in one line. Decided from logged state (``job.order``,
        the members' nproc), so a replay drops the same."""
        own = tuple(r for r in ranks if r in span)
        if len(own) < len(ranks):
            foreign = sorted({r for r in ranks if r not in span})
            shown = ", ".join(map(str, foreign[:8])) + (" ..." if len(foreign) > 8 else "")
            mine = f"{span.start}..{span.stop - 1}" if span else "none"
            text = (
                f"job {job.id}: node {member.node_id} sent {what} of ranks it does not run "
                f"(its ranks: {mine}): {shown}; ignored"
            )
            out.append(Log("warning", escape(clip_text(text, LOG_TEXT_LEN))))
        return own

    def _more_hung_ranks(self, job: Job, msg: HangDetected, out: list[Effect]) -> None:
        """A later report of the round's hang: its new ranks join the round's HANG event (the
        history keeps one per hang, bounded to HANG_RANKS_KEPT ranks)."""
        if job.hang is not None and job.hang.round == msg.round:
            job.hang.add_ranks(msg.ranks)
        for i in range(len(job.history) - 1, -1, -1):
            e = job.history[i]
            if e.kind is not EventKind.HANG or e.round != msg.round:
                continue
            known = set(e.ranks)
            new = [r for r in dict.fromkeys(msg.ranks) if r not in known]
            new = new[: max(0, HANG_RANKS_KEPT - len(e.ranks))]
            if not new:
                break
            ranks = [*e.ranks, *new]
            step, phase, silent = e.step if e.step is not None else -1, e.phase, e.silent_s or 0.0
            event = said.hang(e.time, e.node, e.addr, msg.round, ranks, step, phase, silent)
            job.history[i] = replace(event, text=clip_text(event.text, HISTORY_TEXT_LEN))
            out.append(Log("warning", escape(clip_text(f"job {job.id}: {event.text}", LOG_TEXT_LEN))))
            return
        self.unchanged = True  # nothing new (or the event is out of the history's ring)

    def _on_stacks(self, job: Job, member: Member, msg: Stacks, now: float, out: list[Effect]) -> None:
        """A node's ranks' stacks after a hang: kept in the job's hang report (volatile). Taken
        for the hang's round even after it restarted: the hung node's own failure usually
        restarts the round before the other nodes' stacks come in."""
        hang = job.hang
        if hang is None or hang.round != msg.round or job.members.get(member.node_id) is not member:
            self.unchanged = True
            return
        span = hang.spans.get(member.node_id, range(0))
        own = self._own_ranks(job, member, span, msg.ranks, "stacks", out)
        if len(own) < len(msg.ranks):
            if not own:
                self.unchanged = True
                return
            keep = [i for i, rank in enumerate(msg.ranks) if rank in span]
            msg = Stacks(
                round=msg.round,
                ranks=tuple(msg.ranks[i] for i in keep),
                steps=tuple(msg.steps[i] for i in keep),
                phases=tuple(msg.phases[i] for i in keep),
                silent_s=tuple(msg.silent_s[i] for i in keep),
                stacks=tuple(msg.stacks[i] for i in keep),
            )
        hang.add_stacks(member.node_id, msg)

    def _crash_loop(
        self,
        job: Job,
        step: int,
        cause: str,
        failure: Failure,
        now: float,
        out: list[Effect],
        report: str = "",
    ) -> bool:
        """Count a failed round that made no step progress; True if the job failed for it.

        From ``WorkersFailed.step`` only (the state log keeps it; Progress it does not): the
        highest step a failing round reported is the job's best; a round whose failure reports
        no more than that made no progress. ``crash_loop_restarts`` such rounds in a row end
        the job, once it has reported a step at all (a job that never calls
        ``worker.progress`` is never in a crash loop).
        """
        if step > job.best_step:
            job.best_step, job.stuck_restarts = step, 0
            return False
        job.stuck_restarts += 1
        limit = job.settings.crash_loop_restarts
        if not limit or job.best_step < 0 or job.stuck_restarts < limit:
            return False
        said.note(job, said.crash_loop(now, job.round, job.stuck_restarts, job.best_step), out, "error")
        reason = f"{said.crash_loop_reason(job.stuck_restarts, job.best_step)}; the last failure: {cause}"
        self._fail(job, reason, failure, now, out, code="crash_loop", report=report)
        return True

    # -- a hang's verdict, once every node's stacks are in ---------------------------------
    # The node whose ranks hung reports its failure right after its own stacks; the other
    # nodes' stacks (asked for by CollectStacks) follow within STACKS_TIMEOUT. The verdict on
    # the failure waits for them (at most HANG_VERDICT_WAIT_S), so the job's root cause can
    # name the rank every node's stacks point at (hang_cause.py). Whether it waits, when it
    # goes and whom it names come from the stacks (volatile): facts of their events.

    @from_volatile("hang_wait")
    def _hang_waits(self, job: Job, member: Member, failure: Failure, step: int, now: float) -> bool:
        """Whether the verdict on ``member``'s hang ``failure`` waits for the other nodes'
        stacks (kept as ``job.hang_verdict``). It waits while a node of the round has not sent
        them, and only if the reporter's own came (kept in the report or not): stacks reach
        this machine (not through etcd, not from an older agent)."""
        if self.logged_facts is not None:
            waits = any(e[0] == job.id for e in self.logged_facts.get("hang_wait", ()))
        else:
            hang = job.hang
            waits = (
                failure.signal == HUNG
                and hang is not None
                and hang.round == job.round
                and hang.heard(member.node_id)
                and not all_stacks_in(hang, self._round_nodes(job))
            )
            if waits:
                self._add_fact("hang_wait", [job.id])
        if waits:
            job.hang_verdict = HangVerdict(
                round=job.round,
                node=member.node_id,
                failure=failure,
                step=step,
                deadline=now + HANG_VERDICT_WAIT_S,
            )
        return waits

    def _round_nodes(self, job: Job) -> int:
        return rank_spans(job).nodes

    @from_volatile("hang_settled")
    def _stacks_in(self, job: Job, rnd: int, now: float, out: list[Effect]) -> None:
        """A node's stacks of round ``rnd`` came: a verdict waiting for them goes once every
        node of the round has sent its own."""
        v, hang = job.hang_verdict, job.hang
        if self.logged_facts is not None:
            due = any(e[0] == job.id for e in self.logged_facts.get("hang_settled", ()))
        else:
            due = (
                v is not None
                and v.round == rnd
                and hang is not None
                and hang.round == rnd
                and all_stacks_in(hang, self._round_nodes(job))
            )
            if due:
                self._add_fact("hang_settled", [job.id])
        if due:
            self._settle_hang(job, now, out)

    def _settle_hang(self, job: Job, now: float, out: list[Effect]) -> None:
        """The waiting verdict goes (every node's stacks are in, or its deadline passed)."""
        v, job.hang_verdict = job.hang_verdict, None
        if v is not None and job.phase is JobPhase.RUNNING and job.round == v.round:
            self._verdict(job, v.node, v.failure, v.step, now, out)

    @from_volatile("hang_cause")
    def _hang_cause(self, job: Job, failure: Failure) -> tuple[Failure, str]:
        """``failure`` as the job's hang report tells it (hang_cause.job_cause), and the
        report's text for the agents ("" when replaying: nothing is sent then)."""
        if self.logged_facts is not None:
            for e in self.logged_facts.get("hang_cause", ()):
                if e[0] == job.id:
                    return Failure(**e[1]), ""
            return failure, ""
        hang = job.hang
        if failure.signal != HUNG or hang is None or hang.round != job.round:
            return failure, ""  # not a hang, or no stacks of this round's
        addrs = {nid: m.addr for nid, m in job.members.items()}
        found = job_cause(hang, failure, self._rank_spans(job), addrs, FAILURE_TEXT_LEN)
        if found is None:
            return failure, ""
        named, text = found
        self._add_fact("hang_cause", [job.id, asdict(named)])
        return named, clip_text(text, MAX_TEXT_LEN)
