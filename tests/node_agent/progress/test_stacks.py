"""Collecting stacks from real worker processes, bounded in time (node_agent.progress.stacks)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_agent.machine.training import JOB_REPORT_TITLE
from node_agent.progress.pages import create_page, read_page
from node_agent.progress.poll import add_job_report
from node_agent.progress.stacks import (
    NO_STACKS,
    Target,
    append_report,
    collect,
    poke_flight_recorder,
    write_report,
)
from protocol.hang_report import Entry, merge, parse_stacks, render

ROOT = Path(__file__).resolve().parents[3]
DEADLINE = 30.0
PY_SPY = Path(sys.executable).parent / "py-spy"

# A rank that reports one step through node_agent.worker (which arms the stack signal),
# then waits in a function of its own; "unarmed" never imports the module.
RANK = r"""
import sys, threading, time

def stuck_here():
    while True:
        time.sleep(3600)  # SLEEP

def side(main):
    # "ready" once the main thread sleeps where the test expects it
    line = next(i for i, text in enumerate(open(__file__), 1) if text.rstrip().endswith("# SLEEP"))
    while sys._current_frames()[main].f_lineno != line:
        time.sleep(0.001)
    print("ready", flush=True)
    time.sleep(3600)

if sys.argv[1] == "armed":
    from node_agent import worker
    worker.progress(7)
