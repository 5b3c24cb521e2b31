"""A job's goodput (issue 47): how much of its wall time made training progress, and what each
restart cost. Pure: the rules call in at the moments that matter, with the time; the figures are
read from the ledger and a time.

Wall time, from the job's creation to its end (or now), is split into:

- ``rendezvous``: the first round gathering (creation to the first round's assignments);
- ``startup``: from the first round's assignments to the first step any rank reported (every
  round before the job's first step counts here, failed attempts too);
- ``training``: from a round's first step to its stop (or the job's end), less the two below;
- ``finishing``: from the end of the training (the last round's first node whose workers all
  exited 0, back to its most recent step: ``WorkersSucceeded.idle_ms``) to the job's end: the
  process groups' teardown, the interpreters' exit and the exit barrier;
- per cause of a stop (``CAUSES``), the time from the stop to the next round's first step (the
  re-rendezvous, ``regather_s``, and the workers' restart), and the time spent doing the steps
  lost by it again (steps lost x the step time);
- ``checkpoint``: the time the ranks spent in a "checkpoint" or "snapshot" phase
  (``worker.phase``), sampled from the nodes' Progress (their least recent rank's phase).

Goodput = training / wall. A job that never reported a step has no training figure: what the
server knows without progress is shown instead (rounds, restarts by cause, the time to
re-rendezvous), and the time its rounds ran (``ran_s``), never a guess of its split.

When. ``formed`` (a round's assignments went out), ``stopped`` (``_regather``: the running round
stops, for the cause the job's history gives since the round formed: ``stop_cause``),
``finishing`` (the running round's first node whose workers all exited 0),
``ended`` (finished, failed or abandoned), and, from Progress, ``first_step`` (the first step of
a formed round) and ``sample`` (the volatile figures). A hang's stop counts from the hung
rank's last progress (the HANG event's time less its silence), not from the verdict.

Logged and volatile. Everything in the :class:`Ledger`'s logged part is a function of the state
log's inputs: the rules that call in run again on replay, and the one figure taken from
Progress (a round's first step: when, the step, the previous round's highest step and the step
time) is logged as a fact of that Progress (``first_step``, in ``training_rules.py``), so replay
takes it from there. The state image keeps the logged part (``dump``/``load``; an image
without it is adopted: the figures start at its last event, ``unknown_s`` before). Volatile
(lost with a server restart, and said so: ``volatile_since``): the checkpoint time, the
highest step and median step time of the last round that trained (read from the nodes'
summaries as it stops; unknown if none came since a restart) and the chart's series.

Bounds: a ledger is O(1): a few numbers per cause (at most ``len(CAUSES)``) and the series, at
most ``SERIES_MAX`` (time, step) points, halved (every other point kept, the spacing doubled)
when full, so it covers the whole job at a resolution that falls as the job grows. Every
Progress costs a few comparisons here (``sample``); a stop, O(nodes) once.
"""

from __future__ import annotations

import enum
import math
from dataclasses import field
from typing import TYPE_CHECKING, Any

from protocol.records import record

from .history import EventKind
from .progress import MAX_STEP

if TYPE_CHECKING:
    from protocol import Progress

    from .jobs import Job
    from .progress import NodeProgress

# Why a running round stopped, most telling first (a round's history may name several: a worker
# failure that also excluded its node is a worker crash). Unplanned ones are failures.
CAUSES = ("hang", "worker_crash", "node_lost", "server", "drain", "scale_up", "commit", "unknown")
FAILURE_CAUSES = frozenset({"hang", "worker_crash", "node_lost", "server", "unknown"})
CAUSE_WORDS = {
    "hang": "hang",
    "worker_crash": "worker crash",
    "node_lost": "node lost",
    "server": "server restart",
    "drain": "drain",
    "scale_up": "scale-up",
    "commit": "commit point",
    "unknown": "unknown cause",
}
CHECKPOINT_PHASES = frozenset({"checkpoint", "snapshot"})
SERIES_MAX = 512  # (time, step) points a job keeps for the chart
SERIES_EVERY = 1.0  # seconds between two points at first (doubled each time the series halves)
SENTENCE_LEN = 512  # characters of the one-line summary (JobDone/JobFailed.summary's bound)

