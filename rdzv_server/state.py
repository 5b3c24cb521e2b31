"""The rendezvous rules, as a pure state machine.

Nothing here opens a socket, reads a clock or sleeps. The asyncio layer (``service.py``)
turns connections, frames and timers into events, calls :meth:`Rendezvous.handle` with the
time of its monotonic clock, and carries out the effects it gets back (send a message, close
a connection, log a line). Deadlines are exposed by :meth:`Rendezvous.next_deadline` so the
caller knows when to deliver the next :class:`Tick`.

Connections. Each connection starts in ``HELLO``: the first frame must be a ``Hello`` whose
versions overlap ours. It is then ``READY`` and may send one ``Join``; from then on it *is*
one node of one job (``JOINED``) until it leaves, drops, or goes silent for longer than its
job's heartbeat timeout.

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

Ranks. The first round orders nodes by (address, node id). Later rounds keep the surviving
members in their previous order, so group rank 0, and with it MASTER_ADDR, stays put while
that node survives; newcomers follow, ordered by (address, node id). Node ``i`` in that order
gets group rank ``i`` and global ranks starting at the sum of ``nproc`` of the nodes before it.
Each node is told only its own slice: messages stay O(1) in the size of the job.

Node ranks. In a fixed-size job (min_nodes == max_nodes) an agent may give ``--node-rank``
(``Join.node_rank``). Each one must be below the node count and held by one agent at a time:
a join that breaks either is refused (a fatal Error naming the value and, for a duplicate,
the node holding it) and everyone else goes on. A round in which *every* member gave one is
ordered by node rank, so group rank = node rank, in every round with such members; if only
some gave one, the round falls back to the order above, and the job's history says so once.
An elastic job ignores node ranks, as torchrun's c10d backend does (also said once).

Leaving. A member's ``Leave`` is answered with ``Left(job_continues)`` just before its
connection is closed: whether the job goes on without the node (enough members remain or a
spare took its place, its own workers had finished, or the job finished). The agent exits 0
after a drain only then, so a scheduler that cancels the last node sees a failure. A node that
drains first says so when it starts stopping its workers (``Leave(workers_stopping=True)``):
the round stops for everyone at once, as for a Leave, but the node stays a member, not ready,
until its Leave comes after its workers have exited. So no round starts while a worker of the
previous one is alive (a rank 0 saving the checkpoint the next round loads).

After a restart from the state log (``recover``) members whose agents have not come back are
AWAY, and not ready: a round completes only with members that are connected. A job token
proves the job, not the node: each member keeps the ``node_secret`` of its Join, and only a
Join or Resume showing it may take an away member's place back.

Bounds. Whatever peers send, a job keeps at most its first failure, the last FAILURES_KEPT and
a count, HISTORY_LEN history lines of HISTORY_TEXT_LEN characters, MAX_EXCLUDED exclusions,
min(max_nodes, MAX_SPARES) spares and ENTRYPOINT_KEPT characters of entrypoint; a server holds
at most ``max_jobs`` jobs. Every text built from a peer's is clipped to its field, and every
reply is built before the state it reports changes; should a peer's event still raise,
``handle`` logs it, refuses that peer and goes on (``_contain``).
"""

from __future__ import annotations

import bisect
import enum
import re
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import field, replace

from protocol import (
    Assignment,
    Drain,
    Error,
    Failure,
    GoingAway,
    Heartbeat,
    Hello,
    JobDone,
    JobFailed,
    Join,
    Leave,
    Left,
    Message,
    Restart,
    Resume,
    Resumed,
    VersionMismatch,
    Waiting,
    Welcome,
    WorkersFailed,
    WorkersSucceeded,
    negotiate_version,
)
from protocol.auth import TokenTable, verify
from protocol.messages import clip_text
from protocol.records import record

SOFTWARE = "rdzv-server/0.1"
# The Error code of a join refused while ``Rendezvous.refuse_joins`` is set.
SERVER_BUSY = "server_busy"

# Bounds on what one job and one server keep, whatever their peers send (the README's
# per-job memory bound is computed from these; tests/rdzv_server/test_state_bounds.py checks it).
HISTORY_TEXT_LEN = 512  # characters of one history line
FAILURES_KEPT = 8  # a job's last failures, besides its first one and a count of all
FAILURE_TEXT_LEN = 2048  # characters of a failure's message (the worker's error) kept
FAILURE_PATH_LEN = 1024  # characters of a failure's error file path kept
PEER_TEXT_LEN = 1024  # characters of a peer's free text (a Leave or drain reason) quoted
REASON_LEN = 4096  # characters of a reason the server sends (Restart, JobFailed, Error, ...)
LOG_TEXT_LEN = 2048  # characters of one line the server logs
ENTRYPOINT_KEPT = 1024  # characters of a job's entrypoint (longer ones: cut, with a digest)
NAMES_SHOWN = 10  # node ids named in one text; the rest are counted
MAX_JOBS = 1000  # jobs one server holds at once; a new one beyond is refused
MAX_SPARES = 1024  # spares per job (and at most max_nodes): more nodes are refused
MAX_EXCLUDED = 128  # excluded node ids a job remembers (the oldest is forgotten first)
# A job's restart budget: a larger --max-restarts is taken as this (the server alone counts
# restarts). A clamp, not a protocol limit, so an agent given "effectively unlimited" is
# still served, by any server.
MAX_RESTARTS = 1_000_000


# --- events -------------------------------------------------------------------------------


@record(frozen=True, slots=True)
class Connected:
    conn: int
    peer: str
    challenge: str = ""  # a fresh random nonce, when the server asks for tokens


@record(frozen=True, slots=True)
class Received:
    conn: int
    msg: Message


@record(frozen=True, slots=True)
class Disconnected:
    conn: int
    reason: str = "connection closed"


@record(frozen=True, slots=True)
class Tick:
    """Delivered at (or after) :meth:`Rendezvous.next_deadline`."""


Event = Connected | Received | Disconnected | Tick


# --- effects ------------------------------------------------------------------------------


@record(frozen=True, slots=True)
class Send:
    conn: int
    msg: Message


