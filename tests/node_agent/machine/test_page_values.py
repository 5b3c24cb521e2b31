"""Values from the workers' pages are checked where they enter the agent (issue 30, part 3).

A page is written by the user's process, or by a C++ or Rust trainer following
``docs/progress-page.md``: whatever it holds, the agent never crashes and every message it
sends is valid. Phase names are cleaned by the worker's writer and by the agent's reader (one
rule: ``layout.clean_name``); a page with a value the layout does not allow is said once and its
rank counts as not reporting. The property test at the end writes random page contents under
the agent's machine, in process: real pages on disk, the agent's reader, the machine, and every
message through the wire codec.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from node_agent import worker
from node_agent.machine import events as st
from node_agent.machine.events import DumpStacks, StacksDumped, WriteStop
from node_agent.machine.watch import Hung
from node_agent.progress.pages import Page, create_page, read_page
from node_agent.progress.poll import RoundPages, dump
from node_agent.worker import layout as L
from protocol import CLIENT_MESSAGES, CollectStacks, FrameDecoder, HangDetected, Progress, StopAt, encode
from protocol.codec import frame_limits
from protocol.messages import MAX_PHASE_LEN

from .test_training import machine

NS = 1_000_000_000
I64 = hs.integers(-(1 << 63), (1 << 63) - 1)
U64 = hs.integers(0, (1 << 64) - 1)


# --- pages as any writer may leave them -----------------------------------------------------


def attached(path: Path, pid: int = 4321, sig: int = 0) -> None:
    """A page (created here unless it exists) with its header as a worker leaves it (pid last)."""
    if not path.exists():
        create_page(str(path))
    with open(path, "r+b") as f:
        f.seek(L.SIGNAL_OFFSET)
        f.write(sig.to_bytes(4, "little"))
        f.seek(L.PID_OFFSET)
        f.write(pid.to_bytes(4, "little"))


def put(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def progress_record(step: int, ns: int, count: int) -> bytes:
    return L.PROGRESS.pack(step, ns, count, L.check(step, ns, count))


def phase_record(slot: int, ns: int, compute_ns: int) -> bytes:
    return L.PHASE.pack(slot, ns, compute_ns, L.check(slot, ns, compute_ns))


def check_record(seen: int, at: int, stopped: int) -> bytes:
    return L.CHECK.pack(seen, at, stopped, L.check(seen, at, stopped))


def name(slot: int, raw: bytes) -> tuple[int, bytes]:
    return L.name_offset(slot), raw[: L.NAME_SIZE].ljust(L.NAME_SIZE, b"\0")


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This test process attached to a fresh page as a worker (module state reset around it)."""
    page = tmp_path / "progress.page"
    create_page(str(page))
    worker._reset()
    monkeypatch.setenv(worker.PAGE_VAR, str(page))
    yield page
    worker._reset()


def is_plain(text: str) -> bool:
    return text.isprintable() and len(text) <= MAX_PHASE_LEN


# --- phase names ----------------------------------------------------------------------------


def test_the_worker_writes_a_phase_name_with_control_characters_cleaned(here: Path) -> None:
    def stored(slot: int) -> bytes:
        off = L.name_offset(slot)
        return here.read_bytes()[off : off + L.NAME_SIZE].rstrip(b"\0")

    with worker.phase("load\tdata"):
        s = read_page(str(here))
        assert s is not None and s.phase == "load?data"
    assert stored(2) == b"load?data"
    with worker.phase("load\rdata"):  # the same once cleaned: the same slot
        s = read_page(str(here))
        assert s is not None and s.phase == "load?data"
    assert stored(3) == b""
    with worker.phase("\x1b[2J\u2028\udc80" + "é" * 20):  # ESC, a separator, a lone surrogate
        s = read_page(str(here))
        assert s is not None and s.phase == "?[2J??" + "é" * 12  # 31 bytes, cut at a character
    assert stored(3) == b"?[2J??" + "é".encode() * 12


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        (b"load\tdata", "load?data"),
        (b"\x1b[31mred\x7f\xc2\x85", "?[31mred??"),  # ESC, DEL and C1 NEL
        (b"\xe2\x80\xae" + b"x" * 28, "?" + "x" * 28),  # a right-to-left override
    ],
)
def test_the_reader_cleans_the_phase_name_any_writer_left(tmp_path: Path, raw: bytes, shown: str) -> None:
    path = tmp_path / "p.page"
    attached(path)
    put(path, *name(2, raw))
    put(path, L.PHASE_OFFSET, phase_record(2, 5 * NS, 0))
    s = read_page(str(path))
    assert s is not None and s.phase == shown and is_plain(s.phase)


