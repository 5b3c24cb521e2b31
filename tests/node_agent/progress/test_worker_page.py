"""The progress page: the worker's writer (node_agent.worker) against the agent's reader
(node_agent.progress.pages), through real files and real worker processes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent import worker
from node_agent.progress import pages
from node_agent.progress.pages import Page, PageSet, RankSample, create_page, read_page, read_stacks_since
from node_agent.worker import layout as L

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "progress-page.md"
DEADLINE = 30.0

# A worker driven line by line from stdin; it answers each command with one JSON line.
DRIVER = r"""
import json, os, sys, threading, time
from node_agent import worker

def parked_in_a_side_thread():
    while True:
        time.sleep(3600)

threading.Thread(target=parked_in_a_side_thread, daemon=True).start()
stack = []
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    out = None
    if cmd == "progress":
        worker.progress(int(arg))
    elif cmd == "enter":
        stack.append(worker.phase(arg))
        stack[-1].__enter__()
    elif cmd == "exit":
        stack.pop().__exit__(None, None, None)
    elif cmd == "sleep":
        time.sleep(float(arg))
    elif cmd == "attached":
        out = worker.attached()
    elif cmd == "stop":
        out = worker.should_stop()
    elif cmd == "fork":  # a DataLoader-like child reports, then exits: 0 if it stayed a no-op
        pid = os.fork()
        if pid == 0:
            worker.progress(999)
            with worker.phase("child"):
                pass
            os._exit(0 if not worker.attached() and not worker.should_stop() else 1)
        out = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    elif cmd == "pid":
        out = os.getpid()
    elif cmd == "letgo":  # what the interpreter's finalization does, before the process is gone
        import faulthandler
        faulthandler.unregister(worker.STACK_SIGNAL)
    print(json.dumps(out), flush=True)
"""


class Driver:
    """A real worker process reporting to ``page`` (None: the variable unset)."""

    def __init__(self, page: Path | str | None) -> None:
        env = {k: v for k, v in os.environ.items() if k != worker.PAGE_VAR}
        if page is not None:
            env[worker.PAGE_VAR] = str(page)
        self.p = subprocess.Popen(
            [sys.executable, "-c", DRIVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=ROOT,
            text=True,
        )

    def __call__(self, line: str) -> object:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        answer = self.p.stdout.readline()
        assert answer, f"the worker died on {line!r}: rc {self.p.wait(5)}"
        return json.loads(answer)

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)


@pytest.fixture
def driver() -> Iterator[type[Driver]]:
    started: list[Driver] = []

    def make(page: Path | str | None) -> Driver:
        d = Driver(page)
        started.append(d)
        return d

    yield make  # type: ignore[misc]
    for d in started:
        d.close()


@pytest.fixture
def page(tmp_path: Path) -> Path:
    path = tmp_path / "progress.page"
    create_page(str(path))
    return path


@pytest.fixture
def here(page: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This test process attached to ``page`` as a worker (module state reset around it)."""
    worker._reset()
    monkeypatch.setenv(worker.PAGE_VAR, str(page))
    yield page
    worker._reset()


def attach_header(path: Path, pid: int = 4321) -> None:
    """Make a created page look attached by process ``pid`` (as a worker leaves the header)."""
    with open(path, "r+b") as f:
        f.seek(L.PID_OFFSET)
        f.write(pid.to_bytes(4, "little"))


# --- import --------------------------------------------------------------------------------

IMPORT_PROBE = (
    "import sys, time; before = set(sys.modules); t = time.perf_counter(); "
    "from node_agent import worker; dt = time.perf_counter() - t; "
    "print(sorted(set(sys.modules) - before)); print(dt * 1000)"
)
ALLOWED = {
    "node_agent",
    "node_agent.worker",
    "node_agent.worker.layout",
    "__future__",
    "struct",
    "_struct",
    "mmap",
    "faulthandler",
}


