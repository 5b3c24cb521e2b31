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

Training (issue 19). A job shows its ``progress`` (the round's highest and lowest step, the
job's best step, steps/s, the oldest last-progress age and its phase), each member its own
(step, lag behind the fastest node, phase, age with a verdict, step-time percentiles, its
slowest rank's straggler score), the job's ``stragglers`` and its latest ``hang`` report (the
stacks every node sent, merged by ``protocol.hang_report``). All of it is volatile machine
state (``machine/progress.py``): empty after a server restart until the agents' next Progress.

Goodput (issue 47). A job shows where its wall time went (``goodput``: training, start-up,
rendezvous, checkpoints, and per cause of a restart its count, cost and steps lost), the one
line ``rdzv-server status`` and the agents print, and the chart's (time, step) series, from
``machine/goodput.py``: logged figures survive a server restart, volatile ones (checkpoint
time, the series) start again then (``volatile_since``); unknown ones are ``None``.

Facts come from the history events' typed fields (``machine/history.py``: a round's number, a departed
node's address, which failure an event reports), never from their sentences, which are for
people. An event older than its field (restored from a version 1 snapshot) has the field
empty, and the fact it would give shows as ``None``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict
from functools import lru_cache
from itertools import islice
from typing import Any

from protocol import Stacks
from protocol.failure_text import describe_failure
from protocol.hang_report import merge

from .machine import goodput
from .machine.history import EventKind, JobEvent
from .machine.progress import HangState, NodeProgress, RankScore, stack_entries, straggler_scores
from .machine.state import SOFTWARE, ConnPhase, Job, JobPhase, Member, Rendezvous

K = EventKind
# The kinds of history events that end a running round (the first one after it starts).
_ROUND_ENDERS = frozenset({K.FAILURE, K.LOST, K.LEFT, K.ADMIT, K.EXCLUDED, K.FINISHED, K.FAILED, K.FORGOTTEN})
# The kinds that say why a node is gone.
_DEPARTURES = frozenset({K.LOST, K.LEFT, K.EXCLUDED})
TERMINAL_PHASES = frozenset({JobPhase.FINISHED, JobPhase.FAILED, JobPhase.ABANDONED})

JOBS_LISTED = 200  # jobs in one GET /v1/jobs (active first); each job's detail is per id
STRAGGLERS_SHOWN = 64  # flagged ranks listed in a job's detail, slowest first (all are counted)
# A hang report's bounds: groups listed (the rest counted), ranks named per group, frames per
# group and characters per frame. With the machine's own caps (HANG_TEXT_KEPT characters of
# stacks), a job's hang report is at most about 32 x 2 KiB of stacks and frames.
HANG_GROUPS_SHOWN = 32
HANG_GROUP_RANKS_SHOWN = 256
HANG_FRAMES_KEPT = 30
HANG_FRAME_LEN = 300

# A node's last-progress age gets a verdict (the dashboard's colour, the table's mark):
# "ok" up to AGE_LATE_STEPS x its p90 step time, "late" past that, "stalled" past
# max(AGE_STALLED_STEPS x p90, AGE_STALLED_MIN_S): about where the agent's default hang
# policy (5x the largest step interval, at least 120 s) would soon call it hung. Each bound
# has AGE_SLACK_S added, because Progress rides the heartbeats (about 1 s apart), so the age
# the server knows grows by up to an interval between two of them. Before the node has a
# p90 (no step interval yet: the first step may take many minutes) it is "ok" up to
# AGE_STALLED_MIN_S and "late" after, never "stalled"; a node with no step yet is "none".
AGE_SLACK_S = 2.0
AGE_LATE_STEPS = 2.0
AGE_STALLED_STEPS = 5.0
AGE_STALLED_MIN_S = 60.0


def to_json(view: Any) -> str:
    """A view as JSON text. JSON has no NaN or Infinity: a browser's ``JSON.parse`` refuses the
    whole body (the dashboard then shows no job at all), so should a non-finite number get
    past the bounds at its source, it is written as null, never as ``Infinity``."""
    try:
        return json.dumps(view, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(view), allow_nan=False)


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float, however deep, as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


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
        # O(1) per job: the highest step ever reported, and the round of the latest hang.
        "step": _step(job.progress.max_step),
        "hang_round": _step(job.hang_round),
        "snapshot": _snapshot_view(job, clock),
        "goodput": goodput_summary(job, clock),
    }


def _step(step: int) -> int | None:
    return step if step >= 0 else None


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
    scores = straggler_scores(job.progress, s.straggler_threshold)  # once: O(world size log)
    worst: dict[str, RankScore] = {}  # node id -> its slowest scored rank
    for sc in scores:
        if sc.node not in worst or sc.score < worst[sc.node].score:
            worst[sc.node] = sc
    training = _Training(job, clock, worst)
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
            *(
                _member_view(machine, m, "member", ranks.get(m.node_id), clock, training)
                for m in _in_order(job)
            ),
            *(_member_view(machine, m, "spare", None, clock, None) for m in job.spares.values()),
            *_departed(job, history, present, clock),
        ],
        "excluded": [{"node_id": nid, "reason": why} for nid, why in job.excluded.items()],
        "failures": _failures(job, history),
        "rounds": _rounds(job, history, clock),
        "history": [_event_view(e, clock) for e in history],
        "fail_code": job.fail_code or None,
        "progress": _job_progress(job, clock),
        "crash_loop": {
            "restarts_without_progress": job.stuck_restarts,
            "limit": s.crash_loop_restarts,
            "best_step": _step(job.best_step),
        },
        "stragglers": _stragglers(job, scores),
        "hang": _hang_view(job, clock),
        "commit": _commit_view(job, clock),
        "snapshot": _snapshot_view(job, clock),
        "goodput": goodput_view(job, clock),
    }


