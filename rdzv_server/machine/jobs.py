"""The rendezvous machine's state: connections, jobs, members and the bounds on them.

Plain records and the few functions that keep their invariants (``put_member``,
``pop_member`` and ``set_state`` keep ``Job.not_ready`` exact, and the first two
``Job.members_version``, from which ``rank_spans`` knows when to derive the round's ranks
again; ``rank_holder`` and ``node_rank_problem`` keep node ranks unique). No rule of the
rendezvous is here: those are in ``rounds.py`` (and ``recovery.py``), which change this state;
``state_image.py`` writes it down.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Mapping
from dataclasses import field, replace
from types import MappingProxyType
from typing import ClassVar

from protocol import Failure, Join
from protocol.messages import clip_text
from protocol.records import record

from .goodput import Ledger
from .history import HISTORY_LEN, HISTORY_TEXT_LEN, JobEvent, node_range
from .progress import HangState, JobProgress
from .provenance import Provenance
from .restore_points import RestorePoints

# Bounds on what one job and one server keep, whatever their peers send (the README's
# per-job memory bound is computed from these; tests/rdzv_server/test_state_bounds.py checks it).
FAILURES_KEPT = 8  # a job's last failures, besides its first one and a count of all
FAILURE_TEXT_LEN = 2048  # characters of a failure's message (the worker's error) kept
FAILURE_PATH_LEN = 1024  # characters of a failure's error file path kept
PEER_TEXT_LEN = 1024  # characters of a peer's free text (a Leave or drain reason) quoted
REASON_LEN = 4096  # characters of a reason the server sends (Restart, JobFailed, Error, ...)
ENTRYPOINT_KEPT = 1024  # characters of a job's entrypoint (longer ones: cut, with a digest)
MAX_JOBS = 1000  # jobs one server holds at once; a new one beyond is refused
MAX_SPARES = 1024  # spares per job (and at most max_nodes): more nodes are refused
MAX_EXCLUDED = 128  # excluded node ids a job remembers (the oldest is forgotten first)
# A job's restart budget: a larger --max-restarts is taken as this (the server alone counts
# restarts). A clamp, not a protocol limit, so an agent given "effectively unlimited" is
# still served, by any server.
MAX_RESTARTS = 1_000_000


class ConnPhase(enum.Enum):
    HELLO = "hello"
    READY = "ready"
    JOINED = "joined"
    # A connection of the server's previous process, restored from its state log: its
    # member waits (see ``recovery.py``) for the agent to come back on a new connection.
    AWAY = "away"


class JobPhase(enum.Enum):
    RESUMING = "resuming"  # rebuilding a round from the agents' Resume after losing our state
    GATHERING = "gathering"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    # Every node left before it finished or failed; set as the job is forgotten (so only a
    # forgotten job has it), never "running" or "gathering" for a job nobody is in.
    ABANDONED = "abandoned"


class MemberState(enum.Enum):
    WAITING = "waiting"  # in the job, not yet (re-)joined for the next round
    READY = "ready"  # joined, waiting for the round to complete
    RUNNING = "running"  # holds the current round's assignment
    SUCCEEDED = "succeeded"  # its workers finished; waiting at the exit barrier


MEMBER_PHASES = (ConnPhase.JOINED, ConnPhase.AWAY)  # connections that stand for a member


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
    local: str = ""  # Connected.local: the server's address this peer reached
    # Until it joins: when it must have said hello (phase HELLO) or joined (READY) by, on the
    # machine's clock; None once joined, and when replaying. Not kept in snapshots: a restart
    # keeps no unjoined connection.
    deadline: float | None = None


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
    # Join.hosts_store: this node's agent can host the workers' TCPStore (issue 21); the
    # round's group-rank-0 member's decides Assignment.agent_store.
    hosts_store: bool = False
    # Join.replica_port/replica_key (issue 35): where this node's agent takes snapshot
    # replicas (0: nowhere) and the key a peer proves to it; relayed only to the job's members.
    replica_port: int = 0
    replica_key: str = ""
    replica_cert: str = ""  # Join.replica_cert: the sha256 its replica server's TLS cert has
    # It sent SnapshotsHeld: it snapshots, so it gets KeepSnapshot (an older agent never does).
    snapshots: bool = False
    # Join.durable_world/durable_steps (issue 35): the steps its snapshot directory holds
    # complete for a job of that many ranks (-1, (): none).
    durable_world: int = -1
    durable_steps: tuple[int, ...] = ()
    standby_port: int = 0  # Join.standby_port (issue 45): where it would host; 0: nowhere

    def take_join(self, msg: Join) -> None:
        """What a re-join (or a spare's) may change: where the agent is and what it offers."""
        self.addr, self.master_port = msg.addr, msg.master_port
        self.hosts_store = msg.hosts_store
        self.replica_port, self.replica_key = msg.replica_port, msg.replica_key
        self.replica_cert = msg.replica_cert
        self.durable_world, self.durable_steps = msg.durable_world, msg.durable_steps
        self.standby_port = msg.standby_port


@record(frozen=True, slots=True)
class JobSettings:
    min_nodes: int
    max_nodes: int
    entrypoint: str
    max_restarts: int
    last_call_timeout: float
    heartbeat_timeout: float
    exclude_after: int = 0
    # Training health (issue 19): a rank below this fraction of the job's median compute
    # speed is a straggler; exclude_stragglers leaves such a node out of the next round;
    # crash_loop_restarts restarts in a row with no step progress fail the job (0: never).
    straggler_threshold: float = 0.75
    exclude_stragglers: bool = False
    crash_loop_restarts: int = 3
    # Commit points (issue 20): the checkpoint budget of a commit (0: no commits) and the
    # steps ahead a commit stops at (0: derived from the step time; commits.py).
    commit_timeout: float = 300.0
    commit_steps: int = 0

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
            straggler_threshold=msg.straggler_threshold,
            exclude_stragglers=msg.exclude_stragglers,
            crash_loop_restarts=msg.crash_loop_restarts,
            commit_timeout=msg.commit_timeout,
            commit_steps=msg.commit_steps,
        )

    def to_dict(self) -> dict[str, int | float | str | bool]:
        """The settings by name (the status API shows them; a snapshot keeps them)."""
        return {
            "min_nodes": self.min_nodes,
            "max_nodes": self.max_nodes,
            "entrypoint": self.entrypoint,
            "max_restarts": self.max_restarts,
            "last_call_timeout": self.last_call_timeout,
            "heartbeat_timeout": self.heartbeat_timeout,
            "exclude_after": self.exclude_after,
            "straggler_threshold": self.straggler_threshold,
            "exclude_stragglers": self.exclude_stragglers,
            "crash_loop_restarts": self.crash_loop_restarts,
            "commit_timeout": self.commit_timeout,
            "commit_steps": self.commit_steps,
        }

    def mismatch(self, other: JobSettings) -> str | None:
        """What an agent disagrees on with the job it tries to join, or None."""
        if (self.min_nodes, self.max_nodes) != (other.min_nodes, other.max_nodes):
            return (
                f"node range: the job has --nnodes {node_range(self.min_nodes, self.max_nodes)}, "
                f"this agent has --nnodes {node_range(other.min_nodes, other.max_nodes)}"
            )
        if self.entrypoint != other.entrypoint:
            return f"entrypoint: the job runs {self.entrypoint!r}, this agent runs {other.entrypoint!r}"
        if self.max_restarts != other.max_restarts:
            return (
                f"max restarts: the job has --max-restarts {self.max_restarts}, "
                f"this agent has --max-restarts {other.max_restarts}"
            )
        for name in _SAME_CONF:
            ours, theirs = getattr(self, name), getattr(other, name)
            if ours != theirs:
                return f"--rdzv-conf {name}: the job has {_conf(ours)}, this agent has {_conf(theirs)}"
        return None