def imported_by_worker() -> tuple[set[str], float]:
    env = {k: v for k, v in os.environ.items() if k != worker.PAGE_VAR}
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    return set(eval(lines[0])), float(lines[1])


def test_importing_the_worker_module_pulls_in_no_agent_code() -> None:
    mods, ms = imported_by_worker()
    print(f"import node_agent.worker: {ms:.2f} ms, new modules {sorted(mods)}")
    heavy = {"asyncio", "aiohttp", "msgpack", "dataclasses", "socket", "selectors", "threading"}
    assert not mods & heavy, sorted(mods & heavy)
    assert not [m for m in mods if m.startswith(("protocol", "edge")) or m.split(".")[0] in heavy]
    assert {m for m in mods if m.startswith("node_agent")} == {
        "node_agent",
        "node_agent.worker",
        "node_agent.worker.layout",
    }


def test_importing_the_worker_module_imports_only_its_stdlib() -> None:
    mods, _ = imported_by_worker()
    assert mods <= ALLOWED, sorted(mods - ALLOWED)


# --- the page, agent side ------------------------------------------------------------------


def test_a_created_page_is_private_fresh_and_reads_as_not_attached(tmp_path: Path) -> None:
    path = tmp_path / "p.page"
    path.write_bytes(b"x" * 10_000)
    os.chmod(path, 0o644)
    create_page(str(path))
    assert path.stat().st_size == L.PAGE_SIZE
    assert path.stat().st_mode & 0o777 == 0o600
    data = path.read_bytes()
    assert L.HEADER.unpack_from(data, 0) == (L.MAGIC, L.VERSION, L.PAGE_SIZE, 0, 0, 0)
    assert L.STOP.unpack_from(data, L.STOP_OFFSET) == (-1, L.STOP_NONE, 0, L.check(-1, 0, 0))
    assert data[L.PROGRESS_OFFSET : L.STOP_OFFSET] == bytes(64)
    assert data[L.CHECK_OFFSET : L.CHECK_OFFSET + L.CHECK.size] == bytes(32)  # no check-in yet
    assert read_page(str(path)) is None  # nobody attached
    assert [p.name for p in tmp_path.iterdir()] == ["p.page"]  # no temporary left behind


def test_replacing_a_page_leaves_a_mapping_of_the_old_one_whole(tmp_path: Path) -> None:
    import mmap

    path = tmp_path / "p.page"
    create_page(str(path))
    with open(path, "r+b") as f:
        old = mmap.mmap(f.fileno(), L.PAGE_SIZE)
    old[L.PID_OFFSET : L.PID_OFFSET + 4] = (77).to_bytes(4, "little")
    create_page(str(path))
    assert len(old) == L.PAGE_SIZE and old[: len(L.MAGIC)] == L.MAGIC  # no SIGBUS, old data
    assert old[L.PID_OFFSET] == 77
    assert read_page(str(path)) is None  # the new page is fresh
    old.close()


@pytest.mark.parametrize(
    "damage",
    ["missing", "empty", "short", "magic", "version", "size"],
)
def test_a_page_that_is_not_one_reads_as_none(page: Path, damage: str) -> None:
    attach_header(page)
    good = page.read_bytes()
    assert read_page(str(page)) is not None
    data = bytearray(good)
    if damage == "missing":
        page.unlink()
    elif damage == "empty":
        page.write_bytes(b"")
    elif damage == "short":
        page.write_bytes(good[:300])
    elif damage == "magic":
        data[0:8] = b"NOTAPAGE"
    elif damage == "version":
        data[8:12] = (L.VERSION - 1).to_bytes(4, "little")  # a page of the layout before
    elif damage == "size":
        data[12:16] = (8192).to_bytes(4, "little")
    if damage in ("magic", "version", "size"):
        page.write_bytes(bytes(data))
    assert read_page(str(page)) is None
    assert pages.write_stop(str(page), 3, L.STOP_ARMED) is (damage not in ("missing",))


