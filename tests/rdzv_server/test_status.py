"""The status views, on a machine driven through its events with a fake clock."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from protocol import Heartbeat, Leave, WorkersFailed, WorkersSucceeded
from rdzv_server.machine.state import Rendezvous
from rdzv_server.status import find_job, jobs_view

from .harness import Harness, failure

WALL0 = 1_700_000_000.0  # the wall clock when the fake monotonic clock reads 0
SPEC = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"


def view(h: Harness) -> dict[str, Any]:
    out = jobs_view(h.machine, mono_now=h.now, wall_now=WALL0 + h.now)
    json.dumps(out)  # JSON-able, all of it
    conforms(out, "JobList")
    return out


def job(h: Harness, job_id: str = "job") -> dict[str, Any]:
    found = find_job(h.machine, job_id, mono_now=h.now, wall_now=WALL0 + h.now)
    assert found is not None
    conforms(found, "Job")
    return found


def member(j: dict[str, Any], node: str) -> dict[str, Any]:
    (m,) = [m for m in j["members"] if m["node_id"] == node]
    return m


_validators: dict[str, Any] = {}


def conforms(doc: Any, schema: str) -> None:
    """The view matches the documented schema in docs/openapi.yaml."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    yaml = pytest.importorskip("yaml")
    if schema not in _validators:
        components = yaml.safe_load(SPEC.read_text())["components"]
        _validators[schema] = jsonschema_rs.validator_for(
            {"$ref": f"#/components/schemas/{schema}", "components": components}
        )
    _validators[schema].validate(doc)


def test_empty_server() -> None:
    out = jobs_view(Rendezvous(), mono_now=5.0, wall_now=WALL0)
    conforms(out, "JobList")
    assert out["jobs"] == []
    assert out["server"]["connections"] == 0 and out["server"]["time"] == WALL0
    assert find_job(Rendezvous(), "nope", mono_now=0.0, wall_now=WALL0) is None


def test_running_job_members_ranks_and_heartbeats_in_wall_time() -> None:
    h = Harness()
    h.now = 10.0
    a = h.join(nproc=4)
    h.now = 11.0
    b = h.join(nproc=2)
    h.now = 12.0
    h.send(a, Heartbeat())
    h.now = 14.5
    j = job(h)
    assert (j["phase"], j["round"], j["rounds_completed"], j["finished"]) == ("running", 0, 1, False)
    assert j["created_at"] == WALL0 + 10.0 and j["age"] == 4.5
    assert j["world_size"] == 6 and j["master"] == {"addr": "10.0.0.1", "port": 20001}
    assert (j["restart_count"], j["max_restarts"]) == (0, 0)
    assert [m["node_id"] for m in j["members"]] == ["node1", "node2"]
    ma, mb = member(j, "node1"), member(j, "node2")
    assert (ma["group_rank"], ma["rank_offset"], mb["group_rank"], mb["rank_offset"]) == (0, 0, 1, 4)
    assert ma["state"] == mb["state"] == "running" and ma["role"] == "member"
    assert (ma["addr"], ma["nproc"], ma["master_port"]) == ("10.0.0.1", 4, 20001)
    # a's last word was its heartbeat at 12; b's was its join at 11
    assert ma["last_heartbeat_ago"] == 2.5 and ma["last_heartbeat_at"] == WALL0 + 12.0
    assert mb["last_heartbeat_ago"] == 3.5 and mb["joined_at"] == WALL0 + 11.0
    assert ma["peer"] == "127.0.0.1:1001"
    (r0,) = j["rounds"]
    assert r0["round"] == 0 and r0["started_at"] == WALL0 + 11.0 and r0["ended_at"] is None
    assert r0["gathering_since"] == WALL0 + 10.0
    assert [e["kind"] for e in j["history"]] == ["created", "joined", "joined", "round"]
    assert j["history"][0]["time"] == WALL0 + 10.0 and j["history"][0]["ago"] == 4.5
    server = view(h)["server"]
    assert server["agents"] == 2 and server["active_jobs"] == 1
    assert server["stats"]["rounds_completed"] == 1
    del b


