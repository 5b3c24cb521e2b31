"""Training progress, stragglers and hangs on every surface of the server: the status API
(``/v1/jobs``, ``/v1/jobs/ID``), ``rdzv-server status``'s tables and ``/metrics``.

The machine is driven the way agents drive it: Progress, HangDetected and Stacks frames from
joined members, through the fake-clock harness, or over a real socket to a live server.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from protocol import Assignment, CollectStacks, HangDetected, Progress, Stacks, WorkersFailed
from rdzv_server import tables
from rdzv_server.machine.state import JobPhase
from rdzv_server.service import RendezvousService
from rdzv_server.status import STRAGGLERS_SHOWN, age_state, find_job, jobs_view

from .harness import Harness, failure
from .test_http import FakeClock, Watch, parse_metrics, running_job
from .test_status import WALL0, conforms

# --- helpers ------------------------------------------------------------------------------


def progress(
    rnd: int = 0,
    step: int = 10,
    compute: tuple[float, ...] = (100.0, 100.0),
    **kw: Any,
) -> Progress:
    fields: dict[str, Any] = dict(
        round=rnd,
        min_step=step,
        max_step=step,
        step_p50_ms=120.0,
        step_p90_ms=150.0,
        compute_ms=compute,
    )
    fields.update(kw)
    return Progress(**fields)


def running(h: Harness, n: int = 2, nproc: int = 2, **kw: Any) -> list[int]:
    """``n`` nodes of ``nproc`` ranks in round 0 of job "job"."""
    kw = {"min_nodes": n, "max_nodes": n, "max_restarts": 5, "nproc": nproc, **kw}
    conns = [h.join(**kw) for _ in range(n)]
    h.advance(0.1)
    assert all(h.last(c, Assignment) for c in conns)
    return conns


def job(h: Harness, job_id: str = "job") -> dict[str, Any]:
    found = find_job(h.machine, job_id, mono_now=h.now, wall_now=WALL0 + h.now)
    assert found is not None
    json.dumps(found)
    conforms(found, "Job")
    return found


def member(j: dict[str, Any], node: str) -> dict[str, Any]:
    (m,) = [m for m in j["members"] if m["node_id"] == node]
    return m


# --- progress -----------------------------------------------------------------------------


def test_job_and_nodes_show_step_lag_phase_age_and_rate() -> None:
    h = Harness()
    a, b = running(h)
    j = job(h)
    assert j["progress"] is None and member(j, "node1")["progress"] is None
    assert j["stragglers"]["flagged"] == [] and j["hang"] is None
    h.now = 10.0
    h.send(a, progress(step=100, min_step=98, phase="compute"))
    h.send(b, progress(step=90, age_ms=500.0, phase="data"))
    h.now = 15.0
    h.send(a, progress(step=150, min_step=149))
    h.now = 16.0
    j = job(h)
    p = j["progress"]
    assert (p["step"], p["min_step"], p["best_step"], p["round"], p["nodes_reporting"]) == (
        150,
        90,
        150,
        0,
        2,
    )
    assert p["steps_per_s"] == pytest.approx(10.0)  # 100 -> 150 in 5 s
    # node2 is the one whose progress is oldest: its age grew from 0.5 s at receipt by 6 s
    assert p["last_progress_age_s"] == pytest.approx(6.5) and p["phase"] == "data"
    na, nb = member(j, "node1")["progress"], member(j, "node2")["progress"]
    assert (na["step"], na["min_step"], na["lag"], na["phase"]) == (150, 149, 0, "")
    assert (nb["step"], nb["lag"], nb["phase"], nb["age_s"]) == (90, 60, "data", 6.5)
    assert (nb["step_p50_ms"], nb["step_p90_ms"]) == (120.0, 150.0)
    assert na["age_state"] == "ok" and nb["age_state"] == "late"  # 6.5 s > 2 x 0.15 + 2
    # the summary: the job's best step, cheaply; no node is named
    (listed,) = jobs_view(h.machine, mono_now=h.now, wall_now=WALL0)["jobs"]
    assert listed["step"] == 150 and listed["hang_round"] is None


def test_age_verdict_is_relative_to_the_nodes_step_time() -> None:
    assert age_state(0.0, 0.0, -1) == "none"  # no step yet
    # with a p90 of 10 s: ok up to 2 x 10 + 2, late up to max(5 x 10, 60) + 2, then stalled
    assert [age_state(t, 10_000.0, 5) for t in (21.9, 22.1, 61.9, 62.1)] == ["ok", "late", "late", "stalled"]
    # 100 s steps: stalled only past 5 x 100 + 2
    assert [age_state(t, 100_000.0, 5) for t in (203.0, 501.0, 503.0)] == ["late", "late", "stalled"]
    # no p90 yet (the first interval): ok for a minute, then late, never stalled
    assert [age_state(t, 0.0, 0) for t in (61.0, 63.0, 86_400.0)] == ["ok", "late", "late"]


def test_the_table_shows_step_and_age_per_node_and_a_training_line() -> None:
    h = Harness()
    a, b = running(h)
    h.now = 1.0
    h.send(a, progress(step=41))
    h.send(b, progress(step=37, min_step=35, phase="\u202echeckpoint"))
    h.now = 100.0
    text = tables.format_job(job(h))
    head = next(line for line in text.splitlines() if line.startswith("NODE"))
    assert "STEP" in head and "AGE" in head
    row2 = next(line for line in text.splitlines() if line.startswith("node2"))
    # the slowest-fastest rank range, a stalled age, the lag and the escaped phase
    assert "35-37" in row2 and "1m39s!!" in row2 and "4 behind" in row2
    assert "in \\u202echeckpoint" in row2 and "\u202e" not in text
    assert "training: step 41 (slowest rank at 35)" in text


# --- stragglers ---------------------------------------------------------------------------


def test_a_rank_twice_as_slow_is_flagged_on_every_surface() -> None:
    h = Harness()
    a, b = running(h)
    h.now = 1.0
    h.send(a, progress(compute=(100.0, 100.0)))
    h.now = 2.0  # the server checks a job's stragglers at most once a second
    h.send(b, progress(compute=(100.0, 200.0)))
    j = job(h)
    st = j["stragglers"]
    assert (st["threshold"], st["scored"], st["flagged_total"]) == (0.75, 4, 1)
    assert st["flagged"] == [
        {"rank": 3, "node_id": "node2", "local_rank": 1, "compute_ms": 200.0, "score": 0.5}
    ]
    s2 = member(j, "node2")["progress"]["straggler"]
    assert s2 == {"rank": 3, "local_rank": 1, "compute_ms": 200.0, "score": 0.5, "flagged": True}
    assert member(j, "node1")["progress"]["straggler"]["flagged"] is False
    (event,) = [e for e in j["history"] if e["kind"] == "straggler"]
    assert (event["node"], event["ranks"], event["scores"], event["round"]) == ("node2", [3], [0.5], 0)
    text = tables.format_job(j)
    assert "rank 3 (local rank 1) on node2: score 0.50, 200ms compute per step" in text
    assert "straggler: rank 3 at 0.50" in next(x for x in text.splitlines() if x.startswith("node2"))


def test_a_balanced_job_flags_nobody() -> None:
    h = Harness()
    a, b = running(h)
    h.now = 1.0
    h.send(a, progress(compute=(100.0, 104.0)))
    h.send(b, progress(compute=(98.0, 101.0)))
    j = job(h)
    assert j["stragglers"]["scored"] == 4 and j["stragglers"]["flagged"] == []
    assert all(not m["progress"]["straggler"]["flagged"] for m in j["members"])
    assert "stragglers" not in tables.format_job(j)


def test_a_big_job_lists_a_bounded_number_of_stragglers_slowest_first() -> None:
    h = Harness()
    conns = running(h, n=4, nproc=64)
    h.now = 1.0
    for i, c in enumerate(conns):
        # node 4's ranks are all slow, at different speeds: 64 flagged of 256
        compute = tuple(100.0 for _ in range(64)) if i < 3 else tuple(200.0 + r for r in range(64))
        h.send(c, progress(compute=compute))
    st = job(h)["stragglers"]
    assert st["flagged_total"] == 64 and len(st["flagged"]) == STRAGGLERS_SHOWN == 64
    assert st["flagged"][0]["rank"] == 255 and st["flagged"][-1]["rank"] == 192
    text = tables.format_job(job(h))
    assert "... and 54 more" in text


# --- metrics over a live server -----------------------------------------------------------


async def test_metrics_aggregate_progress_hangs_and_stragglers_without_ids() -> None:
    clock = FakeClock()
    svc = RendezvousService(http=True, clock=clock)
    port = await svc.start("127.0.0.1", 0)
    watch = Watch(svc)
    import aiohttp

    try:
        a, b = await running_job(port, ["a", "b"], job="secret-job-name")
        c, d = await running_job(port, ["c", "d"], job="other")
        a.send(progress(step=5, compute=(100.0, 100.0)))
        b.send(progress(step=5, compute=(100.0, 300.0), age_ms=2000.0))
        c.send(progress(step=7))
        jobs = svc.machine.jobs
        await watch.until(lambda: len(jobs["secret-job-name"].progress.nodes) == 2)
        await watch.until(lambda: len(jobs["other"].progress.nodes) == 1)
        clock.now += 30.0
        c.send(HangDetected(round=0, ranks=(0,), step=7, phase="compute", silent_s=30.0))
        await c.expect(CollectStacks)
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            async with http.get("/metrics") as r:
                text = await r.text()
        m = parse_metrics(text)
        assert "secret-job-name" not in text and "other" not in text
        assert m[("rdzv_jobs_reporting_progress", ())] == 2
        assert m[("rdzv_jobs_hung", ())] == 1
        assert m[("rdzv_stragglers_flagged", ())] == 1
        # b's progress was 2 s old when it arrived, 30 s ago; c's arrived 30 s ago
        assert m[("rdzv_progress_age_max_seconds", ())] == pytest.approx(32.0)
        assert m[("rdzv_progress_age_seconds_bucket", (("le", "15"),))] == 0
        assert m[("rdzv_progress_age_seconds_bucket", (("le", "60"),))] == 2
        assert m[("rdzv_progress_age_seconds_gcount", ())] == 2
        del d
    finally:
        await svc.close()


async def test_metrics_per_job_only_when_asked_and_for_at_most_that_many_jobs() -> None:
    from rdzv_server.http_app import Access

    clock = FakeClock()
    svc = RendezvousService(http=True, clock=clock, http_access=Access(metrics_jobs=1))
    port = await svc.start("127.0.0.1", 0)
    watch = Watch(svc)
    import aiohttp

    try:
        a, b = await running_job(port, ["a", "b"], job="alpha")
        c, _d = await running_job(port, ["c", "d"], job="beta")
        a.send(progress(step=5, compute=(100.0, 100.0)))
        b.send(progress(step=4, compute=(100.0, 300.0)))
        c.send(progress(step=9))
        jobs = svc.machine.jobs
        await watch.until(
            lambda: len(jobs["alpha"].progress.nodes) == 2 and len(jobs["beta"].progress.nodes) == 1
        )
        clock.now += 10.0
        b.send(HangDetected(round=0, ranks=(3,), step=4, phase="compute", silent_s=30.0))
        await b.expect(CollectStacks)
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            async with http.get("/metrics") as r:
                text = await r.text()
        m = parse_metrics(text)
        job = (("job", "alpha"),)
        assert m[("rdzv_job_step", job)] == 5
        assert m[("rdzv_job_progress_age_seconds", job)] == pytest.approx(10.0)
        assert m[("rdzv_job_stragglers", job)] == 1
        assert m[("rdzv_job_hung", job)] == 1
        assert "beta" not in text  # past the limit of 1: the series stay bounded
    finally:
        await svc.close()


# --- hangs --------------------------------------------------------------------------------

# What faulthandler writes for a rank (dump_traceback(all_threads=True)): the hung rank sleeps
# outside any collective; the others wait in all_reduce.
SLEEPING = """Thread 0x00007f3a1c2b5700 (most recent call first):
  File "/usr/lib/python3.12/threading.py", line 355 in wait
  File "/usr/lib/python3.12/threading.py", line 655 in wait