# --rdzv-conf settings every node of a job must give alike.
_SAME_CONF = (
    "straggler_threshold",
    "exclude_stragglers",
    "crash_loop_restarts",
    "commit_timeout",
    "commit_steps",
)


def _conf(value: float | bool) -> str:
    return str(int(value)) if isinstance(value, bool) else f"{value:g}"


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


class CommitKind(enum.Enum):
    """What a commit point is for (what happens once every rank stopped at it)."""

    ADMIT = "admit"  # newcomers join: the job regathers with them
    DRAIN = "drain"  # nodes leave: they are drained, the others regather


@record(slots=True)
class Commit:
    """A planned change waiting for the job's ranks to stop at ``step`` (commits.py)."""

    round: int  # the running round whose ranks stop
    step: int  # S: every rank stops at the first step >= S it checks at; PENDING: not chosen yet
    reason: str  # why, in words ("node(s) joined: n3"), cut to REASON_LEN
    # Past it, the change happens as a hard restart. One deadline for the whole commit: set
    # when S is first chosen (a re-ask for a later step keeps it); while PENDING, how long the
    # server waits for the progress it needs to choose S.
    deadline: float
    started_at: float
    arms: int = 1  # how many times a step was asked for (a late rank asks for a later one)
    go: bool = False  # every node armed in time: the ranks stop at ``step``
    drains: list[str] = field(default_factory=list)  # nodes to drain once stopped (members)
    armed: set[str] = field(default_factory=set)  # nodes of the round armed in time for ``step``
    # node -> the step its workers all stopped at (>= step: a rank that checks should_stop()
    # every few steps stops at its first check past S; every node must say the same step)
    stopped: dict[str, int] = field(default_factory=dict)

    PENDING: ClassVar[int] = -1

    @property
    def kind(self) -> CommitKind:
        return CommitKind.DRAIN if self.drains else CommitKind.ADMIT

    @property
    def pending(self) -> bool:
        """S is not chosen yet: the server waits (bounded) for every node's progress."""
        return self.step == Commit.PENDING

    @property
    def committed(self) -> set[str]:
        """The nodes whose workers stopped at the commit point."""
        return set(self.stopped)


