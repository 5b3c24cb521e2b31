"""What the server knows, as JSON-able dicts: the status API, the dashboard and the CLI.

Pure: the machine and two readings of the clock in, plain dicts out. Nothing here opens a
socket or reads a clock. The machine keeps time on the server's monotonic clock; people want
wall-clock times, so the caller passes ``mono_now`` (the machine's clock) and ``wall_now``
(``time.time()``) read at the same moment, and every monotonic time ``t`` is shown as the
wall time ``wall_now - (mono_now - t)``. Times are Unix seconds; ages are seconds before now.

The machine forgets a node the moment it leaves, but a person looking at a job wants to see
the node that was lost. So a job's ``members`` lists, after the present members and spares,
the nodes that took part and are gone ("departed"): those of the last round's rank order that
are no longer there, the excluded ones, and any named by a ``joined`` event still in the
job's history. Why each one went comes from the history (``lost``, ``left``, ``excluded``).

Facts come from the history events' typed fields (``history.py``: a round's number, a departed
node's address, which failure an event reports), never from their sentences, which are for
people. An event older than its field (restored from a version 1 snapshot) has the field
empty, and the fact it would give shows as ``None``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict
from itertools import islice
from typing import Any

from protocol.failure_text import describe_failure

from .history import EventKind, JobEvent
from .state import SOFTWARE, ConnPhase, Job, JobPhase, Member, Rendezvous

K = EventKind
# The kinds of history events that end a running round (the first one after it starts).
_ROUND_ENDERS = frozenset({K.FAILURE, K.LOST, K.LEFT, K.ADMIT, K.EXCLUDED, K.FINISHED, K.FAILED, K.FORGOTTEN})
# The kinds that say why a node is gone.
_DEPARTURES = frozenset({K.LOST, K.LEFT, K.EXCLUDED})
TERMINAL_PHASES = frozenset({JobPhase.FINISHED, JobPhase.FAILED})

JOBS_LISTED = 200  # jobs in one GET /v1/jobs (active first); each job's detail is per id


class Clock:
    """Converts the machine's monotonic times to wall-clock times and ages."""

    __slots__ = ("mono_now", "wall_now")

    def __init__(self, mono_now: float, wall_now: float) -> None:
        self.mono_now = mono_now
        self.wall_now = wall_now

    def wall(self, t: float) -> float:
        return round(self.wall_now - (self.mono_now - t), 3)

    def ago(self, t: float) -> float:
        return round(max(0.0, self.mono_now - t), 3)


def server_view(machine: Rendezvous, clock: Clock) -> dict[str, Any]:
    s = machine.stats
    return {
        "software": SOFTWARE,
        "time": round(clock.wall_now, 3),
        "connections": len(machine.conns),
        "agents": sum(1 for c in machine.conns.values() if c.phase is ConnPhase.JOINED),
        "active_jobs": len(machine.jobs),
        "stats": {
            "jobs_created": s.jobs_created,
            "jobs_finished": s.jobs_finished,
            "jobs_failed": s.jobs_failed,
            "rounds_started": s.rounds_started,
            "rounds_completed": s.rounds_completed,
            "restarts": s.restarts,
            "failures": dict(sorted(s.failures.items())),
        },
    }


def jobs_view(
    machine: Rendezvous, *, mono_now: float, wall_now: float, limit: int = JOBS_LISTED
) -> dict[str, Any]:
    """``GET /v1/jobs``: the server, then a summary of at most ``limit`` jobs: the active ones,
    newest first, then the recently forgotten ones, newest first.

    A summary is a few numbers per job: no members, addresses, failures or history (those
    are per job, ``find_job``), so the body stays small whatever the jobs hold, and names no
    node (with tokens it is the one job read open to anyone; ``http_app.py``).
    """
    clock = Clock(mono_now, wall_now)
    total = len(machine.jobs) + len(machine.finished_jobs)
    active = list(islice(reversed(machine.jobs.values()), limit))
    jobs = [job_summary(j, clock, forgotten=False) for j in active]
    jobs += [
        job_summary(j, clock, forgotten=True)
        for j in islice(reversed(machine.finished_jobs), max(0, limit - len(active)))
    ]
    return {
        "server": server_view(machine, clock),
        "jobs": jobs,
        "jobs_total": total,
        "truncated": len(jobs) < total,
    }


