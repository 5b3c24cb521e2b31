"""The rendezvous machine: one pure state machine for every job on a server.

Nothing here (or in the modules below) opens a socket, reads a clock or sleeps. The asyncio
layer (``service.py``) turns connections, frames and timers into events, calls
:meth:`Rendezvous.handle` with the time of its monotonic clock, and carries out the effects it
gets back (send a message, close a connection, log a line). Deadlines are exposed by
:meth:`Rendezvous.next_deadline` so the caller knows when to deliver the next :class:`Tick`.
The same machine is what the state log replays after a crash (``journal.py``) and what the
etcd backend's agents replicate (``node_agent/rdzv/etcd.py``).

Where things are. ``Rendezvous.handle(event, now) -> effects`` is the one entry point; this
file routes events and holds the connection handshake and its deadlines. Every input is an
event, an operator's drain (:class:`DrainRequested`), a shutdown (:class:`ShuttingDown`) and a
restart from the state log (:class:`Restarted`) too, so the state log replays exactly what
``handle`` was given. The rest, by concern:

- ``events.py``: the events and effects (re-exported here);
- ``rounds.py``: **the rendezvous rules**: joining, rounds and ranks, failures and restarts,
  spares, exclusion, leaving, finishing; read it to learn what the server decides;
- ``commits.py`` and ``training_rules.py``: the layers under the round rules: commit points
  (a planned change stops every rank at one step first) and the training rules (progress,
  hangs, stragglers, crash loops);
- ``recovery.py``: taking jobs back after a server restart (resume windows, away members,
  rounds rebuilt from the agents);
- ``jobs.py``: the state (connections, jobs, members) and the bounds on it;
- ``history.py``: a job's typed history, the sentences it is told in, the join-log throttle
  and the counters behind ``/metrics``.

``Rendezvous`` is those layers stacked as mixins: ``TrainingRules`` <- ``CommitRules`` <-
``RoundRules`` <- ``Recovery`` <- ``Rendezvous``. Helper objects were the other choice, but
the rules are one algorithm over one set of tables (a departure may complete a round; a
resume goes through the join rules), so each helper would need the others and the tables
back; a stack shares one ``self``, and each layer calls only down it, except one hook
(``_join_known``) that recovery overrides, and the ``_regather`` the commit layer calls up.

Connections. Each connection starts in ``HELLO``: the first frame must be a ``Hello`` whose
versions overlap ours. It is then ``READY`` and may send one ``Join`` (or a ``Resume``), which
must carry a proof of the job's token when the server has tokens; from then on it *is* one
node of one job (``JOINED``) until it leaves, drops, or goes silent for longer than its job's
heartbeat timeout (the sweep, on :class:`Tick`). A heartbeat is the one input that never
reaches ``handle`` (nor the state log): :meth:`Rendezvous.heartbeat` is its fast path.

Handshake deadlines. A connection must say hello within ``hello_timeout`` of its accept
(``Connected.since``), and join within ``auth_timeout`` of its hello; heartbeats and frames
that never complete buy no time. Each deadline is state of its ``Conn``, kept in a heap that
``next_deadline`` reads, and a :class:`Tick` closes the late ones. Like the heartbeat sweep
they are off with ``expire_silent=False`` (the state log's replay gets the closes from the
logged Tick; etcd replicas have no sockets). Before its first bytes are routed (our protocol,
or HTTP), a socket is the service's alone, and so is that deadline.

Bounds. Whatever peers send, a job keeps at most its first failure, the last FAILURES_KEPT and
a count, HISTORY_LEN history lines of HISTORY_TEXT_LEN characters, MAX_EXCLUDED exclusions,
min(max_nodes, MAX_SPARES) spares and ENTRYPOINT_KEPT characters of entrypoint; a server holds
at most ``max_jobs`` jobs. Every text built from a peer's is clipped to its field, and every
reply is built before the state it reports changes.

Faults (``faults.py``). ``handle`` runs an event as units, each for one job or for the server
(``_unit``): a member's frame, an authenticated join or resume, a job's share of a tick, a lost
connection, a drain. Should a rule still raise, the job of its unit fails with
``internal_error`` (its agents told which rule), the event's other units go on, and the
containment is a fact of the event, so the log and a replay agree (``_contain``); a fault
outside any job's unit refuses the peer whose frame it was.
"""

