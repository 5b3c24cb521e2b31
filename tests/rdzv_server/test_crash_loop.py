"""Crash loops: restarts in a row that make no step progress end the job with a distinct code."""

from __future__ import annotations

import msgpack

from protocol import Assignment, JobFailed, Restart, WorkersFailed
from rdzv_server import state_image
from rdzv_server.machine.history import EventKind
from rdzv_server.machine.state import JobPhase, Rendezvous

from .harness import Harness, failure
from .test_journal import Recording, replayed, state

KW = dict(min_nodes=2, max_nodes=2, max_restarts=10)


def fail_round(h: Harness, conns: list[int], step: int, **kw: object) -> None:
    """The round running now fails on the first node, which reports ``step``; all re-join."""
    job = h.machine.jobs["job"]
    h.send(conns[0], WorkersFailed(round=job.round, failure=failure(), step=step))
    if job.phase is JobPhase.GATHERING:
        for c in conns:
            h.join(c, **{**KW, **kw})


def start(h: Harness, **kw: object) -> list[int]:
    conns = [h.join(**{**KW, **kw}) for _ in range(2)]
    assert all(h.last(c, Assignment) for c in conns)
    return conns


def test_three_restarts_without_step_progress_fail_the_job_as_a_crash_loop() -> None:
    h = Harness()
    a, b = start(h)
    fail_round(h, [a, b], 41)  # progress (from none to 41): no count
    fail_round(h, [a, b], 41)
    fail_round(h, [a, b], 12)  # a restart from a checkpoint that dies earlier: no progress either
    job = h.machine.jobs["job"]
    assert job.phase is JobPhase.RUNNING and job.stuck_restarts == 2
    fail_round(h, [a, b], -1)  # died before any step
    assert job.phase is JobPhase.FAILED and job.fail_code == "crash_loop"
    for c in (a, b):
        got = h.last(c, JobFailed)
        assert got is not None and got.code == "crash_loop"
        assert got.reason.startswith("3 restarts in a row made no step progress (stuck at step 41)")
    e = [e for e in job.history if e.kind is EventKind.CRASH_LOOP]
    assert len(e) == 1 and (e[0].restarts, e[0].step) == (3, 41)
    assert job.restart_count == 3  # the budget (10) was not burnt


def test_a_step_increase_resets_the_count() -> None:
    h = Harness()
    a, b = start(h)
    fail_round(h, [a, b], 10)
    fail_round(h, [a, b], 10)
    fail_round(h, [a, b], 10)
    fail_round(h, [a, b], 11)  # progress: the count starts over
    job = h.machine.jobs["job"]
    assert job.stuck_restarts == 0 and job.best_step == 11
    fail_round(h, [a, b], 11)
    fail_round(h, [a, b], 11)
    assert job.phase is JobPhase.RUNNING and job.stuck_restarts == 2
    assert h.last(a, Restart) is not None


def test_a_job_that_never_reports_a_step_is_never_in_a_crash_loop() -> None:
    h = Harness()
    a, b = start(h)
    for _ in range(5):
        fail_round(h, [a, b], -1)
    job = h.machine.jobs["job"]
    assert job.phase is JobPhase.RUNNING and job.restart_count == 5 and job.fail_code == ""


def test_crash_loop_restarts_0_turns_it_off_and_the_setting_is_the_jobs() -> None:
    h = Harness()
    a, b = start(h, crash_loop_restarts=0)
    for _ in range(6):
        fail_round(h, [a, b], 5, crash_loop_restarts=0)
    assert h.machine.jobs["job"].phase is JobPhase.RUNNING
    h2 = Harness()
    a, b = start(h2, crash_loop_restarts=1)
    fail_round(h2, [a, b], 5, crash_loop_restarts=1)
    fail_round(h2, [a, b], 5, crash_loop_restarts=1)
    got = h2.last(a, JobFailed)
    assert (
        got is not None
        and got.code == "crash_loop"
        and got.reason.startswith("1 restart in a row made no step progress")
    )


def test_a_second_failure_of_the_same_round_counts_once() -> None:
    h = Harness()
    a, b = start(h)
    fail_round(h, [a, b], 7)
    h.send(a, WorkersFailed(round=1, failure=failure(), step=7))
    h.send(b, WorkersFailed(round=1, failure=failure(), step=7))  # the same round: ignored
    assert h.machine.unchanged and h.machine.jobs["job"].stuck_restarts == 1


def test_the_counters_survive_a_snapshot_and_a_replay() -> None:
    h = Harness(machine=Recording())
    a, b = start(h)
    fail_round(h, [a, b], 41)
    fail_round(h, [a, b], 41)
    m = h.machine
    again = replayed(m.records)
    assert state(again) == state(m)
    loaded = state_image.load(msgpack.unpackb(msgpack.packb(state_image.dump(m)), raw=False), Rendezvous())
    job = loaded.jobs["job"]
    assert (job.best_step, job.stuck_restarts) == (41, 1)
    assert job.settings.crash_loop_restarts == 3


def test_a_snapshot_from_before_crash_loops_loads_with_the_defaults() -> None:
    h = Harness()
    start(h)
    data = msgpack.unpackb(msgpack.packb(state_image.dump(h.machine)), raw=False)
    for j in data["jobs"]:
        for key in ("best_step", "stuck_restarts", "fail_code"):
            del j[key]
        for key in ("straggler_threshold", "exclude_stragglers", "crash_loop_restarts"):
            del j["settings"][key]
    job = state_image.load(data, Rendezvous()).jobs["job"]
    assert (job.best_step, job.stuck_restarts, job.fail_code) == (-1, 0, "")
    s = job.settings
    assert (s.straggler_threshold, s.exclude_stragglers, s.crash_loop_restarts) == (0.75, False, 3)