def test_a_page_set_reads_every_rank_and_stops_them_all(tmp_path: Path) -> None:
    paths = [str(tmp_path / f"{r}.page") for r in range(3)]
    for p in paths:
        create_page(p)
    attach_header(Path(paths[1]), pid=99)
    with PageSet([*paths, str(tmp_path / "missing.page")]) as ps:
        got = ps.read()
        ps.write_stop(12, L.STOP_GO)
    assert got[0] is None and got[2] is None and got[3] is None
    assert got[1] == RankSample(
        step=-1,
        progress_ns=0,
        count=0,
        phase="",
        phase_ns=0,
        compute_ns=0,
        pid=99,
        stack_signal=0,
        attached_ns=0,
        checks=False,
        seen=-1,
        seen_at=-1,
        stopped=-1,
    )
    for p in paths:
        assert L.STOP.unpack_from(Path(p).read_bytes(), L.STOP_OFFSET) == (12, 2, 0, L.check(12, 2, 0))


@pytest.mark.parametrize(
    ("step", "state"),
    [
        *[(-2, L.STOP_NONE), (1 << 63, L.STOP_ARMED), (True, L.STOP_GO), (1.0, L.STOP_GO)],
        *[(3, 3), (3, -1), (3, True), (-1, L.STOP_ARMED), (-1, L.STOP_GO), (5, L.STOP_NONE)],
    ],
)
def test_a_stop_record_must_be_none_or_a_step_armed_or_go(page: Path, step: object, state: object) -> None:
    attach_header(page)
    before = page.read_bytes()
    with Page(str(page)) as p, PageSet([str(page)]) as ps:
        for write in (p.write_stop, ps.write_stop, lambda a, b: pages.write_stop(str(page), a, b)):
            with pytest.raises(ValueError, match=r"stop (step|state)"):
                write(step, state)  # type: ignore[arg-type]
    assert page.read_bytes() == before  # nothing written


@pytest.mark.parametrize(
    ("step", "state"), [(-1, L.STOP_NONE), (0, L.STOP_ARMED), ((1 << 63) - 1, L.STOP_GO)]
)
def test_a_stop_record_is_written_whole_with_its_check(page: Path, step: int, state: int) -> None:
    assert pages.write_stop(str(page), step, state)
    assert L.STOP.unpack_from(page.read_bytes(), L.STOP_OFFSET) == (step, state, 0, L.check(step, state, 0))


def test_stacks_are_read_from_an_offset_and_bounded(tmp_path: Path) -> None:
    path = str(tmp_path / "progress.page.stacks")
    assert read_stacks_since(path, 0) == ("", 0)  # no file yet: nothing gained
    Path(path).write_bytes(b"first\n")
    assert read_stacks_since(path, 0) == ("first\n", 6)
    with open(path, "ab") as f:
        f.write(b"second \xff\n")
    assert read_stacks_since(path, 6) == ("second \ufffd\n", 15)
    Path(path).write_bytes(b"x" * 100)
    text, off = read_stacks_since(path, 15, limit=40)
    assert (text, off) == ("x" * 40, 55)
    Path(path).write_bytes(b"new\n")  # replaced: shorter than the offset, read from its start
    assert read_stacks_since(path, 55) == ("new\n", 4)


# --- torn writes ---------------------------------------------------------------------------

_u64 = st.integers(min_value=0, max_value=(1 << 64) - 1)
_steps = st.integers(min_value=0, max_value=(1 << 63) - 1)
_records = st.tuples(_steps, _u64, _u64) | st.tuples(
    st.integers(0, 10**7), st.integers(0, 10**15), st.integers(0, 10**7)
)


def _words(rec: tuple[int, int, int]) -> list[bytes]:
    raw = L.PROGRESS.pack(rec[0], rec[1], rec[2], L.check(*rec))
    return [raw[i : i + 8] for i in range(0, 32, 8)]


