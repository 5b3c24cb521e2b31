"""What a person at the launcher's terminal sees, under torchrun and under node-agent.

Each launch runs under a fresh pty (or, for the no-terminal cases, over pipes) through
``ptyrun``; the worker is ``workers/console_check.py``.  A worker that must wait reads a line
from the launcher's stdin, which both launchers leave to their workers: the test types it once
the partial text is on the screen, so "shown before the worker went on" is an event, not a
timing.
"""

from __future__ import annotations

import re
import sys

import pytest

from .procs import ROOT, WORKERS, agent_cmd
from .ptyrun import PtyRun

WORKER = str(WORKERS / "console_check.py")
COLS, ROWS = 97, 31
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],  # .venv/bin/torchrun's entry point
    "node-agent": agent_cmd(),
}
TIMEOUT = 60.0  # torchrun imports torch: ~2 s alone, more while other tests run


def launch(launcher: str, mode: str, *flags: str) -> list[str]:
    return [*LAUNCHERS[launcher], "--standalone", "--nproc-per-node", "1", *flags, WORKER, mode]


def start(argv: list[str], terminal: str) -> PtyRun:
    return PtyRun(argv, cwd=ROOT, cols=COLS, rows=ROWS, pty=terminal == "pty")


@pytest.mark.parametrize(
    ("terminal", "seen"),
    [
        ("pty", f"stdout: tty {COLS}x{ROWS}; stderr: tty {COLS}x{ROWS}"),
        ("pipe", "stdout: not a tty; stderr: not a tty"),
    ],
)
def test_workers_see_what_torchrun_workers_see(terminal: str, seen: str) -> None:
    shown = {}
    for launcher in LAUNCHERS:
        with start(launch(launcher, "info"), terminal) as run:
            result = run.wait(TIMEOUT)
        assert result.code == 0, result.text
        m = re.search(r"^stdout: .*$", result.text, re.MULTILINE)
        assert m is not None, result.text
        shown[launcher] = m.group()
    assert shown == {"torchrun": seen, "node-agent": seen}


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
@pytest.mark.parametrize(
    ("terminal", "flags", "prefix"),
    [("pty", (), b""), ("pipe", (), b""), ("pty", ("--tee", "3"), b"[default0]:")],
    ids=["pty", "pipe", "pty-tee"],
)
def test_partial_lines_show_while_the_worker_waits(
    launcher: str, terminal: str, flags: tuple[str, ...], prefix: bytes
) -> None:
    with start(launch(launcher, "partial", *flags), terminal) as run:
        run.wait_for(prefix + b"prompt> ", TIMEOUT)  # stdout, no newline yet
        run.wait_for(prefix + b"progress 1/3", TIMEOUT)  # stderr, ended by "\r" only
        run.send(b"yes\n")  # only now may the worker go on
        run.wait_for(b"answered yes", TIMEOUT)
        result = run.wait(TIMEOUT)
    assert result.code == 0, result.text
    assert b"progress 3/3" in result.screen


@pytest.mark.parametrize("terminal", ["pty", "pipe"])
def test_failure_report_carries_the_stderr_tail(terminal: str) -> None:
    """No @record error file: the report quotes the worker's last stderr lines, which we kept
    while the worker's stderr was (on a pty) a terminal."""
    with start(launch("node-agent", "fail"), terminal) as run:
        result = run.wait(TIMEOUT)
    assert result.code != 0
    tty = terminal == "pty"
    screen = result.text
    assert f"stderr is a tty: {tty}\n" in screen  # live, as the worker wrote it
    report = screen[screen.index("Root Cause") :]
    assert re.search(
        rf"error\s*: stderr is a tty: {tty}\n.*detail 0\n.*detail 1\n.*detail 2\n.*fatal: boom\n", report
    ), screen