async def test_a_hang_beside_a_rank_in_an_odd_phase_collects_every_ranks_stacks(tmp_path: Path) -> None:
    # Two local ranks: rank 0 hung, rank 1 (not hung) in a phase whose name holds a tab, as a
    # C++ writer or an older worker leaves it. The stacks message must still be built.
    paths = [str(tmp_path / f"{lr}.page") for lr in range(2)]
    pages = RoundPages(
        paths, rank_offset=6, fr_pipe_stem=str(tmp_path / "fr_"), report_path=str(tmp_path / "r.txt")
    )
    try:
        for p in paths:
            attached(Path(p))
        put(Path(paths[0]), L.PROGRESS_OFFSET, progress_record(19, 3 * NS, 20))
        put(Path(paths[1]), L.PROGRESS_OFFSET, progress_record(20, 4 * NS, 21))
        put(Path(paths[1]), *name(2, b"load\tdata"))
        put(Path(paths[1]), L.PHASE_OFFSET, phase_record(2, 4 * NS, 0))
        hung = Hung(local_rank=0, step=19, phase="compute", silent_s=31.0, budget_s=30.0)
        got = await dump(DumpStacks(round=3, hung=(hung,), reason="hang"), pages, {}, "n1")
    finally:
        pages.close()
    assert isinstance(got, StacksDumped) and got.stacks is not None
    assert got.stacks.ranks == (6, 7) and got.stacks.phases == ("compute", "load?data")
    assert got.path and "hang: suspect rank 6" in Path(got.path).read_text()  # the node's report
    assert FrameDecoder(allowed=CLIENT_MESSAGES).feed(encode(got.stacks)) == [got.stacks]


# --- values the layout does not allow -------------------------------------------------------


@pytest.mark.parametrize(
    ("offset", "record", "why"),
    [
        (L.PROGRESS_OFFSET, progress_record(-5, 5 * NS, 6), "step -5"),
        (L.PROGRESS_OFFSET, progress_record(-(1 << 63), 0, 1), "step -9223372036854775808"),
        (L.PHASE_OFFSET, phase_record(16, 5 * NS, 0), "phase slot 16"),
        (L.PHASE_OFFSET, phase_record((1 << 64) - 1, 5 * NS, 0), "phase slot 18446744073709551615"),
        (L.CHECK_OFFSET, check_record(120, -5, -1), "steps 120, -5, -1 in its check record"),
        (L.CHECK_OFFSET, check_record(-2, -1, -1), "steps -2, -1, -1"),
        (L.CHECK_OFFSET, check_record(-1, -1, -7), "steps -1, -1, -7"),
    ],
)
def test_a_whole_record_with_a_value_the_layout_does_not_allow_makes_the_page_bad(
    tmp_path: Path, offset: int, record: bytes, why: str
) -> None:
    from node_agent.progress.pages import BadPage

    path = tmp_path / "p.page"
    attached(path)
    put(path, offset, record)
    with Page(str(path)) as page:
        got = page.check()
        assert isinstance(got, BadPage) and why in got.why
        assert page.read() is None  # to a reader that does not ask why: nothing to act on


def bad_pages(tmp_path: Path) -> RoundPages:
    """Two ranks' pages: rank 0 reports step 10; rank 1's progress record holds step -5, with
    a valid check word."""
    paths = [str(tmp_path / f"{lr}.page") for lr in range(2)]
    pages = RoundPages(
        paths, rank_offset=2, fr_pipe_stem=str(tmp_path / "fr_"), report_path=str(tmp_path / "r.txt")
    )
    for p in paths:
        attached(Path(p))
    put(Path(paths[0]), L.PROGRESS_OFFSET, progress_record(10, 2 * NS, 11))
    put(Path(paths[1]), L.PROGRESS_OFFSET, progress_record(-5, 2 * NS, 11))
    return pages


def warnings(effects: list[st.Effect]) -> list[str]:
    return [e.text for e in effects if isinstance(e, st.Log) and e.level == "warning"]


def sent(effects: list[st.Effect]) -> list[object]:
    return [e.msg for e in effects if isinstance(e, st.Send)]


