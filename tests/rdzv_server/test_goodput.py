"""Goodput (issue 47): where a job's wall time went, on scripted histories with a fake clock.

Each script's times are chosen so every figure is known exactly: a job of two nodes forms at
t=2 (rendezvous 2 s), reports its first step at t=11 (start-up 9 s), a worker crash at t=61.5
restarts it (1.5 s to re-rendezvous, 8.5 s to its next step, 10 steps of 0.5 s lost), a hang
whose rank stopped at t=120 ends the next round at t=150, a server restart comes between, and
so on. The state log's replay from every cut gives the same ledger (the state image keeps it).
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from protocol import (
    Armed,
    Assignment,
    HangDetected,
    JobDone,
    JobFailed,
    Progress,
    Resume,
    Resumed,
    WorkersCommitted,
    WorkersFailed,
    WorkersSucceeded,
)
from rdzv_server import state_image, tables
from rdzv_server.machine import goodput
from rdzv_server.machine.state import Rendezvous, Restarted
from rdzv_server.status import find_job, jobs_view

from .harness import Harness, failure
from .test_commit import asked, join_and_settle
from .test_commit import running as elastic_running
from .test_hang_verdict import WAITING, hung, stacks
from .test_journal import Recording, replays_from_every_cut
from .test_recover import join_msg
from .test_status import WALL0, conforms

pytestmark = pytest.mark.unit

KW: dict[str, Any] = dict(min_nodes=2, max_nodes=2, max_restarts=5, heartbeat_timeout=600.0)


def progress(rnd: int, step: int, *, p50: float = 500.0, phase: str = "compute") -> Progress:
    return Progress(round=rnd, min_step=step, max_step=step, step_p50_ms=p50, step_p90_ms=p50, phase=phase)


def at(h: Harness, t: float) -> None:
    assert t >= h.now
    h.advance(t - h.now)


def figures(h: Harness) -> dict[str, Any]:
    return goodput.figures(h.machine.jobs["job"], h.now)


def adds_up(f: dict[str, Any]) -> None:
    """Every second of the wall time is in exactly one part."""
    parts = [f["unknown_s"], f["rendezvous_s"], f["startup_s"] or f["ran_s"] or 0.0]
    parts += [f["training_s"] or 0.0, f["checkpoint_s"] or 0.0, f["finishing_s"] or 0.0]
    parts += [c["seconds"] if c["seconds"] is not None else c["regather_s"] for c in f["causes"].values()]
    assert sum(parts) == pytest.approx(f["wall_s"], abs=1e-6), f


def crash_then_restart(h: Harness) -> tuple[int, int]:
    """t=0..70: formed at 2, first step at 11, step 100 at 61, a worker crash at 61.5, round 1
    formed at 63 and its first step (91: resumed from a checkpoint of step 90) at 70."""
    a = h.join(**KW)
    at(h, 2.0)
    b = h.join(**KW)
    assert h.last(a, Assignment) is not None
    at(h, 11.0)
    h.send(a, progress(0, 0))
    at(h, 61.0)
    h.send(a, progress(0, 100))
    h.send(b, progress(0, 99))
    at(h, 61.5)
    h.send(b, WorkersFailed(round=0, failure=failure(rank=2, node="node2"), step=100))
    at(h, 63.0)
    h.join(a, **KW), h.join(b, **KW)
    assert h.last(a, Assignment).round == 1  # type: ignore[union-attr]
    at(h, 70.0)
    h.send(b, progress(1, 91))
    return a, b


def hang_in_round_1(h: Harness, a: int, b: int, nodes: tuple[str, str] = ("node1", "node2")) -> None:
    """Rank 0 makes no progress after t=120 (step 190); found 30 s later, both nodes' stacks
    come and the hang's failure restarts the job (round 2 at 152, first step 181 at 160)."""
    at(h, 120.0)
    h.send(a, progress(1, 190))
    at(h, 150.0)
    h.send(a, HangDetected(round=1, ranks=(0,), step=190, silent_s=30.0))
    h.send(a, stacks((0, 1), (WAITING, WAITING)))
    h.send(b, stacks((2, 3), (WAITING, WAITING)))
    h.send(a, WorkersFailed(round=1, failure=hung(0), step=190))
    at(h, 152.0)
    h.join(a, node=nodes[0], **KW), h.join(b, node=nodes[1], **KW)
    assert h.last(a, Assignment).round == 2  # type: ignore[union-attr]
    at(h, 160.0)
    h.send(a, progress(2, 181))


