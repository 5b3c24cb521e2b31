"""The rendezvous rules: how a job gathers nodes into rounds, runs them and ends.

This is the file to read to learn what the server decides; ``state.py`` routes events here
(``Rendezvous`` is this class with the handshake and crash recovery added), ``jobs.py`` holds
the state it changes, ``history.py`` words what it notes. Pure: no socket, clock or sleep.

Jobs. A job is keyed by its rdzv id. Its phases:

- ``GATHERING``: collecting nodes for the next round. A round completes when every member is
  ready (has sent ``Join`` since the last round) and either ``max_nodes`` are there, or at
  least ``min_nodes`` are there and no last-call window is open. A last-call window opens when
  the member count first reaches ``min_nodes`` and when a new node joins a running job; it
  lets a burst of nodes arrive together instead of causing one restart each.
- ``RUNNING``: the round's assignment is out. A worker failure, a lost or departing member,
  or a new node (after its settle window) sends ``Restart`` to every member, and the job
  gathers again. Only worker failures (and, in a fixed-size job, node loss) use up the job's
  restart budget, which the server alone counts, so every node agrees on it.
- ``FINISHED`` / ``FAILED``: terminal. The job is forgotten once its last node disconnects.
- (``RESUMING``: a round being rebuilt from its agents after the server lost its state;
  ``recovery.py``.)

Ranks. The first round orders nodes by (address, node id). Later rounds keep the surviving
members in their previous order, so group rank 0, and with it MASTER_ADDR, stays put while
that node survives; newcomers follow, ordered by (address, node id). Node ``i`` in that order
gets group rank ``i`` and global ranks starting at the sum of ``nproc`` of the nodes before it.
Each node is told only its own slice: messages stay O(1) in the size of the job.
A member that reported a loopback address while others connect from elsewhere is given the
address they reached the server on first (``addresses.py``), so no round hands its nodes a
loopback MASTER_ADDR that only one machine can reach.

Node ranks. In a fixed-size job (min_nodes == max_nodes) an agent may give ``--node-rank``
(``Join.node_rank``). Each one must be below the node count and held by one agent at a time:
a join that breaks either is refused (a fatal Error naming the value and, for a duplicate,
the node holding it) and everyone else goes on. A round in which *every* member gave one is
ordered by node rank, so group rank = node rank, in every round with such members; if only
some gave one, the round falls back to the order above, and the job's history says so once.
An elastic job ignores node ranks, as torchrun's c10d backend does (also said once).

Spares and exclusion. A node that joins a full job (or asks to be a spare) waits as a spare and
takes the place of a member that goes. A node whose workers failed ``exclude_after`` times is
excluded for good; a fixed-size job that cannot replace it fails.

Leaving. A member's ``Leave`` is answered with ``Left(job_continues)`` just before its
connection is closed: whether the job goes on without the node (enough members remain or a
spare took its place, its own workers had finished, or the job finished). The agent exits 0
after a drain only then, so a scheduler that cancels the last node sees a failure. A node that
drains first says so when it starts stopping its workers (``Leave(workers_stopping=True)``):
the round stops for everyone at once, as for a Leave, but the node stays a member, not ready,
until its Leave comes after its workers have exited. So no round starts while a worker of the
previous one is alive (a rank 0 saving the checkpoint the next round loads).

Every reply is built before the state it reports changes, and every text built from a peer's
is clipped to its field (the bounds are in ``jobs.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import replace

from protocol import (
    Assignment,
    Drain,
    Error,
    Failure,
    JobDone,
    JobFailed,
    Join,
    Leave,
    Left,
    Restart,
    Waiting,
    WorkersFailed,
    WorkersSucceeded,
)
from protocol.failure_text import describe_failure
from protocol.messages import clip_text

from . import goodput
from . import history as said
from .addresses import Seen, is_loopback, peer_host, plain, reachable_addrs
from .events import Close, Effect, Log, Send
from .history import LOG_TEXT_LEN, Departure, EventKind, JobEvent, Stats, escape, summarise
from .jobs import (
    FAILURE_PATH_LEN,
    FAILURE_TEXT_LEN,
    MAX_SPARES,
    MEMBER_PHASES,
    PEER_TEXT_LEN,
    REASON_LEN,
    Conn,
    ConnPhase,
    Job,
    JobPhase,
    JobSettings,
    LocalError,
    Member,
    MemberState,
    node_rank_problem,
    pop_member,
    put_member,
    set_state,
)
from .progress import (
    JobProgress,
)
from .restore_rules import RestoreRules
from .standbys import TakeOver, standbys_of

# The (world, step)s a job remembers as unrestorable (WorkersFailed.restore_failed): a member
# can name only the round's own restore step, once a round.
MAX_UNRESTORABLE = 16


class RoundRules(RestoreRules):
    """The job rules, as the lowest layer of :class:`~rdzv_server.machine.state.Rendezvous`.

    A mixin, not a helper object: every rule reads and changes the same few tables (and the
    rules call each other: a departure may complete a round, a failure regathers one), so they
    share one ``self``; the state those tables are is declared below and set up by
    ``Rendezvous.__init__``.
    """

    conns: dict[int, Conn]
    jobs: dict[str, Job]
    stats: Stats
    finished_jobs: deque[Job]
    host_node: str | None
    standby_term: int
    taken_over: TakeOver | None
    max_jobs: int
    expire_silent: bool
    unchanged: bool
    _next_sweep: float | None

    # -- joining ---------------------------------------------------------------------------

    def _on_join(self, conn: Conn, msg: Join, now: float, out: list[Effect]) -> None:
        settings = JobSettings.from_join(msg)
        job = self.jobs.get(msg.job_id)
        if job is not None and job.phase in (JobPhase.FINISHED, JobPhase.FAILED):
            if job.members or job.spares:
                what = f"job {job.id!r} has {job.phase.value}; use another --rdzv-id"
                self._refuse(conn, "job_closed", what, now, out)
                return
            del self.jobs[job.id]
            job = None
        if job is None:
            refused = node_rank_problem(settings, None, msg)
            if refused is None and len(self.jobs) >= self.max_jobs:
                refused = self._too_many_jobs(msg.job_id)
            if refused is not None:
                self._refuse(conn, *refused, now, out)  # before the job exists: nothing to forget
                return
            job = Job(id=msg.job_id, settings=settings, created_at=now, gathering_since=now)
            self.jobs[job.id] = job
            self.stats.jobs_created += 1
            self.stats.rounds_started += 1
            said.note(job, said.created(now, settings), out)
            took = self.taken_over
            if took is not None and took.job == job.id:
                # A node joined the job we took over before any came back holding its round
                # (a newcomer that waited for it, first through the door): it gathers anew.
                event = said.took_over(now, None, self.host_node or "", self.standby_term, took.host)
                said.note(job, event, out)
        else:
            problem = job.settings.mismatch(settings)
            if problem is not None:
                self._refuse(conn, "job_mismatch", f"job {job.id!r} disagrees on {problem}", now, out)
                return
            if self._join_known(job, conn, msg, now, out):
                return
        if msg.node_id in job.members or msg.node_id in job.spares:
            self._refuse(
                conn, "duplicate_node", f"node id {msg.node_id!r} is already in job {job.id!r}", now, out
            )
            return
        if msg.node_id in job.excluded:
            why = job.excluded[msg.node_id]
            self._refuse(
                conn, "excluded", f"node {msg.node_id} is excluded from job {job.id!r}: {why}", now, out
            )
            return
        refused = node_rank_problem(job.settings, job, msg)
        if refused is not None:
            self._refuse(conn, *refused, now, out)
            return
        member = self._attach(job, conn, msg, now, MemberState.READY)
        full = len(job.members) >= job.settings.max_nodes
        # Only a running (or resuming) round has succeeded members; skip the scan otherwise,
        # which matters in a join storm.
        finishing = job.phase in (JobPhase.RUNNING, JobPhase.RESUMING) and any(
            m.state is MemberState.SUCCEEDED for m in job.members.values()
        )
        if msg.spare or full or finishing:
            cap = min(job.settings.max_nodes, MAX_SPARES)
            if len(job.spares) >= cap:
                conn.phase, conn.job_id, conn.node_id = ConnPhase.READY, None, None  # not bound
                self._refuse(
                    conn,
                    "job_full",
                    f"job {job.id!r} is full: {len(job.members)} nodes and {len(job.spares)} spares "
                    f"(at most {cap} spares wait)",
                    now,
                    out,
                )
                return
            job.spares[member.node_id] = member
            said.note(job, said.waits_as_spare(now, member), out)
            out.append(Send(conn.id, self._waiting(job, "spare: the job is full", spare=True)))
            self._tell_standbys(job, [member], out)
            return
        put_member(job, member)
        said.note_join(job, member, now, out)
        if job.phase is JobPhase.RUNNING:
            # A newcomer to a running job: let the workers run on while the settle window
            # gathers any other newcomers, then restart everyone once.
            if job.last_call_deadline is None:
                job.last_call_deadline = now + job.settings.last_call_timeout
            out.append(Send(conn.id, self._waiting(job, "joining a running job")))
            self._tell_standbys(job, [member], out)
            self._maybe_regather(job, now, out)
            return
        if len(job.members) == job.settings.min_nodes and job.last_call_deadline is None and not job.order:
            job.last_call_deadline = now + job.settings.last_call_timeout
        self._maybe_complete(job, now, out)
        if member.state is MemberState.READY:
            out.append(Send(conn.id, self._waiting(job, "")))

    def _too_many_jobs(self, job_id: str) -> tuple[str, str]:
        return (
            "too_many_jobs",
            f"job {job_id!r} is refused: this server already holds {len(self.jobs)} jobs (its limit); "
            "it takes new jobs again once others end",
        )

    def _join_known(self, job: Job, conn: Conn, msg: Join, now: float, out: list[Effect]) -> bool:
        """A Join of a node this job held before the server restarted: True if taken.
        ``recovery.py`` decides; the round rules alone know no such node."""
        return False

    def _attach(self, job: Job, conn: Conn, join: Join, now: float, state: MemberState) -> Member:
        """Bind a connection to its node in a job; the caller decides where the member goes."""
        conn.phase = ConnPhase.JOINED
        conn.job_id, conn.node_id = job.id, join.node_id
        member = Member(
            node_id=join.node_id,
            conn=conn.id,
            addr=join.addr,
            nproc=join.nproc,
            master_port=join.master_port,
            seq=job.next_seq,
            joined_at=now,
            state=state,
            node_rank=join.node_rank,
            node_secret=join.node_secret,
            hosts_store=join.hosts_store,
            replica_port=join.replica_port,
            replica_key=join.replica_key,
            replica_cert=join.replica_cert,
            durable_world=join.durable_world,
            durable_steps=join.durable_steps,
            standby_port=join.standby_port,
        )
        if join.node_rank >= 0 and not job.elastic:
            job.rank_holders[join.node_rank] = join.node_id
        job.next_seq += 1
        self._ensure_sweep(now, job.settings.heartbeat_timeout)
        return member

    def _on_rejoin(self, job: Job, member: Member, msg: Join, now: float, out: list[Effect]) -> None:
        if (
            job.settings.mismatch(JobSettings.from_join(msg)) is not None
            or msg.node_id != member.node_id
            or msg.node_rank != member.node_rank
            or (member.node_secret and msg.node_secret != member.node_secret)
        ):
            self._refuse(
                self.conns[member.conn], "job_mismatch", "a re-join must repeat the first join", now, out
            )
            return
        if member.node_id in job.spares:
            self.unchanged = (member.addr, member.master_port) == (msg.addr, msg.master_port)
            member.take_join(msg)
            return
        if member.state is not MemberState.WAITING:
            # Only a member told to restart re-joins; anything else is a confused agent.
            what = f"join while {member.state.value} in round {job.round}"
            self._refuse(self.conns[member.conn], "unexpected_message", what, now, out)
            return
        member.nproc = msg.nproc
        member.take_join(msg)
        set_state(job, member, MemberState.READY)
        self._maybe_complete(job, now, out)

    # -- rounds ----------------------------------------------------------------------------

    def _maybe_complete(self, job: Job, now: float, out: list[Effect]) -> None:
        if not self._can_complete(job, now):
            return
        if (
            job.settings.exclude_stragglers
            and self._leave_out_stragglers(job, now, out)
            and not self._can_complete(job, now)
        ):
            return  # a spare that took a place is not ready yet, or a window is open again
        self._complete(job, now, out)

    def _can_complete(self, job: Job, now: float) -> bool:
        if job.phase is not JobPhase.GATHERING:
            return False
        s = job.settings
        n = len(job.members)
        if n < s.min_nodes:
            return False
        # The cheap test first: during a last-call window there is no need to scan members.
        if n < s.max_nodes and job.last_call_deadline is not None and now < job.last_call_deadline:
            return False
        return not job.not_ready  # kept up to date, so a rejoin storm is not O(N) per join

    def _complete(self, job: Job, now: float, out: list[Effect]) -> None:
        self._reachable(job, out)
        by_node_rank = self._node_rank_order(job, now, out)
        if by_node_rank is not None:
            job.order = by_node_rank
        else:
            survivors = [nid for nid in job.order if nid in job.members]
            kept = set(survivors)
            newcomers = sorted(
                (m for nid, m in job.members.items() if nid not in kept), key=lambda m: (m.addr, m.node_id)
            )
            job.order = survivors + [m.node_id for m in newcomers]
        world_size = sum(job.members[nid].nproc for nid in job.order)
        master = job.members[job.order[0]]
        offsets = []
        at = 0
        for nid in job.order:
            offsets.append(at)
            at += job.members[nid].nproc
        choice = self._restore_step(job, world_size, job.order)
        plans = self._restore_fields(job, choice, world_size, job.order, offsets, now, out)
        job.phase = JobPhase.RUNNING
        job.running_since = now
        job.last_call_deadline = None
        job.rounds_completed += 1
        self.stats.rounds_completed += 1
        self.stats.observe_latency(now - job.gathering_since)
        # The first is built (and validated) as usual; the others differ only in group_rank
        # (< len(order)) and rank_offset (< world_size, every nproc being >= 1), so they are
        # copies: validating 10,000 alike messages was a tenth of a large round's CPU.
        first = Assignment(
            job_id=job.id,
            round=job.round,
            group_rank=0,
            group_world_size=len(job.order),
            rank_offset=0,
            world_size=world_size,
            master_addr=master.addr,
            master_port=master.master_port,
            restart_count=job.restart_count,
            max_restarts=job.settings.max_restarts,
            # Every node must agree on who hosts the store: the one whose workers rank 0 are.
            agent_store=master.hosts_store,
            **plans[0],  # type: ignore[arg-type]
        )
        for group_rank, nid in enumerate(job.order):
            m = job.members[nid]
            set_state(job, m, MemberState.RUNNING)
            if group_rank == 0:
                msg = first
            elif plans[group_rank] or plans[0]:  # every field of node 0's plan is set again
                base = {"restore_step": -1, "restore_source": (), "restore_addrs": (), "restore_keys": ()}
                base |= {"replica_to": "", "replica_key": "", "restore_durable": False}
                base |= {"restore_alt": (), "restore_digests": (), "restore_certs": ()}
                base |= {"replica_cert": "", "replica_from": 0, "replica_count": 0}
                base |= {"restore_world": 0, "restore_ranks": ()}
                fields = base | plans[group_rank]
                msg = first._copy_with(group_rank=group_rank, rank_offset=offsets[group_rank], **fields)
            else:
                msg = first._copy_with(group_rank=group_rank, rank_offset=offsets[group_rank])
            out.append(Send(m.conn, msg))
        self._tell_standbys(job, [*job.members.values(), *job.spares.values()], out)
        event = said.round_complete(
            now, job.round, len(job.order), world_size, master, job.restart_count, by_node_rank is not None
        )
        said.note(job, event, out)
        goodput.formed(job, now)

    def _tell_standbys(self, job: Job, whom: list[Member], out: list[Effect]) -> None:
        """Where ``whom`` go if the agent hosting us is lost (``standbys.py``): said with every
        round, and to a spare or newcomer that waits meanwhile. Not by a rdzv-server."""
        if self.host_node is None or not job.order:
            return
        standbys = standbys_of(job, self.host_node, self.standby_term)
        for m in whom:
            if m.standby_port > 0:  # it offered one, so it reads the list: an older agent never
                out.append(Send(m.conn, standbys))

    def _reachable(self, job: Job, out: list[Effect]) -> None:
        """A member that reported a loopback address takes one the others can reach, when
        they connect from elsewhere (``addresses.py``): before the order, which follows it."""
        members, conns = job.members, self.conns
        if not any(is_loopback(m.addr) for m in members.values()) or all(
            m.conn not in conns or is_loopback(peer_host(conns[m.conn].peer)) for m in members.values()
        ):
            return  # the common cases (no loopback member, or all on one machine): cheap passes
        seen = {}
        for nid, m in members.items():
            c = conns.get(m.conn)
            seen[nid] = Seen(addr=m.addr, peer=peer_host(c.peer), local=c.local) if c else Seen(addr=m.addr)
        for nid, addr in reachable_addrs(seen).items():
            m = members[nid]
            whence = (
                "the address it connects from"
                if addr == plain(seen[nid].peer)
                else "the address the other nodes reach this server on"
            )
            line = (
                f"job {job.id}: node {nid} reported {m.addr}, a loopback address, while other nodes "
                f"connect from elsewhere: its address is {addr}, {whence}"
            )
            out.append(Log("info", escape(clip_text(line, LOG_TEXT_LEN))))
            m.addr = addr

    def _node_rank_order(self, job: Job, now: float, out: list[Effect]) -> list[str] | None:
        """The round's order by --node-rank, or None when node ranks do not decide it."""
        if all(m.node_rank < 0 for m in job.members.values()):
            return None
        s = job.settings
        if job.elastic:
            self._note_ranks_once(job, said.ranks_ignored_elastic(now, s), out)
            return None
        missing = [nid for nid, m in job.members.items() if m.node_rank < 0]
        if missing:
            self._note_ranks_once(job, said.ranks_ignored_partial(now, len(job.members), missing), out)
            return None
        # A fixed-size round has max_nodes members, and the join rules keep their node ranks
        # distinct and below max_nodes: 0..n-1, so each node's group rank is its node rank. Only
        # a round rebuilt from agents' Resumes (which are not refused) could break that.
        order = sorted(job.members, key=lambda nid: job.members[nid].node_rank)
        if [job.members[nid].node_rank for nid in order] != list(range(len(order))):
            self._note_ranks_once(job, said.ranks_ignored_gaps(now), out)
            return None
        return order

    def _note_ranks_once(self, job: Job, event: JobEvent, out: list[Effect]) -> None:
        if not job.ranks_noted:
            job.ranks_noted = True
            said.note(job, event, out, "warning")

    def _regather(
        self,
        job: Job,
        reason: str,
        now: float,
        out: list[Effect],
        *,
        quiet: Collection[str] = (),
        report: str = "",
    ) -> None:
        """Stop the running round: every member restarts its workers and re-joins (all but
        ``quiet``, leaving nodes already stopping their own). A commit under way ends with the
        round; the nodes it was to drain are told to leave now. ``report``: the job's hang
        report, when a hang ended the round."""
        abandoned = job.round
        # Built before anything changes: a message that cannot be built leaves the job as it was.
        restart = Restart(
            round=abandoned,
            reason=clip_text(reason, REASON_LEN),
            restart_count=job.restart_count,
            report=report,
        )
        goodput.stopped(job, now)
        self._hang_superseded(job)
        if job.commit is not None:
            drains = [job.members[nid] for nid in job.commit.drains if nid in job.members]
            drain = Drain(reason=clip_text(job.commit.reason, PEER_TEXT_LEN))
            job.commit = None
            out.extend(Send(m.conn, drain) for m in drains)
        job.round += 1
        job.phase = JobPhase.GATHERING
        job.gathering_since = now
        job.last_call_deadline = None  # newcomers already here are in; no need to wait longer
        self.stats.rounds_started += 1
        in_round = set(job.order)
        for m in job.members.values():
            if m.node_id in in_round:
                set_state(job, m, MemberState.WAITING)
                if m.node_id not in quiet:
                    out.append(Send(m.conn, restart))
        # Newcomers joined while the round ran are ready already; promote spares if room.
        self._promote_spares(job, now, out)
        self._maybe_complete(job, now, out)

    def _maybe_regather(self, job: Job, now: float, out: list[Effect]) -> None:
        """A running job with newcomers restarts when their settle window closes or it is full."""
        if job.phase is not JobPhase.RUNNING:
            return
        newcomers = [nid for nid in job.members if nid not in job.order]
        if not newcomers:
            job.last_call_deadline = None  # the newcomers it was for left: a window left open stays due
            return
        if job.commit is not None:
            # A commit under way: the regather after it takes every newcomer in.
            job.last_call_deadline = None
            return
        full = len(job.members) >= job.settings.max_nodes
        if full or (job.last_call_deadline is not None and now >= job.last_call_deadline):
            names = summarise(newcomers)  # 1,100 node ids would not fit a Restart's reason
            said.note(job, said.admitting(now, names), out)
            job.last_call_deadline = None
            self._plan_change(job, f"node(s) joined: {names}", now, out)

    def _promote_spares(self, job: Job, now: float, out: list[Effect]) -> None:
        while job.spares and len(job.members) < job.settings.max_nodes:
            # A connected spare first. One still away after a server restart takes the place
            # too when it is the only one, but is not ready until it is back and joins.
            nid = next((n for n, m in job.spares.items() if not self._is_away(m)), next(iter(job.spares)))
            m = job.spares.pop(nid)
            m.state = MemberState.WAITING if self._is_away(m) else MemberState.READY
            put_member(job, m)
            said.note(job, said.spare_takes_place(now, m), out)

    def _is_away(self, member: Member) -> bool:
        """Whether the member's agent has not come back since the server restarted."""
        conn = self.conns.get(member.conn)
        return conn is not None and conn.phase is ConnPhase.AWAY

    def _maybe_finish(self, job: Job, now: float, out: list[Effect]) -> None:
        if job.phase is not JobPhase.RUNNING or not job.members:
            return
        in_round = [job.members[nid] for nid in job.order if nid in job.members]
        if all(m.state is MemberState.SUCCEEDED for m in in_round):
            job.phase = JobPhase.FINISHED
            job.commit = None
            job.last_call_deadline = None
            job.outcome = f"all workers succeeded in round {job.round}"
            self.stats.jobs_finished += 1
            done = JobDone(summary=goodput.line(job, now))
            goodput.ended(job, now)
            for m in [*job.members.values(), *job.spares.values()]:
                out.append(Send(m.conn, done))
            said.note(job, said.finished(now, job.round, job.outcome), out)

    def _fail(
        self,
        job: Job,
        reason: str,
        failure: Failure | None,
        now: float,
        out: list[Effect],
        code: str = "",
        report: str = "",
    ) -> None:
        reason = clip_text(reason, REASON_LEN)
        # One object: encoded once for all. ``code``: why, for the agent's exit code.
        failed = JobFailed(
            reason=reason, failure=failure, code=code, report=report, summary=goodput.line(job, now)
        )
        goodput.ended(job, now)
        self._hang_superseded(job)
        job.phase = JobPhase.FAILED
        job.commit = None
        job.fail_code = code
        job.last_call_deadline = None
        job.outcome = reason
        self.stats.jobs_failed += 1
        for m in [*job.members.values(), *job.spares.values()]:
            out.append(Send(m.conn, failed))
        number = job.failures_total if failure is not None else 0
        said.note(job, said.failed(now, job.round, reason, number), out, "error")

    # -- worker results --------------------------------------------------------------------

    def _on_failed(self, job: Job, member: Member, msg: WorkersFailed, now: float, out: list[Effect]) -> None:
        rebuilding = job.phase is JobPhase.RESUMING and msg.round == job.round
        if rebuilding:
            # A failure while the round is being rebuilt ends the rebuild: it is a failure of
            # that round, handled like any other.
            job.end_rebuild([job.resume_slots[i] for i in sorted(job.resume_slots)])
        if (
            job.phase is not JobPhase.RUNNING
            or msg.round != job.round
            or member.node_id not in job.order
            or job.hang_verdict is not None
        ):
            # A second failure in a round that is already being restarted (or whose hang's
            # verdict waits for the nodes' stacks) counts once.
            self.unchanged = not rebuilding
            return
        goodput.failure_reported(job, msg.step)
        if msg.restore_failed >= 0 and msg.restore_failed == job.restore_step:
            # It could not get its own ranks' snapshots of the round's restore step (issue
            # 42): the next round restores from an older step, not this one again.
            bad = (job.world_size, msg.restore_failed)
            if bad not in job.unrestorable:
                job.unrestorable = [*job.unrestorable, bad][-MAX_UNRESTORABLE:]
        # The node and address are the sender's, whatever it wrote: a member cannot name
        # another node as the root cause. Its message is kept cut to FAILURE_TEXT_LEN.
        failure = replace(
            msg.failure,
            node_id=member.node_id,
            addr=member.addr,
            message=clip_text(msg.failure.message, FAILURE_TEXT_LEN),
            error_file=clip_text(msg.failure.error_file, FAILURE_PATH_LEN),
        )
        if not self._hang_waits(job, member, failure, msg.step, now):
            self._verdict(job, member.node_id, failure, msg.step, now, out)

    def _verdict(
        self, job: Job, node_id: str, failure: Failure, step: int, now: float, out: list[Effect]
    ) -> None:
        """Restart or fail the job for a worker failure of its running round, which ``node_id``
        reported. A hang's is first told as every node's stacks tell it: the rank they point
        at, on its node, which the failure then counts against."""
        failure, report = self._hang_cause(job, failure)
        member = job.members.get(failure.node_id) or job.members.get(node_id)
        if member is not None:
            member.failures += 1
        job.add_failure(failure)
        self.stats.failures["worker"] += 1
        cause = describe_failure(failure)
        if self._crash_loop(job, step, cause, failure, now, out, report):
            return
        limit = job.settings.exclude_after
        excluded = member if member is not None and limit > 0 and member.failures >= limit else None
        if job.restart_count < job.settings.max_restarts:
            job.restart_count += 1
            self.stats.restarts += 1
            event = said.worker_failure(
                now,
                job.round,
                cause,
                failure.node_id,
                failure.addr,
                job.failures_total,
                job.restart_count,
                job.settings.max_restarts,
            )
            said.note(job, event, out, "warning")
            if excluded is not None:
                self._exclude(job, excluded, f"its workers failed {excluded.failures} times", now, out)
                if job.phase is not JobPhase.RUNNING:
                    return
            self._regather(job, f"worker failure: {cause}", now, out, report=report)
        else:
            reason = (
                f"{cause}; no restarts left (--max-restarts {job.settings.max_restarts})"
                if job.settings.max_restarts
                else f"{cause} (--max-restarts 0)"
            )
            self._fail(job, reason, failure, now, out, report=report)

    def _hang_superseded(self, job: Job) -> None:
        """The round ends for another reason while a hang's verdict waited for the nodes'
        stacks: the hang is still one of its failures (kept and counted, as reported), but
        that other reason decides what follows."""
        v, job.hang_verdict = job.hang_verdict, None
        if v is None:
            return
        member = job.members.get(v.node)
        if member is not None:
            member.failures += 1
        job.add_failure(v.failure)
        self.stats.failures["worker"] += 1

    def _exclude(self, job: Job, member: Member, why: str, now: float, out: list[Effect]) -> None:
        """Take a flaky node out of the job for good; the others go on if enough remain."""
        job.exclude(member.node_id, why)
        said.note(job, said.excluded(now, member, why), out, "warning")
        text = f"node {member.node_id} is excluded from job {job.id!r}: {why}"
        out.append(Send(member.conn, Error(code="excluded", message=text, fatal=True)))
        conn = self.conns.pop(member.conn, None)
        out.append(Close(member.conn, "excluded"))
        pop_member(job, member.node_id)
        if conn is not None:
            conn.phase = ConnPhase.READY
        self._promote_spares(job, now, out)
        if len(job.members) < job.settings.min_nodes and not job.spares and not job.elastic:
            self._fail(
                job,
                f"node {member.node_id} excluded ({why}) and the job needs {job.settings.min_nodes} nodes",
                None,
                now,
                out,
            )

    def _on_succeeded(
        self, job: Job, member: Member, msg: WorkersSucceeded, now: float, out: list[Effect]
    ) -> None:
        if msg.round != job.round or member.state is not MemberState.RUNNING:
            self.unchanged = True
            return
        if job.phase is JobPhase.RESUMING:
            set_state(job, member, MemberState.SUCCEEDED)  # counted once the round is rebuilt
            return
        if job.phase is not JobPhase.RUNNING:
            self.unchanged = True
            return
        set_state(job, member, MemberState.SUCCEEDED)
        goodput.finishing(job, now, msg.idle_ms / 1000.0)
        self._maybe_finish(job, now, out)

    # -- departures ------------------------------------------------------------------------

    def _on_leave(
        self, conn: Conn, job: Job, member: Member, msg: Leave, now: float, out: list[Effect]
    ) -> None:
        """A node leaves on purpose; tell it whether the job goes on without it, then close."""
        was_spare = member.node_id in job.spares
        had_succeeded = member.state is MemberState.SUCCEEDED
        reason = f"left ({clip_text(msg.reason, PEER_TEXT_LEN)})" if msg.reason else "left"
        self._drop(conn.id, Departure.LEFT, reason, now, out, close=False)
        goes_on, why = self._goes_on_without(job, was_spare=was_spare, had_succeeded=had_succeeded)
        out.append(Send(conn.id, Left(job_continues=goes_on, reason=why)))
        out.append(Close(conn.id, reason))

    def _on_leaving_soon(self, job: Job, member: Member, msg: Leave, now: float, out: list[Effect]) -> None:
        """A node stops its workers to leave (a drain): the others' round stops now, as it would
        for its Leave, but the node keeps its place, not ready, until that Leave (sent once its
        workers have exited), so the next round cannot start while they live."""
        nid = member.node_id
        if (
            nid in job.spares
            or job.phase not in (JobPhase.RUNNING, JobPhase.GATHERING)
            or member.state is MemberState.SUCCEEDED
        ):
            self.unchanged = True
            return  # no workers to wait for, or a job being rebuilt or ended: the Leave decides
        why = f" ({clip_text(msg.reason, PEER_TEXT_LEN)})" if msg.reason else ""
        in_round = job.phase is JobPhase.RUNNING and nid in job.order and member.state is MemberState.RUNNING
        was_waiting = member.state is MemberState.WAITING
        set_state(job, member, MemberState.WAITING)
        if not in_round:
            self.unchanged = was_waiting  # a repeated notice changes nothing
            return  # gathering, or a newcomer: not ready is all it takes
        said.note(job, said.leaving(now, member, why, job.round), out, "warning")
        self._regather(job, f"node {nid} ({member.addr}) is leaving{why}", now, out, quiet=(nid,))

    def _goes_on_without(self, job: Job, *, was_spare: bool, had_succeeded: bool) -> tuple[bool, str]:
        """After a node left: whether its job goes on, and why (for the node's exit code)."""
        if job.phase is JobPhase.FINISHED:
            return True, "the job finished"
        if job.phase is JobPhase.FAILED:
            return False, f"the job failed: {job.outcome}"
        if was_spare:
            return True, "this node was a spare; the job goes on without it"
        if self.jobs.get(job.id) is not job:
            return False, "this node was the last of the job"
        if had_succeeded and job.phase is JobPhase.RUNNING:
            return True, "this node's workers had finished; the other nodes go on"
        n, need = len(job.members), job.settings.min_nodes
        if n >= need:
            return True, f"{n} node(s) remain and the job needs {need}"
        return False, f"only {n} node(s) remain and the job needs {need}"

    def _drop(
        self, conn_id: int, how: Departure, reason: str, now: float, out: list[Effect], *, close: bool
    ) -> None:
        """A connection is gone (``how``, and ``reason`` in words); so is its node, if it had one."""
        conn = self.conns.pop(conn_id, None)
        if conn is None:
            return
        if close:
            out.append(Close(conn_id, reason))
        if conn.phase not in MEMBER_PHASES or conn.job_id is None or conn.node_id is None:
            return
        job = self.jobs.get(conn.job_id)
        if job is None:
            return
        nid = conn.node_id
        spare = job.spares.pop(nid, None)
        if spare is not None:
            said.note(job, said.spare_departed(now, spare, how, reason), out)
            self._forget_if_done(job, now, out)
            return
        member = pop_member(job, nid)
        if member is None:
            return
        job.progress.forget(nid)
        if job.phase in (JobPhase.FINISHED, JobPhase.FAILED):
            self._forget_if_done(job, now, out)
            return
        if job.phase is JobPhase.RESUMING:
            job.resume_slots = {r: n for r, n in job.resume_slots.items() if n != nid}
            said.note(job, said.departed_in_rebuild(now, member, how, reason), out, "warning")
            self._forget_if_done(job, now, out)
            return
        kind = how.kind
        self.stats.failures[f"node_{kind.value}"] += 1
        said.note(job, said.departed(now, member, how, reason, len(job.members)), out, "warning")
        if job.phase is JobPhase.GATHERING:
            self._promote_spares(job, now, out)
            if self._forget_if_done(job, now, out):
                return
            if len(job.members) < job.settings.min_nodes and not job.order:
                job.last_call_deadline = None
            self._notify_waiting(job, out)
            self._maybe_complete(job, now, out)
            return
        # RUNNING
        if nid not in job.order:
            self._newcomer_gone(job, now, out)  # a newcomer that had not started yet
            return
        if member.state is MemberState.SUCCEEDED:
            self._maybe_finish(job, now, out)
            return
        if self._forget_if_done(job, now, out):
            return
        cause = f"node {nid} ({member.addr}) {reason}"
        if not job.elastic and kind is EventKind.LOST:
            # A fixed-size job cannot go on smaller: losing a node is a failure, as it is for
            # torchrun (whose survivors fail in their next collective).
            if job.restart_count >= job.settings.max_restarts and not job.spares:
                self._fail(job, f"{cause}; the job needs {job.settings.min_nodes} nodes", None, now, out)
                return
            if not job.spares:
                job.restart_count += 1
                self.stats.restarts += 1
        self._regather(job, cause, now, out)
        self._notify_waiting(job, out)

    def _notify_waiting(self, job: Job, out: list[Effect]) -> None:
        if job.phase is JobPhase.GATHERING and len(job.members) < job.settings.min_nodes:
            msg = self._waiting(job, "waiting for nodes")
            for m in job.members.values():
                out.append(Send(m.conn, msg))

    def _forget_if_done(self, job: Job, now: float, out: list[Effect]) -> bool:
        """Forget a job nobody is in any more (its id may then be used again)."""
        if job.members or job.spares:
            return False
        if job.phase not in (JobPhase.FINISHED, JobPhase.FAILED):
            job.phase = JobPhase.ABANDONED  # its status must not say it still runs or gathers
            job.outcome = job.outcome or "every node left"
            said.note(job, said.forgotten(now), out)
        goodput.ended(job, now)
        del self.jobs[job.id]
        job.progress = JobProgress()  # a job that is over shows no training, but its hang:
        if job.hang is not None:
            job.hang.settle()  # the evidence stays, one stack per group of alike stacks
        self.finished_jobs.append(job)
        return True

    def _ensure_sweep(self, now: float, timeout: float) -> None:
        if not self.expire_silent:
            return
        due = now + max(timeout / 4, 0.05)
        if self._next_sweep is None or due < self._next_sweep:
            self._next_sweep = due

    # -- helpers ---------------------------------------------------------------------------

    def _member_of(self, conn: Conn) -> tuple[Job, Member]:
        job = self.jobs.get(conn.job_id or "")
        member = None
        if job is not None and conn.node_id is not None:
            member = job.members.get(conn.node_id) or job.spares.get(conn.node_id)
        if job is None or member is None:
            raise LocalError(f"joined connection {conn.id} has no member")
        return job, member

    def _waiting(self, job: Job, reason: str, *, spare: bool = False) -> Waiting:
        return Waiting(
            job_id=job.id,
            round=job.round,
            joined=len(job.members),
            min_nodes=job.settings.min_nodes,
            max_nodes=job.settings.max_nodes,
            reason=reason,
            spare=spare,
        )

    def _refuse(self, conn: Conn, code: str, message: str, now: float, out: list[Effect]) -> None:
        """The peer was wrong: tell it why and close its connection; everyone else goes on."""
        message = clip_text(message, REASON_LEN)
        out.append(Send(conn.id, Error(code=code, message=message, fatal=True)))
        out.append(Log("warning", escape(clip_text(f"refused {conn.peer}: {message}", LOG_TEXT_LEN))))
        self._drop(conn.id, Departure.REFUSED, f"refused: {message}", now, out, close=True)
