"""The rendezvous server dies mid-job and comes back: the job goes on, no worker restarts."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from .procs import WORKERS, Proc, agent_cmd, server_cmd, start_server

SLEEPER = str(WORKERS / "sleeper.py")


def started(folder: Path) -> list[list[int]]:
    return [[int(x) for x in line.split()] for line in (folder / "started.txt").read_text().splitlines()]


def wait_for_starts(folder: Path, n: int, within: float = 30.0) -> list[list[int]]:
    """Worker processes write their start line themselves: a bounded wait for n of them."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if (folder / "started.txt").exists() and len(rows := started(folder)) >= n:
            return rows
        time.sleep(0.02)
    raise AssertionError(f"fewer than {n} workers started within {within} s")


def test_server_killed_and_restarted_without_state_agents_rebuild_the_round(tmp_path: Path) -> None:
    srv, port = start_server()
    args = (
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "crash",
    )
    release = tmp_path / "release"
    # The workers run through the crash and the rebuild, and finish once the test has seen both.
    env = {"DUMP_DIR": str(tmp_path), "EXIT_WHEN_FILE": str(release)}
    agents = [Proc(agent_cmd(*args, SLEEPER), env=env) for _ in range(2)]
    again = None
    try:
        for a in agents:
            a.wait_for_line(r"started 2 worker", timeout=30)
        before = wait_for_starts(tmp_path, 4)
        assert len(before) == 4
        srv.signal(signal.SIGKILL)
        srv.wait(timeout=10)
        for a in agents:
            a.wait_for_line(r"lost the connection .* workers keep running; reconnecting", timeout=10)
        again = Proc(server_cmd("--host", "127.0.0.1", "--port", str(port)))
        try:
            again.wait_for_line(r"round 0 rebuilt from its 2 agents", timeout=30)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nagents:\n" + "\n---\n".join(a.stderr for a in agents)) from None
        for a in agents:
            a.wait_for_line(r"resumed round 0 \(rebuilt by the server", timeout=30)
        release.touch()
        for a in agents:
            assert a.wait(timeout=60) == 0, a.stderr
        assert started(tmp_path) == before  # nothing was restarted
        again.wait_for_line(r"job crash: finished", timeout=10)
    finally:
        release.touch()
        for a in agents:
            a.kill()
        srv.kill()
        if again is not None:
            again.kill()
