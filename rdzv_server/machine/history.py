"""A job's history: typed events, the one place their sentences are written, and the counters.

Each event the rendezvous machine notes about a job is a :class:`JobEvent`: a kind (an
:class:`EventKind`), the facts as typed fields (the node, its address and nproc, the round,
how a node departed, ...) and a sentence for people, rendered from those facts by the
functions below and nowhere else. Whoever needs a fact reads its field: the status API, the
dashboard and the CLI never read one back out of a sentence, so a sentence can be reworded
freely. The history is kept in the state log's snapshots (``state_image.py``), and a replay of
the log's events writes the same history again.

Also here: how a job's events reach the server's log (one line each, except a join storm's
``joined`` lines, which are summarised once a second: ``JOIN_LINES``) and :class:`Stats`,
the counters behind ``/metrics``.

Pure: no clock (every event is given its time), no I/O (log lines are returned as effects).
"""

from __future__ import annotations

import bisect
import enum
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import field
from typing import TYPE_CHECKING

from protocol.messages import clip_text
from protocol.records import record

from .events import Effect, Log

if TYPE_CHECKING:
    from .jobs import Job, JobSettings, Member

HISTORY_LEN = 200  # events a job keeps (a ring: the oldest goes first)
HISTORY_TEXT_LEN = 512  # characters of one history sentence
LOG_TEXT_LEN = 2048  # characters of one line the server logs
NAMES_SHOWN = 10  # node ids named in one text; the rest are counted
# A job's "joined" lines: one each for the first JOIN_LINES joins in a second, then one line a
# second for the rest. A 10,000-node join storm logged line by line cost the server 15 % of its
# CPU, and nobody reads 10,000 lines; the job's history still holds every join. The summary
# goes out with the job's next event or the next Tick after its second: the heartbeat sweep
# ticks every heartbeat_timeout / 4 while nodes are joined. It is no deadline of its own: the
# etcd backend's agents would race to log a tick for a line nobody prints there.
JOIN_LINES = 20
JOIN_LOG_WINDOW = 1.0
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class EventKind(str, enum.Enum):
    """What happened. The value is the ``kind`` the status API shows (a ``str``, so it also
    compares equal to that text)."""

    CREATED = "created"
    JOINED = "joined"
    SPARE = "spare"  # a node waits as a spare, or a spare takes a place
    ROUND = "round"  # a round's assignment went out (or was rebuilt after a server restart)
    RESTART = "restart"  # a round could not be rebuilt after a server restart
    FAILURE = "failure"  # a worker failed; the job restarts
    EXCLUDED = "excluded"
    DRAIN = "drain"  # an operator asked a node to leave
    ADMIT = "admit"  # newcomers are let into a running job
    LOST = "lost"
    LEFT = "left"  # a node left (or, draining, is leaving) on purpose
    FINISHED = "finished"
    FAILED = "failed"
    FORGOTTEN = "forgotten"
    RECOVERED = "recovered"  # restored from the state log after a server restart
    RESUMING = "resuming"  # rebuilding a round from its agents (no record of it)
    RESUMED = "resumed"  # a node came back after a server restart
    SERVER = "server"  # the server is going away
    RANKS = "ranks"  # --node-rank does not order this job's ranks
    HANG = "hang"  # a rank made no progress past its deadline; every node sends its stacks
    STRAGGLER = "straggler"  # a node's rank computes slower than the job's threshold allows
    CRASH_LOOP = "crash_loop"  # restarts in a row made no step progress: the job fails
    COMMIT = "commit"  # a planned change waits for every rank to stop at one step (issue 20)
    RESTORE = "restore"  # a round restores every rank from one in-memory snapshot (issue 35)
    TAKEOVER = "takeover"  # a standby agent hosts the rendezvous of a lost host (issue 45)


