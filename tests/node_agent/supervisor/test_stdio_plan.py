"""Where a worker's streams go, as a table (supervisor/output.py plan_stdio): torchrun's
--redirects/--tee, the console filter, and whether the agent's console is a descriptor or a
terminal. No process: the plan is decided before anything is opened."""

from __future__ import annotations

import pytest

from node_agent.config import Std
from node_agent.supervisor.output import StreamPlan, plan_stdio
from node_agent.supervisor.spec import WorkerSpec

OUT, ERR = "/logs/0/stdout.log", "/logs/0/stderr.log"
FILTERED = "/logs/filtered_stdout.log"


def spec(
    redirect: Std = Std.NONE, tee: Std = Std.NONE, console: bool = True, filters: bool = False
) -> WorkerSpec:
    return WorkerSpec(
        local_rank=0,
        rank=0,
        argv=["python", "train.py"],
        env={},
        redirect=redirect,
        tee=tee,
        stdout_path=OUT,
        stderr_path=ERR,
        console=console,
        prefix="[default0]:",
        duplicate_stdout_filters=("loss",) if filters else (),
        filtered_stdout_path=FILTERED if filters else None,
    )


CONSOLE = {1: 1, 2: 2}  # the agent's stdout and stderr are real descriptors
NO_FDS: dict[int, int | None] = {1: None, 2: None}  # e.g. a wrapper's io.StringIO
PIPES = {1: False, 2: False}
TERMINAL = {1: True, 2: True}


def piped(fd: int, how: str = "pipe", **kw: object) -> StreamPlan:
    return StreamPlan(fd=fd, how=how, keep_tail=fd == 2, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "worker, fds, ttys, stdout, stderr",
    [
        # Neither redirected nor tee'd: stdout is the agent's own (torchrun's way), stderr passes
        # through the agent (its tail is the failure message): a pty on a terminal, else a pipe.
        (spec(), CONSOLE, PIPES, StreamPlan(fd=1, how="console"), piped(2, console=True)),
        (spec(), CONSOLE, TERMINAL, StreamPlan(fd=1, how="console"), piped(2, "pty", console=True)),
        (spec(), NO_FDS, PIPES, piped(1, console=True), piped(2, console=True)),
        # Redirected: the worker writes its files itself.
        (
            spec(redirect=Std.ALL),
            CONSOLE,
            TERMINAL,
            StreamPlan(fd=1, how="file", file=OUT),
            StreamPlan(fd=2, how="file", file=ERR),
        ),
        (
            spec(redirect=Std.OUT),
            CONSOLE,
            TERMINAL,
            StreamPlan(fd=1, how="file", file=OUT),
            piped(2, "pty", console=True),
        ),
        # Tee'd: through the agent, to the file and, prefixed, to the console (never a pty).
        (
            spec(tee=Std.ALL),
            CONSOLE,
            TERMINAL,
            piped(1, file=OUT, console=True, prefixed=True),
            piped(2, file=ERR, console=True, prefixed=True),
        ),
        (
            spec(tee=Std.OUT, filters=True),
            CONSOLE,
            PIPES,
            piped(1, file=OUT, console=True, prefixed=True, filtered=True),
            piped(2, console=True),
        ),
        # A rank --local-ranks-filter hides: stdout to /dev/null, stderr still read for its tail.
        (spec(console=False), CONSOLE, TERMINAL, StreamPlan(fd=1, how="devnull"), piped(2)),
        (
            spec(console=False, tee=Std.ALL),
            CONSOLE,
            PIPES,
            StreamPlan(fd=1, how="file", file=OUT),
            StreamPlan(fd=2, how="file", file=ERR),
        ),
        # Filters copy only what is shown with the rank's prefix: a hidden rank's lines are not.
        (
            spec(console=False, tee=Std.OUT, filters=True),
            CONSOLE,
            PIPES,
            StreamPlan(fd=1, how="file", file=OUT),
            piped(2),
        ),
    ],
)
def test_plan(
    worker: WorkerSpec,
    fds: dict[int, int | None],
    ttys: dict[int, bool],
    stdout: StreamPlan,
    stderr: StreamPlan,
) -> None:
    assert plan_stdio(worker, fds, ttys) == (stdout, stderr)