def job_summary(job: Job, clock: Clock, *, forgotten: bool) -> dict[str, Any]:
    """One job in ``GET /v1/jobs``: bounded, and free of node ids, addresses and texts."""
    s = job.settings
    return {
        "id": job.id,
        "instance": f"{job.id}@{job.created_at:.6f}",
        "phase": job.phase.value,
        "finished": forgotten or job.phase in TERMINAL_PHASES,
        "forgotten": forgotten,
        "created_at": clock.wall(job.created_at),
        "age": clock.ago(job.created_at),
        "round": job.round,
        "rounds_completed": job.rounds_completed,
        "restart_count": job.restart_count,
        "max_restarts": s.max_restarts,
        "settings": {"min_nodes": s.min_nodes, "max_nodes": s.max_nodes},
        "nodes": len(job.members),
        "spares": len(job.spares),
        "world_size": _world_size(job),
    }


def _world_size(job: Job) -> int | None:
    if job.phase is not JobPhase.RUNNING:
        return None
    return sum(job.members[nid].nproc for nid in job.order if nid in job.members)


def find_job(machine: Rendezvous, job_id: str, *, mono_now: float, wall_now: float) -> dict[str, Any] | None:
    """``GET /v1/jobs/{id}``: the active job of that id, else the newest forgotten one, else None."""
    clock = Clock(mono_now, wall_now)
    job = machine.jobs.get(job_id)
    if job is not None:
        return job_view(machine, job, clock, forgotten=False)
    for old in reversed(machine.finished_jobs):
        if old.id == job_id:
            return job_view(machine, old, clock, forgotten=True)
    return None


def job_view(machine: Rendezvous, job: Job, clock: Clock, *, forgotten: bool) -> dict[str, Any]:
    s = job.settings
    history = list(job.history)
    present = {**job.members, **job.spares}
    in_round = [job.members[nid] for nid in job.order if nid in job.members]
    master = job.members.get(job.order[0]) if job.order else None  # rank 0 of the last round
    running = job.phase is JobPhase.RUNNING
    ranks: dict[str, tuple[int, int]] = {}  # node id -> (group rank, first global rank)
    offset = 0
    for group_rank, nid in enumerate(job.order):
        if nid in job.members:
            ranks[nid] = (group_rank, offset)
            offset += job.members[nid].nproc
    return {
        "id": job.id,
        # Opaque and stable across requests: tells this job from an older one of the same id.
        "instance": f"{job.id}@{job.created_at:.6f}",
        "phase": job.phase.value,
        "finished": forgotten or job.phase in TERMINAL_PHASES,
        "forgotten": forgotten,
        "outcome": job.outcome,
        "created_at": clock.wall(job.created_at),
        "age": clock.ago(job.created_at),
        "round": job.round,
        "rounds_completed": job.rounds_completed,
        "restart_count": job.restart_count,
        "max_restarts": s.max_restarts,
        "settings": s.to_dict(),
        "nodes": len(job.members),
        "spares": len(job.spares),
        "world_size": sum(m.nproc for m in in_round) if running else None,
        "master": (
            {"addr": master.addr, "port": master.master_port} if master is not None and running else None
        ),
        "members": [
            *(_member_view(machine, m, "member", ranks.get(m.node_id), clock) for m in _in_order(job)),
            *(_member_view(machine, m, "spare", None, clock) for m in job.spares.values()),
            *_departed(job, history, present, clock),
        ],
        "excluded": [{"node_id": nid, "reason": why} for nid, why in job.excluded.items()],
        "failures": _failures(job, history),
        "rounds": _rounds(job, history, clock),
        "history": [_event_view(e, clock) for e in history],
    }


def _event_view(e: JobEvent, clock: Clock) -> dict[str, Any]:
    return {
        "time": clock.wall(e.time),
        "ago": clock.ago(e.time),
        "kind": e.kind.value,
        "text": e.text,
        "node": e.node or None,
        "addr": e.addr or None,
        "nproc": e.nproc,
        "round": e.round,
        "departure": None if e.departure is None else e.departure.value,
        "spare": e.spare,
    }


def _in_order(job: Job) -> Iterable[Member]:
    """The last round's members by group rank, then newcomers in arrival order."""
    seen = set()
    for nid in job.order:
        if nid in job.members:
            seen.add(nid)
            yield job.members[nid]
    yield from sorted((m for nid, m in job.members.items() if nid not in seen), key=lambda m: m.seq)