def test_a_crash_and_a_hang_cost_what_the_script_says_and_the_agents_are_told() -> None:
    h = Harness(machine=Recording())
    a, b = crash_then_restart(h)
    f = figures(h)
    assert (f["stage"], f["wall_s"], f["rendezvous_s"], f["startup_s"]) == ("training", 70.0, 2.0, 9.0)
    crash = f["causes"]["worker_crash"]
    # 10 steps lost (100 reached, resumed after 90), each 0.5 s: 5 s of the training carved out.
    assert crash == {
        "count": 1,
        "seconds": 8.5 + 5.0,
        "regather_s": 1.5,
        "steps_lost": 10,
        "steps_lost_unknown": 0,
        "rerun_s": 5.0,
    }
    assert f["training_s"] == 50.5 - 5.0
    adds_up(f)
    hang_in_round_1(h, a, b)
    at(h, 200.0)
    for c in (a, b):
        h.send(c, WorkersSucceeded(round=2))
    done = h.last(a, JobDone)
    assert done is not None
    f = figures(h)
    # The hang counts from the rank's last progress (150 - 30 s): 40 s to the next step, and
    # its 10 lost steps (190 reached, resumed after 180).
    assert f["causes"]["hang"] == {
        "count": 1,
        "seconds": 45.0,
        "regather_s": 2.0,
        "steps_lost": 10,
        "steps_lost_unknown": 0,
        "rerun_s": 5.0,
    }
    assert f["stage"] == "ended" and f["wall_s"] == 200.0
    assert f["training_s"] == (61.5 - 11) + (120 - 70) + (200 - 160) - 10.0
    assert f["goodput"] == round(130.5 / 200, 4)
    assert f["failures"] == {
        "count": 2,
        "seconds": 58.5,
        "regather_s": 3.5,
        "steps_lost": 20,
        "steps_lost_unknown": 0,
    }
    assert f["changes"]["count"] == 0
    adds_up(f)
    text = "goodput 65.3 % over 3 min 20 s: 2 failures cost 58 s and 20 steps; start-up 9 s; rendezvous 2 s"
    assert goodput.sentence(f) == text
    assert done.summary == text  # what every agent prints
    h.advance(50.0)
    assert goodput.sentence(figures(h)) == text  # an ended job's figures stay
    replays_from_every_cut(h.machine.records, h.machine)


def test_a_failure_reports_step_counts_when_the_summaries_were_a_step_behind() -> None:
    """The nodes' once-a-second summaries said step 99 at most; the failing node's report says
    its ranks reached 100 (read as they exited): the steps lost count from 100."""
    h = Harness(machine=Recording())
    a = h.join(**KW)
    at(h, 2.0)
    b = h.join(**KW)
    at(h, 11.0)
    h.send(a, progress(0, 0))
    at(h, 61.0)
    h.send(a, progress(0, 99))
    h.send(b, progress(0, 99))
    at(h, 61.5)
    h.send(b, WorkersFailed(round=0, failure=failure(rank=2, node="node2"), step=100))
    at(h, 63.0)
    h.join(a, **KW), h.join(b, **KW)
    at(h, 70.0)
    h.send(b, progress(1, 91))
    assert figures(h)["causes"]["worker_crash"]["steps_lost"] == 10
    replays_from_every_cut(h.machine.records, h.machine)


def test_the_training_ends_at_the_last_step_not_when_the_last_node_exits() -> None:
    """The first node to finish says its last step came 2 s before its report (the process
    group's teardown, the interpreter's exit); the other node reports 3 s later: the 5 s from
    the last step to the job's end are finishing, not training, and the sentence says so."""
    h = Harness(machine=Recording())
    a = h.join(**KW)
    at(h, 2.0)
    b = h.join(**KW)
    at(h, 10.0)
    h.send(a, progress(0, 0))
    at(h, 100.0)
    h.send(a, WorkersSucceeded(round=0, idle_ms=2000.0))
    f = figures(h)
    assert (f["stage"], f["training_s"], f["finishing_s"]) == ("finishing", 88.0, 2.0)
    adds_up(f)
    at(h, 103.0)
    h.send(b, WorkersSucceeded(round=0, idle_ms=4000.0))  # (the training had ended already)
    done = h.last(a, JobDone)
    assert done is not None
    f = figures(h)
    assert (f["stage"], f["wall_s"], f["training_s"], f["finishing_s"]) == ("ended", 103.0, 88.0, 5.0)
    assert f["goodput"] == round(88.0 / 103.0, 4)
    adds_up(f)
    text = "goodput 85.4 % over 1 min 43 s: no failures; start-up 8 s; rendezvous 2 s; finishing 5 s"
    assert done.summary == goodput.sentence(f) == text
    replays_from_every_cut(h.machine.records, h.machine)


