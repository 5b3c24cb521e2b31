"""``worker.should_stop()`` and the commit protocol's page records: the worker's side (the
acknowledgement, the late rank, the wait at the stop step) against the agent's writer and
reader in ``node_agent.progress.pages``, in this process and in real worker processes.

The test plays the agent: it writes the stop record with ``pages.write_stop`` and reads the
ranks' check records with ``read_page``. Nothing here sleeps to prove a timing: a test waits
for a page state or for the worker to enter its wait, with a deadline.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent import worker
from node_agent.progress import pages
from node_agent.progress.pages import PageSet, RankSample, create_page, read_page
from node_agent.worker import layout as L

ROOT = Path(__file__).resolve().parents[3]
DEADLINE = 30.0
ARMED, GO, NONE = L.STOP_ARMED, L.STOP_GO, L.STOP_NONE


@pytest.fixture
def page(tmp_path: Path) -> Path:
    path = tmp_path / "progress.page"
    create_page(str(path))
    return path


class Waits:
    """Counts the worker's waits (its sleeps at the stop step) and lets a test await one."""

    def __init__(self) -> None:
        self.count = 0
        self.cond = threading.Condition()

    def sleep(self, seconds: float) -> None:
        with self.cond:
            self.count += 1
            self.cond.notify_all()
        time.sleep(seconds)

    def await_more_than(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.count > n, DEADLINE), "the worker never waited"


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> Waits:
    w = Waits()
    monkeypatch.setattr(worker, "_sleep", w.sleep)
    return w