@record(frozen=True, slots=True)
class Close:
    conn: int
    reason: str


@record(frozen=True, slots=True)
class Log:
    level: str  # "info" | "warning" | "error"
    text: str


Effect = Send | Close | Log


# --- state --------------------------------------------------------------------------------


class ConnPhase(enum.Enum):
    HELLO = "hello"
    READY = "ready"
    JOINED = "joined"
    # A connection of the server's previous process, restored from its state log: its
    # member waits (see ``recover``) for the agent to come back on a new connection.
    AWAY = "away"


class JobPhase(enum.Enum):
    RESUMING = "resuming"  # rebuilding a round from the agents' Resume after losing our state
    GATHERING = "gathering"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


class MemberState(enum.Enum):
    WAITING = "waiting"  # in the job, not yet (re-)joined for the next round
    READY = "ready"  # joined, waiting for the round to complete
    RUNNING = "running"  # holds the current round's assignment
    SUCCEEDED = "succeeded"  # its workers finished; waiting at the exit barrier


_MEMBER_PHASES = (ConnPhase.JOINED, ConnPhase.AWAY)  # connections that stand for a member


class LocalError(Exception):
    """A bug on our side: an event the machine cannot handle in its state."""


@record(slots=True)
class Conn:
    id: int
    peer: str
    phase: ConnPhase = ConnPhase.HELLO
    last_seen: float = 0.0
    challenge: str = ""
    job_id: str | None = None
    node_id: str | None = None


@record(slots=True)
class Member:
    node_id: str
    conn: int
    addr: str
    nproc: int
    master_port: int
    seq: int  # arrival order, for logs and ties
    joined_at: float = 0.0
    state: MemberState = MemberState.READY
    failures: int = 0
    node_rank: int = -1  # --node-rank as the agent gave it; -1: not given
    # Join.node_secret: only an agent that shows it may take this node's place back after
    # the server restarted. Kept in the state log; never shown.
    node_secret: str = ""


@record(frozen=True, slots=True)
class JobSettings:
    min_nodes: int
    max_nodes: int
    entrypoint: str
    max_restarts: int
    last_call_timeout: float
    heartbeat_timeout: float
    exclude_after: int = 0

    @classmethod
    def from_join(cls, msg: Join) -> JobSettings:
        return cls(
            min_nodes=msg.min_nodes,
            max_nodes=msg.max_nodes,
            entrypoint=entrypoint_key(msg.entrypoint),
            max_restarts=min(msg.max_restarts, MAX_RESTARTS),
            last_call_timeout=msg.last_call_timeout,
            heartbeat_timeout=msg.heartbeat_timeout,
            exclude_after=msg.exclude_after,
        )

    def mismatch(self, other: JobSettings) -> str | None:
        """What an agent disagrees on with the job it tries to join, or None."""
        if (self.min_nodes, self.max_nodes) != (other.min_nodes, other.max_nodes):
            return (
                f"node range: the job has --nnodes {_range(self.min_nodes, self.max_nodes)}, "
                f"this agent has --nnodes {_range(other.min_nodes, other.max_nodes)}"
            )
        if self.entrypoint != other.entrypoint:
            return f"entrypoint: the job runs {self.entrypoint!r}, this agent runs {other.entrypoint!r}"
        if self.max_restarts != other.max_restarts:
            return (
                f"max restarts: the job has --max-restarts {self.max_restarts}, "
                f"this agent has --max-restarts {other.max_restarts}"
            )
        return None


def _range(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}:{hi}"


def entrypoint_key(entrypoint: str) -> str:
    """What a job keeps of its entrypoint: the text itself up to ENTRYPOINT_KEPT characters;
    a longer one is cut, with its length and SHA-256, so two agents still agree on it exactly
    while a 64 KiB command line costs the job 1 KiB."""
    if len(entrypoint) <= ENTRYPOINT_KEPT:
        return entrypoint
    import hashlib  # only for a long entrypoint: OpenSSL's start is ~5 ms of every launch

    digest = hashlib.sha256(entrypoint.encode("utf-8", "surrogatepass")).hexdigest()
    tail = f" ... ({len(entrypoint):,} characters, sha256 {digest})"
    return entrypoint[: ENTRYPOINT_KEPT - len(tail)] + tail


def summarise(names: Sequence[str], shown: int = NAMES_SHOWN) -> str:
    """``n1, n2, ... and 1,098 more``: a list of node ids that fits any text field."""
    if len(names) <= shown:
        return ", ".join(names)
    return f"{', '.join(names[:shown])} ... and {len(names) - shown:,} more"


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape(text: str) -> str:
    """``text`` with control characters written as Python escapes (``\\n``, ``\\x1b``), so
    a peer's text cannot forge a line in the server's log or drive a terminal."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


HISTORY_LEN = 200
# A job's "joined" lines: one each for the first JOIN_LINES joins in a second, then one line a
# second for the rest. A 10,000-node join storm logged line by line cost the server 15 % of its
# CPU, and nobody reads 10,000 lines; the job's history still holds every join. The summary
# goes out with the job's next event or the next Tick after its second: the heartbeat sweep
# ticks every heartbeat_timeout / 4 while nodes are joined. It is no deadline of its own: the
# etcd backend's agents would race to log a tick for a line nobody prints there.
JOIN_LINES = 20
JOIN_LOG_WINDOW = 1.0
RESUME_WINDOW = 10.0  # how long a rebuilt round waits for every node to come back
FINISHED_JOBS_KEPT = 50
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


@record(frozen=True, slots=True)
class JobEvent:
    """One line of a job's history, for the status API and dashboard."""

    time: float  # the server's monotonic clock
    kind: str  # created | joined | round | restart | failure | lost | left | finished | failed | excluded
    text: str


@record(slots=True)
class Stats:
    """Counters since the server started, for /metrics."""

    jobs_created: int = 0
    jobs_finished: int = 0
    jobs_failed: int = 0
    rounds_started: int = 0
    rounds_completed: int = 0
    restarts: int = 0
    failures: Counter[str] = field(default_factory=Counter)  # by cause
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0
    latency_count: int = 0

    def observe_latency(self, seconds: float) -> None:
        self.latency_buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum += seconds
        self.latency_count += 1


