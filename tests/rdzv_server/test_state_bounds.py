"""What one job and one server may cost, whatever their peers send (issue 17, items 3, 5, 13, 14).

Every collection the machine keeps per job or per server has a cap, every text it keeps or
builds is cut to its field with a marker, and a failing transition leaves the job as it was.
"""

from __future__ import annotations

import tracemalloc
from dataclasses import replace
from typing import Any

from protocol import (
    MAX_TEXT_LEN,
    Assignment,
    Drain,
    Error,
    JobFailed,
    Join,
    Leave,
    Left,
    Restart,
    WorkersFailed,
)
from rdzv_server.machine.state import (
    ENTRYPOINT_KEPT,
    FAILURE_TEXT_LEN,
    FAILURES_KEPT,
    HISTORY_LEN,
    HISTORY_TEXT_LEN,
    MAX_EXCLUDED,
    MAX_RESTARTS,
    MAX_SPARES,
    DrainRequested,
    JobPhase,
    Received,
    Rendezvous,
)
from rdzv_server.state_image import dump, load

from .harness import Harness, failure

# The documented cost of one job (README, "Running the server securely"): at most JOB_BYTES
# whatever its peers send, plus NODE_BYTES for each member or spare (each holds a connection).
JOB_BYTES = 900 * 1024
NODE_BYTES = 4 * 1024
WIDE = "\U0001f600"  # a 4-byte character: Python stores the whole string 4 bytes a character


def running(h: Harness, **kw: Any) -> tuple[int, int]:
    a, b = h.join(**kw), h.join(**kw)
    assert h.last(a, Assignment) is not None and h.last(b, Assignment) is not None
    return a, b


def fail_round(h: Harness, conn: int, message: str = "") -> None:
    rnd = h.machine.jobs["job"].round
    h.send(conn, WorkersFailed(round=rnd, failure=replace(failure(node=f"node{conn}"), message=message)))


def rejoin(h: Harness, conns: list[int], **kw: Any) -> None:
    for c in conns:
        h.join(c, node=f"node{c}", **kw)


def test_a_job_keeps_its_first_failure_the_last_few_and_a_count() -> None:
    h = Harness()
    kw = dict(max_restarts=10**6)
    a, b = running(h, **kw)
    for i in range(100):
        fail_round(h, a if i % 2 else b, message=f"failure {i} " + "x" * (MAX_TEXT_LEN - 20))
        rejoin(h, [a, b], **kw)
    job = h.machine.jobs["job"]
    assert job.phase is JobPhase.RUNNING and job.restart_count == 100
    assert job.failures_total == 100 and len(job.failures) == FAILURES_KEPT + 1
    firsts = [f.message.split(" ", 2)[1] for f in job.failures]
    assert firsts == ["0", *(str(i) for i in range(100 - FAILURES_KEPT, 100))]
    assert all(len(f.message) <= FAILURE_TEXT_LEN and "more characters]" in f.message for f in job.failures)


def test_history_lines_are_cut_and_the_history_is_a_ring() -> None:
    h = Harness()
    kw = dict(max_restarts=10**6, entrypoint="e" * MAX_TEXT_LEN)
    a, b = running(h, **kw)
    for _ in range(HISTORY_LEN):
        fail_round(h, a)
        rejoin(h, [a, b], **kw)
    job = h.machine.jobs["job"]
    assert len(job.history) == HISTORY_LEN
    assert all(len(e.text) <= HISTORY_TEXT_LEN for e in job.history)


def test_a_long_entrypoint_is_kept_cut_with_a_digest_and_still_compared_exactly() -> None:
    h = Harness()
    long = "python train.py " + "--flag " * 9000
    a = h.join(entrypoint=long)
    job = h.machine.jobs["job"]
    assert len(job.settings.entrypoint) <= ENTRYPOINT_KEPT and "sha256" in job.settings.entrypoint
    # Differing only past the kept prefix: refused, and the refusal fits its field.
    b = h.join(entrypoint=long + "x")
    err = h.last(b, Error)
    assert err is not None and err.code == "job_mismatch" and len(err.message) < 4 * ENTRYPOINT_KEPT
    c = h.join(entrypoint=long)  # the same one: served
    assert h.last(c, Assignment) is not None and h.last(a, Assignment) is not None


