"""Crash recovery: a server that restarted takes its jobs back without stopping them.

Two ways back, both through the rules in ``rounds.py``:

- From the state log (``journal.py`` replays it, then hands the machine a ``Restarted`` event,
  which :meth:`Recovery._recover` handles). Joined
  nodes become AWAY: their members keep their places (the round goes on) for a resume window,
  in which each agent reconnects and sends ``Resume`` (or ``Join``, between rounds). A member
  that is away is not ready: a round completes only with members that are connected. A node
  not back in time is lost, as if its connection had dropped. A job token proves the job, not
  the node: each member keeps the ``node_secret`` of its Join, and only a Join or Resume
  showing it may take an away member's place back.
- From the agents alone (no state dir, or a job the log does not know): the first ``Resume``
  creates the job in phase ``RESUMING``, and the round is rebuilt when every node of it has
  come back agreeing on it (round, sizes, master); a disagreement, a failure or the window's
  end start a new round with whoever came back.
"""

from __future__ import annotations

from collections import Counter

from protocol import JobDone, JobFailed, Join, Restart, Resume, Resumed

from . import goodput
from . import history as said
from .events import Effect, Send
from .history import Departure
from .jobs import (
    RESUME_WINDOW,
    Conn,
    ConnPhase,
    Job,
    JobPhase,
    JobSettings,
    Member,
    MemberState,
    put_member,
    set_state,
)
from .rounds import RoundRules
from .standbys import TakeOver


