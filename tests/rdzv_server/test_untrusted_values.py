"""What nodes send is bounded where it enters the server (issue 30, part 3).

- Straggler scores stay finite whatever valid compute times come (1e10 ms beside 5e-324 ms), and
  no JSON the server writes holds NaN or Infinity, so one job's odd numbers never blank the
  dashboard (whose ``JSON.parse`` refuses a whole body for one ``Infinity``).
- A node reports hangs and stacks of its own ranks only: ranks of another node, or ranks the job
  does not have, are dropped, said in the log, and never blamed.
"""

from __future__ import annotations

import json
import math
from typing import Any

import aiohttp
import pytest

from protocol import CollectStacks, HangDetected, Heartbeat, Progress, Stacks
from rdzv_server.machine import progress as progress_mod
from rdzv_server.machine.history import EventKind
from rdzv_server.machine.progress import straggler_scores
from rdzv_server.service import RendezvousService
from rdzv_server.status import find_job

from .harness import Harness
from .test_http import FakeAgent, FakeClock, Watch, running_job
from .test_progress_surfaces import running
from .test_status import WALL0

# Valid compute times (Progress takes 0..1e10 ms): a node whose ranks compute in 5e-324 ms beside
# one whose ranks take 1e10 ms scores median / 5e-324, which overflows a float.
FAST, SLOW = (5e-324, 5e-324), (1e10, 1e10)


def strict(text: str) -> Any:
    """JSON as a browser parses it: NaN and Infinity are not JSON."""

    def refuse(token: str) -> None:
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


# --- straggler scores and the JSON out ------------------------------------------------------


def test_straggler_scores_stay_finite_whatever_valid_compute_times_come() -> None:
    h = Harness()
    a, b = running(h)
    h.now = 5.0
    h.send(a, Progress(round=0, min_step=3, max_step=3, compute_ms=FAST))
    h.send(b, Progress(round=0, min_step=3, max_step=3, compute_ms=SLOW))
    job = h.machine.jobs["job"]
    scores = straggler_scores(job.progress, 0.75)
    assert len(scores) == 4 and all(math.isfinite(s.score) and s.score >= 0 for s in scores), scores
    view = find_job(h.machine, "job", mono_now=h.now, wall_now=WALL0 + h.now)
    strict(json.dumps(view))  # the job's status holds no Infinity


def test_to_json_writes_a_non_finite_number_as_null() -> None:
    from rdzv_server.status import to_json

    view = {"a": [1.5, math.inf, {"b": -math.inf, "c": (math.nan, 2)}], "d": "Infinity", "e": 7}
    assert strict(to_json(view)) == {"a": [1.5, None, {"b": None, "c": [None, 2]}], "d": "Infinity", "e": 7}
    assert to_json({"x": 1.0}) == json.dumps({"x": 1.0})  # finite views are written as before


async def two_jobs(svc: RendezvousService, port: int, clock: FakeClock) -> list[FakeAgent]:
    """Job "odd" (ranks computing in 5e-324 ms) and job "fine", both reporting progress; their
    agents (keep them: a dropped agent's connection closes)."""
    watch = Watch(svc)
    jobs = svc.machine.jobs
    odd = await running_job(port, ["a", "b"], job="odd", heartbeat_timeout=600.0)
    fine = await running_job(port, ["c", "d"], job="fine", heartbeat_timeout=600.0)
    for agents, computes in ((odd, (FAST, SLOW)), (fine, ((100.0, 100.0), (100.0, 120.0)))):
        for agent, compute in zip(agents, computes, strict=True):
            agent.send(Progress(round=0, min_step=3, max_step=3, compute_ms=compute))
    await watch.until(lambda: all(len(jobs[j].progress.nodes) == 2 for j in ("odd", "fine")))
    clock.now += 2.0
    return odd + fine


async def get_all(port: int) -> dict[str, Any]:
    """Every JSON body the dashboard reads, parsed as a browser would (a ValueError if not JSON)."""
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
        out = {}
        for path in ("/v1/jobs", "/v1/jobs/odd", "/v1/jobs/fine"):
            async with http.get(path) as r:
                assert r.status == 200, path
                out[path] = strict(await r.text())
    return out