class Departure(str, enum.Enum):
    """How a node left its job."""

    LEFT = "left"  # it said so (Leave)
    # Its connection dropped, or its heartbeats stopped (one kind: the state log replays a
    # silent node's drop as its disconnection, and replay must write the same history).
    LOST = "lost"
    REFUSED = "refused"  # it sent something the server refused, and was closed
    NOT_BACK = "not_back"  # away after a server restart, and not back in time
    STALE = "stale"  # came back after a server restart holding a round the server does not
    EXCLUDED = "excluded"  # its workers failed too often

    @property
    def kind(self) -> EventKind:
        """The history kind of a member's departure: left on purpose, excluded, or lost."""
        if self is Departure.LEFT:
            return EventKind.LEFT
        return EventKind.EXCLUDED if self is Departure.EXCLUDED else EventKind.LOST


@record(frozen=True, slots=True)
class JobEvent:
    """One event of a job's history, for the status API and dashboard.

    ``text`` is rendered from the other fields (and the event's free-text reasons) by this
    module's functions; a field the event is not about is left empty (``""``, ``None``).
    """

    time: float  # the server's monotonic clock
    kind: EventKind
    text: str
    node: str = ""  # the node it is about
    addr: str = ""  # that node's address
    nproc: int | None = None  # that node's nproc (joins)
    round: int | None = None  # the round it is about
    departure: Departure | None = None  # how the node went (departures)
    spare: bool = False  # the node was a spare: its going disturbs no round
    failure_no: int = 0  # a worker failure's number in the job (1: the first); 0: none
    ranks: tuple[int, ...] = ()  # global ranks (HANG: hung; STRAGGLER: flagged)
    step: int | None = None  # HANG: the hung rank's last step; CRASH_LOOP: the step stuck at
    phase: str = ""  # HANG: the hung rank's phase
    silent_s: float | None = None  # HANG: how long it had made no progress
    scores: tuple[float, ...] = ()  # STRAGGLER: the flagged ranks' scores (parallel to ranks)
    restarts: int = 0  # CRASH_LOOP: the restarts in a row without progress


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


# --- text helpers -------------------------------------------------------------------------


def node_range(lo: int, hi: int) -> str:
    """``--nnodes`` as written: ``4`` or ``2:4``."""
    return str(lo) if lo == hi else f"{lo}:{hi}"


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


# --- the sentences ------------------------------------------------------------------------
# One function per event: its facts in, the event (facts and sentence) out.


def created(now: float, s: JobSettings) -> JobEvent:
    text = (
        f"created (nnodes {node_range(s.min_nodes, s.max_nodes)}, "
        f"entrypoint {s.entrypoint!r}, max restarts {s.max_restarts})"
    )
    return JobEvent(now, EventKind.CREATED, text)


def joined(now: float, m: Member, members: int, s: JobSettings) -> JobEvent:
    text = (
        f"node {m.node_id} ({m.addr}, nproc {m.nproc}) joined "
        f"({members} of {node_range(s.min_nodes, s.max_nodes)})"
    )
    return JobEvent(now, EventKind.JOINED, text, node=m.node_id, addr=m.addr, nproc=m.nproc)


def waits_as_spare(now: float, m: Member) -> JobEvent:
    text = f"node {m.node_id} ({m.addr}) waits as a spare"
    return JobEvent(now, EventKind.SPARE, text, node=m.node_id, addr=m.addr, nproc=m.nproc, spare=True)


def spare_takes_place(now: float, m: Member) -> JobEvent:
    text = f"spare {m.node_id} takes a place in the job"
    return JobEvent(now, EventKind.SPARE, text, node=m.node_id, addr=m.addr, nproc=m.nproc)


def round_complete(
    now: float, rnd: int, nodes: int, world_size: int, master: Member, restarts: int, by_node_rank: bool
) -> JobEvent:
    text = (
        f"round {rnd} complete: {nodes} nodes, world size {world_size}, "
        f"master {master.addr}:{master.master_port}, restarts {restarts}"
        + (", group ranks by --node-rank" if by_node_rank else "")
    )
    return JobEvent(now, EventKind.ROUND, text, round=rnd)


def round_rebuilt(now: float, rnd: int, nodes: int) -> JobEvent:
    text = f"round {rnd} rebuilt from its {nodes} agents; nothing restarts"
    return JobEvent(now, EventKind.ROUND, text, round=rnd)


def rebuild_abandoned(now: float, rnd: int, why: str) -> JobEvent:
    text = f"cannot rebuild round {rnd}: {why}; a new round begins"
    return JobEvent(now, EventKind.RESTART, text, round=rnd)