def test_an_idle_time_longer_than_the_round_ends_the_training_at_its_first_step() -> None:
    """A report claiming a last step before the round's first one is held to the round."""
    h = Harness()
    a = h.join(**{**KW, "min_nodes": 1, "max_nodes": 1})
    at(h, 10.0)
    h.send(a, progress(0, 0))
    at(h, 20.0)
    h.send(a, WorkersSucceeded(round=0, idle_ms=60_000.0))
    f = figures(h)
    assert (f["training_s"], f["finishing_s"], f["wall_s"]) == (0.0, 10.0, 20.0)
    adds_up(f)


def test_a_node_failing_after_another_finished_restarts_and_counts_the_finishing_time() -> None:
    h = Harness(machine=Recording())
    a = h.join(**KW)
    b = h.join(**KW)
    at(h, 10.0)
    h.send(a, progress(0, 50))
    h.send(b, progress(0, 50))
    at(h, 20.0)
    h.send(a, WorkersSucceeded(round=0, idle_ms=1000.0))
    at(h, 22.0)
    h.send(b, WorkersFailed(round=0, failure=failure(rank=2, node="node2"), step=50))
    f = figures(h)
    assert (f["stage"], f["training_s"], f["finishing_s"]) == ("down", 9.0, 3.0)
    adds_up(f)
    replays_from_every_cut(h.machine.records, h.machine)


def test_a_failed_job_says_it_too() -> None:
    h = Harness()
    a = h.join(**{**KW, "max_restarts": 0})
    b = h.join(**{**KW, "max_restarts": 0})
    at(h, 5.0)
    h.send(a, progress(0, 0))
    at(h, 25.0)
    h.send(b, WorkersFailed(round=0, failure=failure(rank=2, node="node2"), step=40))
    got = h.last(a, JobFailed)
    assert got is not None
    assert got.summary == "goodput 80.0 % over 25 s: no failures; start-up 5 s; rendezvous 0 s"


def test_a_scale_up_at_a_commit_point_loses_no_step() -> None:
    h = Harness(machine=Recording())
    a, b = elastic_running(h)  # formed at 2.0
    h.send(a, progress(0, 0, p50=250.0))
    new = join_and_settle(h, [a, b])  # the nodes are at step 62
    s = asked(h, [a, b]).step
    for c in (a, b):
        h.send(c, Armed(round=0, step=s, late=False, checked=62))
    asked(h, [a, b])  # go
    h.advance(1.0)
    stopped_at = h.now
    for c in (a, b):
        h.send(c, WorkersCommitted(round=0, step=s))
    for c in (a, b):
        h.join(c, min_nodes=1, max_nodes=4, max_restarts=5, last_call_timeout=2.0, heartbeat_timeout=600.0)
    assert h.last(new, Assignment) is not None
    h.advance(3.0)
    h.send(new, progress(1, s + 1, p50=250.0))
    f = figures(h)
    commit = f["causes"]["commit"]
    assert commit["count"] == 1 and commit["steps_lost"] == 0 and commit["seconds"] == h.now - stopped_at
    assert f["failures"]["count"] == 0 and f["changes"]["count"] == 1
    assert "1 planned change cost 3 s" in goodput.sentence(f) and "no failures" in goodput.sentence(f)
    adds_up(f)
    replays_from_every_cut(h.machine.records, h.machine)