@pytest.fixture
def here(page: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This test process attached to ``page`` as a worker (module state reset around it)."""
    worker._reset()
    monkeypatch.setenv(worker.PAGE_VAR, str(page))
    yield page
    pages.write_stop(str(page), -1, NONE)  # a call left waiting by a failed test returns
    worker._reset()


class Call:
    """``should_stop()`` running in a thread, as the training thread would block in it."""

    def __init__(self) -> None:
        self.result: list[bool] = []
        self.thread = threading.Thread(target=lambda: self.result.append(worker.should_stop()), daemon=True)
        self.thread.start()

    def outcome(self) -> bool:
        self.thread.join(DEADLINE)
        assert not self.thread.is_alive(), "should_stop() did not return"
        return self.result[0]


def sample(path: Path) -> RankSample:
    s = read_page(str(path))
    assert s is not None
    return s


def acked(path: Path) -> tuple[bool, int, int, int]:
    s = sample(path)
    return s.checks, s.seen, s.seen_at, s.stopped


def write_raw_stop(path: Path, step: int, state: int, chk: int) -> None:
    with open(path, "r+b") as f:
        f.seek(L.STOP_OFFSET)
        f.write(L.STOP.pack(step, state, 0, chk))


def until(what: Callable[[], object], message: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not what():
        assert time.monotonic() < deadline, message
        time.sleep(0.005)


# --- in this process -----------------------------------------------------------------------


def test_nothing_armed_is_false_and_only_the_first_call_writes(here: Path) -> None:
    assert worker.should_stop() is False  # attaches on first use, like progress()
    assert sample(here).pid == os.getpid()
    assert acked(here) == (True, -1, -1, -1)  # "this rank calls should_stop"
    with open(here, "r+b") as f:  # clear the check record: no later call may write it again
        f.seek(L.CHECK_OFFSET)
        f.write(bytes(L.CHECK.size))
    for step in range(100):
        worker.progress(step)
        assert worker.should_stop() is False
    assert acked(here) == (False, -1, -1, -1)


def test_a_page_where_should_stop_was_never_called_does_not_check(here: Path) -> None:
    worker.progress(3)
    assert acked(here) == (False, -1, -1, -1)


def test_an_armed_step_is_acknowledged_in_time_and_every_rank_stops_at_it(here: Path) -> None:
    worker.progress(3)
    assert worker.should_stop() is False
    assert pages.write_stop(str(here), 10, ARMED)
    assert worker.should_stop() is False
    assert acked(here) == (True, 10, 3, -1)  # seen 10 at step 3: in time
    for step in range(4, 10):
        worker.progress(step)
        assert worker.should_stop() is False
    assert pages.write_stop(str(here), 10, GO)
    assert worker.should_stop() is False  # at step 9: not yet
    worker.progress(10)
    assert worker.should_stop() is True
    assert acked(here) == (True, 10, 3, 10)
    assert pages.write_stop(str(here), -1, NONE)  # once True, True for good
    worker.progress(11)
    assert worker.should_stop() is True
    assert acked(here) == (True, 10, 3, 10)


@pytest.mark.parametrize("at", [10, 14])
def test_a_rank_at_or_past_the_armed_step_is_late_and_never_stops_there(here: Path, at: int) -> None:
    worker.progress(at)
    assert worker.should_stop() is False
    assert pages.write_stop(str(here), 10, ARMED)
    assert worker.should_stop() is False
    assert acked(here) == (True, 10, at, -1)  # seen_at >= seen: late
    assert pages.write_stop(str(here), 10, GO)  # even a go for it (the server never sends one)
    for step in (at + 1, at + 2):
        worker.progress(step)
        assert worker.should_stop() is False
    assert acked(here) == (True, 10, at, -1)
    # The server arms a later step: acknowledged in time, and the rank stops there.
    assert pages.write_stop(str(here), at + 5, ARMED)
    assert worker.should_stop() is False
    assert acked(here) == (True, at + 5, at + 2, -1)
    assert pages.write_stop(str(here), at + 5, GO)
    for step in range(at + 3, at + 5):
        worker.progress(step)
        assert worker.should_stop() is False
    worker.progress(at + 5)
    assert worker.should_stop() is True
    assert acked(here) == (True, at + 5, at + 2, at + 5)


def test_before_the_first_progress_the_step_is_minus_one_and_in_time(here: Path) -> None:
    assert pages.write_stop(str(here), 0, ARMED)
    assert worker.should_stop() is False
    assert acked(here) == (True, 0, -1, -1)
    assert pages.write_stop(str(here), 0, GO)
    worker.progress(0)
    assert worker.should_stop() is True


def arm_and_reach(page: Path, stop: int) -> None:
    """Acknowledge ``stop`` in time, then report it: the next call waits for go."""
    worker.progress(stop - 2)
    assert worker.should_stop() is False
    assert pages.write_stop(str(page), stop, ARMED)
    assert worker.should_stop() is False
    assert acked(page) == (True, stop, stop - 2, -1)
    worker.progress(stop)  # a step skipped: it stops at the first call at or past S


def test_at_the_armed_step_it_waits_for_go(here: Path, waits: Waits) -> None:
    arm_and_reach(here, 6)
    call = Call()
    waits.await_more_than(0)
    assert call.thread.is_alive()  # waiting: the record says armed and nobody changed it
    assert pages.write_stop(str(here), 6, GO)
    assert call.outcome() is True
    assert acked(here) == (True, 6, 4, 6)
    assert worker.should_stop() is True


def test_a_wait_called_off_goes_on_and_the_same_step_armed_again_is_late(here: Path, waits: Waits) -> None:
    arm_and_reach(here, 6)
    call = Call()
    waits.await_more_than(0)
    assert pages.write_stop(str(here), -1, NONE)
    assert call.outcome() is False
    assert acked(here) == (True, -1, -1, -1)  # the acknowledgement is withdrawn
    worker.progress(7)
    assert worker.should_stop() is False
    # S armed again after the rank went past it: acknowledged anew, and late this time.
    assert pages.write_stop(str(here), 6, ARMED)
    assert worker.should_stop() is False
    assert acked(here) == (True, 6, 7, -1)
    assert pages.write_stop(str(here), 6, GO)
    worker.progress(8)
    assert worker.should_stop() is False


@pytest.mark.parametrize(("new", "late"), [(9, False), (5, True)])
def test_a_wait_re_armed_to_another_step_goes_on(here: Path, waits: Waits, new: int, late: bool) -> None:
    arm_and_reach(here, 6)
    call = Call()
    waits.await_more_than(0)
    assert pages.write_stop(str(here), new, ARMED)
    assert call.outcome() is False
    assert acked(here) == (True, new, 6, -1)  # seen at step 6: in time for 9, late for 5
    assert pages.write_stop(str(here), new, GO)
    for step in (7, 8, 9):
        worker.progress(step)
        assert worker.should_stop() is (step == 9 and not late)


def test_a_torn_stop_record_at_the_step_is_read_again_not_taken_for_no(here: Path, waits: Waits) -> None:
    arm_and_reach(here, 6)
    write_raw_stop(here, 6, GO, L.check(6, ARMED, 0))  # go's words with armed's check: torn
    call = Call()
    waits.await_more_than(0)
    assert call.thread.is_alive()  # neither "no" nor "go" from a record it cannot read
    write_raw_stop(here, 6, GO, L.check(6, GO, 0))  # the write completes
    assert call.outcome() is True
    assert acked(here) == (True, 6, 4, 6)


def test_a_torn_stop_record_before_the_step_is_no_stop_yet_and_forgets_nothing(here: Path) -> None:
    worker.progress(2)
    assert pages.write_stop(str(here), 6, ARMED)
    assert worker.should_stop() is False
    write_raw_stop(here, -1, NONE, L.check(6, ARMED, 0))  # a cancel caught halfway
    worker.progress(3)
    assert worker.should_stop() is False  # before S: False is right whatever the record says
    assert acked(here) == (True, 6, 2, -1)  # not taken for a cancel: S still acknowledged
    write_raw_stop(here, 6, 7, L.check(6, 7, 0))  # a state this layout does not know
    assert worker.should_stop() is False
    assert acked(here) == (True, 6, 2, -1)
    assert pages.write_stop(str(here), 6, GO)
    worker.progress(6)
    assert worker.should_stop() is True


def test_a_torn_record_never_counts_as_a_new_step(here: Path) -> None:
    worker.progress(2)
    assert worker.should_stop() is False
    write_raw_stop(here, 8, ARMED, L.check(8, GO, 0))
    assert worker.should_stop() is False
    assert acked(here) == (True, -1, -1, -1)  # no acknowledgement of a record it could not read
    assert pages.write_stop(str(here), 8, ARMED)
    assert worker.should_stop() is False
    assert acked(here) == (True, 8, 2, -1)


def test_a_forked_child_never_stops_and_never_writes_the_page(here: Path) -> None:
    arm_and_reach(here, 6)
    assert pages.write_stop(str(here), 6, GO)
    assert worker.should_stop() is True
    before = here.read_bytes()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            worker.progress(999)
            code = 0 if worker.should_stop() is False and not worker.attached() else 1
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert here.read_bytes() == before
    assert worker.should_stop() is True  # the parent is still stopped


def test_outside_node_agent_should_stop_is_false_and_writes_nothing(
    page: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker._reset()
    monkeypatch.delenv(worker.PAGE_VAR, raising=False)
    try:
        assert pages.write_stop(str(page), 0, GO)
        worker.progress(3)
        assert worker.should_stop() is False
        monkeypatch.setenv(worker.PAGE_VAR, str(page))  # too late: a no-op for good
        assert worker.should_stop() is False
        assert read_page(str(page)) is None
    finally:
        worker._reset()


# --- the agent's reader --------------------------------------------------------------------

_i64 = st.integers(min_value=-1, max_value=(1 << 63) - 1)


@settings(max_examples=200, deadline=None)
@given(old=st.tuples(_i64, _i64, _i64), new=st.tuples(_i64, _i64, _i64), mask=st.integers(1, 14))
def test_a_mix_of_two_check_records_never_reads_as_a_third(
    tmp_path_factory: pytest.TempPathFactory,
    old: tuple[int, int, int],
    new: tuple[int, int, int],
    mask: int,
) -> None:
    path = tmp_path_factory.mktemp("torn") / "p.page"
    create_page(str(path))
    with open(path, "r+b") as f:
        f.seek(L.PID_OFFSET)
        f.write((4321).to_bytes(4, "little"))
    a, b = ([L.CHECK.pack(*r, L.check(*r))[i : i + 8] for i in range(0, 32, 8)] for r in (old, new))
    mixed = b"".join(b[i] if mask >> i & 1 else a[i] for i in range(4))
    with open(path, "r+b") as f:
        f.seek(L.CHECK_OFFSET)
        f.write(mixed)
    got = read_page(str(path))
    read = None if got is None else (got.seen, got.seen_at, got.stopped)
    whole = {b"".join(a): old, b"".join(b): new}
    assert read == whole.get(mixed)  # one of the two, or None (read again next poll)
    if got is not None:
        assert got.checks


# --- real worker processes -----------------------------------------------------------------

LOOP = r"""
import sys, time
from node_agent import worker
pace = float(sys.argv[1])
for step in range(10**9):
    worker.progress(step)
    if worker.should_stop():
        print(step, flush=True)
        break
    time.sleep(pace)
"""


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[Callable[[list[float]], list[tuple[Path, subprocess.Popen[str]]]]]:
    started: list[subprocess.Popen[str]] = []

    def start(paces: list[float]) -> list[tuple[Path, subprocess.Popen[str]]]:
        out = []
        for rank, pace in enumerate(paces):
            path = tmp_path / f"{rank}.page"
            create_page(str(path))
            env = {**os.environ, worker.PAGE_VAR: str(path)}
            p = subprocess.Popen(
                [sys.executable, "-c", LOOP, str(pace)], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True
            )
            started.append(p)
            out.append((path, p))
        return out

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def test_real_ranks_at_different_speeds_all_stop_at_the_step_that_went(
    ranks: Callable[[list[float]], list[tuple[Path, subprocess.Popen[str]]]],
) -> None:
    procs = ranks([0.001, 0.003])
    paths = [str(path) for path, _ in procs]

    def samples() -> list[RankSample | None]:
        return [read_page(p) for p in paths]

    def all_seen(step: int) -> Callable[[], bool]:
        return lambda: all(s is not None and s.seen == step for s in samples())

    until(lambda: all(s is not None and s.checks and s.step > 0 for s in samples()), "no check-in")
    with PageSet(paths) as ps:
        # An arm at a step every rank has reached: someone is late, nobody stops there.
        first = min(s.step for s in samples() if s is not None)
        ps.write_stop(first, ARMED)
        until(all_seen(first), "no acknowledgement of the arm")
        assert max(s.seen_at for s in samples() if s is not None) >= first
        # The server re-arms past every rank, as the agent saw them; retried if the machine is so
        # loaded that a rank went past it before reading it (the protocol's late path again).
        stop = -1
        for _ in range(5):
            stop = max(s.step for s in samples() if s is not None) + 300
            ps.write_stop(stop, ARMED)
            until(all_seen(stop), "no acknowledgement")
            if all(s is not None and s.seen_at < stop for s in samples()):
                break
        else:
            pytest.fail("every arm was late")
        assert all(p.poll() is None for _, p in procs)  # nobody stopped at the late step
        ps.write_stop(stop, GO)
    printed = []
    for _, p in procs:
        out, _ = p.communicate(timeout=DEADLINE)
        assert p.returncode == 0
        printed.append(int(out.strip()))
    assert printed == [stop, stop]
    assert [(s.stopped, s.step) for s in samples() if s is not None] == [(stop, stop)] * 2