async def test_the_status_api_holds_no_infinity_for_a_job_with_odd_compute_times() -> None:
    clock = FakeClock()
    svc = RendezvousService(http=True, clock=clock)
    port = await svc.start("127.0.0.1", 0)
    agents: list[FakeAgent] = []
    try:
        agents = await two_jobs(svc, port, clock)
        got = await get_all(port)
        assert {j["id"] for j in got["/v1/jobs"]["jobs"]} == {"odd", "fine"}
        scores = [m["progress"]["straggler"]["score"] for m in got["/v1/jobs/odd"]["members"]]
        assert all(isinstance(s, float) and math.isfinite(s) for s in scores), scores
        assert got["/v1/jobs/fine"]["stragglers"]["scored"] == 4
    finally:
        for a in agents:
            await a.kill()
        await svc.close()


async def test_a_non_finite_number_past_the_sources_is_null_in_the_api(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Past the bound at the source (lifted here), JSON out is still JSON: the score is null.
    monkeypatch.setattr(progress_mod, "SCORE_MAX", math.inf)
    clock = FakeClock()
    svc = RendezvousService(http=True, clock=clock)
    port = await svc.start("127.0.0.1", 0)
    agents: list[FakeAgent] = []
    try:
        agents = await two_jobs(svc, port, clock)
        got = await get_all(port)
        assert None in [m["progress"]["straggler"]["score"] for m in got["/v1/jobs/odd"]["members"]]
        assert got["/v1/jobs/fine"]["stragglers"]["scored"] == 4
    finally:
        for a in agents:
            await a.kill()
        await svc.close()


# --- a node's own ranks only ----------------------------------------------------------------


def test_a_node_reporting_another_nodes_ranks_as_hung_blames_only_its_own() -> None:
    h = Harness()
    a, b, c = running(h, n=3)  # ranks 0-1, 2-3, 4-5
    job = h.machine.jobs["job"]
    order = {job.members[nid].conn: i for i, nid in enumerate(job.order)}
    a, b, c = sorted((a, b, c), key=order.__getitem__)
    h.send(b, HangDetected(round=0, ranks=(0, 3, 99), step=20, phase="compute", silent_s=30.0))
    assert job.hang is not None and job.hang.ranks == [3]
    (event,) = [e for e in job.history if e.kind is EventKind.HANG]
    assert event.ranks == (3,) and "rank 3 " in event.text
    assert any("ranks it does not run (its ranks: 2..3): 0, 99" in line for line in h.logs), h.logs
    assert h.last(a, CollectStacks) is not None
    # A later report naming only others' ranks adds nothing.
    h.send(c, HangDetected(round=0, ranks=(1, 2, 6), step=20, silent_s=30.0))
    assert job.hang.ranks == [3] and [e.ranks for e in job.history if e.kind is EventKind.HANG] == [(3,)]


def test_a_hang_naming_no_rank_of_the_sender_is_ignored() -> None:
    h = Harness()
    a, b = running(h)
    job = h.machine.jobs["job"]
    first = job.members[job.order[0]].conn
    h.send(first, HangDetected(round=0, ranks=(2, 3, 1000), step=20, silent_s=30.0))
    assert job.hang is None and job.hang_round == -1
    assert not [e for e in job.history if e.kind is EventKind.HANG]
    assert h.last(a, CollectStacks) is None and h.last(b, CollectStacks) is None


def stacks(ranks: tuple[int, ...], text: str) -> Stacks:
    n = len(ranks)
    return Stacks(
        round=0,
        ranks=ranks,
        steps=(20,) * n,
        phases=("compute",) * n,
        silent_s=(1.0,) * n,
        stacks=(text,) * n,
    )


def test_stacks_of_ranks_a_node_did_not_run_are_dropped() -> None:
    h = Harness()
    conns = running(h)
    job = h.machine.jobs["job"]
    first, second = (job.members[nid].conn for nid in job.order)  # ranks 0-1 and 2-3
    h.send(second, HangDetected(round=0, ranks=(3,), step=20, silent_s=30.0))
    h.send(first, stacks((0, 3, 7), 'File "train.py", line 9 in all_reduce'))
    h.send(second, stacks((0, 1), 'File "x.py", line 1 in forged'))  # none of its own: ignored
    assert job.hang is not None
    assert [(r, text) for r, _, _, _, text in job.hang.entries()] == [
        (0, 'File "train.py", line 9 in all_reduce')
    ]
    assert any("sent stacks of ranks it does not run (its ranks: 0..1): 3, 7" in line for line in h.logs)
    assert h.machine.heartbeat is not None and conns  # the nodes stay members
    h.send(second, Heartbeat())
    assert set(job.members) == {"node1", "node2"}