def worker_failure(
    now: float, rnd: int, cause: str, f_node: str, f_addr: str, number: int, restart: int, of: int
) -> JobEvent:
    text = f"round {rnd}: {cause}; restart {restart} of {of}"
    return JobEvent(now, EventKind.FAILURE, text, node=f_node, addr=f_addr, round=rnd, failure_no=number)


def excluded(now: float, m: Member, why: str) -> JobEvent:
    text = f"node {m.node_id} ({m.addr}) excluded: {why}"
    return JobEvent(now, EventKind.EXCLUDED, text, node=m.node_id, addr=m.addr, departure=Departure.EXCLUDED)


def drain_asked(now: float, node_id: str, reason: str) -> JobEvent:
    why = f": {reason}" if reason else ""
    return JobEvent(now, EventKind.DRAIN, f"node {node_id} asked to drain{why}", node=node_id)


def ranks_ignored_elastic(now: float, s: JobSettings) -> JobEvent:
    text = (
        f"--node-rank ignored: the job is elastic (--nnodes {node_range(s.min_nodes, s.max_nodes)}), "
        "so group ranks follow the rendezvous order (address, node id), as with torchrun's c10d"
    )
    return JobEvent(now, EventKind.RANKS, text)


def ranks_ignored_partial(now: float, members: int, missing: Sequence[str]) -> JobEvent:
    named = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    text = (
        f"--node-rank ignored: {members - len(missing)} of {members} nodes gave "
        f"one ({named} did not), so group ranks follow address order"
    )
    return JobEvent(now, EventKind.RANKS, text)


def ranks_ignored_gaps(now: float) -> JobEvent:
    text = "--node-rank ignored: the nodes' ranks are not 0..n-1; ordering by address"
    return JobEvent(now, EventKind.RANKS, text)


def leaving(now: float, m: Member, why: str, rnd: int) -> JobEvent:
    """A draining node stops its workers: the others restart now (``why``: `` (reason)`` or "")."""
    text = f"node {m.node_id} leaves once its workers have exited{why}; the others restart now"
    return JobEvent(now, EventKind.LEFT, text, node=m.node_id, addr=m.addr, round=rnd)


def admitting(now: float, names: str) -> JobEvent:
    return JobEvent(now, EventKind.ADMIT, f"admitting {names}; re-rendezvous")


def finished(now: float, rnd: int, outcome: str) -> JobEvent:
    return JobEvent(now, EventKind.FINISHED, f"finished: {outcome}", round=rnd)


def failed(now: float, rnd: int, reason: str, failure_no: int) -> JobEvent:
    return JobEvent(now, EventKind.FAILED, f"failed: {reason}", round=rnd, failure_no=failure_no)


def spare_departed(now: float, m: Member, how: Departure, reason: str) -> JobEvent:
    text = f"spare {m.node_id} {reason}"
    return JobEvent(now, EventKind.LEFT, text, node=m.node_id, addr=m.addr, departure=how, spare=True)


def departed(now: float, m: Member, how: Departure, reason: str, remain: int) -> JobEvent:
    text = f"node {m.node_id} {reason} ({remain} remain)"
    return JobEvent(now, how.kind, text, node=m.node_id, addr=m.addr, departure=how)


def departed_in_rebuild(now: float, m: Member, how: Departure, reason: str) -> JobEvent:
    text = f"node {m.node_id} {reason} during the rebuild"
    return JobEvent(now, EventKind.LOST, text, node=m.node_id, addr=m.addr, departure=how)


def forgotten(now: float) -> JobEvent:
    return JobEvent(now, EventKind.FORGOTTEN, "no nodes left; forgotten")


def rebuilt_anew(now: float) -> JobEvent:
    text = "was being rebuilt when the server stopped; rebuilt anew"
    return JobEvent(now, EventKind.FORGOTTEN, text)


def recovered(now: float, phase: str, rnd: int, window: float, away: int) -> JobEvent:
    text = (
        f"restored from the state log in phase {phase}, round "
        f"{rnd}; waiting up to {window:g} s for {away} node(s) to resume"
    )
    return JobEvent(now, EventKind.RECOVERED, text, round=rnd)