from __future__ import annotations

import heapq
from collections import deque
from contextlib import suppress
from dataclasses import replace
from typing import Any

from protocol import (
    Armed,
    Drain,
    Error,
    GoingAway,
    HangDetected,
    Heartbeat,
    Hello,
    Join,
    Leave,
    LeaveAfterCommit,
    Left,
    Message,
    Progress,
    Resume,
    SnapshotsHeld,
    Stacks,
    VersionMismatch,
    Welcome,
    WorkersCommitted,
    WorkersFailed,
    WorkersSucceeded,
    negotiate_version,
)
from protocol.auth import TokenTable, verify
from protocol.messages import clip_text

from . import faults
from . import history as said
from .events import (
    Close,
    Connected,
    Disconnected,
    DrainRequested,
    Effect,
    Event,
    Log,
    NotFound,
    Received,
    Restarted,
    Send,
    ShuttingDown,
    Tick,
)
from .history import (
    HISTORY_LEN,
    HISTORY_TEXT_LEN,
    JOIN_LINES,
    JOIN_LOG_WINDOW,
    LATENCY_BUCKETS,
    LOG_TEXT_LEN,
    NAMES_SHOWN,
    Departure,
    EventKind,
    JobEvent,
    Stats,
    escape,
    summarise,
)
from .jobs import (
    ENTRYPOINT_KEPT,
    FAILURE_PATH_LEN,
    FAILURE_TEXT_LEN,
    FAILURES_KEPT,
    FINISHED_JOBS_KEPT,
    MAX_EXCLUDED,
    MAX_JOBS,
    MAX_RESTARTS,
    MAX_SPARES,
    MEMBER_PHASES,
    PEER_TEXT_LEN,
    REASON_LEN,
    RESUME_WINDOW,
    Conn,
    ConnPhase,
    Job,
    JobPhase,
    JobSettings,
    LocalError,
    Member,
    MemberState,
    entrypoint_key,
)
from .recovery import Recovery
from .standbys import TakeOver

SOFTWARE = "rdzv-server/0.1"
HELLO_TIMEOUT = 10.0  # a connection that has not said hello by then is closed
# ... and one that said hello but has not joined (proved its token) by then. Longer: an agent
# runs its --health-check (up to 60 s, node_agent.runner.HEALTH_CHECK_TIMEOUT) before joining.
AUTH_TIMEOUT = 90.0
# The Error code of a join refused while ``Rendezvous.refuse_joins`` is set.
SERVER_BUSY = "server_busy"

# What ``from rdzv_server.machine.state import ...`` gives (the machine, its events and effects,
# its state and bounds), wherever each now lives.
__all__ = [
    "AUTH_TIMEOUT",
    "ENTRYPOINT_KEPT",
    "FAILURES_KEPT",
    "FAILURE_PATH_LEN",
    "FAILURE_TEXT_LEN",
    "FINISHED_JOBS_KEPT",
    "HELLO_TIMEOUT",
    "HISTORY_LEN",
    "HISTORY_TEXT_LEN",
    "JOIN_LINES",
    "JOIN_LOG_WINDOW",
    "LATENCY_BUCKETS",
    "LOG_TEXT_LEN",
    "MAX_EXCLUDED",
    "MAX_JOBS",
    "MAX_RESTARTS",
    "MAX_SPARES",
    "NAMES_SHOWN",
    "PEER_TEXT_LEN",
    "REASON_LEN",
    "RESUME_WINDOW",
    "SERVER_BUSY",
    "SOFTWARE",
    "Close",
    "Conn",
    "ConnPhase",
    "Connected",
    "Departure",
    "Disconnected",
    "DrainRequested",
    "Effect",
    "Event",
    "EventKind",
    "Job",
    "JobEvent",
    "JobPhase",
    "JobSettings",
    "LocalError",
    "Log",
    "Member",
    "MemberState",
    "NotFound",
    "Received",
    "Rendezvous",
    "Restarted",
    "Send",
    "ShuttingDown",
    "Stats",
    "Tick",
    "entrypoint_key",
    "escape",
    "summarise",
]


