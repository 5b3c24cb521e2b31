"""Merging every rank's stacks into a hang report (protocol.hang_report)."""

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

from protocol.hang_report import (
    MAX_REPORT_CHARS,
    MAX_SHOWN_FRAMES,
    Entry,
    compact,
    merge,
    parse_stacks,
    ranges,
    render,
)

DEADLINE = 30.0

# A "rank": its main thread waits in fake_all_reduce (or sleeps in sleep_forever when told to
# hang), a side thread sleeps; SIGUSR1 makes faulthandler write every thread's stack.
RANK = r"""
import faulthandler, signal, sys, threading, time

def side_thread_sleeping(main):
    # Say "ready" once the main thread waits where the test expects it.
    frame = sys._current_frames()[main]
    while not (frame.f_code.co_name == "sleep_forever" or frame.f_code.co_name == "wait" and
               frame.f_back.f_back.f_code.co_name == "fake_all_reduce"):
        time.sleep(0.001)
        frame = sys._current_frames()[main]
    print("ready", flush=True)
    while True:
        time.sleep(3600)

def fake_all_reduce(ev):
    ev.wait()

def sleep_forever():
    while True:
        time.sleep(3600)

def train(hang):
    if hang:
        sleep_forever()
    else:
        fake_all_reduce(threading.Event())

faulthandler.register(signal.SIGUSR1, file=open(sys.argv[1], "w"), all_threads=True, chain=False)
threading.Thread(target=side_thread_sleeping, args=(threading.get_ident(),), daemon=True).start()
train(sys.argv[2] == "hang")
"""