def test_a_negative_step_is_said_once_and_its_rank_counts_as_not_reporting(tmp_path: Path) -> None:
    m = machine(timeout="3")
    pages = bad_pages(tmp_path)
    try:
        said: list[str] = []
        summaries = []
        for i in range(8):  # 8 s of reads: rank 0 goes on, rank 1's page stays bad
            put(Path(pages.paths[0]), L.PROGRESS_OFFSET, progress_record(10 + i, (3 + i) * NS, 11 + i))
            effects = m.handle(pages.read(), 3.0 + i)
            said += warnings(effects)
            summaries += [x for x in sent(effects) if isinstance(x, Progress)]
    finally:
        pages.close()
    assert len(said) == 1, said
    assert "local rank 1 (rank 3)" in said[0] and "step -5 in its progress record" in said[0]
    assert summaries and all(p.min_step >= 10 for p in summaries)  # rank 1 is in no summary
    assert m.phase is st.Phase.RUNNING  # and it is not watched: no hang for it


def test_a_check_record_at_a_negative_step_is_said_and_never_reaches_the_server(tmp_path: Path) -> None:
    m = machine(timeout="3")
    pages = bad_pages(tmp_path)
    try:
        put(Path(pages.paths[1]), L.PROGRESS_OFFSET, progress_record(10, 2 * NS, 11))
        for lr in range(2):
            put(Path(pages.paths[lr]), L.CHECK_OFFSET, check_record(-1, -1, -1))  # should_stop() called
        m.handle(pages.read(), 3.0)
        effects = m.handle(st.ServerSent(StopAt(round=4, step=12, state="arm")), 3.1)
        for w in effects:
            if isinstance(w, WriteStop):
                pages.write_stop(w)
        # Both ranks acknowledge 12, saying they were at step -3 then (valid check words).
        for lr in range(2):
            put(Path(pages.paths[lr]), L.CHECK_OFFSET, check_record(12, -3, -1))
        effects = m.handle(pages.read(), 3.2)
    finally:
        pages.close()
    said = warnings(effects)
    assert len(said) == 2 and all("steps 12, -3, -1 in its check record" in w for w in said), said
    assert not [x for x in sent(effects) if type(x).__name__ == "Armed"]  # neither rank takes part


def test_a_first_progress_dated_before_the_round_is_no_hang(tmp_path: Path) -> None:
    # A writer's clock says its first step was done at boot (progress_ns 1): the agent dates it
    # no earlier than its own reads allow, so a budget of 3 s is not already spent.
    m = machine(timeout="3")
    paths = [str(tmp_path / f"{lr}.page") for lr in range(2)]
    pages = RoundPages(
        paths, rank_offset=2, fr_pipe_stem=str(tmp_path / "fr_"), report_path=str(tmp_path / "r")
    )
    try:
        for p in paths:
            attached(Path(p))
        put(Path(paths[0]), L.PROGRESS_OFFSET, progress_record(0, 1, 1))
        assert not [x for x in sent(m.handle(pages.read(), 10.0)) if isinstance(x, HangDetected)]
        assert not [x for x in sent(m.handle(pages.read(), 12.0)) if isinstance(x, HangDetected)]
        hung = [x for x in sent(m.handle(pages.read(), 13.5)) if isinstance(x, HangDetected)]
    finally:
        pages.close()
    assert [(h.ranks, h.silent_s) for h in hung] == [((2, 3), 3.5)]  # rank 3 never reported


# --- any bytes, any values: the property ----------------------------------------------------

SPAN = L.NAMES_OFFSET + L.NAME_SLOTS * L.NAME_SIZE  # what the agent reads of a page
# Values a writer with small bugs leaves (a step below 0 now and then, a slot past 15, any
# bytes for a name), and any bytes and any values at all (most pages then soon read as bad).
TAME = hs.one_of(
    hs.tuples(hs.just("progress"), hs.integers(-1, 50), hs.integers(0, 200 * NS), hs.integers(0, 60)),
    hs.tuples(hs.just("phase"), hs.integers(0, 16), hs.integers(0, 200 * NS), hs.integers(0, 100 * NS)),
    hs.tuples(hs.just("check"), hs.integers(-2, 40), hs.integers(-2, 40), hs.integers(-1, 40)),
    hs.tuples(hs.just("name"), hs.integers(1, 15), hs.binary(max_size=40)),
    hs.tuples(hs.just("raw"), hs.integers(L.NAMES_OFFSET, SPAN - 1), hs.binary(min_size=1, max_size=64)),
)
WILD = hs.one_of(
    TAME,
    hs.tuples(hs.just("raw"), hs.integers(0, SPAN - 1), hs.binary(min_size=1, max_size=64)),
    hs.tuples(hs.just("progress"), I64, U64, U64),
    hs.tuples(hs.just("phase"), U64, U64, U64),
    hs.tuples(hs.just("check"), I64, I64, I64),
)
# Every rank acknowledges the stop step the agent wrote, at some step, stopped or not.
ACK = hs.none() | hs.tuples(hs.just("ack"), hs.integers(-2, 60), hs.integers(-1, 60))
SERVER = hs.one_of(
    hs.none(),
    hs.builds(
        StopAt, round=hs.just(4), step=hs.integers(0, 60), state=hs.sampled_from(["arm", "go", "cancel"])
    ),
    hs.builds(CollectStacks, round=hs.just(4), reason=hs.just("rank 0 on node n0 made no progress")),
)


