"""The runner's own safety net, in process: a bug of ours stops the workers gracefully."""

from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path

import pytest

from node_agent import state as st
from node_agent.args import parse_config
from node_agent.runner import Agent


def test_a_bug_in_the_machine_stops_the_workers_with_sigterm_not_sigkill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "train.py"
    started, termed = tmp_path / "started", tmp_path / "termed"
    script.write_text(
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (open({str(termed)!r}, 'w').close(), sys.exit(143)))\n"
        f"open({str(started)!r}, 'w').close()\n"
        "time.sleep(60)\n"
    )

    def broken(self: st.AgentMachine) -> list[st.Effect]:
        deadline = time.monotonic() + 30
        # Until the worker's handler is in place (another process: no event to await).
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        raise RuntimeError("a bug")

    monkeypatch.setattr(st.AgentMachine, "_on_started", broken)
    config = parse_config(["--standalone", "--nproc-per-node", "1", str(script)], {})
    err = io.StringIO()
    code = asyncio.run(Agent(config, stdout=io.StringIO(), stderr=err).run())
    assert code == st.EXIT_FAILED
    assert "internal error while handling WorkersStarted: RuntimeError('a bug')" in err.getvalue()
    assert termed.exists()  # SIGTERM first: the worker had its grace period
