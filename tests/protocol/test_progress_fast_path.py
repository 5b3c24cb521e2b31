"""Progress checks its common shape on a fast path: it must accept nothing the general rules
refuse, and keep what they would keep."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import InvalidField, Progress
from protocol.messages import MAX_COUNT, MAX_NPROC, MAX_PHASE_LEN, _Schema

EDGE_INTS = st.sampled_from([-(2**63), -2, -1, 0, 1, MAX_COUNT - 1, MAX_COUNT, MAX_COUNT + 1, True])
EDGE_MS = st.sampled_from([0.0, -0.0, 1e10, 1e10 + 1, -1.0, math.nan, math.inf, 0, 5, 2.5, False])
PHASES = st.sampled_from(
    ["", "compute", "x" * MAX_PHASE_LEN, "x" * (MAX_PHASE_LEN + 1), "a\x1bb", "a\x7f", "ré", " ", 7]
)


@settings(max_examples=400, deadline=None)
@given(
    rnd=EDGE_INTS,
    lo=EDGE_INTS,
    hi=EDGE_INTS,
    p50=EDGE_MS,
    age=EDGE_MS,
    phase=PHASES,
    compute=st.one_of(st.lists(EDGE_MS, max_size=9), st.just([1.0] * (MAX_NPROC + 1))),
    checks=st.sampled_from([True, False, 1]),
)
def test_the_fast_path_accepts_only_what_the_rules_accept(
    rnd: int, lo: int, hi: int, p50: float, age: float, phase: str, compute: list[float], checks: bool
) -> None:
    kw = dict(round=rnd, min_step=lo, max_step=hi, step_p50_ms=p50, age_ms=age, phase=phase)
    try:
        p = Progress(**kw, compute_ms=compute, checks=checks)  # type: ignore[arg-type]
    except InvalidField:
        return
    before = (p.round, p.min_step, p.max_step, p.step_p50_ms, p.age_ms, p.phase, p.compute_ms, p.checks)
    _Schema.__post_init__(p)  # the general rules, on what the constructor kept: no complaint
    after = (p.round, p.min_step, p.max_step, p.step_p50_ms, p.age_ms, p.phase, p.compute_ms, p.checks)
    assert before == after and type(p.compute_ms) is tuple


def test_a_real_summary_takes_the_fast_path_and_a_bad_one_is_named() -> None:
    p = Progress(round=1, min_step=5, max_step=7, step_p50_ms=1.5, phase="compute", compute_ms=[1.0, 2.0])
    assert p.compute_ms == (1.0, 2.0)
    try:
        Progress(round=1, min_step=5, max_step=7, compute_ms=[1.0, math.nan])
    except InvalidField as exc:
        assert "compute_ms" in str(exc)
    else:
        raise AssertionError("a NaN compute time was accepted")