@pytest.fixture(scope="module")
def real_dumps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """faulthandler's real output from 4 ranks; rank 2 hangs outside the collective."""
    tmp = tmp_path_factory.mktemp("dumps")
    script = tmp / "rank.py"
    script.write_text(RANK)
    procs = []
    try:
        for r in range(4):
            out = tmp / f"{r}.stacks"
            p = subprocess.Popen(
                [sys.executable, str(script), str(out), "hang" if r == 2 else "ok"],
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append((p, out))
        texts = []
        for p, out in procs:
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
            os.kill(p.pid, signal.SIGUSR1)
            end = time.monotonic() + DEADLINE
            text = ""
            while not text or text != out.read_text():  # until it stops growing
                assert time.monotonic() < end, "no stacks written"
                text = out.read_text()
                time.sleep(0.05)
            texts.append(text)
        yield texts
    finally:
        for p, _ in procs:
            p.kill()
            p.wait()


def test_parse_real_faulthandler_output(real_dumps: list[str]) -> None:
    threads = parse_stacks(real_dumps[0])
    assert len(threads) == 2
    (main,) = [t for t in threads if t.main]
    assert [f.split(" (")[0] for f in main.frames[:3]] == ["wait", "wait", "fake_all_reduce"]
    module_line = RANK.splitlines().index('train(sys.argv[2] == "hang")') + 1
    assert main.frames[-1].startswith("<module> (") and main.frames[-1].endswith(f"rank.py:{module_line})")
    (side,) = [t for t in threads if not t.main]
    assert side.frames[0].startswith("side_thread_sleeping (") and "0x" in side.name


def test_merge_real_dumps_finds_the_sleeping_rank(real_dumps: list[str]) -> None:
    entries = [
        Entry(rank=r, step=20, phase="", silent_s=31.0, text=t, hung=r in (0, 2), source="signal")
        for r, t in enumerate(real_dumps)
    ]
    report = merge(entries)
    assert [(g.ranks, g.odd) for g in report.groups] == [((2,), True), ((0, 1, 3), False)]
    assert [e.rank for e in report.suspects] == [2]  # hung and the odd one out
    text = render(report)
    first, second = text.splitlines()[:2]
    assert first == "hang: suspect rank 2 (last step 20, no progress for 31 s)"
    assert second == "also past their deadline: rank 0 (last step 20, no progress for 31 s)"
    odd = text.index("ranks 2 (1 of 4; stacks by signal)  <- odd one out")
    crowd = text.index("ranks 0,1,3 (3 of 4; stacks by signal)\n")
    assert odd < crowd
    assert text.index("    sleep_forever (") > odd
    assert text.index("    fake_all_reduce (") > crowd
    assert "thread Thread 0x" in text and "side_thread_sleeping (" in text


def test_line_numbers_count_addresses_do_not(real_dumps: list[str]) -> None:
    moved = re.sub(r"line (\d+) in fake_all_reduce", "line 999 in fake_all_reduce", real_dumps[0])
    assert moved != real_dumps[0]
    readdressed = real_dumps[1].replace("0x", "0x1")
    report = merge(
        [
            Entry(rank=0, step=1, phase="", silent_s=1, text=moved),
            Entry(rank=1, step=1, phase="", silent_s=1, text=readdressed),
            Entry(rank=3, step=1, phase="", silent_s=1, text=real_dumps[3]),
        ]
    )
    assert [g.ranks for g in report.groups] == [(0,), (1, 3)]


PY_SPY = """Process 4242: python train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 4242 (idle): "MainThread"
    wait (threading.py:331)
    all_reduce (torch/distributed/distributed_c10d.py:2050)
    train_step (/home/u/train.py:40)
    <module> (/home/u/train.py:80)
Thread 4250 (idle): "pin_memory"
    select (selectors.py:415)
    run (threading.py:982)
    _bootstrap (threading.py:1002)
"""


def test_parse_py_spy_output_and_group_it_with_faulthandler_output() -> None:
    threads = parse_stacks(PY_SPY)
    assert [(t.name, t.main) for t in threads] == [("MainThread", True), ("pin_memory", False)]
    assert threads[0].frames[1] == "all_reduce (torch/distributed/distributed_c10d.py:2050)"
    fh = """Thread 0x00007f3a (most recent call first):
  File "/usr/lib/python3.11/selectors.py", line 415 in select
  File "/usr/lib/python3.11/threading.py", line 982 in run
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f3b (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/v/site-packages/torch/distributed/distributed_c10d.py", line 2050 in all_reduce
  File "/home/u/train.py", line 40 in train_step
  File "/home/u/train.py", line 80 in <module>
"""
    sleeping = PY_SPY.replace("wait (threading.py:331)\n    all_reduce", "sleep (time.py:1)\n    all_reduce")
    report = merge(
        [
            Entry(rank=0, step=5, phase="", silent_s=1, text=PY_SPY, source="py-spy"),
            Entry(rank=1, step=5, phase="", silent_s=1, text=fh, source="signal"),
            Entry(rank=2, step=4, phase="compute", silent_s=9, text=sleeping, source="py-spy"),
        ],
        hung=[0, 1],
    )
    assert [(g.ranks, g.sources) for g in report.groups] == [
        ((2,), ("py-spy",)),
        ((0, 1), ("py-spy", "signal")),
    ]
    # not hung itself (its node has not seen it pass its deadline yet), yet the only odd one
    assert [e.rank for e in report.suspects] == [2]
    assert render(report).startswith(
        "hang: suspect rank 2 (last step 4, phase compute, no progress for 9 s)\n"
    )


def test_all_alike_suspects_are_the_hung_ranks() -> None:
    report = merge([(r, 3, "", 5.0, PY_SPY) for r in range(4)], hung=[3])  # tuples do too
    assert [g.odd for g in report.groups] == [False]
    assert [e.rank for e in report.suspects] == [3]
    assert "ranks 0-3 (4 of 4; stacks by none)" in render(report)


def test_unparsable_and_missing_stacks_are_kept_as_opaque_groups() -> None:
    none = "no stacks: the rank did not import node_agent.worker and py-spy is not installed/allowed"
    report = merge(
        [
            Entry(rank=0, step=1, phase="", silent_s=1, text=none),
            Entry(rank=1, step=1, phase="", silent_s=1, text=none),
            Entry(rank=2, step=1, phase="", silent_s=1, text="garbage at 0x1234\x1b[31m"),
            Entry(rank=3, step=1, phase="", silent_s=1, text=""),
        ]
    )
    assert [(g.ranks, g.opaque) for g in report.groups] == [
        ((2,), "garbage at 0x1234?[31m"),  # no terminal escape gets through
        ((3,), "(no stacks)"),
        ((0, 1), none),
    ]


def test_everything_is_bounded() -> None:
    deep = "Current thread 0x1 (most recent call first):\n" + "".join(
        f'  File "/x/f{i}.py", line {i} in f{i}\n' for i in range(500)
    )
    many_threads = "".join(
        f'Thread 0x{i:x} (most recent call first):\n  File "a.py", line 1 in f\n' for i in range(500)
    )
    threads = parse_stacks(deep)
    assert len(threads[0].frames) == 64 and threads[0].more == 436
    assert len(parse_stacks(many_threads)) == 64
    # 2000 ranks, each stuck somewhere else: the text stays within its bound
    entries = [
        Entry(
            rank=r,
            step=r,
            phase="p" * 40,
            silent_s=1,
            text=deep.replace("line 7 ", f"line {r} "),
            hung=True,
        )
        for r in range(2000)
    ]
    report = merge(entries, hung=range(2000))
    assert len(report.groups) == 32 and report.dropped_groups == 1968
    assert report.n_suspects == 2000 and len(report.suspects) == 16
    text = render(report)
    assert len(text) <= MAX_REPORT_CHARS
    assert f"... {64 - MAX_SHOWN_FRAMES + 436} more frames" in text
    assert len(json.dumps(report.to_dict())) < 1_000_000


def test_to_dict_is_plain() -> None:
    report = merge(
        [Entry(rank=r, step=3, phase="", silent_s=5, text=PY_SPY, node="n1") for r in range(3)]
        + [Entry(rank=9, step=2, phase="checkpoint", silent_s=50, text="??", node="n2", hung=True)]
    )
    d = json.loads(json.dumps(report.to_dict()))
    assert d["suspects"] == [{"rank": 9, "node": "n2", "step": 2, "phase": "checkpoint", "silent_s": 50}]
    assert [(g["ranks"], g["odd"], g["size"]) for g in d["groups"]] == [("9", True, 1), ("0-2", False, 3)]
    assert d["groups"][1]["frames"][0] == "wait (threading.py:331)"


def test_ranges() -> None:
    assert ranges([0, 1, 3, 4, 5, 7]) == "0,1,3-5,7"
    assert ranges(list(range(0, 200, 2)), limit=3) == "0,2,4,... (100 ranks)"
    assert ranges([]) == ""


def test_a_file_with_two_dumps_reads_as_the_last(tmp_path: Path) -> None:
    one = 'Current thread 0x1 (most recent call first):\n  File "a.py", line 1 in old\n'
    two = 'Current thread 0x1 (most recent call first):\n  File "a.py", line 2 in new\n'
    (main,) = [t for t in parse_stacks(one + two) if t.main]
    assert main.frames == ("new (a.py:2)",)


def test_compact_keeps_the_main_thread_within_the_wire_bound(real_dumps: list[str]) -> None:
    # faulthandler lists the main thread last: a plain cut would drop it
    text = real_dumps[0] + "".join(
        f'Thread 0x{i:x} (most recent call first):\n  File "/x/threading.py", line 1 in _bootstrap\n'
        for i in range(100)
    )
    assert len(text) > 2048
    small = compact(text, 2048)
    assert len(small) <= 2048
    report = merge(
        [
            Entry(rank=0, step=1, phase="", silent_s=1, text=small),
            Entry(rank=1, step=1, phase="", silent_s=1, text=real_dumps[0]),
        ]
    )
    assert [g.ranks for g in report.groups] == [(0, 1)]  # the same stacks, whichever form
    tiny = compact(real_dumps[0], 120)
    assert len(tiny) <= 120 and tiny.startswith('Thread 0 (main): "MainThread"\n    wait (')
    assert compact("not a dump" * 100, 50) == ("not a dump" * 100)[:46] + "\n..."
