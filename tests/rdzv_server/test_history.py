"""A job's history is typed: views read its fields, its sentences are only for people."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from protocol import Leave, WorkersFailed
from protocol.failure_text import describe_failure
from rdzv_server import state_image
from rdzv_server.machine.history import Departure, EventKind
from rdzv_server.machine.state import JobPhase, Rendezvous, Restarted
from rdzv_server.status import find_job

from .harness import Harness, failure
from .test_status import WALL0, conforms

DATA = Path(__file__).parent / "data"


def eventful() -> Harness:
    """Joins, a spare, a failure and restart, a lost node the spare replaces, a node leaving."""
    h = Harness()
    kw: dict[str, Any] = dict(min_nodes=2, max_nodes=3, max_restarts=3, last_call_timeout=1.0)
    a, b, c = h.join(**kw), h.join(**kw), h.join(**kw)
    h.advance(0.5)
    s = h.join(**{**kw, "spare": True})
    h.now += 1.0
    h.send(b, WorkersFailed(round=0, failure=failure(rank=2, node="node2")))
    for x in (a, b, c):
        h.join(x, **kw)
    h.advance(0.5)
    h.now += 1.0
    h.drop(c)  # lost: the spare takes its place
    for x in (a, b):
        h.join(x, **kw)
    h.advance(0.5)
    h.send(s, Leave(reason="scale down"))
    for x in (a, b):
        h.join(x, **kw)
    h.advance(1.5)
    return h


def facts(j: dict[str, Any]) -> dict[str, Any]:
    """What the status view says beside the history's own sentences."""
    return {
        "members": [
            (m["node_id"], m["role"], m["state"], m["addr"], m["nproc"], m["group_rank"], m["departed_at"])
            for m in j["members"]
            if m["role"] == "departed"
        ],
        "failures": [(f["round"], f["node_id"], f["description"]) for f in j["failures"]],
        "rounds": [(r["round"], r["started_at"], r["ended_at"], r["ended_by"]) for r in j["rounds"]],
    }


def view(m: Rendezvous, now: float) -> dict[str, Any]:
    found = find_job(m, "job", mono_now=now, wall_now=WALL0 + now)
    assert found is not None
    conforms(found, "Job")
    return found


def test_the_status_reads_facts_from_typed_fields_so_rewording_a_sentence_changes_none() -> None:
    h = eventful()
    before = view(h.machine, h.now)
    assert facts(before) == {
        "members": [
            ("node3", "departed", "lost", "10.0.0.3", 2, None, WALL0 + 3.0),
        ],
        "failures": [(0, "node2", "rank 2 (local rank 0) on node node2 (10.0.0.2) failed with exit code 1")],
        "rounds": [(0, WALL0, WALL0 + 1.5, "failure"), (1, WALL0 + 1.5, WALL0 + 3.0, "lost"),
                   (2, WALL0 + 3.0, WALL0 + 3.5, "left"), (3, WALL0 + 3.5, None, None)],
    }  # fmt: skip
    job = h.machine.jobs["job"]
    reworded = [replace(e, text=f"something else happened ({i})") for i, e in enumerate(job.history)]
    job.history.clear()
    job.history.extend(reworded)
    assert facts(view(h.machine, h.now)) == facts(before)


def test_history_events_carry_their_kind_and_facts() -> None:
    h = eventful()
    by_kind = [(e.kind, e.node, e.departure, e.spare) for e in h.machine.jobs["job"].history]
    assert (EventKind.LOST, "node3", Departure.LOST, False) in by_kind
    assert (EventKind.LEFT, "node4", Departure.LEFT, False) in by_kind
    joined = [e for e in h.machine.jobs["job"].history if e.kind is EventKind.JOINED]
    assert [(e.node, e.addr, e.nproc) for e in joined] == [(f"node{i}", f"10.0.0.{i}", 2) for i in (1, 2, 3)]
    # The API shows the typed fields beside each sentence.
    j = view(h.machine, h.now)
    lost = next(e for e in j["history"] if e["kind"] == "lost")
    assert (lost["node"], lost["addr"], lost["departure"], lost["round"]) == (
        "node3",
        "10.0.0.3",
        "lost",
        None,
    )
    assert [e["round"] for e in j["history"] if e["kind"] == "round"] == [0, 1, 2, 3]