@settings(max_examples=300, deadline=None)
@given(old=_records, new=_records, mask=st.integers(0, 15))
def test_a_mix_of_two_progress_records_never_reads_as_a_third(
    tmp_path_factory: pytest.TempPathFactory, old: tuple[int, int, int], new: tuple[int, int, int], mask: int
) -> None:
    path = tmp_path_factory.mktemp("torn") / "p.page"
    create_page(str(path))
    attach_header(path)
    a, b = _words(old), _words(new)
    mixed = b"".join(b[i] if mask >> i & 1 else a[i] for i in range(4))
    with open(path, "r+b") as f:
        f.seek(L.PROGRESS_OFFSET)
        f.write(mixed)
    got = read_page(str(path))
    read = None if got is None else (got.step, got.progress_ns, got.count)
    whole = {b"".join(a): old, b"".join(b): new}
    assert read == whole.get(mixed)  # one of the two records, or None: never a third


@settings(max_examples=200, deadline=None)
@given(old=_records, new=_records, mask=st.integers(1, 14))
def test_a_mix_of_two_phase_records_never_reads_as_a_third(
    tmp_path_factory: pytest.TempPathFactory, old: tuple[int, int, int], new: tuple[int, int, int], mask: int
) -> None:
    path = tmp_path_factory.mktemp("torn") / "p.page"
    create_page(str(path))
    attach_header(path)
    recs = [(o[0] % 15 + 1, o[1], o[2]) for o in (old, new)]
    a, b = ([L.PHASE.pack(*r, L.check(*r))[i : i + 8] for i in range(0, 32, 8)] for r in recs)
    mixed = b"".join(b[i] if mask >> i & 1 else a[i] for i in range(4))
    with open(path, "r+b") as f:
        f.seek(L.PHASE_OFFSET)
        f.write(mixed)
    got = read_page(str(path))
    read = None if got is None else (L.PHASE.unpack(mixed)[0], got.phase_ns, got.compute_ns)
    whole = {b"".join(a): recs[0], b"".join(b): recs[1]}
    assert read == whole.get(mixed)


def test_a_record_caught_halfway_reads_as_none_then_as_the_new_value(page: Path) -> None:
    attach_header(page)
    old, new = (41, 10**12, 42), (42, 10**12 + 5_000_000, 43)
    with open(page, "r+b") as f:
        f.seek(L.PROGRESS_OFFSET)
        f.write(b"".join(_words(old)))
        f.flush()
        assert (s := read_page(str(page))) is not None and (s.step, s.progress_ns, s.count) == old
        f.seek(L.PROGRESS_OFFSET)
        f.write(b"".join(_words(new))[:16])  # the writer is halfway
        f.flush()
        assert read_page(str(page)) is None  # neither value: never a mix
        f.write(b"".join(_words(new))[16:])
        f.flush()
        assert (s := read_page(str(page))) is not None and (s.step, s.progress_ns, s.count) == new


