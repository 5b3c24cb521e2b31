"""``GET /metrics``: the machine's state and counters in Prometheus' text format.

A custom collector reads the machine when Prometheus scrapes, so nothing runs between
scrapes and no second copy of the state can drift from the first: every number comes from
``Rendezvous`` (its connections, jobs and ``Stats``) at the moment of the scrape, with the
service's monotonic clock for the heartbeat ages.

Each service has its own registry (tests run several services in one process, and an
embedded server must not register anything process-wide).

Counts only, no ids: ``/metrics`` is the one page besides ``/healthz`` that answers any
``Host`` (scrapers use service names and IPs; ``http_app.py``), so it must tell a web page
that rebinds its DNS name to this server nothing a job's id would; and ids are the peers'
texts, so a label per job would let agents grow the series without bound. Training health
(issue 19) is therefore server-wide aggregates over the running jobs: jobs reporting
progress, jobs whose running round hung, ranks flagged as stragglers now (scored at the
scrape, as the status API does: O(world size) per job), and the distribution of the jobs'
oldest last-progress ages (a job's own numbers are in its status,
``/v1/jobs/{id}``).

Per job, only when the operator asks (``rdzv-server --metrics-jobs N``): the training gauges of
at most N running jobs, labelled ``job``, so the series stay bounded whatever the agents send;
the operator accepts that a job's id is then readable by anyone who reaches the port. The N are
the largest: most nodes in the running round, then the oldest. Not the first by id: agents choose
ids, so a stranger's jobs named to sort first would push the real ones out; to displace a job
here, one must run a larger one (each node is a connection of its own, heartbeating), and an
older one cannot be made after the fact. The choice is stable from scrape to scrape while the
jobs keep their sizes.

Goodput (issue 47, ``machine/goodput.py``): server-wide, the active jobs' training and wall
seconds (jobs that report progress; their ratio is the fleet's goodput) and their badput seconds
by cause (``rdzv_badput_seconds{cause}``: ``rendezvous``, ``startup``, ``checkpoint``, ``finishing`` and each
cause of a restart, its downtime and the time its lost steps took again). Per job, within the
same ``--metrics-jobs`` bound: ``rdzv_job_goodput_ratio``, ``rdzv_job_training_seconds``,
``rdzv_job_wall_seconds``, ``rdzv_job_badput_seconds{cause}``, ``rdzv_job_restarts_by_cause``
and ``rdzv_job_steps_lost``. Gauges (a share of time can be moved between parts: the time of
steps found lost later is taken out of training), and only what is known: a job that reports
no progress has no training, ratio or badput-seconds series of its own, only its restarts.

The state log (``--state-dir``): ``rdzv_state_log_read_only`` is 1 while it cannot be written
for want of room (a full disk: the server serves running jobs from memory and takes no new
agents; ``journal.py``, "A full disk"), with the changes of state held in memory meanwhile and
how many times it happened; 0 without a state dir.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from protocol.records import record

from .machine import goodput
from .machine.progress import flagged_scores
from .machine.state import LATENCY_BUCKETS, ConnPhase, JobPhase, Rendezvous

if TYPE_CHECKING:
    from .journal import LogHealth

# Upper bounds for the heartbeat-age distribution: agents beat every second or so by default.
HEARTBEAT_LAG_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
# ... and for the jobs' oldest last-progress ages: steps take from milliseconds to minutes,
# and the agent's default hang budgets are 120 s (after warm-up) and 30 min (the first step).
PROGRESS_AGE_BUCKETS = (1.0, 5.0, 15.0, 60.0, 120.0, 300.0, 900.0, 1800.0)


def _le(bound: float) -> str:
    return f"{bound:g}"


class RendezvousCollector(Collector):
    """Reads the machine at scrape time."""

    def __init__(
        self,
        machine: Callable[[], Rendezvous],
        clock: Callable[[], float],
        jobs: int = 0,
        state_log: Callable[[], LogHealth | None] | None = None,
    ) -> None:
        # A getter rather than the machine itself, so a service that replaces its machine
        # (none does today) is still the one scraped.
        self._machine = machine
        self._clock = clock
        self._jobs = jobs  # running jobs with per-job gauges (--metrics-jobs)
        self._state_log = state_log  # whether the state log is written (None: no state dir)

    def collect(self) -> Iterator[Metric]:
        m = self._machine()
        now = self._clock()
        s = m.stats

        yield GaugeMetricFamily("rdzv_connections", "Open agent connections (any phase).", value=len(m.conns))
        joined = [c for c in m.conns.values() if c.phase is ConnPhase.JOINED and c.job_id in m.jobs]
        yield GaugeMetricFamily(
            "rdzv_agents_connected", "Agents connected and joined to a job.", value=len(joined)
        )

        jobs = GaugeMetricFamily("rdzv_jobs", "Active jobs by phase.", labels=["phase"])
        for phase in JobPhase:
            if phase is JobPhase.ABANDONED:
                continue  # only forgotten jobs have it: never an active one
            jobs.add_metric([phase.value], sum(1 for j in m.jobs.values() if j.phase is phase))
        yield jobs

        for name, doc, value in (
            ("rdzv_jobs_created", "Jobs created.", s.jobs_created),
            ("rdzv_jobs_finished", "Jobs whose workers all succeeded.", s.jobs_finished),
            ("rdzv_jobs_failed", "Jobs that failed.", s.jobs_failed),
            ("rdzv_rounds_started", "Rendezvous rounds started (gathering began).", s.rounds_started),
            ("rdzv_rounds_completed", "Rendezvous rounds completed (assignments sent).", s.rounds_completed),
            ("rdzv_restarts", "Restarts charged to jobs' restart budgets.", s.restarts),
        ):
            yield CounterMetricFamily(name, doc, value=value)

        failures = CounterMetricFamily("rdzv_failures", "Failures by cause.", labels=["cause"])
        for cause, n in sorted(s.failures.items()):
            failures.add_metric([cause], n)
        yield failures

        cumulative, buckets = 0, []
        for bound, n in zip((*LATENCY_BUCKETS, float("inf")), s.latency_buckets, strict=True):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else _le(bound), cumulative))
        yield HistogramMetricFamily(
            "rdzv_rendezvous_latency_seconds",
            "Time from the start of gathering to the round's assignments.",
            buckets=buckets,
            sum_value=s.latency_sum,
        )

        lags = sorted(max(0.0, now - c.last_seen) for c in joined)
        yield GaugeMetricFamily(
            "rdzv_heartbeat_lag_max_seconds",
            "The longest time since any joined agent was last heard from.",
            value=lags[-1] if lags else 0.0,
        )
        yield GaugeHistogramMetricFamily(
            "rdzv_heartbeat_lag_seconds",
            "Joined agents by the time since they were last heard from, now.",
            buckets=[
                *((_le(b), bisect.bisect_right(lags, b)) for b in HEARTBEAT_LAG_BUCKETS),
                ("+Inf", len(lags)),
            ],
            gsum_value=sum(lags),
        )
        running = _running(m, now)
        yield from _training(running)
        yield from _goodput([goodput.figures(j, now) for j in m.jobs.values()])
        if self._jobs:
            yield from _per_job(running, self._jobs)
        yield from _state_log(self._state_log() if self._state_log is not None else None)


def _state_log(health: LogHealth | None) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "rdzv_state_log_read_only",
        "1 while the state log cannot be written for want of room (a full disk): running jobs are "
        "served from memory, new agents are refused and changes of state wait.",
        value=1 if health is not None and health.read_only else 0,
    )
    yield GaugeMetricFamily(
        "rdzv_state_log_held_changes",
        "Changes of state applied in memory while the state log is read-only, not yet written.",
        value=health.held if health is not None else 0,
    )
    yield CounterMetricFamily(
        "rdzv_state_log_read_only_entered",
        "Times the state log went read-only (a write failed for want of room).",
        value=health.entered if health is not None else 0,
    )


@record(frozen=True, slots=True)
class _JobNow:
    """One running job's training figures at this scrape (each computed once: scoring is
    O(world size))."""

    id: str
    nodes: int  # in the running round: what the per-job series are chosen by
    created_at: float
    step: int
    steps_per_s: float  # 0: none in the running round
    age: float | None  # its least recent rank's last-progress age (None: no progress this round)
    flagged: int  # ranks below the straggler threshold
    hung: bool  # the running round has a hang report
    snapshot_step: int  # the newest in-memory snapshot every rank has (-1: none; issue 35)
    snapshot_age: float  # since the server saw it complete (0: none)
    goodput: dict[str, Any]  # goodput.figures


def _running(m: Rendezvous, now: float) -> list[_JobNow]:
    out = []
    for j in m.jobs.values():
        if j.phase is not JobPhase.RUNNING:
            continue
        p = j.progress
        current = p.round == j.round
        oldest = p.oldest(now) if current else None
        scores = flagged_scores(p, j.settings.straggler_threshold) if current else []
        out.append(
            _JobNow(
                id=j.id,
                nodes=sum(1 for nid in j.order if nid in j.members),
                created_at=j.created_at,
                step=p.max_step,
                steps_per_s=p.steps_per_s if current else 0.0,
                age=oldest.age_s(now) if oldest is not None else None,
                flagged=sum(1 for sc in scores if sc.flagged),
                hung=j.hang is not None and j.hang.round == j.round,
                snapshot_step=j.snapshot_step,
                snapshot_age=now - j.snapshot_since if j.snapshot_step >= 0 else 0.0,
                goodput=goodput.figures(j, now),
            )
        )
    return out


def _training(running: list[_JobNow]) -> Iterator[Metric]:
    """Training health over the running jobs: no ids (see the module's docstring)."""
    ages = sorted(j.age for j in running if j.age is not None)
    yield GaugeMetricFamily(
        "rdzv_jobs_reporting_progress",
        "Running jobs whose agents report training progress in the running round.",
        value=len(ages),
    )
    yield GaugeMetricFamily(
        "rdzv_jobs_hung",
        "Running jobs whose running round has a hang report (a rank made no progress).",
        value=sum(1 for j in running if j.hung),
    )
    yield GaugeMetricFamily(
        "rdzv_stragglers_flagged",
        "Ranks of running jobs whose compute speed is now below their job's straggler threshold.",
        value=sum(j.flagged for j in running),
    )
    yield GaugeMetricFamily(
        "rdzv_progress_age_max_seconds",
        "The oldest last progress of any running job's rank (0 when none reports progress).",
        value=ages[-1] if ages else 0.0,
    )
    yield GaugeHistogramMetricFamily(
        "rdzv_progress_age_seconds",
        "Running jobs by the age of their least recent rank's last progress, now.",
        buckets=[
            *((_le(b), bisect.bisect_right(ages, b)) for b in PROGRESS_AGE_BUCKETS),
            ("+Inf", len(ages)),
        ],
        gsum_value=sum(ages),
    )


def _badput(f: dict[str, Any]) -> dict[str, float]:
    """A job's known badput seconds by cause (none without progress)."""
    if not f["progress_reported"]:
        return {}
    out = {
        "rendezvous": f["rendezvous_s"],
        "startup": f["startup_s"],
        "checkpoint": f["checkpoint_s"],
        "finishing": f["finishing_s"],
    }
    out.update((cause, c["seconds"]) for cause, c in f["causes"].items())
    return out


def _goodput(figures: list[dict[str, Any]]) -> Iterator[Metric]:
    """The active jobs' goodput, summed: no ids (see the module's docstring)."""
    known = [f for f in figures if f["progress_reported"]]
    yield GaugeMetricFamily(
        "rdzv_goodput_training_seconds",
        "Training seconds of the active jobs that report progress (goodput.py's training time).",
        value=sum(f["training_s"] for f in known),
    )
    yield GaugeMetricFamily(
        "rdzv_goodput_wall_seconds",
        "Wall seconds of the active jobs that report progress (training / wall: their goodput).",
        value=sum(f["wall_s"] for f in known),
    )
    bad = GaugeMetricFamily(
        "rdzv_badput_seconds",
        "Seconds of the active jobs that report progress not spent training, by cause.",
        labels=["cause"],
    )
    totals: dict[str, float] = dict.fromkeys(
        ("rendezvous", "startup", "checkpoint", "finishing", *goodput.CAUSES), 0.0
    )
    for f in known:
        for cause, seconds in _badput(f).items():
            totals[cause] += seconds
    for cause, seconds in totals.items():
        bad.add_metric([cause], seconds)
    yield bad


def _per_job(running: list[_JobNow], limit: int) -> Iterator[Metric]:
    """The training gauges of the ``limit`` largest running jobs (the module's docstring),
    labelled ``job``."""
    step = GaugeMetricFamily("rdzv_job_step", "The job's highest step reported (-1: none).", labels=["job"])
    rate = GaugeMetricFamily(
        "rdzv_job_steps_per_second", "The job's steps per second, lately.", labels=["job"]
    )
    age = GaugeMetricFamily(
        "rdzv_job_progress_age_seconds",
        "The age of the job's least recent rank's last progress.",
        labels=["job"],
    )
    slow = GaugeMetricFamily(
        "rdzv_job_stragglers", "The job's ranks now below its straggler threshold.", labels=["job"]
    )
    hung = GaugeMetricFamily(
        "rdzv_job_hung", "1 while the job's running round has a hang report.", labels=["job"]
    )
    snap = GaugeMetricFamily(
        "rdzv_job_snapshot_step",
        "The newest in-memory snapshot step every rank of the job has (-1: none).",
        labels=["job"],
    )
    snap_age = GaugeMetricFamily(
        "rdzv_job_snapshot_age_seconds",
        "Seconds since the job's newest in-memory snapshot step became complete (0: none).",
        labels=["job"],
    )
    ratio = GaugeMetricFamily(
        "rdzv_job_goodput_ratio",
        "The job's training time / wall time (only if it reports progress).",
        labels=["job"],
    )
    trained = GaugeMetricFamily(
        "rdzv_job_training_seconds",
        "The job's training seconds (only if it reports progress).",
        labels=["job"],
    )
    wall = GaugeMetricFamily("rdzv_job_wall_seconds", "Seconds since the job was created.", labels=["job"])
    bad = GaugeMetricFamily(
        "rdzv_job_badput_seconds",
        "The job's seconds not spent training, by cause (only if it reports progress).",
        labels=["job", "cause"],
    )
    stops = GaugeMetricFamily(
        "rdzv_job_restarts_by_cause", "The job's rounds stopped, by cause.", labels=["job", "cause"]
    )
    lost = GaugeMetricFamily(
        "rdzv_job_steps_lost", "Steps the job did again after restarts (known ones).", labels=["job"]
    )
    for j in sorted(running, key=lambda j: (-j.nodes, j.created_at, j.id))[:limit]:
        label = [j.id]
        f = j.goodput
        wall.add_metric(label, f["wall_s"])
        if f["progress_reported"]:
            ratio.add_metric(label, f["goodput"] or 0.0)
            trained.add_metric(label, f["training_s"])
            lost.add_metric(label, sum(c["steps_lost"] for c in f["causes"].values()))
        for cause, seconds in _badput(f).items():
            bad.add_metric([j.id, cause], seconds)
        for cause, c in f["causes"].items():
            stops.add_metric([j.id, cause], c["count"])
        step.add_metric(label, j.step)
        rate.add_metric(label, j.steps_per_s)
        age.add_metric(label, j.age if j.age is not None else 0.0)
        slow.add_metric(label, j.flagged)
        hung.add_metric(label, 1 if j.hung else 0)
        snap.add_metric(label, j.snapshot_step)
        snap_age.add_metric(label, j.snapshot_age)
    yield from (step, rate, age, slow, hung, snap, snap_age, ratio, trained, wall, bad, stops, lost)


def make_registry(
    machine: Callable[[], Rendezvous],
    clock: Callable[[], float],
    *,
    jobs: int = 0,
    state_log: Callable[[], LogHealth | None] | None = None,
) -> CollectorRegistry:
    """``jobs``: per-job training gauges for at most that many running jobs (0: none);
    ``state_log``: whether the state log is written (``StateLog.health``; None: no state dir)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RendezvousCollector(machine, clock, jobs, state_log))
    ProcessCollector(registry=registry)  # process_* : CPU, memory, open files (Linux only)
    return registry


def render(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """The exposition for an ``Accept`` header: OpenMetrics if asked for, else text 0.0.4."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type