Current thread 0x00007f3a2d4e6740 (most recent call first):
  File "/job/train.py", line 41 in stuck
  File "/job/train.py", line 60 in main
  File "/job/train.py", line 70 in <module>
"""
ALL_REDUCE = """Current thread 0x00007f{tid}2d4e6740 (most recent call first):
  File "/venv/torch/distributed/distributed_c10d.py", line 2501 in all_reduce
  File "/job/train.py", line 55 in main
  File "/job/train.py", line 70 in <module>
"""


def stacks(rnd: int, ranks: tuple[int, ...], texts: tuple[str, ...], step: int = 20) -> Stacks:
    n = len(ranks)
    return Stacks(
        round=rnd,
        ranks=ranks,
        steps=(step,) * n,
        phases=("compute",) * n,
        silent_s=(30.0,) * n,
        stacks=texts,
    )


def hung_job(h: Harness) -> tuple[int, int]:
    a, b = running(h)
    h.now = 5.0
    h.send(a, progress(step=20))
    h.send(b, progress(step=20))
    h.now = 35.0
    h.send(b, HangDetected(round=0, ranks=(3,), step=20, phase="compute", silent_s=30.0))
    assert h.last(a, CollectStacks) and h.last(b, CollectStacks)
    return a, b


def test_a_hang_is_shown_with_its_ranks_and_who_reported_it() -> None:
    h = Harness()
    hung_job(h)
    h.now = 36.0
    j = job(h)
    hang = j["hang"]
    assert (hang["round"], hang["node_id"], hang["ranks"], hang["step"], hang["phase"]) == (
        0,
        "node2",
        [3],
        20,
        "compute",
    )
    assert hang["silent_s"] == 30.0 and hang["ago"] == 1.0 and hang["detected_at"] == WALL0 + 35.0
    assert "rank 3 on node node2 made no progress for 30 s" in hang["reason"]
    assert hang["report"] is None and hang["nodes_reported"] == 0  # no stacks yet
    (listed,) = jobs_view(h.machine, mono_now=h.now, wall_now=WALL0)["jobs"]
    assert listed["hang_round"] == 0
    (event,) = [e for e in j["history"] if e["kind"] == "hang"]
    assert (event["ranks"], event["step"], event["phase"], event["silent_s"]) == ([3], 20, "compute", 30.0)
    text = tables.format_job(j)
    assert "hang in round 0 (1.0s ago): ranks 3 made no progress for 30s (step 20, phase compute)" in text
    assert "first reported by node2" in text


def test_the_report_merges_stacks_and_names_the_odd_rank_out() -> None:
    h = Harness()
    a, b = hung_job(h)
    h.send(a, stacks(0, (0, 1), (ALL_REDUCE.format(tid="00"), ALL_REDUCE.format(tid="01"))))
    h.send(b, stacks(0, (2, 3), (ALL_REDUCE.format(tid="02"), SLEEPING)))
    j = job(h)
    hang = j["hang"]
    assert hang["nodes_reported"] == 2 and hang["nodes_dropped"] == 0
    r = hang["report"]
    assert r["suspects"] == [3] and r["groups_total"] == 2
    odd, rest = r["groups"]
    assert (odd["ranks"], odd["ranks_total"], odd["odd"]) == ([3], 1, True)
    assert odd["frames"][0] == "stuck (/job/train.py:41)" and odd["stack"] == SLEEPING
    assert (rest["ranks"], rest["odd"]) == ([0, 1, 2], False)  # thread ids do not split a group
    assert rest["frames"][0].startswith("all_reduce (") and rest["frames"][0].endswith(
        "distributed_c10d.py:2501)"
    )
    text = tables.format_job(j)
    assert "suspects: rank 3 (stacks from 2 nodes)" in text
    lines = text.splitlines()
    i = lines.index("  odd one out: rank 3:")
    assert lines[i + 1].strip() == "stuck (/job/train.py:41)"
    assert "  ranks 0,1,2 (3 ranks):" in lines


def test_py_spy_stacks_group_by_the_main_thread() -> None:
    h = Harness()
    a, b = hung_job(h)
    spy = 'Process 4242: python train.py\nThread 4242 (idle): "MainThread"\n    {fn} ({file}:{line})\n'
    h.send(a, stacks(0, (0, 1), tuple(spy.format(fn="all_reduce", file="c10d.py", line=9) for _ in "ab")))
    h.send(b, stacks(0, (2, 3), (spy.format(fn="all_reduce", file="c10d.py", line=9), "garbage \x1b[2J")))
    r = job(h)["hang"]["report"]
    odd, rest = r["groups"]
    assert odd["ranks"] == [3] and odd["frames"] == ["garbage ?[2J"]  # kept whole (escaped), opaque
    assert rest["frames"] == ["all_reduce (c10d.py:9)"] and rest["ranks_total"] == 3
    # the terminal escape in a peer's text never reaches the table
    text = tables.format_job(job(h))
    assert "garbage ?[2J" in text and "\x1b" not in text


def test_a_hang_report_stays_bounded_whatever_the_nodes_send() -> None:
    h = Harness()
    conns = running(h, n=100, nproc=32)
    h.now = 1.0
    j = h.machine.jobs["job"]
    first = {j.members[nid].conn: i * 32 for i, nid in enumerate(j.order)}  # each node's ranks
    h.send(conns[0], HangDetected(round=0, ranks=(first[conns[0]],), step=1, phase="", silent_s=9.0))
    for i, c in enumerate(conns):
        # every rank a different 2 KiB stack: nothing merges
        texts = tuple(
            f'Current thread 0x1 (most recent call first):\n  File "f{i}_{r}.py", line 1 in x\n' + "#" * 1900
            for r in range(32)
        )
        h.send(c, stacks(0, tuple(range(first[c], first[c] + 32)), texts))
    hang = job(h)["hang"]
    assert hang["nodes_reported"] + hang["nodes_dropped"] == 100 and hang["nodes_reported"] <= 64
    r = hang["report"]
    assert len(r["groups"]) == 32 and r["groups_total"] == hang["nodes_reported"] * 32
    assert len(json.dumps(hang)) < 128 * 1024


# --- crash loops --------------------------------------------------------------------------


def test_the_crash_loop_count_and_its_end_are_shown() -> None:
    h = Harness()
    a, b = running(h, max_restarts=10)

    def fail(step: int) -> None:
        h.send(a, WorkersFailed(round=h.machine.jobs["job"].round, failure=failure(node="node1"), step=step))
        if h.machine.jobs["job"].phase is JobPhase.GATHERING:
            for c in (a, b):
                h.join(c, min_nodes=2, max_nodes=2, max_restarts=10)

    fail(41)
    fail(41)
    j = job(h)
    assert j["crash_loop"] == {"restarts_without_progress": 1, "limit": 3, "best_step": 41}
    assert j["fail_code"] is None
    assert "crash loop: 1/3 restarts in a row made no progress past step 41" in tables.format_job(j)
    fail(40)
    fail(41)
    j = job(h)
    assert j["phase"] == "failed" and j["fail_code"] == "crash_loop"
    assert "3 restarts in a row made no step progress (stuck at step 41)" in j["outcome"]
    (event,) = [e for e in j["history"] if e["kind"] == "crash_loop"]
    assert (event["restarts"], event["step"]) == (3, 41)


def test_a_forgotten_job_keeps_its_last_hang_report_with_one_stack_per_group() -> None:
    h = Harness()
    a, b = hung_job(h)
    h.send(a, stacks(0, (0, 1), (ALL_REDUCE.format(tid="00"), ALL_REDUCE.format(tid="01"))))
    h.send(b, stacks(0, (2, 3), (ALL_REDUCE.format(tid="02"), SLEEPING)))
    before = job(h)["hang"]["report"]
    h.drop(a)
    h.drop(b)
    (listed,) = jobs_view(h.machine, mono_now=h.now, wall_now=WALL0)["jobs"]
    assert listed["forgotten"] and listed["hang_round"] == 0
    old = job(h)
    assert old["progress"] is None  # volatile: gone with the job; the evidence of its hang stays
    report = old["hang"]["report"]
    assert report["suspects"] == before["suspects"] == [3]
    assert [(g["ranks"], g["frames"]) for g in report["groups"]] == [
        (g["ranks"], g["frames"]) for g in before["groups"]
    ]
    kept = h.machine.finished_jobs[-1].hang
    assert kept is not None and kept.text_kept == len(ALL_REDUCE.format(tid="00")) + len(SLEEPING)


def test_stacks_naming_no_rank_still_show_the_hang() -> None:
    h = Harness()
    a, _b = hung_job(h)
    h.send(a, stacks(0, (), ()))
    hang = job(h)["hang"]
    assert hang["report"] == {"suspects": [3], "groups": [], "groups_total": 0}
    assert "suspects: rank 3 (stacks from 1 node)" in tables.format_job(job(h))


def test_a_commit_point_is_shown_while_under_way_and_in_the_history_after() -> None:
    from protocol import Armed, StopAt, WorkersCommitted

    h = Harness()
    kw = dict(min_nodes=1, max_nodes=4, max_restarts=5, heartbeat_timeout=600.0)
    a, b = h.join(**kw), h.join(**kw)
    h.advance(10.0)  # the settle window closes: round 0 runs
    for c in (a, b):
        assert h.last(c, Assignment) is not None
        h.take(c)
        h.send(c, progress(step=40, checks=True))
    h.join(**kw)
    h.advance(5.0)  # the newcomer's settle window closes
    (arm,) = [m for m in h.take(a) if isinstance(m, StopAt)]
    j = job(h)
    c = j["commit"]
    assert (c["step"], c["state"], c["armed"], c["nodes"], c["drains"]) == (arm.step, "arming", 0, 2, [])
    assert c["reason"] == "node(s) joined: node3" and 300 < c["deadline_in_s"] < 310
    text = tables.format_job(j)
    assert f"commit point: every rank stops at step {arm.step} for: node(s) joined: node3" in text
    assert "(0/2 nodes acknowledged;" in text
    for conn in (a, b):
        h.send(conn, Armed(round=0, step=arm.step, late=False))
    assert job(h)["commit"]["state"] == "stopping"
    for conn in (a, b):
        h.send(conn, WorkersCommitted(round=0, step=arm.step))
    j = job(h)
    assert j["commit"] is None and j["restart_count"] == 0
    done = [e for e in j["history"] if e["kind"] == "commit"]
    assert [e["step"] for e in done] == [arm.step, arm.step]
    assert f"committed at step {arm.step} for: node(s) joined: node3" in done[-1]["text"]
    assert "commit point: every rank stops" not in tables.format_job(j)


def test_the_text_status_shows_the_snapshot_step_the_json_and_the_dashboard_show() -> None:
    """Issue 42 item 8: `rdzv-server status` (text) had no snapshot line."""
    from protocol import SnapshotsHeld

    h = Harness()
    a, b = h.join(max_restarts=1), h.join(max_restarts=1)
    for c in (a, b):
        got = h.last(c, Assignment)
        assert isinstance(got, Assignment)
        ranks = (got.rank_offset, got.rank_offset + 1)  # its own ranks: believed
        h.send(c, SnapshotsHeld(world_size=4, ranks=ranks, steps=(12, 12)))
    j = job(h)
    assert j["snapshot"]["step"] == 12 and j["snapshot"]["kept_step"] is None
    assert "snapshots: every rank can restore step 12 (newest since" in tables.format_job(j)
    assert "none on two nodes yet" in tables.format_job(j)