def test_a_torn_read_is_tried_again_within_the_call(page: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    attach_header(page)
    good = bytearray(page.read_bytes()[:1024])
    L.PROGRESS.pack_into(good, L.PROGRESS_OFFSET, 5, 6, 7, L.check(5, 6, 7))
    torn = bytearray(good)
    torn[L.PROGRESS_OFFSET] = 9  # step 9 with step 5's check: a write in flight
    served = [bytes(torn), bytes(torn), bytes(good)]
    real = os.pread

    def pread(fd: int, n: int, off: int) -> bytes:
        return served.pop(0)[:n] if served else real(fd, n, off)

    monkeypatch.setattr(pages.os, "pread", pread)
    with Page(str(page)) as p:
        assert (s := p.read()) is not None and s.step == 5  # third try
        served[:] = [bytes(torn)] * 3
        assert p.read() is None  # torn three times: None, no exception
        assert served == []


# --- the worker's writer, in this process ---------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 1_000

    def __call__(self) -> int:
        return self.t


def sample(path: Path) -> RankSample:
    s = read_page(str(path))
    assert s is not None
    return s


def test_phases_nest_and_compute_time_adds_up_on_a_fake_clock(
    here: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    monkeypatch.setattr(worker, "_now", clock)
    assert worker.attached()
    assert sample(here).phase == "" and sample(here).compute_ns == 0

    with worker.phase("compute"):
        clock.t = 1_050
    assert (sample(here).phase, sample(here).compute_ns) == ("", 50)

    clock.t = 2_000
    with worker.phase("checkpoint"):
        clock.t = 2_010
        with worker.phase("io"):
            s = sample(here)
            assert (s.phase, s.phase_ns) == ("io", 2_010)
            clock.t = 2_020
        s = sample(here)
        assert (s.phase, s.phase_ns) == ("checkpoint", 2_000)  # restored, with its own start
    assert (sample(here).phase, sample(here).phase_ns) == ("", 0)

    clock.t = 3_000
    with worker.phase("compute"):  # compute in compute, and a phase inside: counted once
        clock.t = 3_010
        with worker.phase("compute"):
            clock.t = 3_020
        with worker.phase("data"):
            clock.t = 3_070
        assert sample(here).compute_ns == 50  # added when the outermost compute ends
        clock.t = 3_100
    assert sample(here).compute_ns == 150

    with pytest.raises(RuntimeError), worker.phase("compute"):  # an exception still leaves it
        clock.t = 3_200
        raise RuntimeError("boom")
    s = sample(here)
    assert (s.phase, s.compute_ns) == ("", 250)


def test_progress_records_step_time_and_count(here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(worker, "_now", clock)
    for step in (0, 1, 7):
        clock.t += 100
        worker.progress(step)
    s = sample(here)
    assert (s.step, s.progress_ns, s.count, s.pid) == (7, 1_300, 3, os.getpid())

    class Index:  # numpy and torch integers have __index__
        def __index__(self) -> int:
            return 8

    worker.progress(Index())  # type: ignore[arg-type]
    assert sample(here).step == 8


@pytest.mark.parametrize("attach", [True, False])
def test_a_bad_step_or_phase_name_fails_at_the_call_attached_or_not(
    here: Path, monkeypatch: pytest.MonkeyPatch, attach: bool
) -> None:
    if not attach:
        monkeypatch.delenv(worker.PAGE_VAR)
    assert worker.attached() is attach
    for bad in (True, 1.5, "3", None):
        with pytest.raises(TypeError, match="int step"):
            worker.progress(bad)  # type: ignore[arg-type]
    for bad in (-1, 1 << 63):
        with pytest.raises(ValueError, match="step in 0"):
            worker.progress(bad)
    with pytest.raises(TypeError):
        worker.phase(b"compute")  # type: ignore[arg-type]
    for name in ("", "a\0b"):
        with pytest.raises(ValueError):
            worker.phase(name)
    if attach:
        assert sample(here).count == 0  # nothing was written by the failed calls


def test_fifteen_slots_then_other_and_long_names_cut_at_a_character(here: Path) -> None:
    long = "é" * 20  # 40 bytes of UTF-8: cut to 15 characters (30 bytes), not mid-character
    names = [long] + [f"p{i}" for i in range(20)]
    seen = []
    for name in names:
        with worker.phase(name):
            seen.append(sample(here).phase)
    assert seen[0] == "é" * 15
    assert seen[1:13] == [f"p{i}" for i in range(12)]  # slots 2..14 ("compute" is slot 1)
    assert seen[13:] == ["other"] * 8
    with worker.phase("compute"):
        assert sample(here).phase == "compute"
    with worker.phase(long + "more"):  # the same once cut: the same slot
        assert sample(here).phase == "é" * 15
    data = here.read_bytes()
    names_in_page = [
        data[L.name_offset(s) : L.name_offset(s) + L.NAME_SIZE].rstrip(b"\0").decode() for s in range(1, 16)
    ]
    assert names_in_page == ["compute", "é" * 15, *[f"p{i}" for i in range(12)], "other"]


def test_outside_node_agent_every_call_is_a_no_op(monkeypatch: pytest.MonkeyPatch, page: Path) -> None:
    worker._reset()
    monkeypatch.delenv(worker.PAGE_VAR, raising=False)
    try:
        worker.progress(3)
        with worker.phase("compute"):
            pass
        assert worker.should_stop() is False and worker.attached() is False
        monkeypatch.setenv(worker.PAGE_VAR, str(page))  # too late: a no-op for good
        worker.progress(4)
        assert worker.attached() is False and read_page(str(page)) is None
    finally:
        worker._reset()


@pytest.mark.parametrize("what", ["missing", "magic", "short", "taken"])
def test_a_page_it_cannot_use_leaves_the_worker_a_no_op(page: Path, driver: type[Driver], what: str) -> None:
    if what == "missing":
        page.unlink()
    elif what == "magic":
        page.write_bytes(b"X" * L.PAGE_SIZE)
    elif what == "short":
        page.write_bytes(page.read_bytes()[:512])
    elif what == "taken":
        attach_header(page, pid=4321)
    before = page.read_bytes() if page.exists() else None
    d = driver(page)
    assert d("progress 3") is None and d("enter compute") is None and d("exit") is None
    assert d("attached") is False and d("stop") is False
    assert (page.read_bytes() if page.exists() else None) == before  # untouched
    assert not Path(f"{page}.stacks").exists()


# --- real worker processes -----------------------------------------------------------------


def test_every_field_round_trips_from_a_real_worker(page: Path, driver: type[Driver]) -> None:
    t0 = time.monotonic_ns()
    d = driver(page)
    assert d("attached") is True
    t1 = time.monotonic_ns()
    s = sample(page)
    pid = d("pid")
    assert (s.pid, s.stack_signal, s.step, s.count, s.phase) == (pid, signal.SIGRTMIN + 4, -1, 0, "")
    assert t0 <= s.attached_ns <= t1
    assert stat_mode(f"{page}.stacks") == 0o600

    d("enter setup")
    d("exit")
    d("enter compute")
    d("sleep 0.02")
    d("exit")
    t2 = time.monotonic_ns()
    d("progress 3")
    d("enter checkpoint")
    t3 = time.monotonic_ns()
    s = sample(page)
    assert (s.step, s.count, s.phase) == (3, 1, "checkpoint")
    assert t2 <= s.progress_ns <= s.phase_ns <= t3
    assert 20_000_000 <= s.compute_ns < t2 - t0
    d("exit")
    d("progress 4")
    s = sample(page)
    assert (s.step, s.count, s.phase, s.phase_ns) == (4, 2, "", 0)


def stat_mode(path: str) -> int:
    return os.stat(path).st_mode & 0o777


def test_a_forked_child_never_writes_its_parents_page(page: Path, driver: type[Driver]) -> None:
    d = driver(page)
    d("progress 1")
    d("enter compute")
    assert d("fork") == 0  # the child found itself detached
    d("exit")
    s = sample(page)
    assert (s.step, s.count, s.phase) == (1, 1, "")
    assert "child" not in page.read_bytes().decode("latin-1")
    assert d("stop") is False and d("attached") is True  # the parent still reports


def test_a_child_forked_before_the_parent_attached_does_not_take_the_page(
    page: Path, driver: type[Driver]
) -> None:
    d = driver(page)
    assert d("fork") == 0  # the child tried progress, phase, attached: all no-ops
    assert read_page(str(page)) is None
    d("progress 2")
    assert sample(page).pid == d("pid")


def test_a_second_process_with_the_same_page_stays_a_no_op(page: Path, driver: type[Driver]) -> None:
    first, second = driver(page), driver(page)
    first("progress 1")
    assert second("attached") is False
    second("progress 50")
    s = sample(page)
    assert (s.pid, s.step) == (first("pid"), 1)


def test_the_stack_signal_writes_every_threads_stack_and_the_worker_goes_on(
    page: Path, driver: type[Driver]
) -> None:
    d = driver(page)
    d("progress 1")
    s = sample(page)
    stacks = f"{page}.stacks"
    text, offset = read_stacks_since(stacks, 0)
    assert text == ""
    os.kill(s.pid, s.stack_signal)
    got = ""
    deadline = time.monotonic() + DEADLINE
    while "parked_in_a_side_thread" not in got or "<module>" not in got:
        assert time.monotonic() < deadline, f"no stacks within {DEADLINE} s: {got!r}"
        time.sleep(0.02)
        more, offset = read_stacks_since(stacks, offset)
        got += more
    assert re.search(r"Thread 0x[0-9a-f]+", got), got
    assert d("progress 2") is None  # still alive and reporting
    assert sample(page).step == 2


def test_a_stack_request_once_faulthandler_let_the_signal_go_is_harmless(
    page: Path, driver: type[Driver]
) -> None:
    # The interpreter's finalization unregisters faulthandler's signals, and with torch loaded
    # the process lives on for many milliseconds after; its page still says "armed" (the agent
    # may have read it just before): a request then killed a rank that was exiting 0 (issue 48).
    d = driver(page)
    d("progress 1")
    s = sample(page)
    d("letgo")
    os.kill(s.pid, s.stack_signal)
    assert d("pid") == s.pid  # alive: the signal was ignored


def test_an_attached_process_leaves_the_stack_signal_ignored_not_at_its_default(here: Path) -> None:
    import signal

    worker.progress(1)
    assert signal.getsignal(worker.STACK_SIGNAL) == signal.SIG_IGN  # faulthandler's, under it
    worker._reset()  # as a fresh process (the test process's own disposition back)
    assert signal.getsignal(worker.STACK_SIGNAL) == signal.SIG_DFL


# --- the documentation ---------------------------------------------------------------------


def test_the_documented_layout_and_worked_example_are_the_codes() -> None:
    doc = DOC.read_text()
    rec = (100, 5_000_000_000, 101)
    raw = L.PROGRESS.pack(*rec, L.check(*rec))
    assert f"0x{L.check(*rec):016x}" in doc
    assert raw.hex(" ").upper() in " ".join(doc.split())  # the 32 bytes, as the doc lists them
    assert f"0x{L.check(-1, 0, 0):016x}" in doc
    flat = " ".join(doc.split())
    for struct, rec in ((L.STOP, (120, L.STOP_ARMED, 0)), (L.CHECK, (120, 100, -1))):
        assert f"0x{L.check(*rec):016x}" in doc
        assert struct.pack(*rec, L.check(*rec)).hex(" ").upper() in flat
    assert f"0x{L.check(120, L.STOP_GO, 0):016x}" in doc
    assert f"0x{L.check(-1, -1, -1):016x}" in doc
    assert f"layout version: {L.VERSION} " in doc
    for name, value in (
        ("K1", L._K1),
        ("K2", L._K2),
        ("K3", L._K3),
        ("K4", L._K4),
    ):
        assert f"{name} = 0x{value:016X}" in doc
    for offset in (
        L.PID_OFFSET,
        L.SIGNAL_OFFSET,
        L.ATTACHED_OFFSET,
        L.PROGRESS_OFFSET,
        L.PHASE_OFFSET,
        L.STOP_OFFSET,
        L.CHECK_OFFSET,
    ):
        assert f"| {offset} " in doc
    assert f"| {L.STOP_OFFSET} | {L.STOP.size} |" in doc and f"| {L.CHECK_OFFSET} | {L.CHECK.size} |" in doc
    assert f"SIGRTMIN + 4 ({signal.SIGRTMIN + 4} on Linux)" in doc
    assert L.MAGIC.decode().strip() in doc