class Rendezvous(Recovery):
    """Every job on one server. Feed it events; carry out what it returns."""

    def __init__(
        self,
        tokens: TokenTable | None = None,
        *,
        expire_silent: bool = True,
        max_jobs: int = MAX_JOBS,
        hello_timeout: float = HELLO_TIMEOUT,
        auth_timeout: float = AUTH_TIMEOUT,
        host_node: str | None = None,
        standby_term: int = 0,
        taken_over: TakeOver | None = None,
    ) -> None:
        self.tokens = tokens  # None: no authentication (the server says so at start)
        # An agent hosts us (issue 45, ``standbys.py``): its node, and the take-overs so far.
        # Each round then names its job's standbys; a rdzv-server (None) names none.
        self.host_node = host_node
        self.standby_term = standby_term
        # We host as the standby that took over (``standbys.py``): the rebuilt round of its job
        # waits for every node but those it knows are lost (``recovery.py``).
        self.taken_over = taken_over
        self.hello_timeout = hello_timeout
        self.auth_timeout = auth_timeout
        self.max_jobs = max_jobs  # jobs held at once (ended ones still held count too)
        # False when something else tells us who is alive (etcd leases): heartbeats are
        # then not delivered, and silence means nothing.
        self.expire_silent = expire_silent
        self.conns: dict[int, Conn] = {}
        self.jobs: dict[str, Job] = {}
        self.stats = Stats()
        # Jobs that ended and were forgotten, newest last, for the status API.
        self.finished_jobs: deque[Job] = deque(maxlen=FINISHED_JOBS_KEPT)
        self._next_sweep: float | None = None
        # (deadline, conn id) of each handshake deadline set; an entry whose conn is gone or
        # has another deadline now is stale, and is skipped when it comes up.
        self._handshake_due: list[tuple[float, int]] = []
        # After a restart from the state log: when members still AWAY are treated as lost.
        self.resume_deadline: float | None = None
        self.draining = False  # the server is going away: no joins
        # Set by handle(): the event changed nothing worth logging (a stale or ignored
        # message). The state log skips such events; the service counts them per connection.
        self.unchanged = False
        # Non-empty (the journal sets it when its disk is nearly full): a Join that would add
        # a node to a job (a new member, spare or job) is refused with this text; members
        # coming back (resumes, rejoins) are still served, so running jobs go on.
        self.refuse_joins = ""
        # Set by handle(): facts the event's handling derived from volatile state (stragglers
        # noted from Progress, nodes left out of a round for it), for the state log to keep
        # with the event's record; None when there are none. ``logged_facts``: set by the
        # log's replay around one record, the facts the live server derived for it (see
        # rounds.RoundRules.facts).
        self.facts: dict[str, list[Any]] | None = None
        self.logged_facts: dict[str, Any] | None = None
        self._units: list[str | None] = []  # the jobs of the units being run (see _unit)

    # -- public API ------------------------------------------------------------------------

    def handle(self, event: Event, now: float) -> list[Effect]:
        """Decide what ``event`` changes; the effects to carry out. Never raises for a fault of
        a rule: the job whose rule raised fails, every other job goes on (``_unit``)."""
        out: list[Effect] = []
        self.unchanged = False
        self.facts = None
        # The caller's mistakes, not the machine's: fail loudly.
        if isinstance(event, Received) and event.conn not in self.conns:
            raise LocalError(f"message {type(event.msg).__name__} on unknown connection {event.conn}")
        if isinstance(event, Connected) and event.conn in self.conns:
            raise LocalError(f"connection {event.conn} connected twice")
        try:
            if isinstance(event, Received):
                self._on_received(event.conn, event.msg, now, out)
            elif isinstance(event, Connected):
                e = event
                conn = Conn(id=e.conn, peer=e.peer, last_seen=now, challenge=e.challenge, local=e.local)
                self.conns[event.conn] = conn
                start = now if event.since is None else min(event.since, now)
                self._set_deadline(conn, start + self.hello_timeout)
            elif isinstance(event, Disconnected):
                self._drop_unit(event.conn, Departure.LOST, event.reason, now, out, close=False)
            elif isinstance(event, Tick):
                self._on_tick(now, out)
            elif isinstance(event, DrainRequested):
                with self._unit("drain", now, out, event.job_id):
                    self._drain(event, now, out)
            elif isinstance(event, ShuttingDown):
                self._going_away(event.reason, now, out)
            elif isinstance(event, Restarted):
                self._recover(now, out)
            else:
                raise LocalError(f"unknown event {event!r}")
        except Exception as exc:
            # Outside every job's unit: the routing, a handshake, the server's bookkeeping.
            if isinstance(event, Received):
                self._contain(event.msg.TYPE, exc, now, out, None, event.conn)
            else:
                self._contain(type(event).__name__.lower(), exc, now, out, None, None)
        return out

    # -- containing a fault (faults.py) ----------------------------------------------------

    def _unit(
        self, rule: str, now: float, out: list[Effect], job_id: str | None = None, conn: int | None = None
    ) -> _Unit:
        """One unit of an event's work, for job ``job_id`` (None: the server): an exception in
        it is contained here (``_contain``), and the event's other units go on. A unit inside
        one for the same job (or inside any, for a server unit) is part of it."""
        return _Unit(self, rule, now, out, job_id, conn)

    def _unit_done(
        self,
        rule: str,
        exc: BaseException | None,
        now: float,
        out: list[Effect],
        job_id: str | None,
        conn: int | None,
    ) -> bool:
        """The end of an outermost unit (``_Unit.__exit__``); True: ``exc`` was contained."""
        try:
            if exc is None:
                if self.logged_facts is not None and job_id is not None and self._logged_fault(job_id, rule):
                    # Replaying a fault this replay did not meet (a rule of volatile state that
                    # is not a ``from_volatile`` one): the job ends as it did live.
                    self._contain(rule, None, now, out, job_id, conn)
                return False
            if not isinstance(exc, Exception):
                return False  # (KeyboardInterrupt and the like go on up)
            self._contain(rule, exc, now, out, job_id, conn)
            return True
        finally:
            self._units.pop()

    def _logged_fault(self, job_id: str, rule: str, *, take: bool = False) -> str | None:
        """The reason the live server gave for a fault of ``job_id`` in ``rule`` (replaying)."""
        entries = (self.logged_facts or {}).get("fault", [])
        hit = next((e for e in entries if [e[0], e[1]] == [job_id, rule]), None)
        if hit is None or self.logged_facts is None:
            return None
        if take:
            self.logged_facts["fault"] = [e for e in entries if e is not hit]  # used once
        return str(hit[2])

    def _contain(
        self,
        rule: str,
        exc: Exception | None,
        now: float,
        out: list[Effect],
        job_id: str | None,
        conn_id: int | None,
    ) -> None:
        """A rule raised ``exc`` in a unit of ``job_id`` (None: of the server), or did when
        the live server handled the event being replayed (``exc`` None). Say so once, with
        the rule's place and the frames of ours that led to it; fail the job (its agents are
        told why); refuse the peer whose frame it was, unless it is one of those agents; and
        keep the decision as a fact of the event, so the state log has the event and a replay
        its words."""
        self.unchanged = False
        logged = self._logged_fault(job_id or "", rule, take=True)
        if logged is not None:
            reason = logged
        elif exc is not None:
            reason = clip_text(
                f"internal error in {faults.where(exc)} handling {rule}: {type(exc).__name__}: {exc}",
                REASON_LEN,
            )
        else:
            reason = f"internal error handling {rule}"
        self._add_fact("fault", [job_id or "", rule, reason])
        line = reason if exc is None else f"{reason} [{faults.trail(exc)}]"
        whose = f"job {job_id}: " if job_id is not None else ""
        conn = self.conns.get(conn_id) if conn_id is not None else None
        peer = f" (from connection {conn.id}, {conn.peer})" if conn is not None else ""
        out.append(Log("error", escape(clip_text(f"{whose}{line}{peer}", LOG_TEXT_LEN))))
        job = self.jobs.get(job_id) if job_id is not None else None
        if job is not None:
            self._end_by_fault(job, reason, now, out)
        if conn is None or conn.id not in self.conns:
            return
        if job is not None and conn.job_id == job.id and conn.phase in MEMBER_PHASES:
            return  # told with the job's other agents
        try:
            self._refuse(conn, faults.INTERNAL_ERROR, f"the server could not handle this {rule}", now, out)
        except Exception:
            self.conns.pop(conn.id, None)
            out.append(Close(conn.id, "internal error"))

    def _end_by_fault(self, job: Job, reason: str, now: float, out: list[Effect]) -> None:
        """Fail ``job`` for a fault of ours. A job already over stays as it is. Should failing
        it raise as well, it ends without a word to its agents, and with no deadline left."""
        if job.phase in (JobPhase.FINISHED, JobPhase.FAILED, JobPhase.ABANDONED):
            return
        try:
            self._fail(job, reason, None, now, out, code=faults.INTERNAL_ERROR)
        except Exception:
            job.phase, job.outcome, job.fail_code = JobPhase.FAILED, reason, faults.INTERNAL_ERROR
            job.commit = job.hang_verdict = job.last_call_deadline = None
            return
        with suppress(Exception):  # else it is forgotten when its last node goes
            self._forget_if_done(job, now, out)

    def heartbeat(self, conn_id: int, now: float) -> bool:
        """Received(conn, Heartbeat()) for a connection past its hello, without the event.

        The server's fast path for the one message every agent sends every second; False when
        the full path must decide (unknown connection, or no hello yet: a protocol error).
        """
        conn = self.conns.get(conn_id)
        if conn is None or conn.phase is ConnPhase.HELLO:
            return False
        conn.last_seen = now
        return True

    def credit_stall(self, seconds: float) -> None:
        """The server itself did not run for ``seconds`` (a stalled loop, a SIGSTOP): that is
        no agent's silence, so every connection's last sign of life moves on by as much."""
        if seconds > 0:
            for conn in self.conns.values():
                conn.last_seen += seconds

    def next_deadline(self) -> float | None:
        """The earliest time at which a Tick would change something."""
        deadlines = [j.last_call_deadline for j in self.jobs.values() if j.last_call_deadline is not None]
        deadlines.extend(j.commit.deadline for j in self.jobs.values() if j.commit is not None)
        deadlines.extend(j.hang_verdict.deadline for j in self.jobs.values() if j.hang_verdict is not None)
        if self._next_sweep is not None:
            deadlines.append(self._next_sweep)
        if self.resume_deadline is not None:
            deadlines.append(self.resume_deadline)
        due = self._handshake_due
        while due and self._stale(*due[0]):
            heapq.heappop(due)  # bookkeeping only: a stale entry would wake the caller for nothing
        if due:
            deadlines.append(due[0][0])
        return min(deadlines) if deadlines else None

    # -- the operator's and the server's own events ----------------------------------------

    def _going_away(self, reason: str, now: float, out: list[Effect]) -> None:
        """The server is shutting down: refuse joins, and tell every agent to reconnect later."""
        self.draining = True
        reason = clip_text(reason, PEER_TEXT_LEN)
        msg = GoingAway(reason=reason)
        out.extend(
            Send(c.id, msg) for c in self.conns.values() if c.phase in (ConnPhase.READY, ConnPhase.JOINED)
        )
        for job in self.jobs.values():
            with self._unit("going_away", now, out, job.id):
                said.note(job, said.server_going_away(now, reason), out)

    def _drain(self, event: DrainRequested, now: float, out: list[Effect]) -> None:
        """An operator asks a node to leave cleanly (its agent stops its workers, then leaves)."""
        job = self.jobs.get(event.job_id)
        member = None if job is None else job.members.get(event.node_id) or job.spares.get(event.node_id)
        if job is None or member is None:
            what = (
                f"no job {event.job_id!r}" if job is None else f"job {job.id!r} has no node {event.node_id!r}"
            )
            out.append(NotFound(what))
            self.unchanged = True  # nothing for the state log
            return
        reason = clip_text(event.reason, PEER_TEXT_LEN)  # any length may come in over HTTP
        said.note(job, said.drain_asked(now, event.node_id, reason), out)
        if member.node_id in job.spares:
            out.append(Send(member.conn, Drain(reason=reason)))
            return
        said_why = f": {reason}" if reason else ""
        change = f"node {member.node_id} ({member.addr}) is drained by the operator{said_why}"
        self._start_drain(job, member, change, now, out, told=reason)  # at a commit point when it can

    # -- routing and the handshake ---------------------------------------------------------

    def _on_received(self, conn_id: int, msg: Message, now: float, out: list[Effect]) -> None:
        conn = self.conns.get(conn_id)
        if conn is None:
            raise LocalError(f"message {type(msg).__name__} on unknown connection {conn_id}")
        conn.last_seen = now
        if conn.phase is ConnPhase.HELLO:
            if not isinstance(msg, Hello):
                self._refuse(conn, "unexpected_message", f"expected hello first, got {msg.TYPE}", now, out)
                return
            try:
                version = negotiate_version(msg.versions)
            except VersionMismatch as exc:
                self._refuse(conn, exc.code, str(exc), now, out)
                return
            conn.phase = ConnPhase.READY
            self._set_deadline(conn, now + self.auth_timeout)
            challenge = conn.challenge if self.tokens is not None else ""
            out.append(Send(conn.id, Welcome(version=version, software=SOFTWARE, challenge=challenge)))
            return
        if isinstance(msg, Heartbeat):
            self.unchanged = True  # last_seen only, which no replay needs
            return
        if conn.phase is ConnPhase.READY:
            if self.draining and isinstance(msg, Join | Resume):
                # Not the agent's fault: it reconnects to the next server process.
                text = "the server is shutting down; reconnect and join again"
                out.append(Send(conn.id, Error(code="server_draining", message=text, fatal=False)))
                self.unchanged = True
                return
            if isinstance(msg, Join | Resume):
                problem = self._authenticate(conn, msg.join if isinstance(msg, Resume) else msg)
                if problem is not None:
                    self._refuse_by_config(conn, "auth_failed", problem, now, out)
                elif isinstance(msg, Join) and self.refuse_joins and not self._coming_back(msg):
                    self._refuse_by_config(conn, SERVER_BUSY, self.refuse_joins, now, out)
                else:
                    # Authenticated: a fault of the job's rules from here on is the job's.
                    job_id = msg.job_id if isinstance(msg, Join) else msg.join.job_id
                    with self._unit(msg.TYPE, now, out, job_id, conn.id):
                        if isinstance(msg, Join):
                            self._on_join(conn, msg, now, out)
                        else:
                            self._on_resume(conn, msg, now, out)
                if conn.phase in MEMBER_PHASES:  # (mypy narrowed phase to READY above)
                    conn.deadline = None  # a member: the heartbeat sweep watches it from now on
            elif isinstance(msg, Leave):
                out.append(Send(conn.id, Left(job_continues=False, reason="this node had not joined a job")))
                self._drop(conn.id, Departure.LEFT, "left before joining", now, out, close=True)
            else:
                self._refuse(conn, "unexpected_message", f"expected join, got {msg.TYPE}", now, out)
            return
        job, member = self._member_of(conn)
        with self._unit(msg.TYPE, now, out, job.id, conn.id):
            self._on_member_message(conn, job, member, msg, now, out)

    def _on_member_message(
        self, conn: Conn, job: Job, member: Member, msg: Message, now: float, out: list[Effect]
    ) -> None:
        if isinstance(msg, Progress):  # first: every node sends one a second
            self._on_progress(job, member, msg, now, out)
        elif isinstance(msg, Join):
            self._on_rejoin(job, member, msg, now, out)
        elif isinstance(msg, WorkersFailed):
            self._on_failed(job, member, msg, now, out)
        elif isinstance(msg, WorkersSucceeded):
            self._on_succeeded(job, member, msg, now, out)
        elif isinstance(msg, SnapshotsHeld):
            self._on_held(job, member, msg, now, out)
        elif isinstance(msg, Stacks):
            self._on_stacks(job, member, msg, now, out)
            self._stacks_in(job, msg.round, now, out)
        elif isinstance(msg, HangDetected):
            self._on_hang(job, member, msg, now, out)
        elif isinstance(msg, Armed):
            self._on_armed(job, member, msg, now, out)
        elif isinstance(msg, WorkersCommitted):
            self._on_committed(job, member, msg, now, out)
        elif isinstance(msg, LeaveAfterCommit):
            self._on_leave_after_commit(job, member, msg, now, out)
        elif isinstance(msg, Leave) and msg.workers_stopping:
            self._on_leaving_soon(job, member, msg, now, out)
        elif isinstance(msg, Leave):
            self._on_leave(conn, job, member, msg, now, out)
        else:
            self._refuse(conn, "unexpected_message", f"{msg.TYPE} is not expected from an agent", now, out)

    def _refuse_by_config(self, conn: Conn, code: str, message: str, now: float, out: list[Effect]) -> None:
        """``_refuse``, for what the server is configured with (tokens, free disk) rather than
        for job state: its Close says so, and the state log keeps it as that disconnection."""
        start = len(out)
        self._refuse(conn, code, message, now, out)
        for i in range(start, len(out)):
            eff = out[i]
            if isinstance(eff, Close) and eff.conn == conn.id:
                out[i] = replace(eff, by_config=True)

    def _authenticate(self, conn: Conn, join: Join) -> str | None:
        """Why this join may not enter its job, or None. The token itself never travels."""
        if self.tokens is None:
            return None
        token = self.tokens.for_job(join.job_id)
        if token is None:
            return f"this server has no token for job {join.job_id!r}"
        if not join.proof:
            return "this server requires a token: give the agent --token-file (or RDZV_TOKEN)"
        if not join.proof.isascii() or not conn.challenge:
            return f"wrong token for job {join.job_id!r}"  # a hex HMAC is ASCII (verify needs it)
        if not verify(token, conn.challenge, join.job_id, join.node_id, join.proof):
            return f"wrong token for job {join.job_id!r}"
        return None

    # -- time ------------------------------------------------------------------------------

    def _set_deadline(self, conn: Conn, at: float) -> None:
        """``conn`` must reach its next handshake stage by ``at`` (not when replaying)."""
        if not self.expire_silent:
            return
        conn.deadline = at
        due = self._handshake_due
        heapq.heappush(due, (at, conn.id))
        if len(due) > 64 + 2 * len(self.conns):
            # Mostly stale (connections that joined or went): keep the heap the size of the live ones.
            self._handshake_due = due = [
                (c.deadline, c.id) for c in self.conns.values() if c.deadline is not None
            ]
            heapq.heapify(due)

    def _stale(self, at: float, conn_id: int) -> bool:
        conn = self.conns.get(conn_id)
        return conn is None or conn.deadline != at

    def _close_late(self, now: float, out: list[Effect]) -> None:
        """Close the connections past their hello or join deadline (the texts operators grep)."""
        due = self._handshake_due
        while due and due[0][0] <= now:
            at, conn_id = heapq.heappop(due)
            conn = self.conns.get(conn_id)
            if conn is None or conn.deadline != at:
                continue
            if conn.phase is ConnPhase.HELLO:
                why = f"no hello within {self.hello_timeout:g} s"
            else:
                why = f"no join within {self.auth_timeout:g} s of its hello"
            out.append(Log("warning", escape(clip_text(f"closing {conn.peer}: {why}", LOG_TEXT_LEN))))
            self._drop_unit(conn_id, Departure.LOST, why, now, out, close=True)

    def _on_tick(self, now: float, out: list[Effect]) -> None:
        """Every deadline due by ``now``, each job's in a unit of its own (a fault of one job's
        rules fails that job; the others' deadlines still go), and each deadline cleared or
        moved past ``now`` before its work: a Tick at ``now`` leaves none due."""
        with self._unit("tick", now, out):
            self._close_late(now, out)  # (no job's: connections that have not joined)
        for job in list(self.jobs.values()):
            with self._unit("tick", now, out, job.id):
                self._job_tick(job, now, out)
        if self.resume_deadline is not None and now >= self.resume_deadline:
            self.resume_deadline = None
            for conn in [c for c in self.conns.values() if c.phase is ConnPhase.AWAY]:
                why = "did not come back after the server restarted"
                self._drop_unit(conn.id, Departure.NOT_BACK, why, now, out, close=False)
        # Last: the drops that replay gets from the log after the rest of the tick (a Tick's
        # closes are logged as disconnections that follow it), so they come last here too.
        if self._next_sweep is not None and now >= self._next_sweep:
            with self._unit("tick", now, out):
                self._sweep(now, out)

    def _job_tick(self, job: Job, now: float, out: list[Effect]) -> None:
        if job.hang_verdict is not None and now >= job.hang_verdict.deadline:
            self._settle_hang(job, now, out)  # with the stacks that came in time
        if job.joins_unlogged and now >= job.join_window_end:
            said.log_unlogged_joins(job, out)
        if job.commit is not None:
            self._commit_due(job, now, out)
        if job.last_call_deadline is not None and now >= job.last_call_deadline:
            if job.phase is JobPhase.RESUMING:
                missing = job.resume_expect[1] - len(job.members) if job.resume_expect else 0
                self._abandon_resume(job, f"{missing} node(s) did not come back in time", now, out)
            elif job.phase is JobPhase.RUNNING:
                self._maybe_regather(job, now, out)
            else:
                job.last_call_deadline = None
                self._maybe_complete(job, now, out)
                self._without_the_lost_host(job, now, out)

    def _without_the_lost_host(self, job: Job, now: float, out: list[Effect]) -> None:
        """A standby took over from a host that held a place in ``job``'s round, and no node
        took that place in time: the job cannot go on (a fixed size without a spare)."""
        lost = self.taken_over.lost(job) if self.taken_over is not None else ()
        if not lost or job.phase is not JobPhase.GATHERING or len(job.members) >= job.settings.min_nodes:
            return
        assert self.taken_over is not None
        reason = (
            f"{self.taken_over.describe(lost)}, and no node took its place within {RESUME_WINDOW:g} s: "
            f"the job needs {job.settings.min_nodes} nodes, {len(job.members)} remain"
        )
        self._fail(job, reason, None, now, out, code="host_lost")

    def _drop_unit(
        self, conn_id: int, how: Departure, reason: str, now: float, out: list[Effect], *, close: bool
    ) -> None:
        """``_drop``, as a unit of the connection's job: a lost connection, live (a drop, the
        sweep, a late handshake) or replayed (the log keeps a tick's drops as disconnections)."""
        conn = self.conns.get(conn_id)
        job_id = conn.job_id if conn is not None and conn.phase in MEMBER_PHASES else None
        with self._unit("disconnect", now, out, job_id):
            self._drop(conn_id, how, reason, now, out, close=close)

    def _sweep(self, now: float, out: list[Effect]) -> None:
        """Drop nodes whose heartbeats stopped: a frozen machine or a pulled cable. The next
        sweep is set before any drop, so a fault in one leaves the sweep armed."""
        shortest: float | None = None
        silent: list[tuple[int, float]] = []
        for conn in self.conns.values():
            if conn.phase is not ConnPhase.JOINED or conn.job_id not in self.jobs:
                continue
            timeout = self.jobs[conn.job_id].settings.heartbeat_timeout
            shortest = timeout if shortest is None else min(shortest, timeout)
            if now - conn.last_seen > timeout:
                silent.append((conn.id, timeout))
        self._next_sweep = None if shortest is None else now + max(shortest / 4, 0.05)
        for conn_id, timeout in silent:
            why = f"went silent (no heartbeat for {timeout:g} s)"
            self._drop_unit(conn_id, Departure.LOST, why, now, out, close=True)


class _Unit:
    """``Rendezvous._unit``'s context manager, written out: every member's frame (a Progress
    from every node every second) runs in one, and a generator-based one costs twice this."""

    __slots__ = ("conn", "job_id", "machine", "now", "out", "outer", "rule")

    def __init__(
        self,
        machine: Rendezvous,
        rule: str,
        now: float,
        out: list[Effect],
        job_id: str | None,
        conn: int | None,
    ) -> None:
        self.machine, self.rule, self.now, self.out, self.job_id, self.conn = (
            machine,
            rule,
            now,
            out,
            job_id,
            conn,
        )
        self.outer = False

    def __enter__(self) -> None:
        units = self.machine._units
        job_id = self.job_id
        if job_id in units or (job_id is None and units):
            return  # part of the unit it is in
        units.append(job_id)
        self.outer = True

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        if not self.outer:
            return False
        machine = self.machine
        if exc is None and machine.logged_facts is None:
            machine._units.pop()  # (the common end: live, and nothing raised)
            return False
        return machine._unit_done(self.rule, exc, self.now, self.out, self.job_id, self.conn)