def test_worker_failure_is_the_root_cause_of_its_round() -> None:
    h = Harness()
    kw = dict(max_restarts=2)
    a, b = h.join(**kw), h.join(**kw)
    h.now = 3.0
    h.send(b, WorkersFailed(round=0, failure=failure(rank=3, node="node2", exitcode=7)))
    j = job(h)
    assert (j["phase"], j["round"], j["restart_count"], j["max_restarts"]) == ("gathering", 1, 1, 2)
    (f,) = j["failures"]
    assert f["round"] == 0 and f["node_id"] == "node2" and f["exitcode"] == 7
    # the node and address are the sender's own (item 13), whatever the report said
    assert f["description"] == "rank 3 (local rank 0) on node node2 (10.0.0.2) failed with exit code 7"
    assert member(j, "node2")["failures"] == 1
    assert {m["state"] for m in j["members"]} == {"waiting"}
    assert j["world_size"] is None and j["master"] is None
    (r0,) = j["rounds"]
    assert r0["ended_by"] == "failure" and r0["ended_at"] == WALL0 + 3.0
    assert f["description"] in r0["end_reason"]
    # both re-join: round 1 runs, the timeline has two rounds, the second still running
    h.now = 4.0
    h.join(a, **kw)
    h.join(b, **kw)
    j = job(h)
    assert j["phase"] == "running" and [r["round"] for r in j["rounds"]] == [0, 1]
    assert j["rounds"][1]["gathering_since"] == WALL0 + 3.0 and j["rounds"][1]["ended_by"] is None


def test_restarts_exhausted_failure_names_its_round() -> None:
    h = Harness()
    a, b = h.join(), h.join()
    h.send(a, WorkersFailed(round=0, failure=failure(node="node1")))
    j = job(h)
    assert j["phase"] == "failed" and j["finished"] and not j["forgotten"]
    assert "no" in j["outcome"] or "max-restarts" in j["outcome"]
    assert j["failures"][0]["round"] == 0
    assert j["rounds"][0]["ended_by"] == "failed"
    del b


def test_lost_node_stays_visible_as_departed_with_its_rank() -> None:
    h = Harness()
    kw = dict(min_nodes=2, max_nodes=3)
    a, b, c = h.join(**kw), h.join(**kw), h.join(**kw)
    j = job(h)
    assert j["rounds_completed"] == 1 and j["nodes"] == 3
    h.now += 1.0
    h.drop(b)
    j = job(h)
    gone = member(j, "node2")
    assert gone["role"] == "departed" and gone["state"] == "lost"
    assert gone["group_rank"] == 1 and gone["addr"] == "10.0.0.2" and gone["nproc"] == 2
    assert gone["last_heartbeat_ago"] is None and "connection closed" in gone["reason"]
    assert gone["departed_at"] == WALL0 + h.now
    assert [m["role"] for m in j["members"]] == ["member", "member", "departed"]
    assert j["rounds"][-1]["ended_by"] == "lost"
    assert j["restart_count"] == 0  # an elastic job goes on smaller without using its budget
    del a, c


def test_node_that_left_and_came_back_is_not_departed() -> None:
    h = Harness()
    kw = dict(min_nodes=1, max_nodes=2, last_call_timeout=0.0)
    a = h.join(**kw)
    h.advance(0.1)
    b = h.join(**kw)
    h.send(b, Leave(reason="maintenance"))
    j = job(h)
    left = member(j, "node2")
    assert left["state"] == "left" and "maintenance" in left["reason"]
    h.join(node="node2", **kw)
    j = job(h)
    assert member(j, "node2")["role"] == "member"
    del a


def test_spares_are_listed_after_members() -> None:
    h = Harness()
    h.join(), h.join()
    h.join()  # the job is full: a spare
    j = job(h)
    assert [(m["node_id"], m["role"]) for m in j["members"]] == [
        ("node1", "member"),
        ("node2", "member"),
        ("node3", "spare"),
    ]
    assert j["spares"] == 1 and member(j, "node3")["group_rank"] is None