def rounds_of(writes: hs.SearchStrategy[tuple[object, ...]]) -> hs.SearchStrategy[list[tuple[object, ...]]]:
    """Reads of both ranks' pages, each after some writes, with the server's message after it."""
    return hs.lists(
        hs.tuples(
            hs.lists(hs.tuples(hs.integers(0, 1), writes), max_size=6),
            ACK,
            hs.sampled_from([0.0, 0.05, 0.5, 1.0]) | hs.floats(0.0, 20.0),  # seconds to the read
            SERVER,
        ),
        min_size=1,
        max_size=12,
    )


ROUNDS = rounds_of(TAME) | rounds_of(WILD)


def write(path: Path, w: tuple[object, ...]) -> None:
    kind = w[0]
    if kind == "raw":
        put(path, w[1], w[2])  # type: ignore[arg-type]
    elif kind == "progress":
        put(path, L.PROGRESS_OFFSET, progress_record(*w[1:]))  # type: ignore[arg-type]
    elif kind == "phase":
        put(path, L.PHASE_OFFSET, L.PHASE.pack(*w[1:], L.check(*w[1:])))  # type: ignore[arg-type]
    elif kind == "check":
        put(path, L.CHECK_OFFSET, check_record(*w[1:]))  # type: ignore[arg-type]
    elif kind == "ack":
        stop = L.STOP.unpack_from(path.read_bytes(), L.STOP_OFFSET)[0]
        put(path, L.CHECK_OFFSET, check_record(stop, *w[1:]))  # type: ignore[arg-type]
    else:
        put(path, *name(w[1], w[2]))  # type: ignore[arg-type]


LIMIT = frame_limits().member


def valid(effects: list[st.Effect]) -> None:
    """Every message the agent sends goes through the wire and back unchanged, within the
    server's frame limit for a member: the server takes it."""
    for e in effects:
        if isinstance(e, st.Send):
            frame = encode(e.msg)
            assert len(frame) <= LIMIT
            assert FrameDecoder(allowed=CLIENT_MESSAGES).feed(frame) == [e.msg]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rounds=ROUNDS, pid=hs.integers(1, (1 << 32) - 1), sig=hs.sampled_from([0, 38, 9, 1 << 31]))
def test_any_page_contents_never_crash_the_agent_and_every_message_is_valid(
    tmp_path_factory: pytest.TempPathFactory, rounds: list, pid: int, sig: int
) -> None:
    tmp = tmp_path_factory.mktemp("pages")
    paths = [str(tmp / f"{lr}.page") for lr in range(2)]
    pages = RoundPages(paths, rank_offset=2, fr_pipe_stem=str(tmp / "fr_"), report_path=str(tmp / "r.txt"))
    m = machine(timeout="3")
    said: list[str] = []
    now = 2.0
    try:
        for p in paths:
            attached(Path(p), pid=pid, sig=sig)
        for writes, ack, dt, msg in rounds:
            for lr, w in writes:
                write(Path(paths[lr]), w)
            for p in paths if ack is not None else ():
                write(Path(p), ack)
            now += dt
            todo: list[st.Event] = [pages.read()]
            if msg is not None:
                todo.append(st.ServerSent(msg))
            while todo:
                effects = m.handle(todo.pop(0), now)
                valid(effects)
                said += warnings(effects)
                for e in effects:
                    if isinstance(e, WriteStop):
                        pages.write_stop(e)
                    elif isinstance(e, DumpStacks):  # collected for real (no pids: no signals)
                        todo.append(asyncio.run(dump(e, pages, {}, "n1")))
    finally:
        pages.close()
    # A bad page is said once per rank (the machine's round does not change here).
    for lr in range(2):
        assert len([w for w in said if w.startswith(f"local rank {lr} ")]) <= 1, said