def test_a_refusal_quoting_two_entrypoints_of_64_kib_fits_its_field() -> None:
    h = Harness()
    h.join(entrypoint="a" * MAX_TEXT_LEN)
    b = h.join(entrypoint="b" * MAX_TEXT_LEN)
    err = h.last(b, Error)
    assert err is not None and err.code == "job_mismatch" and b in h.closed
    assert not any("internal error" in line for line in h.logs)


def test_max_restarts_is_clamped_to_the_servers_budget() -> None:
    h = Harness()
    a, _ = running(h, max_restarts=2**63 - 1)
    got = h.last(a, Assignment)
    assert got is not None and got.max_restarts == MAX_RESTARTS
    assert h.machine.jobs["job"].settings.max_restarts == MAX_RESTARTS


def test_a_server_holds_at_most_max_jobs_and_refuses_a_new_one_clearly() -> None:
    h = Harness(machine=Rendezvous(max_jobs=3))
    conns = [h.join(job=f"j{i}", min_nodes=1, max_nodes=1) for i in range(3)]
    extra = h.join(job="j3", min_nodes=1, max_nodes=1)
    err = h.last(extra, Error)
    assert err is not None and err.code == "too_many_jobs" and err.fatal and "3 jobs" in err.message
    assert set(h.machine.jobs) == {"j0", "j1", "j2"} and extra in h.closed
    assert all(h.last(c, Assignment) is not None for c in conns)
    # A job that ends and is forgotten makes room.
    h.send(conns[0], Leave())
    assert "j0" not in h.machine.jobs
    again = h.join(job="j3", min_nodes=1, max_nodes=1)
    assert h.last(again, Assignment) is not None


def test_spares_per_job_are_capped_by_its_size() -> None:
    h = Harness()
    a, b = running(h)  # max_nodes 2: at most 2 spares
    spares = [h.join(spare=True) for _ in range(2)]
    extra = h.join(spare=True)
    err = h.last(extra, Error)
    assert err is not None and err.code == "job_full" and extra in h.closed
    job = h.machine.jobs["job"]
    assert len(job.spares) == 2 and set(job.members) == {f"node{a}", f"node{b}"}
    assert extra not in h.machine.conns and all(c in h.machine.conns for c in spares)
    assert min(10**6, MAX_SPARES) == MAX_SPARES  # a large job is capped at MAX_SPARES


def test_excluded_nodes_are_capped() -> None:
    h = Harness()
    job_kw = dict(min_nodes=1, max_nodes=1, max_restarts=10**6, exclude_after=1)
    h.join(**job_kw)
    job = h.machine.jobs["job"]
    for i in range(MAX_EXCLUDED + 5):
        job.exclude(f"gone{i}", "its workers failed 1 times")
    assert len(job.excluded) == MAX_EXCLUDED and "gone0" not in job.excluded
    assert f"gone{MAX_EXCLUDED + 4}" in job.excluded


def test_a_leave_reason_of_64_kib_restarts_the_others_and_answers_the_node() -> None:
    h = Harness()
    kw = dict(min_nodes=1, max_nodes=3)
    a, b = h.join(**kw), h.join(**kw)
    h.advance(6.0)
    assert h.last(a, Assignment) is not None
    h.send(b, Leave(reason="r" * MAX_TEXT_LEN))
    left, restart = h.last(b, Left), h.last(a, Restart)
    assert left is not None and left.job_continues and b in h.closed
    assert (
        restart is not None and len(restart.reason) <= MAX_TEXT_LEN and "more characters]" in restart.reason
    )
    job = h.machine.jobs["job"]
    assert job.phase is JobPhase.GATHERING and set(job.members) == {f"node{a}"}
    h.join(a, node=f"node{a}", **kw)
    h.advance(6.0)
    assert h.last(a, Assignment) is not None and h.last(a, Assignment).round == job.round  # type: ignore[union-attr]