def test_a_scale_up_without_commit_points_is_a_hard_restart_that_loses_steps() -> None:
    h = Harness()
    a, b = elastic_running(h, commit_timeout=0.0)  # commits off
    h.send(a, progress(0, 0, p50=250.0))
    h.advance(5.0)
    h.send(a, progress(0, 20, p50=250.0))
    new = h.join(min_nodes=1, max_nodes=4, max_restarts=5, last_call_timeout=2.0, commit_timeout=0.0)
    h.advance(2.0)  # its settle window closes: the job regathers at once
    for c in (a, b):
        h.join(c, min_nodes=1, max_nodes=4, max_restarts=5, last_call_timeout=2.0, commit_timeout=0.0)
    assert h.last(new, Assignment) is not None
    h.advance(1.0)
    h.send(new, progress(1, 0, p50=250.0))  # no checkpoint: from step 0 again
    scale = figures(h)["causes"]["scale_up"]
    assert scale["count"] == 1 and scale["steps_lost"] == 21 and scale["rerun_s"] == 21 * 0.25


def test_a_job_without_progress_gets_rounds_and_restarts_marked_as_such() -> None:
    h = Harness()
    a = h.join(**KW)
    at(h, 1.0)
    b = h.join(**KW)
    at(h, 31.0)
    h.send(a, WorkersFailed(round=0, failure=failure(), step=-1))
    at(h, 33.0)
    h.join(a, **KW), h.join(b, **KW)
    at(h, 60.0)
    f = figures(h)
    assert f["progress_reported"] is False and f["goodput"] is None and f["training_s"] is None
    assert f["ran_s"] == 30.0 + 27.0 and f["rendezvous_s"] == 1.0
    crash = f["causes"]["worker_crash"]
    assert crash["seconds"] is None and crash["regather_s"] == 2.0 and crash["steps_lost"] is None
    adds_up(f)
    assert goodput.sentence(f) == (
        "goodput unknown (no training progress reported) over 1 min: 1 failure, 2 s to re-rendezvous; "
        "rounds ran 57 s; rendezvous 1 s"
    )


def test_checkpoint_phases_are_carved_out_of_training_from_the_nodes_summaries() -> None:
    h = Harness()
    a = h.join(**KW)
    b = h.join(**KW)
    at(h, 10.0)
    h.send(a, progress(0, 0))
    h.send(b, progress(0, 0))
    at(h, 20.0)
    h.send(a, progress(0, 20, phase="checkpoint"))
    h.send(b, progress(0, 20, phase="checkpoint"))
    at(h, 26.0)  # both nodes' ranks were in the checkpoint for 6 s
    h.send(a, progress(0, 21))
    h.send(b, progress(0, 21))
    at(h, 30.0)
    f = figures(h)
    assert f["checkpoint_s"] == 6.0 and f["training_s"] == 20.0 - 6.0
    assert "checkpoints 6 s" in goodput.sentence(f)
    adds_up(f)


def test_a_server_restart_keeps_the_logged_figures_and_replays_the_same() -> None:
    """The state image keeps the ledger; a new process restores it, the agents resume their
    round, and the job goes on being counted: a hang after the restart costs what it should,
    and replaying the log (the process before the restart, then this one) from any cut agrees."""
    h = Harness(machine=Recording())
    a, b = crash_then_restart(h)
    held = {c: h.last(c, Assignment) for c in (a, b)}
    before = figures(h)
    at(h, 80.0)
    h.send(a, progress(1, 110))
    # The server restarts at t=80: a snapshot of its state, read by a new process.
    image = msgpack.unpackb(msgpack.packb(state_image.dump(h.machine)), raw=False)
    old = h.machine
    h.machine = state_image.load(image, Recording())
    h.machine.records = list(old.records)  # type: ignore[attr-defined]
    h._apply(h.machine.handle(Restarted(), h.now))
    job = h.machine.jobs["job"]
    assert job.goodput == old.jobs["job"].goodput  # the logged part, all of it
    assert job.goodput.volatile_since == 80.0
    again = figures(h)
    moving = ("wall_s", "training_s", "goodput")
    assert {k: v for k, v in again.items() if k not in moving} == {
        k: v for k, v in before.items() if k not in moving
    }
    assert again["training_s"] == before["training_s"] + 10.0  # training went on meanwhile
    at(h, 83.0)
    conns = {}
    for c, node in ((a, "node1"), (b, "node2")):
        new = h.connect()
        h.send(new, Resume(join=join_msg(new, node, **KW), assignment=held[c]))  # type: ignore[arg-type]
        assert h.last(new, Resumed) is not None
        conns[c] = new
    hang_in_round_1(h, conns[a], conns[b])
    f = figures(h)
    assert f["causes"]["hang"]["steps_lost"] == 10  # 190 was reported after the restart
    assert f["causes"]["hang"]["seconds"] == 45.0
    adds_up(f)
    replays_from_every_cut(h.machine.records, h.machine)  # type: ignore[attr-defined]