def server_going_away(now: float, reason: str) -> JobEvent:
    text = f"server going away ({reason}); its agents will reconnect"
    return JobEvent(now, EventKind.SERVER, text)


def resuming(now: float, rnd: int) -> JobEvent:
    text = f"rebuilding round {rnd} from its agents (no record of it)"
    return JobEvent(now, EventKind.RESUMING, text, round=rnd)


def took_over(now: float, rnd: int | None, node: str, term: int, lost: str) -> JobEvent:
    """A standby (``node``) hosts the rendezvous now, at take-over ``term``; ``lost``: the node
    that hosted it ("" when that node held no place in the job's round); ``rnd``: the round
    being rebuilt (None: a node joined before any came back holding one, so the job gathers
    anew)."""
    whom = f"node {lost}, which hosted it, is lost" if lost else "the agent that hosted it is lost"
    then = f"rebuilding round {rnd}" if rnd is not None else "a node joined first: the job gathers anew"
    text = f"node {node} took over the rendezvous (term {term}): {whom}; {then}"
    return JobEvent(now, EventKind.TAKEOVER, text, node=node, round=rnd)


def resumed(now: float, m: Member, rnd: int) -> JobEvent:
    text = f"node {m.node_id} resumed round {rnd}; nothing restarts"
    return JobEvent(now, EventKind.RESUMED, text, node=m.node_id, addr=m.addr, round=rnd)


HANG_RANKS_SHOWN = 16  # hung ranks named in a HANG sentence (the typed field has them all)


def hang(
    now: float,
    node: str,
    addr: str,
    rnd: int,
    ranks: Sequence[int],
    step: int,
    phase: str,
    silent: float,
) -> JobEvent:
    """Rank R on node N made no progress (first report of round ``rnd``; ``ranks``: every hung
    rank reported so far, the first one first)."""
    shown = ", ".join(map(str, ranks[:HANG_RANKS_SHOWN])) + (
        f" and {len(ranks) - HANG_RANKS_SHOWN} more" if len(ranks) > HANG_RANKS_SHOWN else ""
    )
    first = ranks[0] if ranks else None
    text = f"round {rnd}: {hang_reason(first, node, step, phase, silent)}" + (
        f"; hung ranks: {shown}" if shown else ""
    )
    return JobEvent(
        now,
        EventKind.HANG,
        text,
        node=node,
        addr=addr,
        round=rnd,
        ranks=tuple(ranks),
        step=step,
        phase=phase,
        silent_s=silent,
    )


def hang_reason(rank: int | None, node: str, step: int, phase: str, silent: float) -> str:
    """What CollectStacks says (and the HANG event begins with); ``rank`` None: not named."""
    where = f"step {step}" if step >= 0 else "no step reported"
    if phase:
        where += f", phase {phase}"
    who = f"rank {rank}" if rank is not None else "a rank"
    return f"{who} on node {node} made no progress for {silent:.0f} s ({where})"


def straggler(
    now: float,
    node: str,
    addr: str,
    rnd: int,
    ranks: Sequence[int],
    scores: Sequence[float],
    threshold: float,
) -> JobEvent:
    shown = ", ".join(f"rank {r} at {s:.2f}" for r, s in list(zip(ranks, scores, strict=True))[:8])
    more = f" and {len(ranks) - 8} more" if len(ranks) > 8 else ""
    text = (
        f"round {rnd}: node {node} has straggler(s): {shown}{more} of the job's median compute "
        f"speed (threshold {threshold:g})"
    )
    return JobEvent(
        now,
        EventKind.STRAGGLER,
        text,
        node=node,
        addr=addr,
        round=rnd,
        ranks=tuple(ranks),
        scores=tuple(scores),
    )


def commit_asked(now: float, rnd: int, step: int, reason: str, deadline_s: float) -> JobEvent:
    text = (
        f"round {rnd}: asking every rank to stop at step {step} (a commit point) for: {reason} "
        f"(then a restart, at most {deadline_s:.0f} s from now)"
    )
    return JobEvent(now, EventKind.COMMIT, text, round=rnd, step=step)