threading.Thread(target=side, args=(threading.get_ident(),), daemon=True).start()
stuck_here()
"""


class Ranks:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.script = tmp / "rank.py"
        self.script.write_text(RANK)
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, local_rank: int, kind: str) -> Target:
        page = str(self.tmp / f"{local_rank}.page")
        create_page(page)
        env = {**os.environ, "NODE_AGENT_PROGRESS_PAGE": page, "PYTHONPATH": str(ROOT)}
        p = subprocess.Popen(
            [sys.executable, str(self.script), kind], stdout=subprocess.PIPE, text=True, env=env
        )
        self.procs.append(p)
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        sample = read_page(page)
        sig = 0
        if kind == "armed":
            assert sample is not None and sample.pid == p.pid and sample.step == 7
            sig = sample.stack_signal
        return Target(
            local_rank=local_rank, rank=10 + local_rank, pid=p.pid, stack_signal=sig, page_path=page
        )

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[Ranks]:
    r = Ranks(tmp_path)
    try:
        yield r
    finally:
        r.close()


async def test_signal_from_an_armed_rank_and_none_from_an_unarmed_one(ranks: Ranks) -> None:
    armed = ranks.start(0, "armed")
    unarmed = ranks.start(1, "unarmed")
    assert armed.stack_signal == signal.SIGRTMIN + 4
    got = await collect([armed, unarmed], timeout=DEADLINE, py_spy=None)
    assert [(g.rank, g.source) for g in got] == [(10, "signal"), (11, "none")]
    (main,) = [t for t in parse_stacks(got[0].text) if t.main]
    assert main.frames[0].startswith("stuck_here (") and main.frames[1].startswith("<module> (")
    assert len(parse_stacks(got[0].text)) == 2  # every thread
    assert got[1].text == NO_STACKS
    assert ranks.alive()  # the signal dumps and carries on; nothing was sent to the unarmed one
    # asked again, the rank answers again with only the new dump
    again = await collect([armed], timeout=DEADLINE, py_spy=None)
    assert again[0].source == "signal" and again[0].text.count("most recent call first") == 2


async def test_four_ranks_in_parallel(ranks: Ranks) -> None:
    targets = [ranks.start(i, "armed") for i in range(4)]
    start = time.monotonic()
    got = await collect(targets, timeout=DEADLINE, py_spy=None)
    took = time.monotonic() - start
    assert [g.source for g in got] == ["signal"] * 4
    report = merge(
        Entry(rank=g.rank, step=7, phase="", silent_s=60, text=g.text, source=g.source, hung=g.rank == 10)
        for g in got
    )
    assert [g.ranks for g in report.groups] == [(10, 11, 12, 13)]
    assert "ranks 10-13 (4 of 4; stacks by signal)" in render(report)
    print(
        f"4 ranks' stacks by signal: {took * 1000:.0f} ms (slowest rank {max(g.seconds for g in got):.3f} s)"
    )


@pytest.mark.skipif(not PY_SPY.exists(), reason="py-spy is not installed (pip install py-spy==0.4.2)")
async def test_py_spy_first_for_armed_and_unarmed_ranks(ranks: Ranks) -> None:
    targets = [ranks.start(0, "armed"), ranks.start(1, "unarmed")]
    size = os.path.getsize(targets[0].page_path + ".stacks")
    start = time.monotonic()
    got = await collect(targets, timeout=DEADLINE, py_spy=str(PY_SPY))
    took = time.monotonic() - start
    assert [g.source for g in got] == ["py-spy", "py-spy"]
    for g in got:
        (main,) = [t for t in parse_stacks(g.text) if t.main]
        assert main.name == "MainThread" and main.frames[0].startswith("stuck_here ("), main.frames
    assert os.path.getsize(targets[0].page_path + ".stacks") == size  # no signal was sent
    # py-spy and the signal agree on where a rank is: one group
    by_signal = await collect(targets[:1], timeout=DEADLINE, py_spy=None)
    report = merge(
        [
            Entry(rank=0, step=7, phase="", silent_s=1, text=got[0].text),
            Entry(rank=1, step=7, phase="", silent_s=1, text=by_signal[0].text),
        ]
    )
    assert [g.ranks for g in report.groups] == [(0, 1)], render(report)
    assert ranks.alive()
    print(f"2 ranks' stacks by py-spy: {took * 1000:.0f} ms")


def fake_py_spy(tmp: Path, body: str) -> str:
    path = tmp / "py-spy-fake"
    path.write_text(f"#!/bin/sh\necho $$ > {tmp}/fake.pid\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


async def test_py_spy_not_allowed_falls_back_to_the_signal(ranks: Ranks, tmp_path: Path) -> None:
    exe = fake_py_spy(tmp_path, 'echo "Error: Permission Denied (os error 1)" >&2; exit 1')
    armed, unarmed = ranks.start(0, "armed"), ranks.start(1, "unarmed")
    got = await collect([armed, unarmed], timeout=DEADLINE, py_spy=exe)
    assert [g.source for g in got] == ["signal", "none"]
    assert got[1].text == f"{NO_STACKS} (py-spy failed: Error: Permission Denied (os error 1))"


async def test_a_stalled_py_spy_is_killed_and_the_signal_still_has_time(ranks: Ranks, tmp_path: Path) -> None:
    exe = fake_py_spy(tmp_path, "exec sleep 600")
    armed = ranks.start(0, "armed")
    got = await collect([armed], timeout=4.0, py_spy=exe)
    assert got[0].source == "signal"
    pid = int((tmp_path / "fake.pid").read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped: not even a zombie
        os.kill(pid, 0)
    unarmed = ranks.start(1, "unarmed")
    got = await collect([unarmed], timeout=0.5, py_spy=exe)
    assert got[0].text == f"{NO_STACKS} (py-spy did not answer in time)"
    assert got[0].seconds < 30  # bounded (the bound itself is not timed: the machine is shared)


async def test_ranks_that_cannot_answer(ranks: Ranks, tmp_path: Path) -> None:
    armed = ranks.start(0, "armed")
    unarmed = ranks.start(1, "unarmed")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    bogus = Target(
        local_rank=1, rank=11, pid=unarmed.pid, stack_signal=int(signal.SIGTERM), page_path=unarmed.page_path
    )
    targets = [
        Target(local_rank=2, rank=12, pid=0, stack_signal=0, page_path=str(tmp_path / "x")),
        Target(
            local_rank=3, rank=13, pid=gone.pid, stack_signal=armed.stack_signal, page_path=armed.page_path
        ),
        bogus,
    ]
    got = await collect(targets, timeout=DEADLINE, py_spy=None)
    assert [g.text for g in got] == [
        "no stacks: the worker is not running",
        f"{NO_STACKS} (the worker is gone)",
        f"{NO_STACKS} (its page names signal 15, not a real-time signal: not sent)",
    ]
    assert ranks.alive()  # SIGTERM from a page was not sent


async def test_an_armed_rank_that_does_not_answer_in_time(tmp_path: Path) -> None:
    # A process that blocks the signal: it never writes; the wait ends at the timeout.
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time; signal.pthread_sigmask(signal.SIG_BLOCK, "
            "[signal.SIGRTMIN + 4]); print('ready', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        t = Target(
            local_rank=0,
            rank=0,
            pid=child.pid,
            stack_signal=int(signal.SIGRTMIN) + 4,
            page_path=str(tmp_path / "p"),
        )
        got = await collect([t], timeout=0.5, py_spy=None)
        assert (
            got[0].text
            == f"{NO_STACKS} (the rank did not answer its stack signal ({t.stack_signal}) in time)"
        )
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_poke_flight_recorder(tmp_path: Path) -> None:
    stem = str(tmp_path / "pipe_rank_")
    os.mkfifo(f"{stem}0.pipe")  # torch reads this one
    os.mkfifo(f"{stem}1.pipe")  # nobody reads this one: ENXIO
    Path(f"{stem}2.pipe").write_text("not a pipe")
    reader = os.open(f"{stem}0.pipe", os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert poke_flight_recorder(stem, [0, 1, 2, 3]) == [0]
        assert os.read(reader, 10) == b"1"
    finally:
        os.close(reader)
    assert Path(f"{stem}2.pipe").read_text() == "not a pipe"


def test_write_report(tmp_path: Path) -> None:
    path = tmp_path / "hang_report.txt"
    assert write_report(str(path), "hang: rank 3\n")
    assert path.read_text() == "hang: rank 3\n"
    assert write_report(str(path), "second\n") and path.read_text() == "second\n"
    assert not write_report(str(tmp_path / "missing" / "r.txt"), "x")
    assert os.listdir(tmp_path) == ["hang_report.txt"]  # no temporary file left behind


def test_the_jobs_hang_report_is_added_after_the_nodes_own(tmp_path: Path) -> None:
    path = tmp_path / "hang_report.txt"
    assert write_report(str(path), "node n1's hang report\n")
    assert add_job_report(str(path), "hang: suspect rank 3 on n2")
    text = path.read_text()
    assert text.startswith("node n1's hang report\n")
    assert text.endswith(f"\n\n{JOB_REPORT_TITLE}:\n\nhang: suspect rank 3 on n2\n")
    # No report of its own (it wrote none): the job's alone.
    alone = tmp_path / "other.txt"
    assert add_job_report(str(alone), "x") and JOB_REPORT_TITLE in alone.read_text()
    # Never through a symlink, never into a missing folder.
    (tmp_path / "link.txt").symlink_to(tmp_path / "elsewhere.txt")
    assert not append_report(str(tmp_path / "link.txt"), "x")
    assert not (tmp_path / "elsewhere.txt").exists()
    assert not append_report(str(tmp_path / "missing" / "r.txt"), "x")