class Recovery(RoundRules):
    """Resume windows, away members and rebuilt rounds (the layer above the round rules)."""

    resume_deadline: float | None
    draining: bool
    taken_over: TakeOver | None
    host_node: str | None
    standby_term: int

    def _recover(self, now: float, out: list[Effect]) -> None:
        """The state was replayed from the log of a previous process whose sockets are gone.

        Joined nodes become AWAY: their members keep their places (the round goes on) for a
        resume window, in which each agent reconnects and sends ``Resume`` (or ``Join`` if it
        was between rounds). A member that was ready for the next round is not while it is
        away (WAITING): a round completes only with members that are back. A node not back in
        time is lost, as if its connection had dropped. A job that was itself being rebuilt
        from its agents is forgotten: the agents' Resumes rebuild it again.
        """
        self.draining = False
        self._next_sweep = None  # nothing to sweep until agents are back
        for kept in [*self.jobs.values(), *self.finished_jobs]:
            goodput.restarted(kept, now)  # its volatile figures start again
        for rebuilding in [j for j in self.jobs.values() if j.phase is JobPhase.RESUMING]:
            said.note(rebuilding, said.rebuilt_anew(now), out)
            del self.jobs[rebuilding.id]
        window = 0.0
        away: Counter[str] = Counter()
        for conn in list(self.conns.values()):
            job = self.jobs.get(conn.job_id or "")
            known = job is not None and conn.node_id is not None
            if conn.phase in (ConnPhase.JOINED, ConnPhase.AWAY) and known and job is not None:
                conn.phase = ConnPhase.AWAY
                away[job.id] += 1
                member = job.members.get(conn.node_id or "")
                if member is not None and member.conn == conn.id and member.state is MemberState.READY:
                    # Joined, but its agent must come back (and join again) before a round may
                    # count on it: an assignment to the old connection would never arrive.
                    set_state(job, member, MemberState.WAITING)
                window = max(window, RESUME_WINDOW, 2 * job.settings.heartbeat_timeout)
            else:
                del self.conns[conn.id]
        self.resume_deadline = now + window if away else None
        for job_id, n in away.items():
            job = self.jobs[job_id]
            said.note(job, said.recovered(now, job.phase.value, job.round, window, n), out)

    def _on_resume(self, conn: Conn, msg: Resume, now: float, out: list[Effect]) -> None:
        """A node whose connection broke comes back holding a round, its workers still running."""
        j, a = msg.join, msg.assignment
        if j.job_id != a.job_id:
            self._refuse(conn, "invalid_field", "resume: join and assignment name different jobs", now, out)
            return
        settings = JobSettings.from_join(j)
        job = self.jobs.get(j.job_id)
        if job is None and len(self.jobs) >= self.max_jobs:
            self._refuse(conn, *self._too_many_jobs(j.job_id), now, out)
            return
        if job is None:
            # We have no record of the job (restarted without a state dir): rebuild the round
            # from what the nodes hold, if they all agree on it.
            job = Job(
                id=j.job_id,
                settings=settings,
                phase=JobPhase.RESUMING,
                round=a.round,
                restart_count=a.restart_count,
                created_at=now,
                gathering_since=now,
            )
            job.resume_expect = (a.round, a.group_world_size, a.world_size, a.master_addr, a.master_port)
            job.last_call_deadline = now + max(RESUME_WINDOW, 2 * settings.heartbeat_timeout)
            self.jobs[job.id] = job
            self.stats.jobs_created += 1
            took = self.taken_over
            if took is not None and took.job == job.id:  # (the history says who took over, when)
                event = said.took_over(now, a.round, self.host_node or "", self.standby_term, took.host)
                said.note(job, event, out)
            said.note(job, said.resuming(now, a.round), out)
        if job.phase is JobPhase.RESUMING:
            self._resume_into_rebuild(job, conn, msg, settings, now, out)
            return
        away = self._away_member(job, j.node_id)
        if away is not None:
            if self._not_this_node(away, j):
                self._refuse_claim(conn, job, j.node_id, now, out)  # the real node keeps its place
                return
            self._resume_known(job, conn, msg, settings, now, out)
            return
        # We know the job, but not this node in its current round (it was dropped when its
        # connection broke): it must stop its workers and join again.
        if job.settings.mismatch(settings) is not None:
            self._refuse(
                conn,
                "job_mismatch",
                f"job {job.id!r} disagrees on {job.settings.mismatch(settings)}",
                now,
                out,
            )
            return
        # The job ended meanwhile (it is kept until its last node is gone): say how, rather
        # than "join again" and a refusal of that join.
        # None of the answers below changes any state: the connection stays unjoined.
        self.unchanged = True
        if job.phase is JobPhase.FAILED:
            root = job.failures[-1] if job.failures else None
            summary = goodput.line(job, now)
            out.append(Send(conn.id, JobFailed(reason=job.outcome, failure=root, summary=summary)))
            return
        if job.phase is JobPhase.FINISHED:
            out.append(Send(conn.id, JobDone(summary=goodput.line(job, now))))
            return
        why = f"the server dropped node {j.node_id} from job {job.id!r} while it was away; join again"
        out.append(Send(conn.id, Restart(round=a.round, reason=why, restart_count=job.restart_count)))

    def _coming_back(self, msg: Join) -> bool:
        """Whether a Join is a member of a restored job coming back (not a new node)."""
        job = self.jobs.get(msg.job_id)
        return job is not None and self._away_member(job, msg.node_id) is not None

    def _away_member(self, job: Job, node_id: str) -> Member | None:
        """The node's member, if the server restarted and the node has not come back yet."""
        member = job.members.get(node_id) or job.spares.get(node_id)
        if member is None:
            return None
        old = self.conns.get(member.conn)
        return member if old is not None and old.phase is ConnPhase.AWAY else None

    def _rebind(self, job: Job, member: Member, conn: Conn, now: float) -> None:
        """Give an AWAY member the agent's new connection."""
        self.conns.pop(member.conn, None)
        conn.phase = ConnPhase.JOINED
        conn.job_id, conn.node_id = job.id, member.node_id
        member.conn = conn.id
        self._ensure_sweep(now, job.settings.heartbeat_timeout)

    def _resume_known(
        self, job: Job, conn: Conn, msg: Resume, settings: JobSettings, now: float, out: list[Effect]
    ) -> None:
        """A node of a job restored from the state log comes back holding a round."""
        j, a = msg.join, msg.assignment
        member = self._away_member(job, j.node_id)
        assert member is not None
        problem = job.settings.mismatch(settings)
        if problem is not None:
            self._refuse(conn, "job_mismatch", f"job {job.id!r} disagrees on {problem}", now, out)
            return
        in_round = job.phase in (JobPhase.RUNNING, JobPhase.FINISHED) and a.round == job.round
        holds = (
            in_round
            and a.group_rank < len(job.order)
            and job.order[a.group_rank] == member.node_id
            and member.state in (MemberState.RUNNING, MemberState.SUCCEEDED)
        )
        if holds:
            self._rebind(job, member, conn, now)
            if msg.succeeded and member.state is MemberState.RUNNING and job.phase is JobPhase.RUNNING:
                set_state(job, member, MemberState.SUCCEEDED)
            said.note(job, said.resumed(now, member, job.round), out)
            out.append(Send(conn.id, Resumed(job_id=job.id, round=job.round, rebuilt=False)))
            if job.phase is JobPhase.FINISHED:
                out.append(Send(conn.id, JobDone(summary=goodput.line(job, now))))
            else:
                self._maybe_finish(job, now, out)
            return
        if job.phase is JobPhase.FAILED:
            self._rebind(job, member, conn, now)
            root = job.failures[-1] if job.failures else None
            summary = goodput.line(job, now)
            out.append(Send(conn.id, JobFailed(reason=job.outcome, failure=root, summary=summary)))
            return
        if member.state is MemberState.WAITING:
            # The round moved on (its Restart may never have reached the node): restart.
            self._rebind(job, member, conn, now)
            why = f"round {a.round} was stopped while the server restarted"
            out.append(Send(conn.id, Restart(round=a.round, reason=why, restart_count=job.restart_count)))
            return
        # The node holds a round we do not (a bug, or a log from elsewhere): it is lost,
        # and joins again as a newcomer.
        reason = f"came back holding round {a.round}, not ours"
        self._drop(member.conn, Departure.STALE, reason, now, out, close=False)
        why = f"the server has no record of node {j.node_id} in round {a.round}; join again"
        out.append(Send(conn.id, Restart(round=a.round, reason=why, restart_count=job.restart_count)))

    def _join_known(self, job: Job, conn: Conn, msg: Join, now: float, out: list[Effect]) -> bool:
        """A node of a job restored from the state log comes back between rounds: True if taken.

        A node that was joining (or waiting as a spare) takes its place again. One the log
        says holds a round but that sends Join did not get its assignment: it is lost and
        joins as a newcomer.
        """
        member = self._away_member(job, msg.node_id)
        if member is None:
            return False
        if self._not_this_node(member, msg):
            self._refuse_claim(conn, job, msg.node_id, now, out)
            return True
        if member.node_id in job.spares:
            self._rebind(job, member, conn, now)
            member.take_join(msg)
            out.append(Send(conn.id, self._waiting(job, "spare: the job is full", spare=True)))
            return True
        if member.state in (MemberState.WAITING, MemberState.READY):
            self._rebind(job, member, conn, now)
            member.nproc = msg.nproc
            member.take_join(msg)
            set_state(job, member, MemberState.READY)
            said.note(job, said.rejoined(now, member), out)
            self._maybe_complete(job, now, out)
            if member.state is MemberState.READY:
                out.append(Send(conn.id, self._waiting(job, "")))
            return True
        self._drop(member.conn, Departure.STALE, "came back without its round", now, out, close=False)
        self._on_join(conn, msg, now, out)  # the job may have ended or been forgotten meanwhile
        return True

    def _resume_into_rebuild(
        self, job: Job, conn: Conn, msg: Resume, settings: JobSettings, now: float, out: list[Effect]
    ) -> None:
        j, a = msg.join, msg.assignment
        view = (a.round, a.group_world_size, a.world_size, a.master_addr, a.master_port)
        problem = job.settings.mismatch(settings)
        if problem is None and view != job.resume_expect:
            problem = f"node {j.node_id} holds round {a.round} of {a.group_world_size} nodes, others another"
        if j.node_id in job.members or j.node_id in job.spares:
            # A second Resume with a node id already back: refused, and the first keeps its
            # place (replacing it would leave its connection bound to nothing).
            self._refuse_claim(conn, job, j.node_id, now, out)
            return
        if problem is None and a.group_rank in job.resume_slots:
            problem = f"two nodes claim group rank {a.group_rank}"
        member = self._attach(
            job, conn, j, now, MemberState.SUCCEEDED if msg.succeeded else MemberState.RUNNING
        )
        put_member(job, member)
        if problem is not None:
            self._abandon_resume(job, f"the agents disagree ({problem})", now, out)
            return
        job.resume_slots[a.group_rank] = member.node_id
        if len(job.resume_slots) < a.group_world_size:
            lost = self.taken_over.lost(job) if self.taken_over is not None else ()
            if lost and len(job.resume_slots) == a.group_world_size - len(lost):
                # Everyone is back but the nodes lost with the rendezvous: they cannot come back.
                assert self.taken_over is not None
                self._abandon_resume(job, self.taken_over.describe(lost), now, out)
                if len(job.members) < job.settings.min_nodes and job.last_call_deadline is None:
                    # Too few without it: a spare on its way here (its walk takes seconds) may
                    # take its place; past the window the job fails, naming it (``_job_tick``).
                    job.last_call_deadline = now + RESUME_WINDOW
            return
        job.end_rebuild([job.resume_slots[i] for i in range(a.group_world_size)])
        job.rounds_completed += 1
        for m in job.members.values():
            out.append(Send(m.conn, Resumed(job_id=job.id, round=job.round, rebuilt=True)))
        said.note(job, said.round_rebuilt(now, job.round, len(job.order)), out)
        goodput.formed(job, now)
        self._maybe_finish(job, now, out)

    def _abandon_resume(self, job: Job, why: str, now: float, out: list[Effect]) -> None:
        """The round cannot be rebuilt: a new round begins with whoever came back."""
        said.note(job, said.rebuild_abandoned(now, job.round, why), out, "warning")
        order = [job.resume_slots[i] for i in sorted(job.resume_slots) if job.resume_slots[i] in job.members]
        # Nodes that came back holding a round but without a slot (they disagreed) were in it
        # too; nodes that sent Join are newcomers: ready already, told nothing.
        order += [
            nid for nid, m in job.members.items() if nid not in order and m.state is not MemberState.READY
        ]
        job.end_rebuild(order)
        self._regather(job, f"the server lost round {job.round} and {why}", now, out)

    def _not_this_node(self, member: Member, join: Join) -> bool:
        """Whether a Join (or a Resume's) for ``member``'s node id fails to show its secret."""
        if not member.node_secret:
            return False  # an older agent, which proves nothing: as before
        import hmac  # here: it loads OpenSSL (~5 ms), which a launch without resumes never needs

        return not hmac.compare_digest(member.node_secret.encode(), join.node_secret.encode())

    def _refuse_claim(self, conn: Conn, job: Job, node_id: str, now: float, out: list[Effect]) -> None:
        self._refuse(
            conn,
            "duplicate_node",
            f"node id {node_id!r} is already in job {job.id!r}, held by another agent (its node "
            "secret differs): a job token proves the job, not the node; give each agent its own node id",
            now,
            out,
        )