def goodput_summary(job: Job, clock: Clock) -> dict[str, Any]:
    """A job's goodput in ``GET /v1/jobs``: the share, the wall time and the line (O(1))."""
    f = goodput.figures(job, clock.mono_now)
    return {"goodput": f["goodput"], "wall_s": f["wall_s"], "text": goodput.sentence(f)}


def goodput_view(job: Job, clock: Clock) -> dict[str, Any]:
    """Where the job's wall time went (``machine/goodput.py``), its line, and the chart's
    (wall time, step) points."""
    f = goodput.figures(job, clock.mono_now)
    g = job.goodput
    return {
        **f,
        "text": goodput.sentence(f),
        "since": clock.wall(job.created_at if g.known_from is None else g.known_from),
        "volatile_since": None if g.volatile_since is None else clock.wall(g.volatile_since),
        "series": [[clock.wall(t), step] for t, step in goodput.series(job)],
    }


def _snapshot_view(job: Job, clock: Clock) -> dict[str, Any] | None:
    """The newest in-memory snapshot step every rank of the running round has (issue 35),
    since when, and the step every agent keeps (two copies of every rank); None: none."""
    if job.phase is not JobPhase.RUNNING or job.snapshot_step < 0:
        return None
    return {
        "step": job.snapshot_step,
        "age_s": round(clock.mono_now - job.snapshot_since, 3),
        "kept_step": _step(job.kept_step),
    }