def test_an_image_from_before_goodput_is_adopted_from_its_last_event() -> None:
    h = Harness()
    crash_then_restart(h)
    at(h, 90.0)
    image = state_image.dump(h.machine)
    for j in image["jobs"]:
        del j["goodput"]
    m = state_image.load(image, Rendezvous())
    job = m.jobs["job"]
    assert job.goodput.known_from == 63.0  # the round event of round 1, its last
    f = goodput.figures(job, 90.0)
    # Whether the round had stepped is not known: its time is the rounds' (no training figure)
    # until its next summary with a step.
    assert f["unknown_s"] == 63.0 and f["stage"] == "startup" and f["ran_s"] == 27.0
    assert "the first 1 min 3 s not accounted" in goodput.sentence(f)


def test_status_table_and_api_show_the_breakdown() -> None:
    h = Harness()
    crash_then_restart(h)
    at(h, 80.0)
    j = find_job(h.machine, "job", mono_now=h.now, wall_now=WALL0 + h.now)
    assert j is not None
    conforms(j, "Job")
    g = j["goodput"]
    assert g["since"] == WALL0 and g["volatile_since"] is None
    assert [p[1] for p in g["series"]] == [0, 100, 91]  # first step, step 100 (99 merged), round 1
    assert g["series"][0][0] == WALL0 + 11.0
    assert g["text"].startswith("goodput 69.4 % over 1 min 20 s: 1 failure cost 14 s and 10 steps")
    assert "  " + g["text"] in tables.format_job(j).splitlines()
    doc = jobs_view(h.machine, mono_now=h.now, wall_now=WALL0 + h.now)
    conforms(doc, "JobList")
    listed = tables.format_jobs(doc)
    assert "69.4 %" in listed.splitlines()[3] and f"job: {g['text']}" in listed


def test_the_series_stays_bounded_and_covers_the_whole_job() -> None:
    h = Harness()
    a = h.join(**KW)
    b = h.join(**KW)
    for i in range(3000):
        at(h, 10.0 + i)
        h.send(a, progress(0, i))
        h.send(b, progress(0, i))
    g = h.machine.jobs["job"].goodput
    assert len(g.series_t) <= goodput.SERIES_MAX
    assert g.series_t[0] == 10.0 and g.series_t[-1] >= 10.0 + 2999 - g.series_every
    assert g.series_s == sorted(g.series_s)


def test_metrics_show_goodput_and_badput_by_cause_within_the_per_job_bound() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from rdzv_server.metrics import make_registry, render

    h = Harness()
    crash_then_restart(h)
    at(h, 80.0)
    other = h.join(job="quiet", min_nodes=1, max_nodes=1)  # a job with no progress, one node
    assert h.last(other, Assignment) is not None

    def scrape(jobs: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        body, _ = render(make_registry(lambda: h.machine, lambda: h.now, jobs=jobs), None)
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples
        }

    got = scrape(jobs=1)  # the bound: one job (the larger one, "job")
    assert got[("rdzv_goodput_training_seconds", ())] == 55.5
    assert got[("rdzv_goodput_wall_seconds", ())] == 80.0  # "quiet" reports no progress
    assert got[("rdzv_badput_seconds", (("cause", "worker_crash"),))] == 13.5
    assert got[("rdzv_badput_seconds", (("cause", "startup"),))] == 9.0
    assert got[("rdzv_job_goodput_ratio", (("job", "job"),))] == 0.6937
    assert got[("rdzv_job_badput_seconds", (("cause", "worker_crash"), ("job", "job")))] == 13.5
    assert got[("rdzv_job_restarts_by_cause", (("cause", "worker_crash"), ("job", "job")))] == 1
    assert got[("rdzv_job_steps_lost", (("job", "job"),))] == 10
    assert not any(labels and dict(labels).get("job") == "quiet" for _, labels in got)
    assert ("rdzv_job_wall_seconds", (("job", "quiet"),)) in scrape(jobs=2)
    assert not any(name.startswith("rdzv_job_") for name, _ in scrape(jobs=0))