@record(slots=True)
class Job:
    id: str
    settings: JobSettings
    phase: JobPhase = JobPhase.GATHERING
    round: int = 0  # the round being gathered, or the one running
    restart_count: int = 0
    members: dict[str, Member] = field(default_factory=dict)
    spares: dict[str, Member] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # node ids of the last completed round, by rank
    last_call_deadline: float | None = None
    # The first failure, then the last FAILURES_KEPT (add them with add_failure).
    failures: list[Failure] = field(default_factory=list)
    failures_total: int = 0  # every failure recorded, including those no longer kept
    next_seq: int = 0
    created_at: float = 0.0
    gathering_since: float = 0.0  # when the round being gathered started (rendezvous latency)
    rounds_completed: int = 0
    outcome: str = ""  # why the job ended, once it has
    excluded: dict[str, str] = field(default_factory=dict)  # node id -> why
    history: deque[JobEvent] = field(default_factory=lambda: deque(maxlen=HISTORY_LEN))
    # While RESUMING: the round every node must hold, and which node holds each group rank.
    resume_expect: tuple[int, int, int, str, int] | None = None
    resume_slots: dict[int, str] = field(default_factory=dict)
    # Members (not spares) that are not READY: a round can complete only when this is empty.
    # Kept by _put_member/_pop_member/_set_state, so that check is O(1) in a join storm.
    not_ready: set[str] = field(default_factory=set)
    # The "joined" lines of this second (JOIN_LINES), and the joins waiting for its summary.
    join_window_end: float = 0.0
    join_lines: int = 0
    joins_unlogged: int = 0
    first_unlogged: str = ""
    last_unlogged: str = ""
    # Whether the history already says that --node-rank does not order this job's ranks.
    ranks_noted: bool = False
    # Fixed-size jobs: node rank -> the node that gave it. Entries of nodes gone since are
    # stale and are dropped when looked up (_rank_holder), so removals need not keep it.
    rank_holders: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.not_ready = {nid for nid, m in self.members.items() if m.state is not MemberState.READY}
        if not self.elastic:
            for m in [*self.members.values(), *self.spares.values()]:
                if m.node_rank >= 0:
                    self.rank_holders[m.node_rank] = m.node_id

    def record(self, now: float, kind: str, text: str) -> None:
        self.history.append(JobEvent(now, kind, clip_text(text, HISTORY_TEXT_LEN)))

    def add_failure(self, failure: Failure) -> None:
        """Keep the first failure (often the root cause), the last few, and a count."""
        self.failures_total += 1
        self.failures.append(failure)
        if len(self.failures) > FAILURES_KEPT + 1:
            del self.failures[1]

    def exclude(self, node_id: str, why: str) -> None:
        self.excluded[node_id] = why
        while len(self.excluded) > MAX_EXCLUDED:
            del self.excluded[next(iter(self.excluded))]

    @property
    def elastic(self) -> bool:
        return self.settings.min_nodes < self.settings.max_nodes


def _put_member(job: Job, m: Member) -> None:
    job.members[m.node_id] = m
    if m.state is MemberState.READY:
        job.not_ready.discard(m.node_id)
    else:
        job.not_ready.add(m.node_id)


def _pop_member(job: Job, node_id: str) -> Member | None:
    job.not_ready.discard(node_id)
    return job.members.pop(node_id, None)


def _set_state(job: Job, m: Member, state: MemberState) -> None:
    m.state = state
    if job.members.get(m.node_id) is m:
        if state is MemberState.READY:
            job.not_ready.discard(m.node_id)
        else:
            job.not_ready.add(m.node_id)


def _rank_holder(job: Job, node_rank: int) -> Member | None:
    """The member or spare that gave ``node_rank``, if one is still in the job."""
    nid = job.rank_holders.get(node_rank)
    if nid is None:
        return None
    m = job.members.get(nid) or job.spares.get(nid)
    if m is None or m.node_rank != node_rank:
        del job.rank_holders[node_rank]  # it left (or was excluded) since
        return None
    return m


def _node_rank_problem(settings: JobSettings, job: Job | None, msg: Join) -> tuple[str, str] | None:
    """(code, message) when a join's --node-rank may not enter the job, else None."""
    r = msg.node_rank
    if r < 0 or settings.min_nodes != settings.max_nodes:
        return None  # not given, or an elastic job, where node ranks order nothing
    who = f"node {msg.node_id} ({msg.addr})"
    if r >= settings.max_nodes:
        return (
            "node_rank_out_of_range",
            f"{who} gave --node-rank {r}, but job {msg.job_id!r} has --nnodes {settings.max_nodes}: "
            f"node ranks are 0..{settings.max_nodes - 1}",
        )
    holder = _rank_holder(job, r) if job is not None else None
    if holder is None:
        return None
    return (
        "duplicate_node_rank",
        f"{who} gave --node-rank {r}, which node {holder.node_id} ({holder.addr}) already holds in job "
        f"{msg.job_id!r}: give each node its own --node-rank (if that node's previous agent died, "
        f"its place is freed when its heartbeat lapses, after {settings.heartbeat_timeout:g} s)",
    )