def _commit_view(job: Job, clock: Clock) -> dict[str, Any] | None:
    c = job.commit
    if c is None:
        return None
    return {
        "round": c.round,
        "step": c.step,
        "reason": c.reason,
        "state": "waiting" if c.pending else "stopping" if c.go else "arming",
        "arms": c.arms,
        "nodes": len(job.order),
        "armed": len(c.armed),
        "committed": len(c.committed),
        "drains": list(c.drains),
        "deadline_in_s": round(c.deadline - clock.mono_now, 3),
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
        "ranks": list(e.ranks),
        "step": e.step,
        "phase": e.phase,
        "silent_s": e.silent_s,
        "scores": [round(x, 3) for x in e.scores],
        "restarts": e.restarts,
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
    machine: Rendezvous,
    m: Member,
    role: str,
    ranks: tuple[int, int] | None,
    clock: Clock,
    training: _Training | None,
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
        "progress": training.node(m.node_id) if training is not None else None,
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
                "progress": None,
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


# --- training: progress, stragglers, hangs -------------------------------------------------


def _ms(value: float) -> float | None:
    return round(value, 3) if value > 0 else None


def age_state(age_s: float, p90_ms: float, step: int) -> str:
    """The verdict on a node's last-progress age: none, ok, late or stalled (AGE_* above)."""
    if step < 0:
        return "none"
    p90 = p90_ms / 1000.0
    if p90 <= 0:
        return "ok" if age_s <= AGE_STALLED_MIN_S + AGE_SLACK_S else "late"
    if age_s <= AGE_LATE_STEPS * p90 + AGE_SLACK_S:
        return "ok"
    if age_s <= max(AGE_STALLED_STEPS * p90, AGE_STALLED_MIN_S) + AGE_SLACK_S:
        return "late"
    return "stalled"


class _Training:
    """A job's per-node training views, from one reading of its progress and scores."""

    def __init__(self, job: Job, clock: Clock, worst: dict[str, RankScore]) -> None:
        self.progress = job.progress
        self.fastest = job.progress.fastest()
        self.clock = clock
        self.worst = worst
        self.flagged = job.progress.flagged

    def node(self, node_id: str) -> dict[str, Any] | None:
        n: NodeProgress | None = self.progress.nodes.get(node_id)
        if n is None:
            return None
        age = n.age_s(self.clock.mono_now)
        worst = self.worst.get(node_id)
        return {
            "round": n.round,
            "step": _step(n.max_step),
            "min_step": _step(n.min_step),
            "lag": max(0, self.fastest - n.max_step) if n.max_step >= 0 else None,
            "phase": n.phase,
            "age_s": round(age, 3),
            "age_state": age_state(age, n.step_p90_ms, n.max_step),
            "step_p50_ms": _ms(n.step_p50_ms),
            "step_p90_ms": _ms(n.step_p90_ms),
            "straggler": (
                None
                if worst is None
                else {
                    "rank": worst.rank,
                    "local_rank": worst.local_rank,
                    "compute_ms": round(worst.compute_ms, 3),
                    "score": round(worst.score, 3),
                    "flagged": worst.flagged,
                }
            ),
        }


def _job_progress(job: Job, clock: Clock) -> dict[str, Any] | None:
    p = job.progress
    if p.max_step < 0 and not p.nodes:
        return None
    oldest = p.oldest(clock.mono_now)
    return {
        "round": p.round if p.nodes else None,
        "step": _step(p.fastest()),
        "min_step": _step(p.min_step()),
        "best_step": _step(p.max_step),
        "steps_per_s": round(p.steps_per_s, 3) if p.steps_per_s > 0 else None,
        "last_progress_age_s": round(oldest.age_s(clock.mono_now), 3) if oldest is not None else None,
        "phase": oldest.phase if oldest is not None else "",
        "nodes_reporting": len(p.nodes),
    }


def _score_view(sc: RankScore) -> dict[str, Any]:
    return {
        "rank": sc.rank,
        "node_id": sc.node,
        "local_rank": sc.local_rank,
        "compute_ms": round(sc.compute_ms, 3),
        "score": round(sc.score, 3),
    }


def _stragglers(job: Job, scores: list[RankScore]) -> dict[str, Any]:
    flagged = sorted((sc for sc in scores if sc.flagged), key=lambda sc: (sc.score, sc.rank))
    return {
        "threshold": job.settings.straggler_threshold,
        "exclude": job.settings.exclude_stragglers,
        "scored": len(scores),
        "flagged_total": len(flagged),
        "flagged": [_score_view(sc) for sc in flagged[:STRAGGLERS_SHOWN]],
    }


def _hang_view(job: Job, clock: Clock) -> dict[str, Any] | None:
    h: HangState | None = job.hang
    if h is None:
        return None
    return {
        "round": h.round,
        "node_id": h.node,
        "addr": h.addr,
        "ranks": list(h.ranks),
        "step": _step(h.step),
        "phase": h.phase,
        "silent_s": round(h.silent_s, 3),
        "detected_at": clock.wall(h.detected_at),
        "ago": clock.ago(h.detected_at),
        "reason": h.reason,
        "nodes_reported": len(h.stacks),
        "nodes_dropped": h.nodes_dropped,
        "report": hang_report_view(h),
    }


def hang_report_view(h: HangState) -> dict[str, Any] | None:
    """The nodes' stacks merged; None before any arrived. Cached on what it is made of (the
    kept Stacks messages and the hung ranks), so a dashboard polling every second does not
    parse up to HANG_TEXT_KEPT characters of stacks each time."""
    if not h.stacks:
        return None
    return _merged(tuple(h.stacks.values()), tuple(h.ranks))


@lru_cache(maxsize=8)
def _merged(stacks: tuple[Stacks, ...], hung: tuple[int, ...]) -> dict[str, Any]:
    # The one merge (protocol/hang_report.py) the agents' own reports use too.
    entries = stack_entries(stacks)
    text_of = {e[0]: e[4] for e in entries}
    report = merge(entries, hung=hung)
    out = []
    for g in report.groups[:HANG_GROUPS_SHOWN]:
        out.append(
            {
                "ranks": list(g.ranks[:HANG_GROUP_RANKS_SHOWN]),
                "ranks_total": len(g.ranks),
                "odd": g.odd,
                "frames": [f[:HANG_FRAME_LEN] for f in g.frames[:HANG_FRAMES_KEPT]]
                or [g.opaque[:HANG_FRAME_LEN]],
                "stack": text_of.get(g.ranks[0], "") if g.ranks else "",
            }
        )
    return {
        # No stacks to tell them apart (yet): the ranks found hung are the suspects.
        "suspects": ([e.rank for e in report.suspects] or list(hung))[:HANG_GROUP_RANKS_SHOWN],
        "groups": out,
        "groups_total": len(report.groups) + report.dropped_groups,
    }