K = EventKind


class Stage(str, enum.Enum):
    RENDEZVOUS = "rendezvous"  # the first round gathers
    STARTUP = "startup"  # a round formed, and the job never reported a step yet
    TRAINING = "training"  # the running round reported a step
    DOWN = "down"  # a round stopped (``cause``): until the next round's first step
    FINISHING = "finishing"  # a node's workers finished: the job ends once every node's have
    ENDED = "ended"


# An enum member read from its class costs some 350 ns on CPython 3.11: the per-Progress path
# reads these instead.
_STARTUP, _DOWN, _TRAINING = Stage.STARTUP, Stage.DOWN, Stage.TRAINING


@record(slots=True)
class CauseCost:
    """What the stops of one cause cost (seconds on the server's clock)."""

    count: int = 0
    down_s: float = 0.0  # stop to the next round's first step (or to its assignments, no progress)
    regather_s: float = 0.0  # stop to the next round's assignments
    steps_lost: int = 0  # steps done again after its stops (known ones)
    rerun_s: float = 0.0  # their time, at the step time of the round that lost them
    lost_unknown: int = 0  # stops whose steps lost are unknown (e.g. none reported since a server restart)

    def dump(self) -> list[Any]:
        return [self.count, self.down_s, self.regather_s, self.steps_lost, self.rerun_s, self.lost_unknown]

    @classmethod
    def load(cls, d: list[Any]) -> CauseCost:
        count, down, regather, lost, rerun, unknown = d
        return cls(int(count), float(down), float(regather), int(lost), float(rerun), int(unknown))


@record(slots=True)
class Ledger:
    """A job's running account. The first group is logged (the state image keeps it); the
    second is volatile."""

    stage: Stage = Stage.RENDEZVOUS
    since: float | None = None  # when ``stage`` began (None: the job's creation)
    cause: str = ""  # DOWN: what stopped the last round
    lost_cause: str = ""  # what stopped the last round that had stepped (its steps are the ones lost)
    stop_at: float = 0.0  # the last stop, for its re-rendezvous time
    regathered: bool = True  # that re-rendezvous is counted (the next round formed)
    stepped: bool = False  # the job reported a step, ever
    rendezvous_s: float = 0.0
    startup_s: float = 0.0
    training_s: float = 0.0  # first steps to stops, before the lost steps' and checkpoints' time
    finishing_s: float = 0.0  # a round's last step to its end (the job finished, or it stopped)
    causes: dict[str, CauseCost] = field(default_factory=dict)
    ended_at: float | None = None
    known_from: float | None = None  # None: from the job's creation (else adopted at that time)
    # -- volatile ------------------------------------------------------------------------------
    committing: bool = field(default=False, compare=False)  # set by the commit rules for one stop
    checkpoint_s: float = field(default=0.0, compare=False)
    # The last round that trained, as it stopped: its highest step and median step time.
    round_best: int = field(default=-1, compare=False)
    step_ms: float = field(default=0.0, compare=False)
    # The highest step a failure report of the running round carried (WorkersFailed.step: the
    # agent reads its pages once more as the workers exit, so it is exact where the nodes'
    # once-a-second summaries may be a step behind); -1: none. (round, step).
    failed_step: tuple[int, int] = field(default=(-1, -1), compare=False)
    volatile_since: float | None = field(default=None, compare=False)  # None: the job's creation
    series_t: list[float] = field(default_factory=list, compare=False)
    series_s: list[int] = field(default_factory=list, compare=False)
    series_every: float = field(default=SERIES_EVERY, compare=False)
    series_next: float = field(default=0.0, compare=False)  # no point before this time

    def cost(self, cause: str) -> CauseCost:
        c = self.causes.get(cause)
        if c is None:
            c = self.causes[cause] = CauseCost()
        return c