@record(frozen=True, slots=True)
class HangVerdict:
    """A hang's failure whose verdict (restart or fail) waits for every node's stacks, at most
    until ``deadline``, so the job's root cause can name the rank they point at
    (``training_rules._settle_hang``)."""

    round: int
    node: str  # the node that reported it
    failure: Failure  # as reported (its message cut to FAILURE_TEXT_LEN)
    step: int  # WorkersFailed.step, for the crash-loop rule
    deadline: float


RESUME_WINDOW = 10.0  # how long a rebuilt round waits for every node to come back
FINISHED_JOBS_KEPT = 50


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
    running_since: float = 0.0  # when the running round formed (a commit early in it waits)
    rounds_completed: int = 0
    outcome: str = ""  # why the job ended, once it has
    excluded: dict[str, str] = field(default_factory=dict)  # node id -> why
    history: deque[JobEvent] = field(default_factory=lambda: deque(maxlen=HISTORY_LEN))
    # While RESUMING: the round every node must hold, and which node holds each group rank.
    resume_expect: tuple[int, int, int, str, int] | None = None
    resume_slots: dict[int, str] = field(default_factory=dict)
    # Members (not spares) that are not READY: a round can complete only when this is empty.
    # Kept by put_member/pop_member/set_state, so that check is O(1) in a join storm.
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
    # stale and are dropped when looked up (rank_holder), so removals need not keep it.
    rank_holders: dict[int, str] = field(default_factory=dict)
    # Crash loops (kept in snapshots): the highest step a failing round reported
    # (WorkersFailed.step; -1: none), and the restarts in a row whose failure made no progress
    # past it. fail_code: JobFailed.code of the job's end ("crash_loop" or "").
    best_step: int = -1
    stuck_restarts: int = 0
    fail_code: str = ""
    hang_round: int = -1  # the round of the job's latest HANG event (kept in snapshots)
    # Training progress and the latest hang (volatile: not in snapshots; progress.py).
    progress: JobProgress = field(default_factory=JobProgress)
    hang: HangState | None = None
    # A commit point under way (commits.py; kept in snapshots); None: none.
    commit: Commit | None = None
    # In-memory snapshots (issue 35; volatile: the agents say again what they hold after a
    # server restart): what the nodes hold, the running round's world size, the newest step
    # every rank has and since when, and the step every agent was last told to keep.
    restore_points: RestorePoints = field(default_factory=RestorePoints)
    # Which claims restore_points was told (issue 42: an original only from the rank's node in
    # the running round, a replica only from the node asked to hold it, with the owner's
    # digest); each member's ranks in the running round (set with world_size, when it forms
    # or is rebuilt), the step it restored from (-1: none) and the (world, step)s a node could
    # not get before its workers started (the next restore picks an older one; newest last).
    provenance: Provenance = field(default_factory=Provenance)
    round_spans: dict[str, range] = field(default_factory=dict)
    restore_step: int = -1
    unrestorable: list[tuple[int, int]] = field(default_factory=list)
    world_size: int = 0
    snapshot_step: int = -1
    snapshot_since: float = 0.0
    kept_step: int = -1
    replicate_step: int = -1  # the step every agent copies to its peer now (-1: none)
    # A hang's failure waiting for the other nodes' stacks (kept in snapshots); None: none.
    hang_verdict: HangVerdict | None = None
    # Where the job's time went (issue 47; goodput.py): its logged part is kept in snapshots.
    goodput: Ledger = field(default_factory=Ledger)
    # Volatile (not in snapshots): bumped by put_member and pop_member; and each member's
    # ranks in the round, as ``rank_spans`` last derived them from ``order`` and the members.
    members_version: int = 0
    spans_cache: RankSpans | None = None

    def __post_init__(self) -> None:
        self.not_ready = {nid for nid, m in self.members.items() if m.state is not MemberState.READY}
        if not self.elastic:
            for m in [*self.members.values(), *self.spares.values()]:
                if m.node_rank >= 0:
                    self.rank_holders[m.node_rank] = m.node_id

    def record(self, event: JobEvent) -> None:
        """Keep an event in the history (``history.note`` also logs it), its text cut."""
        if len(event.text) > HISTORY_TEXT_LEN:
            event = replace(event, text=clip_text(event.text, HISTORY_TEXT_LEN))
        self.history.append(event)

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

    def end_rebuild(self, order: list[str]) -> None:
        """RESUMING ends (the round was rebuilt, or cannot be): it runs in ``order``."""
        self.order = order
        self.phase = JobPhase.RUNNING
        spans: dict[str, range] = {}
        at = 0
        for nid in order:  # the rebuilt round's ranks, as its members' Resumes said them
            m = self.members.get(nid)
            if m is not None:
                spans[nid] = range(at, at + m.nproc)
                at += m.nproc
        self.round_spans, self.world_size = spans, at
        self.resume_slots.clear()
        self.resume_expect = None
        self.last_call_deadline = None

    @property
    def elastic(self) -> bool:
        return self.settings.min_nodes < self.settings.max_nodes


