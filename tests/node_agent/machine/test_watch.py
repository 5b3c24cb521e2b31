"""The hang policy and the node's progress summary, on a fake clock (node_agent.machine.watch)."""

from __future__ import annotations

import re

import pytest

from node_agent.machine.watch import WINDOW, HangPolicy, Hung, NodeWatch
from node_agent.progress.pages import RankSample
from protocol import Progress

S = 1_000_000_000  # ns per second
MS = 1_000_000


class Ranks:
    """Fake workers writing fake pages, and a fake clock: what the agent would read."""

    def __init__(self, watch: NodeWatch, nproc: int) -> None:
        self.watch = watch
        self.now = 1000 * S
        self.step = [-1] * nproc
        self.count = [0] * nproc
        self.progress_ns = [0] * nproc
        self.phase = [""] * nproc
        self.phase_ns = [0] * nproc
        self.compute_ns = [0] * nproc
        self.attached = [True] * nproc

    def progress(self, rank: int, step: int | None = None, *, compute_s: float = 0.0) -> None:
        self.count[rank] += 1
        self.step[rank] = self.step[rank] + 1 if step is None else step
        self.progress_ns[rank] = self.now
        self.compute_ns[rank] += int(compute_s * S)

    def enter(self, rank: int, name: str) -> None:
        self.phase[rank], self.phase_ns[rank] = name, self.now

    def leave(self, rank: int) -> None:
        self.phase[rank], self.phase_ns[rank] = "", 0

    def samples(self) -> list[RankSample | None]:
        return [
            RankSample(
                step=self.step[r],
                progress_ns=self.progress_ns[r],
                count=self.count[r],
                phase=self.phase[r],
                phase_ns=self.phase_ns[r],
                compute_ns=self.compute_ns[r],
                pid=100 + r,
                stack_signal=38,
                attached_ns=1,
            )
            if self.attached[r]
            else None
            for r in range(len(self.step))
        ]

    def poll(self) -> list[Hung]:
        return self.watch.observe(self.samples(), self.now)

    def advance(self, seconds: float, *, poll_every: float = 1.0) -> list[Hung]:
        """Let ``seconds`` pass, polling as the agent does; every hang found on the way."""
        found: list[Hung] = []
        end = self.now + int(seconds * S)
        while self.now < end:
            self.now = min(end, self.now + int(poll_every * S))
            found += self.poll()
        return found

    def train(
        self, steps: int, step_s: float, ranks: list[int] | None = None, *, compute_s: float = 0.0
    ) -> list[Hung]:
        """``steps`` steps of ``step_s`` seconds by ``ranks`` (all), polled after each."""
        found: list[Hung] = []
        for _ in range(steps):
            self.now += int(step_s * S)
            for r in range(len(self.step)) if ranks is None else ranks:
                self.progress(r, compute_s=compute_s)
            found += self.poll()
        return found


def make(timeout: str = "auto", conf: str = "", nproc: int = 2) -> Ranks:
    return Ranks(NodeWatch(HangPolicy.parse(timeout, conf), nproc), nproc)


# --- parsing ---------------------------------------------------------------------------------


def test_parse_defaults_and_every_key() -> None:
    p = HangPolicy.parse("auto", "")
    assert (p.mode, p.first_step, p.floor, p.factor, p.warmup) == ("auto", 1800, 120, 5, 5)
    assert p.phase_budget("checkpoint") == 1800 and p.phase_budget("setup") == 1800
    assert p.phase_budget("eval") == 1800 and p.phase_budget("compute") is None
    p = HangPolicy.parse(" 90 ", "first_step=600, floor=30,factor=3,warmup=2,checkpoint=7200,phase.io=45")
    assert (p.mode, p.timeout, p.first_step, p.floor, p.factor, p.warmup) == ("fixed", 90, 600, 30, 3, 2)
    # setup and eval follow first_step unless set; any phase can have a budget
    assert p.phase_budget("setup") == 600 and p.phase_budget("checkpoint") == 7200
    assert p.phase_budget("io") == 45
    assert HangPolicy.parse("OFF", "").mode == "off"
    assert HangPolicy.parse("auto", "phase.setup=5").phase_budget("setup") == 5