class Rendezvous:
    """Every job on one server. Feed it events; carry out what it returns."""

    def __init__(
        self, tokens: TokenTable | None = None, *, expire_silent: bool = True, max_jobs: int = MAX_JOBS
    ) -> None:
        self.tokens = tokens  # None: no authentication (the server says so at start)
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

    # -- public API ------------------------------------------------------------------------

    def handle(self, event: Event, now: float) -> list[Effect]:
        out: list[Effect] = []
        self.unchanged = False
        if isinstance(event, Received) and event.conn not in self.conns:
            raise LocalError(f"message {type(event.msg).__name__} on unknown connection {event.conn}")
        try:
            if isinstance(event, Received):
                self._on_received(event.conn, event.msg, now, out)
            elif isinstance(event, Connected):
                if event.conn in self.conns:
                    raise LocalError(f"connection {event.conn} connected twice")
                self.conns[event.conn] = Conn(
                    id=event.conn, peer=event.peer, last_seen=now, challenge=event.challenge
                )
            elif isinstance(event, Disconnected):
                self._drop(event.conn, event.reason, now, out, close=False)
            elif isinstance(event, Tick):
                self._on_tick(now, out)
            else:
                raise LocalError(f"unknown event {event!r}")
        except Exception as exc:
            if not isinstance(event, Received | Disconnected):
                raise  # our own clock or bookkeeping: a bug to fail on
            self.unchanged = False
            self._contain(event, exc, now, out)
        return out

    def _contain(self, event: Received | Disconnected, exc: Exception, now: float, out: list[Effect]) -> None:
        """A peer's event raised: a bug of ours that a peer can trigger. Every text the machine
        builds is clipped to its field and every reply is built before the state changes, so
        this should not happen; if it does, say so once (no traceback), send the peer a clear
        Error and close it, and go on serving everyone else. The same input replays the same
        way from the state log, so a restarted server ends up where this one is."""
        conn = self.conns.get(event.conn)
        peer = conn.peer if conn is not None else "?"
        what = event.msg.TYPE if isinstance(event, Received) else "disconnect"
        out.append(
            Log(
                "error",
                escape(
                    clip_text(
                        f"internal error handling {what} from connection {event.conn} ({peer}): "
                        f"{type(exc).__name__}: {exc}",
                        LOG_TEXT_LEN,
                    )
                ),
            )
        )
        if conn is None or isinstance(event, Disconnected):
            return
        try:
            self._refuse(conn, "internal_error", f"the server could not handle this {what}", now, out)
        except Exception:
            self.conns.pop(conn.id, None)
            out.append(Close(conn.id, "internal error"))

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
        if self._next_sweep is not None:
            deadlines.append(self._next_sweep)
        if self.resume_deadline is not None:
            deadlines.append(self.resume_deadline)
        return min(deadlines) if deadlines else None

    def recover(self, now: float) -> list[Effect]:
        """The state was replayed from the log of a previous process whose sockets are gone.

        Joined nodes become AWAY: their members keep their places (the round goes on) for a
        resume window, in which each agent reconnects and sends ``Resume`` (or ``Join`` if it
        was between rounds). A member that was ready for the next round is not while it is
        away (WAITING): a round completes only with members that are back. A node not back in
        time is lost, as if its connection had dropped. A job that was itself being rebuilt
        from its agents is forgotten: the agents' Resumes rebuild it again.
        """
        out: list[Effect] = []
        self.draining = False
        self._next_sweep = None  # nothing to sweep until agents are back
        for job in [j for j in self.jobs.values() if j.phase is JobPhase.RESUMING]:
            self._note(job, now, "forgotten", "was being rebuilt when the server stopped; rebuilt anew", out)
            del self.jobs[job.id]
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
                    _set_state(job, member, MemberState.WAITING)
                window = max(window, RESUME_WINDOW, 2 * job.settings.heartbeat_timeout)
            else:
                del self.conns[conn.id]
        self.resume_deadline = now + window if away else None
        for job_id, n in away.items():
            self._note(
                self.jobs[job_id],
                now,
                "recovered",
                f"restored from the state log in phase {self.jobs[job_id].phase.value}, round "
                f"{self.jobs[job_id].round}; waiting up to {window:g} s for {n} node(s) to resume",
                out,
            )
        return out

    def going_away(self, reason: str, now: float) -> list[Effect]:
        """The server is shutting down: refuse joins, and tell every agent to reconnect later."""
        self.draining = True
        reason = clip_text(reason, PEER_TEXT_LEN)
        msg = GoingAway(reason=reason)
        out: list[Effect] = [
            Send(c.id, msg) for c in self.conns.values() if c.phase in (ConnPhase.READY, ConnPhase.JOINED)
        ]
        for job in self.jobs.values():
            self._note(job, now, "server", f"server going away ({reason}); its agents will reconnect", out)
        return out

    # -- messages --------------------------------------------------------------------------

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
                    self._refuse(conn, "auth_failed", problem, now, out)
                elif isinstance(msg, Join) and self.refuse_joins and not self._coming_back(msg):
                    self._refuse(conn, SERVER_BUSY, self.refuse_joins, now, out)
                elif isinstance(msg, Join):
                    self._on_join(conn, msg, now, out)
                else:
                    self._on_resume(conn, msg, now, out)
            elif isinstance(msg, Leave):
                out.append(Send(conn.id, Left(job_continues=False, reason="this node had not joined a job")))
                self._drop(conn.id, "left before joining", now, out, close=True)
            else:
                self._refuse(conn, "unexpected_message", f"expected join, got {msg.TYPE}", now, out)
            return
        job, member = self._member_of(conn)
        if isinstance(msg, Join):
            self._on_rejoin(job, member, msg, now, out)
        elif isinstance(msg, WorkersFailed):
            self._on_failed(job, member, msg, now, out)
        elif isinstance(msg, WorkersSucceeded):
            self._on_succeeded(job, member, msg, now, out)
        elif isinstance(msg, Leave) and msg.workers_stopping:
            self._on_leaving_soon(job, member, msg, now, out)
        elif isinstance(msg, Leave):
            self._on_leave(conn, job, member, msg, now, out)
        else:
            self._refuse(conn, "unexpected_message", f"{msg.TYPE} is not expected from an agent", now, out)

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
            refused = _node_rank_problem(settings, None, msg)
            if refused is None and len(self.jobs) >= self.max_jobs:
                refused = self._too_many_jobs(msg.job_id)
            if refused is not None:
                self._refuse(conn, *refused, now, out)  # before the job exists: nothing to forget
                return
            job = Job(id=msg.job_id, settings=settings, created_at=now, gathering_since=now)
            self.jobs[job.id] = job
            self.stats.jobs_created += 1
            self.stats.rounds_started += 1
            self._note(
                job,
                now,
                "created",
                f"created (nnodes {_range(settings.min_nodes, settings.max_nodes)}, "
                f"entrypoint {settings.entrypoint!r}, max restarts {settings.max_restarts})",
                out,
            )
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
        refused = _node_rank_problem(job.settings, job, msg)
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
            self._note(job, now, "spare", f"node {member.node_id} ({member.addr}) waits as a spare", out)
            out.append(Send(conn.id, self._waiting(job, "spare: the job is full")))
            return
        _put_member(job, member)
        self._note_join(job, member, now, out)
        if job.phase is JobPhase.RUNNING:
            # A newcomer to a running job: let the workers run on while the settle window
            # gathers any other newcomers, then restart everyone once.
            if job.last_call_deadline is None:
                job.last_call_deadline = now + job.settings.last_call_timeout
            out.append(Send(conn.id, self._waiting(job, "joining a running job")))
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
            self._note(
                job, now, "resuming", f"rebuilding round {a.round} from its agents (no record of it)", out
            )
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
            out.append(Send(conn.id, JobFailed(reason=job.outcome, failure=root)))
            return
        if job.phase is JobPhase.FINISHED:
            out.append(Send(conn.id, JobDone()))
            return
        why = f"the server dropped node {j.node_id} from job {job.id!r} while it was away; join again"
        out.append(Send(conn.id, Restart(round=a.round, reason=why, restart_count=job.restart_count)))

    def _coming_back(self, msg: Join) -> bool:
        """Whether a Join is a member of a restored job coming back (not a new node)."""
        job = self.jobs.get(msg.job_id)
        return job is not None and self._away_member(job, msg.node_id) is not None

    def _is_away(self, member: Member) -> bool:
        """Whether the member's agent has not come back since the server restarted."""
        conn = self.conns.get(member.conn)
        return conn is not None and conn.phase is ConnPhase.AWAY

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
                _set_state(job, member, MemberState.SUCCEEDED)
            self._note(
                job, now, "resumed", f"node {member.node_id} resumed round {job.round}; nothing restarts", out
            )
            out.append(Send(conn.id, Resumed(job_id=job.id, round=job.round, rebuilt=False)))
            if job.phase is JobPhase.FINISHED:
                out.append(Send(conn.id, JobDone()))
            else:
                self._maybe_finish(job, now, out)
            return
        if job.phase is JobPhase.FAILED:
            self._rebind(job, member, conn, now)
            root = job.failures[-1] if job.failures else None
            out.append(Send(conn.id, JobFailed(reason=job.outcome, failure=root)))
            return
        if member.state is MemberState.WAITING:
            # The round moved on (its Restart may never have reached the node): restart.
            self._rebind(job, member, conn, now)
            why = f"round {a.round} was stopped while the server restarted"
            out.append(Send(conn.id, Restart(round=a.round, reason=why, restart_count=job.restart_count)))
            return
        # The node holds a round we do not (a bug, or a log from elsewhere): it is lost,
        # and joins again as a newcomer.
        self._drop(member.conn, f"came back holding round {a.round}, not ours", now, out, close=False)
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
            member.addr, member.master_port = msg.addr, msg.master_port
            out.append(Send(conn.id, self._waiting(job, "spare: the job is full")))
            return True
        if member.state in (MemberState.WAITING, MemberState.READY):
            self._rebind(job, member, conn, now)
            member.addr, member.nproc, member.master_port = msg.addr, msg.nproc, msg.master_port
            _set_state(job, member, MemberState.READY)
            self._note(job, now, "resumed", f"node {member.node_id} rejoined after the server restarted", out)
            self._maybe_complete(job, now, out)
            if member.state is MemberState.READY:
                out.append(Send(conn.id, self._waiting(job, "")))
            return True
        self._drop(member.conn, "came back without its round", now, out, close=False)
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
        _put_member(job, member)
        if problem is not None:
            self._abandon_resume(job, f"the agents disagree ({problem})", now, out)
            return
        job.resume_slots[a.group_rank] = member.node_id
        if len(job.resume_slots) < a.group_world_size:
            return
        job.order = [job.resume_slots[i] for i in range(a.group_world_size)]
        job.phase = JobPhase.RUNNING
        job.last_call_deadline = None
        job.rounds_completed += 1
        for m in job.members.values():
            out.append(Send(m.conn, Resumed(job_id=job.id, round=job.round, rebuilt=True)))
        self._note(
            job,
            now,
            "round",
            f"round {job.round} rebuilt from its {len(job.order)} agents; nothing restarts",
            out,
        )
        self._maybe_finish(job, now, out)

    def _abandon_resume(self, job: Job, why: str, now: float, out: list[Effect]) -> None:
        """The round cannot be rebuilt: a new round begins with whoever came back."""
        self._note(
            job,
            now,
            "restart",
            f"cannot rebuild round {job.round}: {why}; a new round begins",
            out,
            "warning",
        )
        job.order = [
            job.resume_slots[i] for i in sorted(job.resume_slots) if job.resume_slots[i] in job.members
        ]
        # Nodes that came back holding a round but without a slot (they disagreed) were in it
        # too; nodes that sent Join are newcomers: ready already, told nothing.
        job.order += [
            nid for nid, m in job.members.items() if nid not in job.order and m.state is not MemberState.READY
        ]
        job.phase = JobPhase.RUNNING
        job.resume_slots.clear()
        job.resume_expect = None
        self._regather(job, f"the server lost round {job.round} and {why}", now, out)

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
            member.addr, member.master_port = msg.addr, msg.master_port
            return
        if member.state is not MemberState.WAITING:
            # Only a member told to restart re-joins; anything else is a confused agent.
            what = f"join while {member.state.value} in round {job.round}"
            self._refuse(self.conns[member.conn], "unexpected_message", what, now, out)
            return
        member.addr, member.nproc, member.master_port = msg.addr, msg.nproc, msg.master_port
        _set_state(job, member, MemberState.READY)
        self._maybe_complete(job, now, out)

    def _on_failed(self, job: Job, member: Member, msg: WorkersFailed, now: float, out: list[Effect]) -> None:
        rebuilding = job.phase is JobPhase.RESUMING and msg.round == job.round
        if rebuilding:
            # A failure while the round is being rebuilt ends the rebuild: it is a failure of
            # that round, handled like any other.
            job.order = [job.resume_slots[i] for i in sorted(job.resume_slots)]
            job.phase = JobPhase.RUNNING
            job.resume_slots.clear()
            job.resume_expect = None
            job.last_call_deadline = None
        if job.phase is not JobPhase.RUNNING or msg.round != job.round or member.node_id not in job.order:
            # A second failure in a round that is already being restarted counts once.
            self.unchanged = not rebuilding
            return
        member.failures += 1
        # The node and address are the sender's, whatever it wrote: a member cannot name
        # another node as the root cause. Its message is kept cut to FAILURE_TEXT_LEN.
        failure = replace(
            msg.failure,
            node_id=member.node_id,
            addr=member.addr,
            message=clip_text(msg.failure.message, FAILURE_TEXT_LEN),
            error_file=clip_text(msg.failure.error_file, FAILURE_PATH_LEN),
        )
        job.add_failure(failure)
        self.stats.failures["worker"] += 1
        cause = _describe_failure(failure)
        limit = job.settings.exclude_after
        excluded = limit > 0 and member.failures >= limit
        if job.restart_count < job.settings.max_restarts:
            job.restart_count += 1
            self.stats.restarts += 1
            self._note(
                job,
                now,
                "failure",
                f"round {job.round}: {cause}; restart {job.restart_count} of {job.settings.max_restarts}",
                out,
                level="warning",
            )
            if excluded:
                self._exclude(job, member, f"its workers failed {member.failures} times", now, out)
                if job.phase is not JobPhase.RUNNING:
                    return
            self._regather(job, f"worker failure: {cause}", now, out)
        else:
            reason = (
                f"{cause}; no restarts left (--max-restarts {job.settings.max_restarts})"
                if job.settings.max_restarts
                else f"{cause} (--max-restarts 0)"
            )
            self._fail(job, reason, failure, now, out)

    def _exclude(self, job: Job, member: Member, why: str, now: float, out: list[Effect]) -> None:
        """Take a flaky node out of the job for good; the others go on if enough remain."""
        job.exclude(member.node_id, why)
        self._note(
            job, now, "excluded", f"node {member.node_id} ({member.addr}) excluded: {why}", out, "warning"
        )
        text = f"node {member.node_id} is excluded from job {job.id!r}: {why}"
        out.append(Send(member.conn, Error(code="excluded", message=text, fatal=True)))
        conn = self.conns.pop(member.conn, None)
        out.append(Close(member.conn, "excluded"))
        _pop_member(job, member.node_id)
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
            _set_state(job, member, MemberState.SUCCEEDED)  # counted once the round is rebuilt
            return
        if job.phase is not JobPhase.RUNNING:
            self.unchanged = True
            return
        _set_state(job, member, MemberState.SUCCEEDED)
        self._maybe_finish(job, now, out)

    def drain(self, job_id: str, node_id: str, reason: str, now: float) -> list[Effect]:
        """An operator asks a node to leave cleanly (its agent stops its workers, then leaves)."""
        job = self.jobs.get(job_id)
        if job is None:
            raise KeyError(f"no job {job_id!r}")
        member = job.members.get(node_id) or job.spares.get(node_id)
        if member is None:
            raise KeyError(f"job {job_id!r} has no node {node_id!r}")
        out: list[Effect] = []
        reason = clip_text(reason, PEER_TEXT_LEN)  # any length may come in over HTTP
        drain = Drain(reason=reason)
        self._note(job, now, "drain", f"node {node_id} asked to drain: {reason}", out)
        out.append(Send(member.conn, drain))
        return out

    # -- rounds ----------------------------------------------------------------------------

    def _maybe_complete(self, job: Job, now: float, out: list[Effect]) -> None:
        if job.phase is not JobPhase.GATHERING:
            return
        s = job.settings
        n = len(job.members)
        if n < s.min_nodes:
            return
        # The cheap test first: during a last-call window there is no need to scan members.
        if n < s.max_nodes and job.last_call_deadline is not None and now < job.last_call_deadline:
            return
        if job.not_ready:  # kept up to date, so a rejoin storm is not O(N) per join
            return
        self._complete(job, now, out)

    def _complete(self, job: Job, now: float, out: list[Effect]) -> None:
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
        job.phase = JobPhase.RUNNING
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
        )
        offset = 0
        for group_rank, nid in enumerate(job.order):
            m = job.members[nid]
            _set_state(job, m, MemberState.RUNNING)
            msg = first if group_rank == 0 else first._copy_with(group_rank=group_rank, rank_offset=offset)
            out.append(Send(m.conn, msg))
            offset += m.nproc
        self._note(
            job,
            now,
            "round",
            f"round {job.round} complete: {len(job.order)} nodes, world size {world_size}, "
            f"master {master.addr}:{master.master_port}, restarts {job.restart_count}"
            + (", group ranks by --node-rank" if by_node_rank is not None else ""),
            out,
        )

    def _node_rank_order(self, job: Job, now: float, out: list[Effect]) -> list[str] | None:
        """The round's order by --node-rank, or None when node ranks do not decide it."""
        if all(m.node_rank < 0 for m in job.members.values()):
            return None
        s = job.settings
        if job.elastic:
            self._note_ranks_once(
                job,
                now,
                f"--node-rank ignored: the job is elastic (--nnodes {_range(s.min_nodes, s.max_nodes)}), "
                "so group ranks follow the rendezvous order (address, node id), as with torchrun's c10d",
                out,
            )
            return None
        missing = [nid for nid, m in job.members.items() if m.node_rank < 0]
        if missing:
            named = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            self._note_ranks_once(
                job,
                now,
                f"--node-rank ignored: {len(job.members) - len(missing)} of {len(job.members)} nodes gave "
                f"one ({named} did not), so group ranks follow address order",
                out,
            )
            return None
        # A fixed-size round has max_nodes members, and the join rules keep their node ranks
        # distinct and below max_nodes: 0..n-1, so each node's group rank is its node rank. Only
        # a round rebuilt from agents' Resumes (which are not refused) could break that.
        order = sorted(job.members, key=lambda nid: job.members[nid].node_rank)
        if [job.members[nid].node_rank for nid in order] != list(range(len(order))):
            self._note_ranks_once(
                job, now, "--node-rank ignored: the nodes' ranks are not 0..n-1; ordering by address", out
            )
            return None
        return order

    def _note_ranks_once(self, job: Job, now: float, text: str, out: list[Effect]) -> None:
        if not job.ranks_noted:
            job.ranks_noted = True
            self._note(job, now, "ranks", text, out, "warning")

    def _on_leave(
        self, conn: Conn, job: Job, member: Member, msg: Leave, now: float, out: list[Effect]
    ) -> None:
        """A node leaves on purpose; tell it whether the job goes on without it, then close."""
        was_spare = member.node_id in job.spares
        had_succeeded = member.state is MemberState.SUCCEEDED
        reason = f"left ({clip_text(msg.reason, PEER_TEXT_LEN)})" if msg.reason else "left"
        self._drop(conn.id, reason, now, out, close=False)
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
        _set_state(job, member, MemberState.WAITING)
        if not in_round:
            self.unchanged = was_waiting  # a repeated notice changes nothing
            return  # gathering, or a newcomer: not ready is all it takes
        self._note(
            job,
            now,
            "left",
            f"node {nid} leaves once its workers have exited{why}; the others restart now",
            out,
            "warning",
        )
        self._regather(job, f"node {nid} ({member.addr}) is leaving{why}", now, out, quiet=nid)

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

    def _regather(self, job: Job, reason: str, now: float, out: list[Effect], *, quiet: str = "") -> None:
        """Stop the running round: every member restarts its workers and re-joins (all but
        ``quiet``, a leaving node already stopping its own)."""
        abandoned = job.round
        # Built before anything changes: a message that cannot be built leaves the job as it was.
        restart = Restart(
            round=abandoned, reason=clip_text(reason, REASON_LEN), restart_count=job.restart_count
        )
        job.round += 1
        job.phase = JobPhase.GATHERING
        job.gathering_since = now
        job.last_call_deadline = None  # newcomers already here are in; no need to wait longer
        self.stats.rounds_started += 1
        in_round = set(job.order)
        for m in job.members.values():
            if m.node_id in in_round:
                _set_state(job, m, MemberState.WAITING)
                if m.node_id != quiet:
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
            return
        full = len(job.members) >= job.settings.max_nodes
        if full or (job.last_call_deadline is not None and now >= job.last_call_deadline):
            names = summarise(newcomers)  # 1,100 node ids would not fit a Restart's reason
            self._note(job, now, "admit", f"admitting {names}; re-rendezvous", out)
            job.last_call_deadline = None
            self._regather(job, f"node(s) joined: {names}", now, out)

    def _promote_spares(self, job: Job, now: float, out: list[Effect]) -> None:
        while job.spares and len(job.members) < job.settings.max_nodes:
            # A connected spare first. One still away after a server restart takes the place
            # too when it is the only one, but is not ready until it is back and joins.
            nid = next((n for n, m in job.spares.items() if not self._is_away(m)), next(iter(job.spares)))
            m = job.spares.pop(nid)
            m.state = MemberState.WAITING if self._is_away(m) else MemberState.READY
            _put_member(job, m)
            self._note(job, now, "spare", f"spare {nid} takes a place in the job", out)

    def _maybe_finish(self, job: Job, now: float, out: list[Effect]) -> None:
        if job.phase is not JobPhase.RUNNING or not job.members:
            return
        in_round = [job.members[nid] for nid in job.order if nid in job.members]
        if all(m.state is MemberState.SUCCEEDED for m in in_round):
            job.phase = JobPhase.FINISHED
            job.last_call_deadline = None
            job.outcome = f"all workers succeeded in round {job.round}"
            self.stats.jobs_finished += 1
            done = JobDone()
            for m in [*job.members.values(), *job.spares.values()]:
                out.append(Send(m.conn, done))
            self._note(job, now, "finished", f"finished: {job.outcome}", out)

    def _fail(self, job: Job, reason: str, failure: Failure | None, now: float, out: list[Effect]) -> None:
        reason = clip_text(reason, REASON_LEN)
        failed = JobFailed(reason=reason, failure=failure)  # one object: encoded once for all
        job.phase = JobPhase.FAILED
        job.last_call_deadline = None
        job.outcome = reason
        self.stats.jobs_failed += 1
        for m in [*job.members.values(), *job.spares.values()]:
            out.append(Send(m.conn, failed))
        self._note(job, now, "failed", f"failed: {reason}", out, "error")

    # -- departures and time ---------------------------------------------------------------

    def _drop(self, conn_id: int, reason: str, now: float, out: list[Effect], *, close: bool) -> None:
        conn = self.conns.pop(conn_id, None)
        if conn is None:
            return
        if close:
            out.append(Close(conn_id, reason))
        if conn.phase not in _MEMBER_PHASES or conn.job_id is None or conn.node_id is None:
            return
        job = self.jobs.get(conn.job_id)
        if job is None:
            return
        nid = conn.node_id
        if job.spares.pop(nid, None) is not None:
            self._note(job, now, "left", f"spare {nid} {reason}", out)
            self._forget_if_done(job, now, out)
            return
        member = _pop_member(job, nid)
        if member is None:
            return
        if job.phase in (JobPhase.FINISHED, JobPhase.FAILED):
            self._forget_if_done(job, now, out)
            return
        if job.phase is JobPhase.RESUMING:
            job.resume_slots = {r: n for r, n in job.resume_slots.items() if n != nid}
            self._note(job, now, "lost", f"node {nid} {reason} during the rebuild", out, "warning")
            self._forget_if_done(job, now, out)
            return
        kind = "left" if reason.startswith("left") else "lost"
        self.stats.failures[f"node_{kind}"] += 1
        self._note(job, now, kind, f"node {nid} {reason} ({len(job.members)} remain)", out, "warning")
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
            return  # a newcomer that had not started yet
        if member.state is MemberState.SUCCEEDED:
            self._maybe_finish(job, now, out)
            return
        if self._forget_if_done(job, now, out):
            return
        cause = f"node {nid} ({member.addr}) {reason}"
        if not job.elastic and kind == "lost":
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
            job.outcome = job.outcome or "every node left"
            self._note(job, now, "forgotten", "no nodes left; forgotten", out)
        del self.jobs[job.id]
        self.finished_jobs.append(job)
        return True

    def _on_tick(self, now: float, out: list[Effect]) -> None:
        for job in list(self.jobs.values()):
            if job.joins_unlogged and now >= job.join_window_end:
                self._log_unlogged_joins(job, out)
            if job.last_call_deadline is not None and now >= job.last_call_deadline:
                if job.phase is JobPhase.RESUMING:
                    missing = job.resume_expect[1] - len(job.members) if job.resume_expect else 0
                    self._abandon_resume(job, f"{missing} node(s) did not come back in time", now, out)
                elif job.phase is JobPhase.RUNNING:
                    self._maybe_regather(job, now, out)
                else:
                    job.last_call_deadline = None
                    self._maybe_complete(job, now, out)
        if self._next_sweep is not None and now >= self._next_sweep:
            self._sweep(now, out)
        if self.resume_deadline is not None and now >= self.resume_deadline:
            self.resume_deadline = None
            for conn in [c for c in self.conns.values() if c.phase is ConnPhase.AWAY]:
                self._drop(conn.id, "did not come back after the server restarted", now, out, close=False)

    def _sweep(self, now: float, out: list[Effect]) -> None:
        """Drop nodes whose heartbeats stopped: a frozen machine or a pulled cable."""
        shortest: float | None = None
        for conn in list(self.conns.values()):
            if conn.phase is not ConnPhase.JOINED or conn.job_id not in self.jobs:
                continue
            timeout = self.jobs[conn.job_id].settings.heartbeat_timeout
            shortest = timeout if shortest is None else min(shortest, timeout)
            if now - conn.last_seen > timeout:
                self._drop(conn.id, f"went silent (no heartbeat for {timeout:g} s)", now, out, close=True)
        self._next_sweep = None if shortest is None else now + max(shortest / 4, 0.05)

    def _ensure_sweep(self, now: float, timeout: float) -> None:
        if not self.expire_silent:
            return
        due = now + max(timeout / 4, 0.05)
        if self._next_sweep is None or due < self._next_sweep:
            self._next_sweep = due

    # -- helpers ---------------------------------------------------------------------------

    def _note(
        self, job: Job, now: float, kind: str, text: str, out: list[Effect], level: str = "info"
    ) -> None:
        """Log a job event once, and keep it in the job's history."""
        if job.joins_unlogged:
            self._log_unlogged_joins(job, out)  # the joins came first: so do their lines
        job.record(now, kind, text)
        out.append(Log(level, escape(clip_text(f"job {job.id}: {text}", LOG_TEXT_LEN))))

    def _note_join(self, job: Job, member: Member, now: float, out: list[Effect]) -> None:
        """A join, in the history always, and in the log as its own line or in a summary."""
        text = (
            f"node {member.node_id} ({member.addr}, nproc {member.nproc}) joined "
            f"({len(job.members)} of {_range(job.settings.min_nodes, job.settings.max_nodes)})"
        )
        if now >= job.join_window_end:
            job.join_window_end, job.join_lines = now + JOIN_LOG_WINDOW, 0
        if job.join_lines < JOIN_LINES:
            job.join_lines += 1
            self._note(job, now, "joined", text, out)  # the second's earlier summary goes first
            return
        job.record(now, "joined", text)
        if not job.joins_unlogged:
            job.first_unlogged = member.node_id
        job.joins_unlogged += 1
        job.last_unlogged = member.node_id

    def _log_unlogged_joins(self, job: Job, out: list[Effect]) -> None:
        n, first, last = job.joins_unlogged, job.first_unlogged, job.last_unlogged
        job.joins_unlogged, job.first_unlogged, job.last_unlogged = 0, "", ""
        nodes = f"node {first}" if n == 1 else f"{n:,} more nodes ({first} ... {last})"
        size = f"{len(job.members):,} of {_range(job.settings.min_nodes, job.settings.max_nodes)}"
        out.append(Log("info", escape(f"job {job.id}: {nodes} joined; {size}")))

    def _member_of(self, conn: Conn) -> tuple[Job, Member]:
        job = self.jobs.get(conn.job_id or "")
        member = None
        if job is not None and conn.node_id is not None:
            member = job.members.get(conn.node_id) or job.spares.get(conn.node_id)
        if job is None or member is None:
            raise LocalError(f"joined connection {conn.id} has no member")
        return job, member

    def _waiting(self, job: Job, reason: str) -> Waiting:
        return Waiting(
            job_id=job.id,
            round=job.round,
            joined=len(job.members),
            min_nodes=job.settings.min_nodes,
            max_nodes=job.settings.max_nodes,
            reason=reason,
        )

    def _refuse(self, conn: Conn, code: str, message: str, now: float, out: list[Effect]) -> None:
        """The peer was wrong: tell it why and close its connection; everyone else goes on."""
        message = clip_text(message, REASON_LEN)
        out.append(Send(conn.id, Error(code=code, message=message, fatal=True)))
        out.append(Log("warning", escape(clip_text(f"refused {conn.peer}: {message}", LOG_TEXT_LEN))))
        self._drop(conn.id, f"refused: {message}", now, out, close=True)


def _describe_failure(f: Failure) -> str:
    how = f"signal {f.signal}" if f.signal else f"exit code {f.exitcode}"
    return f"rank {f.rank} (local rank {f.local_rank}) on node {f.node_id} ({f.addr}) failed with {how}"


def members_by_rank(job: Job) -> Iterable[Member]:
    """The members of the last completed round in rank order (for status views)."""
    return (job.members[nid] for nid in job.order if nid in job.members)