def test_1100_newcomers_are_summarised_in_the_restart_reason() -> None:
    h = Harness()
    kw = dict(min_nodes=1, max_nodes=2000, last_call_timeout=1.0)
    first = h.join(node="n" * 200 + "-0", **kw)
    h.advance(1.5)
    assert h.last(first, Assignment) is not None
    for i in range(1, 1101):
        h.join(node="n" * 200 + f"-{i}", **kw)
    h.advance(1.5)  # the settle window closes: everyone restarts once
    restart = h.last(first, Restart)
    assert restart is not None and "and 1,090 more" in restart.reason and len(restart.reason) < 4096
    h.join(first, node="n" * 200 + "-0", **kw)
    job = h.machine.jobs["job"]
    assert job.phase is JobPhase.RUNNING and len(job.order) == 1101  # the next round formed


def test_a_drain_reason_of_any_length_fits_the_drain() -> None:
    h = Harness()
    a, _ = running(h)
    h.take(a)
    h._apply(h.machine.handle(DrainRequested("job", f"node{a}", "why " * 10**6), h.now))
    drain = h.last(a, Drain)
    assert drain is not None and len(drain.reason) <= MAX_TEXT_LEN and "more characters]" in drain.reason


def test_a_member_cannot_name_another_node_as_its_failures_root_cause() -> None:
    h = Harness()
    a, b = running(h, max_restarts=3)
    forged = replace(failure(node=f"node{b}"), addr="10.0.0.2")  # a blames b
    h.send(a, WorkersFailed(round=0, failure=forged))
    job = h.machine.jobs["job"]
    assert [(f.node_id, f.addr) for f in job.failures] == [(f"node{a}", f"10.0.0.{a}")]
    assert any(f"on node node{a} (10.0.0.{a}) failed" in line for line in h.logs)
    assert job.members[f"node{a}"].failures == 1 and job.members[f"node{b}"].failures == 0


def test_peer_texts_are_escaped_in_the_servers_log() -> None:
    h = Harness()
    kw = dict(min_nodes=1, max_nodes=3)
    h.join(**kw)
    b = h.join(**kw)
    h.advance(6.0)
    h.send(b, Leave(reason="bye\n2024-01-01 INFO job job: node evil joined\x1b[2J"))
    leaving = [line for line in h.logs if "bye" in line]
    assert leaving and all("\n" not in line and "\x1b" not in line for line in h.logs)
    assert "bye\\n2024" in leaving[0] and "\\x1b[2J" in leaving[0]


def test_an_exception_in_a_transition_fails_that_job_only_and_is_said() -> None:
    h = Harness()
    a, b = running(h, max_restarts=3)
    other = h.join(job="other", min_nodes=1, max_nodes=1)
    h.advance(0.1)

    def broken(*args: object) -> None:
        raise ValueError("a bug")

    h.machine._on_failed = broken  # type: ignore[method-assign]
    h.send(a, WorkersFailed(round=0, failure=failure(node=f"node{a}")))
    job = h.machine.jobs["job"]
    assert job.phase is JobPhase.FAILED and job.fail_code == "internal_error"
    for x in (a, b):  # every agent of the job is told, and why: the rule that raised
        told = h.last(x, JobFailed)
        assert told is not None and told.code == "internal_error"
        # The rule: the innermost function of the server's own code (``broken`` is the test's).
        assert told.reason.startswith("internal error in _on_member_message (state.py line ")
        assert told.reason.endswith("handling workers_failed: ValueError: a bug")
    assert not h.closed  # its agents are told, not cut off
    assert any(line.startswith("job job: internal error in _on_member_message") for line in h.logs)
    assert h.machine.jobs["other"].phase is JobPhase.RUNNING and h.last(other, JobFailed) is None


def test_an_exception_before_a_peer_joined_refuses_that_peer() -> None:
    h = Harness()
    running(h)

    def broken(*args: object) -> None:
        raise ValueError("a bug")

    h.machine._authenticate = broken  # type: ignore[method-assign,assignment]
    c = h.connect()
    h.join(c, job="job")
    err = h.last(c, Error)
    assert err is not None and err.code == "internal_error" and c in h.closed
    said = [line for line in h.logs if line.startswith("internal error in _on_received")]
    assert said and "handling join" in said[0]
    assert h.machine.jobs["job"].phase is JobPhase.RUNNING  # no job is failed for a stranger