# --- the moments the rules call in at ---------------------------------------------------


def _since(job: Job) -> float:
    s = job.goodput.since
    return job.created_at if s is None else s


def formed(job: Job, now: float) -> None:
    """A round's assignments went out (or a round was rebuilt from its agents)."""
    g = job.goodput
    if g.stage is Stage.RENDEZVOUS:
        g.rendezvous_s += max(0.0, now - _since(job))
        g.stage, g.since = Stage.STARTUP, now
    elif g.stage is Stage.DOWN:
        c = g.cost(g.cause)
        if not g.regathered:
            c.regather_s += max(0.0, now - g.stop_at)
            g.regathered = True
        if not g.stepped:  # no progress to wait for: the round's time is the start-up's
            c.down_s += max(0.0, now - _since(job))
            g.stage, g.since = Stage.STARTUP, now


def stopped(job: Job, now: float) -> None:
    """The running round stops (``_regather``): every member restarts its workers."""
    g = job.goodput
    if g.stage is Stage.ENDED:
        return
    cause, onset = stop_cause(job, now)
    g.committing = False
    since = _since(job)
    if g.stage is Stage.TRAINING:
        onset = min(now, max(since, onset))
        g.training_s += onset - since
        g.lost_cause = cause
        _last_trained(job)
    elif g.stage is Stage.FINISHING:  # some nodes had finished: the others' stop restarts it
        onset = now
        g.finishing_s += max(0.0, now - since)
        g.lost_cause = cause
        _last_trained(job)
    else:
        onset = now
        _close(job, now)
    g.cost(cause).count += 1
    g.stage, g.cause, g.since, g.stop_at, g.regathered = Stage.DOWN, cause, onset, now, False


def finishing(job: Job, now: float, idle_s: float) -> None:
    """A node of the running round reports that its workers all exited 0, its most recent
    step ``idle_s`` before: the training ended there (the first such node's report; every
    node's last step is the same one, the others report as their teardown ends)."""
    g = job.goodput
    if g.stage is not Stage.TRAINING:
        return
    since = _since(job)
    end = min(now, max(since, now - idle_s))
    g.training_s += end - since
    g.stage, g.since = Stage.FINISHING, end


def ended(job: Job, now: float) -> None:
    """The job is over (finished, failed, or every node left)."""
    g = job.goodput
    if g.stage is Stage.ENDED:
        return
    if g.stage is Stage.TRAINING:
        g.training_s += max(0.0, now - _since(job))
    else:
        _close(job, now)
    g.stage, g.since, g.ended_at = Stage.ENDED, now, now


def _close(job: Job, now: float) -> None:
    """Count the open stage (not TRAINING) up to ``now``."""
    g = job.goodput
    open_s = max(0.0, now - _since(job))
    if g.stage is Stage.RENDEZVOUS:
        g.rendezvous_s += open_s
    elif g.stage is Stage.STARTUP:
        g.startup_s += open_s
    elif g.stage is Stage.FINISHING:
        g.finishing_s += open_s
    elif g.stage is Stage.DOWN:
        c = g.cost(g.cause)
        c.down_s += open_s
        if not g.regathered:
            c.regather_s += max(0.0, now - g.stop_at)
            g.regathered = True