def committed(now: float, rnd: int, step: int, reason: str, took_s: float) -> JobEvent:
    text = f"round {rnd}: committed at step {step} for: {reason} (every rank stopped there in {took_s:.1f} s)"
    return JobEvent(now, EventKind.COMMIT, text, round=rnd, step=step)


def commit_abandoned(now: float, rnd: int, step: int, why: str) -> JobEvent:
    text = f"round {rnd}: no commit at step {step}: {why}"
    return JobEvent(now, EventKind.COMMIT, text, round=rnd, step=step)


def restored(
    now: float, rnd: int, step: int, reached: int, from_disk: bool = False, world: int = 0
) -> JobEvent:
    """Round ``rnd`` resumes every rank from the snapshot of ``step`` (in memory, or persisted
    in the nodes' --snapshot-dir; ``world``: made by a job of that many ranks, state every rank
    holds alike); the job had reached ``reached`` (-1: not reported), so ``reached - step``
    steps are done again."""
    if reached > step:
        lost = reached - step
        cost = f"{lost} step{'s' if lost != 1 else ''} lost (the job had reached step {reached})"
    elif reached < 0:
        cost = "steps lost unknown (no rank had reported its step)"
    else:
        cost = "no step lost"
    where = (
        f"snapshot of step {step} persisted in --snapshot-dir"
        if from_disk
        else f"in-memory snapshot of step {step}"
    )
    if world:
        where += f" of the {world}-rank world (state every rank holds alike)"
    text = f"round {rnd} resumes every rank from the {where}: {cost}"
    return JobEvent(time=now, kind=EventKind.RESTORE, text=text, round=rnd, step=step)


def crash_loop(now: float, rnd: int, restarts: int, step: int) -> JobEvent:
    text = f"round {rnd}: {crash_loop_reason(restarts, step)}"
    return JobEvent(now, EventKind.CRASH_LOOP, text, round=rnd, step=step, restarts=restarts)


def crash_loop_reason(restarts: int, step: int) -> str:
    restarts_text = "1 restart" if restarts == 1 else f"{restarts} restarts"
    return f"{restarts_text} in a row made no step progress (stuck at step {step})"


def rejoined(now: float, m: Member) -> JobEvent:
    text = f"node {m.node_id} rejoined after the server restarted"
    return JobEvent(now, EventKind.RESUMED, text, node=m.node_id, addr=m.addr, nproc=m.nproc)


# --- history and log ----------------------------------------------------------------------


def note(job: Job, event: JobEvent, out: list[Effect], level: str = "info") -> None:
    """Keep an event in the job's history, and log it once."""
    if job.joins_unlogged:
        log_unlogged_joins(job, out)  # the joins came first: so do their lines
    job.record(event)
    out.append(Log(level, escape(clip_text(f"job {job.id}: {event.text}", LOG_TEXT_LEN))))


def note_join(job: Job, member: Member, now: float, out: list[Effect]) -> None:
    """A join, in the history always, and in the log as its own line or in a summary."""
    event = joined(now, member, len(job.members), job.settings)
    if now >= job.join_window_end:
        job.join_window_end, job.join_lines = now + JOIN_LOG_WINDOW, 0
    if job.join_lines < JOIN_LINES:
        job.join_lines += 1
        note(job, event, out)  # the second's earlier summary goes first
        return
    job.record(event)
    if not job.joins_unlogged:
        job.first_unlogged = member.node_id
    job.joins_unlogged += 1
    job.last_unlogged = member.node_id


def log_unlogged_joins(job: Job, out: list[Effect]) -> None:
    """The summary line of this second's joins beyond the first JOIN_LINES."""
    n, first, last = job.joins_unlogged, job.first_unlogged, job.last_unlogged
    job.joins_unlogged, job.first_unlogged, job.last_unlogged = 0, "", ""
    nodes = f"node {first}" if n == 1 else f"{n:,} more nodes ({first} ... {last})"
    size = f"{len(job.members):,} of {node_range(job.settings.min_nodes, job.settings.max_nodes)}"
    out.append(Log("info", escape(f"job {job.id}: {nodes} joined; {size}")))