def test_the_snapshot_keeps_the_bounds_and_an_older_unbounded_one_still_loads() -> None:
    h = Harness()
    kw = dict(max_restarts=100)
    a, b = running(h, **kw)
    for _ in range(20):
        fail_round(h, a, "m" * 10)
        rejoin(h, [a, b], **kw)
    data = dump(h.machine)
    again = load(data)
    job = again.jobs["job"]
    assert job.failures_total == 20 and len(job.failures) == FAILURES_KEPT + 1
    assert dump(again) == data
    # An older server's snapshot: every failure, each message whole, no count, no secrets,
    # a control character in a failure's node id, the entrypoint whole.
    old = dump(h.machine)
    oj = old["jobs"][0]
    oj.pop("failures_total")
    for m in oj["members"]:
        m.pop("node_secret")
    oj["failures"] = [{**oj["failures"][0], "message": "y" * 60000, "node_id": "n\x1b"}] * 30
    oj["settings"]["entrypoint"] = "z" * 60000
    oj["history"] = [[1.0, "failure", "h" * 60000]] * 10
    loaded = load(old)
    lj = loaded.jobs["job"]
    assert lj.failures_total == 30 and len(lj.failures) == FAILURES_KEPT + 1
    assert all(len(f.message) <= FAILURE_TEXT_LEN and f.node_id == "n\\x1b" for f in lj.failures)
    assert len(lj.settings.entrypoint) <= ENTRYPOINT_KEPT
    assert all(len(e.text) <= HISTORY_TEXT_LEN for e in lj.history)


def _cost(build: Any) -> int:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        keep = build()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del keep
    return after - before


def test_one_job_costs_at_most_the_documented_bytes_whatever_its_peers_send() -> None:
    """The worst a job's peers can do: every kept text at its cap in 4-byte characters."""

    def worst(nodes: int) -> Rendezvous:
        h = Harness()
        node = WIDE * 250
        kw: dict[str, Any] = dict(
            min_nodes=nodes, max_nodes=nodes, max_restarts=10**6, entrypoint=WIDE * MAX_TEXT_LEN,
            last_call_timeout=0.0, exclude_after=0,
        )  # fmt: skip
        # Each node's own id, address and secret, at their caps.
        conns = [
            h.join(node=f"{node}{i:03}", addr=f"{WIDE * 253}{i:03}", **{**kw, "node_secret": f"{i:0128}"})
            for i in range(nodes)
        ]
        job = h.machine.jobs["job"]
        for i in range(HISTORY_LEN + FAILURES_KEPT + 5):
            rnd = job.round
            f = replace(failure(), message=WIDE * MAX_TEXT_LEN, error_file=WIDE * 4096, signal="S" * 64)
            h.send(conns[0], WorkersFailed(round=rnd, failure=f))
            for c in conns:
                m = job.members[h.machine.conns[c].node_id or ""]
                h.send(c, Join(**_join_of({**kw, "addr": m.addr, "node_secret": m.node_secret}, m.node_id)))
            assert job.phase is JobPhase.RUNNING and job.round == i + 1
        for i in range(MAX_EXCLUDED):
            job.exclude(f"{node}x{i}", "its workers failed 1000000 times " + WIDE * 20)
        job.outcome = WIDE * 4096
        h.inbox.clear()
        h.logs.clear()
        h.closed.clear()
        return h.machine

    one, many = _cost(lambda: worst(1)), _cost(lambda: worst(21))
    per_node = (many - one) / 20
    print(f"one job: {one:,} bytes with 1 node; {per_node:,.0f} bytes per more node")
    assert one <= JOB_BYTES + NODE_BYTES and per_node <= NODE_BYTES


def _join_of(kw: dict[str, Any], node_id: str) -> dict[str, Any]:
    return dict(
        job_id="job",
        node_id=node_id,
        nproc=2,
        master_port=29500,
        heartbeat_interval=1.0,
        heartbeat_timeout=5.0,
        **kw,
    )


def test_a_message_on_an_unknown_connection_is_our_bug_and_raises() -> None:
    """Not contained like a peer's input: no peer can send on a connection we do not have."""
    h = Harness()
    try:
        h.machine.handle(Received(999, Leave()), 0.0)
    except Exception as exc:  # a LocalError, raised: not contained, since no peer sent it
        assert "unknown connection" in str(exc)
    else:
        raise AssertionError("an event on an unknown connection was taken silently")