def test_a_spare_that_leaves_ends_no_round() -> None:
    h = Harness()
    kw: dict[str, Any] = dict(min_nodes=2, max_nodes=2, max_restarts=3)
    h.join(**kw), h.join(**kw)
    s = h.join(**{**kw, "spare": True})
    h.send(s, Leave(reason="not needed"))
    j = view(h.machine, h.now)
    left = next(e for e in j["history"] if e["kind"] == "left")
    assert left["spare"] and left["departure"] == "left"
    assert [(r["round"], r["ended_by"]) for r in j["rounds"]] == [(0, None)]


def test_each_failure_gets_its_own_round_even_when_two_read_alike() -> None:
    """Two failures of the same rank, the same way: each is shown with the round it stopped
    (a search of the sentences for the failure's description could not tell them apart)."""
    h = Harness()
    kw: dict[str, Any] = dict(max_restarts=3)
    a, b = h.join(**kw), h.join(**kw)
    for rnd in (0, 1):
        h.send(b, WorkersFailed(round=rnd, failure=failure(rank=2, node="node2")))
        h.join(a, **kw), h.join(b, **kw)
    assert [f["round"] for f in view(h.machine, h.now)["failures"]] == [0, 1]


def test_the_failure_that_ends_a_job_is_shown_with_its_round() -> None:
    h = Harness()
    a, b = h.join(max_restarts=1), h.join(max_restarts=1)
    h.send(b, WorkersFailed(round=0, failure=failure(rank=2, node="node2")))
    h.join(a, max_restarts=1), h.join(b, max_restarts=1)
    h.send(a, WorkersFailed(round=1, failure=failure(rank=0, node="node1", exitcode=3)))
    j = view(h.machine, h.now)
    assert j["phase"] == "failed"
    assert [(f["round"], f["exitcode"]) for f in j["failures"]] == [(0, 1), (1, 3)]
    failed = next(e for e in h.machine.jobs["job"].history if e.kind is EventKind.FAILED)
    assert failed.round == 1 and failed.failure_no == 2


def test_one_sentence_describes_a_failure_everywhere() -> None:
    h = Harness()
    a, b = h.join(max_restarts=1), h.join(max_restarts=1)
    f = failure(rank=3, node="node2")
    h.send(b, WorkersFailed(round=0, failure=f))
    said = describe_failure(replace(f, node_id="node2", addr="10.0.0.2"))
    assert said == "rank 3 (local rank 0) on node node2 (10.0.0.2) failed with exit code 1"
    j = view(h.machine, h.now)
    assert j["failures"][0]["description"] == said
    assert said in next(e["text"] for e in j["history"] if e["kind"] == "failure")
    restart = h.take(a)[-1]
    assert said in getattr(restart, "reason", "")


def test_replay_from_a_snapshot_keeps_the_typed_history() -> None:
    h = eventful()
    data = state_image.dump(h.machine)
    assert data["version"] == state_image.VERSION == 2
    again = state_image.load(json.loads(json.dumps(data)))
    assert list(again.jobs["job"].history) == list(h.machine.jobs["job"].history)
    assert state_image.dump(again) == data


def test_a_version_1_snapshot_still_loads() -> None:
    """``data/snapshot_v1.json`` was written by the server before typed history (version 1:
    events as [time, kind, text]), running the same story as ``eventful``."""
    data = json.loads((DATA / "snapshot_v1.json").read_text())
    assert data["version"] == 1 and len(data["jobs"][0]["history"][0]) == 3
    m = state_image.load(data)
    job = m.jobs["job"]
    assert (job.phase, job.round, job.restart_count) == (JobPhase.RUNNING, 3, 1)
    assert [e.kind for e in job.history][:5] == [EventKind.CREATED, *[EventKind.JOINED] * 3, EventKind.ROUND]
    assert job.history[-2].text == "node node4 left (scale down) (2 remain)"
    j = view(m, 5.0)  # the view of an old job conforms to the schema
    assert [x["node_id"] for x in j["members"] if x["role"] == "member"] == ["node1", "node2"]
    assert state_image.dump(m)["version"] == 2  # written back in the new format
    # The machine goes on from there.
    h = Harness(machine=state_image.load(data))
    h.now = 6.0
    h.machine.handle(Restarted(), h.now)
    assert h.machine.jobs["job"].history[-1].kind is EventKind.RECOVERED