def first_step(job: Job, now: float, first: int, reached: int, step_ms: float) -> None:
    """The running round's first step: ``first`` (the step its first summary reported), the
    highest step of the round that stopped before (``reached``; -1: unknown) and the step time
    then (ms; 0: unknown). Live these come from Progress; replaying, from the logged fact."""
    g = job.goodput
    since = _since(job)
    if g.stage is Stage.STARTUP:
        g.startup_s += max(0.0, now - since)
    elif g.stage is Stage.DOWN:
        g.cost(g.cause).down_s += max(0.0, now - since)
        if g.stepped and g.lost_cause:
            lost_to = g.cost(g.lost_cause)
            # The round resumes from its restore step (issue 35), else from the step before the
            # first one it reported (a checkpoint of the script's own, or none: from step 0).
            resumed = job.restore_step if job.restore_step >= 0 else first - 1
            if reached < 0:
                lost_to.lost_unknown += 1
            else:
                lost = max(0, reached - resumed)
                lost_to.steps_lost = min(MAX_STEP, lost_to.steps_lost + lost)
                if step_ms > 0:  # (else their time is not known: training keeps it)
                    lost_to.rerun_s += lost * step_ms / 1000.0
            g.lost_cause = ""
    else:
        return
    g.stage, g.since, g.stepped = Stage.TRAINING, now, True
    _add_point(g, now, first)


def sample(job: Job, before: NodeProgress | None, msg: Progress, now: float) -> int | None:
    """A Progress of the running round, O(1) and a few comparisons (every node sends one a
    second): the checkpoint time and the chart's series (volatile). Returns the highest step of
    the last round that trained (-1: unknown) when it is the round's first step (the rules then
    call ``first_step``), else None. ``before``: the node's previous summary of the round, if
    any, read before it is replaced (its phase since then: a checkpoint's time)."""
    g = job.goodput
    if before is not None and before.phase in CHECKPOINT_PHASES:
        _checkpoint(job, before, msg, now)
    stage = g.stage
    if stage is _TRAINING:
        if now >= g.series_next and msg.max_step >= 0:
            _add_point(g, now, min(msg.max_step, MAX_STEP))
        return None
    if (stage is _STARTUP or stage is _DOWN) and msg.max_step >= 0:
        return g.round_best
    return None


