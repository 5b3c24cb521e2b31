"""``rdzv-server --metrics-jobs N``: which running jobs get per-job series (issue 31, finding 3).

Agents choose job ids, so the choice must not follow them: jobs named to sort first must not
push the real ones out of the series.
"""

from __future__ import annotations

from typing import Any

from protocol import Assignment, Progress
from rdzv_server.metrics import make_registry, render

from .harness import Harness
from .test_http import parse_metrics


def running(h: Harness, job: str, nodes: int) -> None:
    conns = [h.join(job=job, min_nodes=nodes, max_nodes=nodes, nproc=2) for _ in range(nodes)]
    h.advance(0.1)
    assert all(h.last(c, Assignment) for c in conns)
    summary = Progress(
        round=0, min_step=7, max_step=7, step_p50_ms=100.0, step_p90_ms=120.0, compute_ms=(90.0,)
    )
    for c in conns:
        h.send(c, summary)


def exported(h: Harness, limit: int) -> set[str]:
    text, _ = render(make_registry(lambda: h.machine, lambda: h.now, jobs=limit), None)
    m: dict[Any, float] = parse_metrics(text.decode())
    return {dict(labels)["job"] for (name, labels) in m if name == "rdzv_job_step"}


def test_jobs_named_to_sort_first_do_not_push_the_real_ones_out() -> None:
    h = Harness()
    running(h, "train-llm", 3)  # the real job: three nodes
    h.advance(1.0)
    running(h, "team-b", 2)
    h.advance(1.0)
    for i in range(4):  # a stranger's one-node jobs, named to sort before everything
        running(h, f"!{i}", 1)
    # Before: the first N by id, i.e. the stranger's "!0" ... only.
    assert exported(h, 1) == {"train-llm"}
    assert exported(h, 2) == {"train-llm", "team-b"}
    assert exported(h, 3) == {"train-llm", "team-b", "!0"}  # then the oldest of the same size


def test_a_later_job_of_the_same_size_does_not_displace_an_older_one() -> None:
    h = Harness()
    running(h, "zz-real", 2)
    h.advance(1.0)
    running(h, "00-stranger", 2)
    assert exported(h, 1) == {"zz-real"}