@record(frozen=True, slots=True)
class RankSpans:
    """Each member's global ranks in the job's round (see :func:`rank_spans`)."""

    order: list[str]  # the job's ``order`` they come from (that very list)
    version: int  # its ``members_version`` then
    spans: Mapping[str, range]  # node -> its global ranks (read-only)
    nodes: int  # nodes of ``order`` still members


def rank_spans(job: Job) -> RankSpans:
    """Each member's global ranks in the running round, by its place in ``job.order`` (the
    members of ``order`` in turn, each ``nproc`` ranks), and how many of ``order`` are still
    members. Derived again only when ``order`` (a list the machine replaces, never changes in
    place) or the members (``put_member``, ``pop_member``) changed since; else O(1), so a
    hang's reports and stacks from every node of a large job cost O(1) each, not O(nodes)."""
    c = job.spans_cache
    if c is not None and c.order is job.order and c.version == job.members_version:
        return c
    spans: dict[str, range] = {}
    at = nodes = 0
    for nid in job.order:
        m = job.members.get(nid)
        if m is not None:
            spans[nid] = range(at, at + m.nproc)
            at += m.nproc
            nodes += 1
    c = job.spans_cache = RankSpans(job.order, job.members_version, MappingProxyType(spans), nodes)
    return c


def put_member(job: Job, m: Member) -> None:
    job.members[m.node_id] = m
    job.members_version += 1
    if m.state is MemberState.READY:
        job.not_ready.discard(m.node_id)
    else:
        job.not_ready.add(m.node_id)


def pop_member(job: Job, node_id: str) -> Member | None:
    job.not_ready.discard(node_id)
    job.members_version += 1
    job.restore_points.drop(node_id)  # a node gone is no source of snapshots
    job.provenance.drop(node_id)
    return job.members.pop(node_id, None)


def set_state(job: Job, m: Member, state: MemberState) -> None:
    m.state = state
    if job.members.get(m.node_id) is m:
        if state is MemberState.READY:
            job.not_ready.discard(m.node_id)
        else:
            job.not_ready.add(m.node_id)


def rank_holder(job: Job, node_rank: int) -> Member | None:
    """The member or spare that gave ``node_rank``, if one is still in the job."""
    nid = job.rank_holders.get(node_rank)
    if nid is None:
        return None
    m = job.members.get(nid) or job.spares.get(nid)
    if m is None or m.node_rank != node_rank:
        del job.rank_holders[node_rank]  # it left (or was excluded) since
        return None
    return m


def node_rank_problem(settings: JobSettings, job: Job | None, msg: Join) -> tuple[str, str] | None:
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
    holder = rank_holder(job, r) if job is not None else None
    if holder is None:
        return None
    return (
        "duplicate_node_rank",
        f"{who} gave --node-rank {r}, which node {holder.node_id} ({holder.addr}) already holds in job "
        f"{msg.job_id!r}: give each node its own --node-rank (if that node's previous agent died, "
        f"its place is freed when its heartbeat lapses, after {settings.heartbeat_timeout:g} s)",
    )