def test_excluded_node_is_marked_and_listed() -> None:
    h = Harness()
    kw = dict(min_nodes=1, max_nodes=2, max_restarts=5, exclude_after=1)
    a, b = h.join(**kw), h.join(**kw)
    h.send(b, WorkersFailed(round=0, failure=failure(node="node2")))
    j = job(h)
    assert j["excluded"] == [{"node_id": "node2", "reason": "its workers failed 1 times"}]
    ex = member(j, "node2")
    assert ex["state"] == "excluded" and ex["role"] == "departed" and ex["failures"] == 1
    del a


def test_forgotten_job_is_kept_marked_and_found_after_a_newer_one() -> None:
    h = Harness()
    a, b = h.join(), h.join()
    for c in (a, b):
        h.send(c, WorkersSucceeded(round=0))
    assert job(h)["phase"] == "finished"
    h.drop(a)
    h.drop(b)
    assert h.machine.jobs == {}
    (listed,) = view(h)["jobs"]
    assert listed["forgotten"] and listed["finished"] and listed["phase"] == "finished"
    old = job(h)
    assert old["forgotten"] and old["instance"] == listed["instance"]
    assert {m["state"] for m in old["members"]} == {"gone"}
    assert old["rounds"][0]["ended_by"] == "finished"
    # the same id again: the active one is found first; the list has both, active first
    h.now = 50.0
    h.join()
    assert not job(h)["forgotten"] and job(h)["phase"] == "gathering"
    listed = view(h)["jobs"]
    assert [(x["id"], x["forgotten"]) for x in listed] == [("job", False), ("job", True)]


def test_job_every_node_left_is_forgotten_with_outcome() -> None:
    h = Harness()
    a = h.join()
    h.drop(a)
    (listed,) = view(h)["jobs"]
    assert listed["forgotten"] and listed["finished"] and listed["phase"] == "abandoned"
    old = job(h)
    assert old["outcome"] == "every node left" and old["phase"] == "abandoned"
    assert member(old, "node1")["state"] == "lost"


def test_a_running_job_every_node_left_no_longer_says_running() -> None:
    """Issue 31, finding 4: a job forgotten while its round ran kept "phase": "running" (and
    an open last round) in /v1/jobs/{id} and the list."""
    h = Harness()
    a = h.join(min_nodes=1, max_nodes=2)
    h.advance(6.0)  # past the last call: the round runs with one node
    assert job(h)["phase"] == "running"
    h.send(a, Leave())
    assert h.machine.jobs == {}
    old = job(h)
    assert old["forgotten"] and old["finished"] and old["phase"] == "abandoned"
    assert old["outcome"] == "every node left" and old["master"] is None
    assert old["rounds"][-1]["ended_by"] is not None  # the round is over too
    (listed,) = view(h)["jobs"]
    assert listed["phase"] == "abandoned" and listed["world_size"] is None


def test_the_list_is_a_bounded_summary_naming_no_node() -> None:
    h = Harness()
    for i in range(30):
        a = h.join(job=f"job{i}", min_nodes=1, max_nodes=1)
        h.send(a, WorkersFailed(round=0, failure=failure(rank=0, node=f"node{a}")))
        if i % 2:
            h.drop(a)  # forgotten
    out = jobs_view(h.machine, mono_now=h.now, wall_now=WALL0, limit=20)
    conforms(out, "JobList")
    assert (len(out["jobs"]), out["jobs_total"], out["truncated"]) == (20, 30, True)
    # active first, newest first: the 15 active, then the 5 newest forgotten
    assert [j["id"] for j in out["jobs"][:3]] == ["job28", "job26", "job24"]
    assert [j["forgotten"] for j in out["jobs"]] == [False] * 15 + [True] * 5
    assert out["jobs"][15]["id"] == "job29"
    text = json.dumps(out)
    assert "node" not in text.replace("nodes", "") and "10.0.0." not in text and "failed with" not in text
    full = jobs_view(h.machine, mono_now=h.now, wall_now=WALL0)
    assert (len(full["jobs"]), full["truncated"]) == (30, False)