def _member_view(
    machine: Rendezvous, m: Member, role: str, ranks: tuple[int, int] | None, clock: Clock
) -> dict[str, Any]:
    conn = machine.conns.get(m.conn)
    group_rank, rank_offset = ranks if ranks is not None else (None, None)
    return {
        "node_id": m.node_id,
        "role": role,
        "state": m.state.value,
        "addr": m.addr,
        "nproc": m.nproc,
        "master_port": m.master_port,
        "group_rank": group_rank,
        "rank_offset": rank_offset,
        "failures": m.failures,
        "joined_at": clock.wall(m.joined_at),
        "last_heartbeat_at": clock.wall(conn.last_seen) if conn is not None else None,
        "last_heartbeat_ago": clock.ago(conn.last_seen) if conn is not None else None,
        "peer": conn.peer if conn is not None else None,
        "reason": "",
    }


def _departed(
    job: Job, history: list[JobEvent], present: dict[str, Member], clock: Clock
) -> list[dict[str, Any]]:
    joined: dict[str, tuple[str, int | None]] = {}
    for e in history:
        if e.kind is K.JOINED and e.node:
            joined[e.node] = (e.addr, e.nproc)
    candidates = dict.fromkeys([*job.order, *job.excluded, *joined])
    position = {nid: i for i, nid in enumerate(job.order)}
    out = []
    for nid in candidates:
        if nid in present:
            continue
        event = _why_gone(nid, history)
        if nid in job.excluded:
            state, reason = "excluded", job.excluded[nid]
        elif event is not None:
            state, reason = event.kind.value, event.text
        else:  # gone after the job ended: the machine notes nothing then
            state, reason = "gone", ""
        addr, nproc = joined.get(nid, ("", None))
        out.append(
            {
                "node_id": nid,
                "role": "departed",
                "state": state,
                "addr": addr,
                "nproc": nproc,
                "master_port": None,
                "group_rank": position.get(nid),
                "rank_offset": None,
                "failures": sum(1 for f in job.failures if f.node_id == nid),
                "joined_at": None,
                "last_heartbeat_at": None,
                "last_heartbeat_ago": None,
                "peer": None,
                "reason": reason,
                "departed_at": clock.wall(event.time) if event is not None else None,
            }
        )
    return out


def _why_gone(nid: str, history: list[JobEvent]) -> JobEvent | None:
    for e in reversed(history):
        if e.node != nid:
            continue
        if e.kind in _DEPARTURES:
            return e
        if e.kind is K.JOINED:
            return None  # it came back after that
    return None


def failure_numbers(job: Job) -> list[int]:
    """Each kept failure's number in the job (1: its first), as ``Job.add_failure`` keeps them:
    the first one, then the last ones of ``failures_total``."""
    n, total = len(job.failures), job.failures_total
    if total <= n:
        return list(range(1, n + 1))
    return [1, *range(total - n + 2, total + 1)][:n]


def _failures(job: Job, history: list[JobEvent]) -> list[dict[str, Any]]:
    """Each recorded failure is the root cause of its round: the server keeps one per round."""
    rounds = {e.failure_no: e.round for e in history if e.failure_no and e.kind in (K.FAILURE, K.FAILED)}
    out = []
    for i, (f, number) in enumerate(zip(job.failures, failure_numbers(job), strict=True)):
        text = describe_failure(f)
        rnd = rounds.get(number)
        if rnd is None and i == len(job.failures) - 1 and job.phase is JobPhase.FAILED:
            rnd = job.round  # the failure that ended the job: nothing ran after it
        out.append(
            {
                "round": rnd,
                **asdict(f),
                "description": text,
            }
        )
    return out


def _rounds(job: Job, history: list[JobEvent], clock: Clock) -> list[dict[str, Any]]:
    """The rounds timeline: when each round's assignment went out and what ended it.

    A round runs from its ``round`` event to the first event after it that ends a round; the
    last round of a running job is still running, whatever happened since (a newcomer that
    left before it was admitted does not stop a round).
    """
    out: list[dict[str, Any]] = []
    gathering_since = job.created_at
    current: dict[str, Any] | None = None
    for e in history:
        if e.kind is K.ROUND:
            current = {
                "round": e.round,
                "gathering_since": clock.wall(gathering_since),
                "started_at": clock.wall(e.time),
                "ended_at": None,
                "ended_by": None,
                "end_reason": "",
                "summary": e.text,
            }
            out.append(current)
        elif current is not None and current["ended_by"] is None and _ends_round(e):
            current.update(ended_at=clock.wall(e.time), ended_by=e.kind.value, end_reason=e.text)
            gathering_since = e.time
    if out and job.phase is JobPhase.RUNNING:
        out[-1].update(ended_at=None, ended_by=None, end_reason="")
    return out


def _ends_round(e: JobEvent) -> bool:
    # A spare that leaves does not disturb the round.
    return e.kind in _ROUND_ENDERS and not (e.kind in _DEPARTURES and e.spare)