def _last_trained(job: Job) -> None:
    """As a round that trained stops: its highest step and its median step time, from the
    nodes' summaries (volatile, O(nodes) once a stop), for the steps it lost and their time
    when the next round's first step comes."""
    g, p = job.goodput, job.progress
    failed = g.failed_step[1] if g.failed_step[0] == job.round else -1
    if p.round != job.round or not p.nodes:
        # (e.g. none since the server restarted): unknown but for a failure report's step
        g.round_best, g.step_ms = min(failed, MAX_STEP), 0.0
        return
    g.round_best = min(max(p.fastest(), failed), MAX_STEP)
    times = sorted(n.step_p50_ms for n in p.nodes.values() if n.step_p50_ms > 0)
    g.step_ms = times[len(times) // 2] if times else 0.0


def failure_reported(job: Job, step: int) -> None:
    """A node of the running round reported its workers' failure at ``step`` (its highest)."""
    g = job.goodput
    best = g.failed_step[1] if g.failed_step[0] == job.round else -1
    g.failed_step = (job.round, max(best, step))


def _checkpoint(job: Job, before: NodeProgress, msg: Progress, now: float) -> None:
    """The node's least recent rank was in a checkpoint phase from its previous summary to this
    one: each node counts for 1/nodes of that time (only while the round trains)."""
    g = job.goodput
    if before.round == msg.round and g.stage is _TRAINING:
        dt = now - max(before.received_at, _since(job))
        if dt > 0:
            g.checkpoint_s += dt / max(1, len(job.order))


def _add_point(g: Ledger, now: float, step: int) -> None:
    """A point of the chart: at most one per ``series_every`` seconds (the round's first step
    always), the series halved when full."""
    ts, ss = g.series_t, g.series_s
    if len(ts) >= SERIES_MAX:
        del ts[1::2], ss[1::2]  # the first and every other point stay
        g.series_every *= 2
    ts.append(now)
    ss.append(step)
    g.series_next = now + g.series_every


def restarted(job: Job, now: float) -> None:
    """The server restarted (``Restarted``): the volatile figures start again now."""
    job.goodput.volatile_since = now


def stop_cause(job: Job, now: float) -> tuple[str, float]:
    """Why the running round stops, from the job's history since the round formed (its ROUND
    event; at most the history's length back), and since when its ranks stopped training (a
    hang: the hung rank's last progress; else ``now``). A stop the commit rules carry out at a
    commit point is ``commit`` (``Ledger.committing``)."""
    if job.goodput.committing:
        return "commit", now
    best = len(CAUSES) - 1
    onset = now
    order = set(job.order)
    for e in reversed(job.history):
        kind = e.kind
        if kind is K.ROUND:
            break
        if kind is K.HANG and e.round == job.round and e.silent_s is not None:
            onset = min(onset, e.time - e.silent_s)
            continue
        if kind is K.FAILURE:
            cause = "hang" if job.hang_round == job.round else "worker_crash"
        elif kind in (K.LOST, K.EXCLUDED) and not e.spare and e.node in order:
            cause = "node_lost"
        elif (kind is K.LEFT and not e.spare and e.node in order) or kind is K.DRAIN:
            cause = "drain"
        elif kind is K.ADMIT:
            cause = "scale_up"
        elif kind is K.RESTART:
            cause = "server"
        else:
            continue
        best = min(best, CAUSES.index(cause))
    cause = CAUSES[best]
    return cause, onset if cause == "hang" else now


# --- the state image --------------------------------------------------------------------


def dump(g: Ledger) -> dict[str, Any]:
    """The logged part, as plain data (``state_image.py``)."""
    return {
        "stage": g.stage.value,
        "since": g.since,
        "cause": g.cause,
        "lost_cause": g.lost_cause,
        "stop_at": g.stop_at,
        "regathered": g.regathered,
        "stepped": g.stepped,
        "rendezvous_s": g.rendezvous_s,
        "startup_s": g.startup_s,
        "training_s": g.training_s,
        "finishing_s": g.finishing_s,
        "causes": {name: c.dump() for name, c in g.causes.items()},
        "ended_at": g.ended_at,
        "known_from": g.known_from,
    }


def load(d: dict[str, Any]) -> Ledger:
    """``dump``'s output back (ValueError, KeyError, TypeError if it is not that); the
    volatile figures start again (``volatile_since`` is set by the server's ``Restarted``)."""

    def opt(v: Any) -> float | None:
        return None if v is None else float(v)

    causes = {}
    for name, c in d["causes"].items():
        if name not in CAUSE_WORDS:
            raise ValueError(f"unknown goodput cause {name!r}")
        causes[name] = CauseCost.load(c)
    cause, lost_cause = str(d["cause"]), str(d["lost_cause"])
    if cause not in ("", *CAUSES) or lost_cause not in ("", *CAUSES):
        raise ValueError(f"unknown goodput cause {cause!r} / {lost_cause!r}")
    return Ledger(
        stage=Stage(d["stage"]),
        since=opt(d["since"]),
        cause=cause,
        lost_cause=lost_cause,
        stop_at=float(d["stop_at"]),
        regathered=bool(d["regathered"]),
        stepped=bool(d["stepped"]),
        rendezvous_s=float(d["rendezvous_s"]),
        startup_s=float(d["startup_s"]),
        training_s=float(d["training_s"]),
        finishing_s=float(d.get("finishing_s", 0.0)),  # (an image from before it was kept: 0)
        causes=causes,
        ended_at=opt(d["ended_at"]),
        known_from=opt(d["known_from"]),
    )


def adopted(job: Job) -> Ledger:
    """A ledger for a job restored from an image written before goodput was kept: the figures
    start at the job's last event (``known_from``); the time before is ``unknown_s``."""
    from .jobs import JobPhase  # (jobs imports this module)

    at = max((e.time for e in job.history), default=job.created_at)
    g = Ledger(since=at, known_from=at)
    if job.phase is JobPhase.RUNNING:
        g.stage = Stage.STARTUP
    elif job.phase is JobPhase.GATHERING:
        g.stage, g.cause, g.stop_at, g.regathered = Stage.DOWN, "unknown", at, False
    elif job.phase is not JobPhase.RESUMING:
        g.stage, g.ended_at = Stage.ENDED, at
    return g


# --- figures -------------------------------------------------------------------------------


def figures(job: Job, now: float) -> dict[str, Any]:
    """The job's breakdown at ``now`` (the open stage counted up to it), as plain data: what
    the status API shows (``status.py`` adds wall-clock times), the metrics read and the
    sentence is made of. Seconds on the server's clock; None: unknown."""
    g = job.goodput
    end = g.ended_at if g.ended_at is not None else max(now, _since(job))
    created = job.created_at
    wall = max(0.0, end - created)
    unknown = 0.0 if g.known_from is None else max(0.0, g.known_from - created)
    rendezvous, startup, training, finish = g.rendezvous_s, g.startup_s, g.training_s, g.finishing_s
    costs = {name: CauseCost(*c.dump()) for name, c in g.causes.items()}
    open_s = max(0.0, end - _since(job))
    if g.stage is Stage.RENDEZVOUS:
        rendezvous += open_s
    elif g.stage is Stage.STARTUP:
        startup += open_s
    elif g.stage is Stage.TRAINING:
        training += open_s
    elif g.stage is Stage.FINISHING:
        finish += open_s
    elif g.stage is Stage.DOWN:
        c = costs.setdefault(g.cause, CauseCost())
        c.down_s += open_s
        if not g.regathered:
            c.regather_s += max(0.0, end - g.stop_at)
    stepped = g.stepped
    # What is carved out of the rounds' training time: checkpoints (volatile, sampled) and the
    # time to do lost steps again (estimated: steps x step time), never more than there is.
    checkpoint = min(g.checkpoint_s, training) if stepped else 0.0
    rerun = sum(c.rerun_s for c in costs.values())
    room = max(0.0, training - checkpoint)
    scale = room / rerun if rerun > room else 1.0
    for c in costs.values():
        c.rerun_s *= scale
    net = max(0.0, training - checkpoint - rerun * scale)
    shown = {name: k for name in CAUSES if (k := costs.get(name)) is not None and (k.count or k.down_s)}
    by_cause = {
        name: {
            "count": c.count,
            "seconds": _r(c.down_s + c.rerun_s) if stepped else None,
            "regather_s": _r(c.regather_s),
            "steps_lost": c.steps_lost if stepped else None,
            "steps_lost_unknown": c.lost_unknown,
            "rerun_s": _r(c.rerun_s) if stepped else None,
        }
        for name, c in shown.items()
    }
    return {
        "stage": g.stage.value,
        "progress_reported": stepped,
        "wall_s": _r(wall),
        "goodput": round(net / wall, 4) if stepped and wall > 0 else None,
        "training_s": _r(net) if stepped else None,
        "startup_s": _r(startup) if stepped else None,
        "ran_s": None if stepped else _r(startup),
        "rendezvous_s": _r(rendezvous),
        "finishing_s": _r(finish) if stepped else None,
        "checkpoint_s": _r(checkpoint) if stepped else None,
        "rerun_s": _r(rerun * scale) if stepped else None,
        "unknown_s": _r(unknown),
        "failures": _total(by_cause, FAILURE_CAUSES, stepped),
        "changes": _total(by_cause, frozenset(CAUSES) - FAILURE_CAUSES, stepped),
        "causes": by_cause,
    }


def _r(seconds: float) -> float:
    return round(seconds, 3)


def _total(by_cause: dict[str, dict[str, Any]], names: frozenset[str], stepped: bool) -> dict[str, Any]:
    mine = [c for name, c in by_cause.items() if name in names]
    return {
        "count": sum(c["count"] for c in mine),
        "seconds": _r(sum(c["seconds"] for c in mine)) if stepped else None,
        "regather_s": _r(sum(c["regather_s"] for c in mine)),
        "steps_lost": sum(c["steps_lost"] for c in mine) if stepped else None,
        "steps_lost_unknown": sum(c["steps_lost_unknown"] for c in mine),
    }


def duration(seconds: float) -> str:
    """``41 s``, ``2.5 s``, ``3 min 5 s``, ``2 h 14 min``, ``3 d 4 h``."""
    s = max(0.0, seconds)
    if s < 10:
        return f"{s:.1f}".rstrip("0").rstrip(".") + " s"
    if s < 60:
        return f"{s:.0f} s"
    n = int(s)
    if n < 3600:
        return f"{n // 60} min" + (f" {n % 60} s" if n % 60 else "")
    if n < 86400:
        return f"{n // 3600} h" + (f" {n % 3600 // 60} min" if n % 3600 // 60 else "")
    return f"{n // 86400} d" + (f" {n % 86400 // 3600} h" if n % 86400 // 3600 else "")


def percent(ratio: float) -> str:
    """``97.3 %`` (half up, to a tenth)."""
    return f"{math.floor(ratio * 1000 + 0.5) / 10:.1f} %"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _cost(total: dict[str, Any], noun: str, plural: str) -> str:
    n = total["count"]
    who = f"{n} {noun if n == 1 else plural}"
    if total["seconds"] is None:  # no progress: what the server knows
        return f"{who}, {duration(total['regather_s'])} to re-rendezvous"
    lost, unknown = total["steps_lost"], total["steps_lost_unknown"]
    steps = ""
    if lost and unknown:
        steps = f" and at least {_plural(lost, 'step')}"
    elif lost:
        steps = f" and {_plural(lost, 'step')}"
    elif unknown:
        steps = " (steps lost unknown)"
    return f"{who} cost {duration(total['seconds'])}{steps}"


def sentence(f: dict[str, Any]) -> str:
    """The one line a person reads: ``goodput 97.3 % over 2 h 14 min: 2 failures cost 41 s and
    3 steps; start-up 9 s; rendezvous 2 s`` (only what is known)."""
    over = duration(f["wall_s"])
    if f["goodput"] is None:
        head = f"goodput unknown (no training progress reported) over {over}"
    else:
        head = f"goodput {percent(f['goodput'])} over {over}"
    parts = []
    fails, changes = f["failures"], f["changes"]
    if fails["count"]:
        parts.append(_cost(fails, "failure", "failures"))
    elif f["goodput"] is not None:
        parts.append("no failures")
    if changes["count"]:
        parts.append(_cost(changes, "planned change", "planned changes"))
    if f["startup_s"] is not None:
        parts.append(f"start-up {duration(f['startup_s'])}")
    if f["ran_s"] is not None and f["ran_s"] > 0:
        parts.append(f"rounds ran {duration(f['ran_s'])}")
    parts.append(f"rendezvous {duration(f['rendezvous_s'])}")
    if f["checkpoint_s"]:
        parts.append(f"checkpoints {duration(f['checkpoint_s'])}")
    if f["finishing_s"]:
        parts.append(f"finishing {duration(f['finishing_s'])}")
    if f["unknown_s"]:
        parts.append(f"the first {duration(f['unknown_s'])} not accounted (an older server's state)")
    text = head + ": " + "; ".join(parts)
    return text if len(text) <= SENTENCE_LEN else text[: SENTENCE_LEN - 3] + "..."


def line(job: Job, now: float) -> str:
    """``sentence`` of the job's figures at ``now``."""
    return sentence(figures(job, now))


def series(job: Job) -> list[tuple[float, int]]:
    """The chart's (time, step) points, oldest first (volatile; at most SERIES_MAX)."""
    g = job.goodput
    return list(zip(g.series_t, g.series_s, strict=True))