@pytest.mark.parametrize(
    ("timeout", "conf", "message"),
    [
        ("30s", "", "--hang-timeout: expected auto, off or seconds, got '30s'"),
        ("0", "", "--hang-timeout: expected auto, off or seconds in (0, 1e+07], got '0'"),
        ("nan", "", "got 'nan'"),
        (
            "auto",
            "flor=3",
            "unknown key 'flor' (known: first_step, floor, factor, warmup, checkpoint, phase.NAME)",
        ),
        ("auto", "floor", "'floor' is not key=value"),
        ("auto", "floor=-1", "--hang-conf floor: expected seconds in (0, 1e+07], got '-1'"),
        ("auto", "factor=0.5", "--hang-conf factor: must be >= 1, got '0.5'"),
        ("auto", "warmup=2.5", "--hang-conf warmup: expected a whole number of steps, got '2.5'"),
        ("auto", "warmup=0", "expected 1..1000000 steps, got '0'"),
        ("auto", "floor=3,floor=4", "floor is given twice"),
        ("auto", "checkpoint=3,phase.checkpoint=4", "checkpoint is given twice"),
        ("auto", "phase.=4", "a phase name is 1 to 31 bytes"),
        ("auto", "phase." + "x" * 32 + "=4", "a phase name is 1 to 31 bytes"),
    ],
)
def test_parse_names_the_bad_value(timeout: str, conf: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        HangPolicy.parse(timeout, conf)


def test_poll_interval() -> None:
    assert HangPolicy.parse("auto", "").poll_interval_s() == 1.0
    assert HangPolicy.parse("2", "").poll_interval_s() == pytest.approx(0.2)
    assert HangPolicy.parse("0.1", "").poll_interval_s() == 0.05  # never below 50 ms
    assert HangPolicy.parse("auto", "floor=3").poll_interval_s() == pytest.approx(0.3)
    assert HangPolicy.parse("off", "").poll_interval_s() == 1.0


# --- auto ------------------------------------------------------------------------------------


def test_auto_watches_nothing_before_the_first_progress() -> None:
    t = make()
    t.enter(0, "setup")
    assert t.advance(10 * 3600, poll_every=60) == []  # hours of silence: never a hang
    assert t.watch.deadline_ns() is None


def test_auto_first_step_budget_then_hang() -> None:
    t = make()
    t.advance(5)
    t.progress(0, 0)  # rank 0 reports; rank 1 has not yet: both are watched from now
    start = t.now
    assert t.poll() == []
    assert t.watch.deadline_ns() == start + 1800 * S
    assert t.advance(1799) == []
    hung = t.advance(1)
    assert [(h.local_rank, h.step, h.budget_s, h.silent_s) for h in hung] == [
        (0, 0, 1800, 1800),
        (1, -1, 1800, 1800),
    ]
    assert t.advance(600) == []  # reported once per silence


def test_auto_after_warmup_budget_is_factor_times_longest_interval_with_a_floor() -> None:
    t = make(conf="floor=60")
    t.train(1, 100)  # the first step (setup, compile) is no interval
    assert t.train(5, 10) == []
    assert t.watch.deadline_ns() == t.now + 60 * S  # max(floor 60, 5 x 10 s)
    t.train(1, 20)  # a slower step raises the largest interval: 5 x 20 s = 100 s
    assert t.watch.deadline_ns() == t.now + 100 * S
    assert t.advance(99) == []
    hung = t.advance(1)
    assert [(h.local_rank, h.budget_s) for h in hung] == [(0, 100), (1, 100)]


def test_auto_warmup_keeps_the_first_step_budget() -> None:
    t = make(conf="floor=1,warmup=5")
    t.train(1, 1)
    t.train(4, 1)  # 4 intervals < warm-up 5: still the first-step budget
    assert t.advance(1799) == []
    assert len(t.advance(1)) == 2
    t = make(conf="floor=1,warmup=5")
    t.train(1, 1)
    t.train(5, 1)  # warmed up: max(1 s, 5 x 1 s)
    assert t.advance(4) == []
    assert [h.budget_s for h in t.advance(1)] == [5, 5]


def test_one_rank_stops_the_others_keep_going() -> None:
    t = make(conf="floor=30")
    t.train(10, 1)
    hung = t.train(40, 1, ranks=[1])
    assert [(h.local_rank, h.step) for h in hung] == [(0, 9)]
    assert hung[0].silent_s == 30
    t.train(1, 1)  # it progresses again: it can be reported again later, and its 41 s
    assert [h.local_rank for h in t.advance(31)] == [1]  # step raised its budget to 205 s
    assert [(h.local_rank, h.budget_s) for h in t.advance(174)] == [(0, 205)]


def test_auto_checkpoint_longer_than_the_step_budget_but_within_its_own_is_no_hang() -> None:
    t = make(conf="floor=30,checkpoint=600")
    t.train(10, 1)
    t.enter(0, "checkpoint")
    t.enter(1, "checkpoint")
    assert t.advance(599) == []  # 20 x the step budget, within the checkpoint's
    t.leave(0)
    t.leave(1)
    t.train(1, 1)
    assert t.advance(29) == []


def test_auto_phase_past_its_own_budget_is_a_hang() -> None:
    t = make(conf="floor=30,phase.eval=100")
    t.train(10, 1)
    t.enter(1, "eval")
    entered = t.now
    hung = t.advance(200, poll_every=0.5)
    rank1 = [h for h in hung if h.local_rank == 1]
    assert len(rank1) == 1 and rank1[0].phase == "eval"
    assert rank1[0].silent_s == pytest.approx((entered + 100 * S - t.progress_ns[1]) / S, abs=0.5)
    assert [h.local_rank for h in hung] == [0, 1]  # rank 0 (no phase) ran out first, at 30 s


def test_a_phase_without_its_own_budget_uses_the_step_budget() -> None:
    t = make(conf="floor=30")
    t.train(10, 1)
    t.enter(0, "compute")
    assert [h.local_rank for h in t.advance(30)] == [0, 1]


def test_fixed_timeout() -> None:
    t = make("20")
    assert t.advance(100) == []  # not before the first progress
    t.train(1, 1, ranks=[0])
    assert t.advance(19) == []
    assert [(h.local_rank, h.budget_s) for h in t.advance(1)] == [(0, 20), (1, 20)]


def test_fixed_timeout_keeps_phase_budgets() -> None:
    t = make("20", "checkpoint=100")
    t.train(3, 1)
    t.enter(0, "checkpoint")
    hung = t.advance(99)
    assert [h.local_rank for h in hung] == [1]
    assert [h.local_rank for h in t.advance(1)] == [0]


def test_off_never_hangs_but_summarises() -> None:
    t = make("off")
    t.train(3, 1)
    assert t.advance(10**6, poll_every=1000) == []
    assert t.watch.deadline_ns() is None
    assert t.watch.summary(t.now)["max_step"] == 2


def test_a_rank_that_never_attached_is_not_watched() -> None:
    t = make("10", nproc=3)
    t.attached[2] = False  # e.g. a script that reports from rank 0 and 1 only
    t.train(3, 1, ranks=[0, 1])
    assert [h.local_rank for h in t.advance(10)] == [0, 1]


def test_a_rank_attaching_late_is_watched_from_then() -> None:
    t = make("10", nproc=2)
    t.attached[1] = False
    t.train(1, 1, ranks=[0])
    t.advance(5)
    t.attached[1] = True
    hung = t.advance(5)
    assert [h.local_rank for h in hung] == [0]
    assert [(h.local_rank, h.silent_s) for h in t.advance(6)] == [(1, 10)]  # seen at +1 s


def test_a_none_read_keeps_what_was_known() -> None:
    t = make("10")
    t.train(2, 1)
    t.attached[0] = False  # torn thrice, or gone: the rank's silence still counts
    assert [h.local_rank for h in t.advance(10)] == [0, 1]


def test_a_writer_clock_in_the_future_is_not_trusted() -> None:
    t = make("10")
    t.train(2, 1)
    t.advance(1)
    t.progress(0)
    t.progress_ns[0] = t.now + 10**6 * S  # a broken writer
    t.poll()
    assert t.watch.deadline_ns() == t.now + 9 * S  # rank 1's; rank 0's is now + 10 s
    assert [h.local_rank for h in t.advance(10)] == [1, 0]


def test_reset_forgets_the_round() -> None:
    t = make("10")
    t.train(3, 1)
    t.watch.reset()
    assert t.watch.max_step() == -1 and t.watch.deadline_ns() is None


# --- the summary -----------------------------------------------------------------------------


def test_summary_numbers_are_a_valid_progress() -> None:
    t = make(nproc=4)
    t.enter(3, "setup")
    assert not t.watch.changed()
    t.poll()
    assert t.watch.changed()  # a phase changed
    t.leave(3)
    # ranks 0..2 step every 100 ms, rank 3 every 200 ms with twice the compute time
    for i in range(20):
        t.now += 100 * MS
        for r in range(3):
            t.progress(r, compute_s=0.06)
        if i % 2 == 0:
            t.progress(3, compute_s=0.12)
        t.poll()
    t.enter(3, "checkpoint")
    t.poll()
    t.now += 50 * MS
    s = t.watch.summary(t.now)
    assert not t.watch.changed()
    assert (s["min_step"], s["max_step"]) == (9, 19)
    assert s["step_p50_ms"] == 100 and s["step_p90_ms"] == 200
    assert s["phase"] == "checkpoint"  # rank 3's progress is the oldest
    assert s["age_ms"] == 150
    assert s["compute_ms"] == (60, 60, 60, 120)
    assert Progress(round=1, **s).max_step == 19  # exactly Progress's fields
    assert t.watch.max_step() == 19


def test_summary_before_anything() -> None:
    t = make()
    t.attached = [False, False]
    s = t.watch.summary(t.now)
    assert s == {
        "min_step": -1,
        "max_step": -1,
        "step_p50_ms": 0.0,
        "step_p90_ms": 0.0,
        "phase": "",
        "age_ms": 0.0,
        "compute_ms": (0.0, 0.0),
    }
    Progress(round=0, **s)


def test_summary_windows_are_bounded_and_recent() -> None:
    t = make(nproc=1)
    t.train(1, 1)
    t.train(200, 5.0, compute_s=4.0)  # slow steps long ago
    t.train(WINDOW, 0.01, compute_s=0.005)  # then only fast ones within the window
    s = t.watch.summary(t.now)
    assert s["step_p90_ms"] == 10 and s["compute_ms"] == (5,)
    r = t.watch._ranks[0]
    assert len(r.intervals) == WINDOW and len(r.compute) == WINDOW
    assert r.max_interval_ns == 5 * S  # the budget still remembers the slowest step


def test_summary_cleans_a_phase_name_for_the_wire() -> None:
    t = make(nproc=1)
    t.enter(0, "bad\nname")
    t.train(1, 1)
    s = t.watch.summary(t.now)
    assert s["phase"] == "bad?name"
    Progress(round=0, **s)


def test_no_compute_phase_reports_zero() -> None:
    t = make(nproc=2)
    t.train(5, 1, compute_s=0)
    assert t.watch.summary(t.now)["compute_ms"] == (0.0, 0.0)


def test_after_a_checkpoint_longer_than_a_step_budget_the_step_budget_starts_again() -> None:
    # Every rank checkpoints for 8 s (a step budget is 3 s), then waits in the next step's
    # collective: the wait after the checkpoint is a new step, not the checkpoint's tail.
    t = make("3", "checkpoint=60")
    t.train(5, 0.1)
    for r in (0, 1):
        t.enter(r, "checkpoint")
    assert t.advance(8, poll_every=0.3) == []
    for r in (0, 1):
        t.leave(r)
    assert t.advance(2.5, poll_every=0.3) == []  # 2.5 s since the checkpoint ended: within 3 s
    assert [h.local_rank for h in t.advance(1, poll_every=0.3)] == [0, 1]  # then hung, as any step


def test_a_checkpoint_does_not_stretch_the_calibrated_step_budget() -> None:
    t = make("auto", "floor=1,warmup=3")
    t.train(10, 0.1)
    t.enter(0, "checkpoint")
    t.enter(1, "checkpoint")
    t.advance(30, poll_every=0.5)
    t.leave(0)
    t.leave(1)
    t.train(3, 0.1)
    # 5 x the longest step (0.1 s) is under the floor: 1 s, not 5 x the 30 s checkpoint.
    assert [h.local_rank for h in t.advance(2, poll_every=0.2)] == [0, 1]
