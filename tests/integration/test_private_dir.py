"""The progress pages live in the agent's private, node-local folder, not in --log-dir (issue
29): the log tree stays torchrun's, the folder is 0700 on /dev/shm, and it is gone when the
agent ends, also when the agent is killed with SIGKILL (its orphan watchdog removes it)."""

from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path

from node_agent.runtime_dir import PREFIX, base_dir

from .procs import WORKERS, Proc, agent_cmd, pid_alive

SCRIPT = str(WORKERS / "page_where.py")


def _start(tmp_path: Path) -> tuple[Proc, Path, Path]:
    release = tmp_path / "release"
    agent = Proc(
        agent_cmd("--standalone", "--nproc-per-node", "1", "--log-dir", str(tmp_path / "logs"), SCRIPT),
        env={"RELEASE_FILE": str(release)},
    )
    page = Path(agent.wait_for_line(r"page: (\S+)", stream="out").group(1))
    private = page.parents[2]  # <private>/attempt_<k>/<local_rank>/progress.page
    return agent, page, private


def _gone(path: Path, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)  # a folder's removal by another process: nothing to wait on
    return True


def test_pages_are_private_and_node_local_and_leave_with_the_agent(tmp_path: Path) -> None:
    agent, page, private = _start(tmp_path)
    try:
        assert private.name.startswith(f"{PREFIX}{agent.p.pid}-") and str(private.parent) == base_dir()
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
        assert page.stat().st_size == 4096  # the worker mapped it and wrote its progress
        (tmp_path / "release").touch()
        assert agent.wait() == 0, agent.stderr
    finally:
        agent.kill()
    assert not private.exists()
    # The log tree is torchrun's (test_dropin compares them): no page, no pipe, no folder of ours.
    logs = [p.name for p in (tmp_path / "logs").rglob("*")]
    assert logs and not [n for n in logs if n.startswith(("progress.page", "fr"))], logs


def test_a_sigkilled_agents_folder_is_removed_by_its_watchdog(tmp_path: Path) -> None:
    agent, _page, private = _start(tmp_path)
    try:
        os.kill(agent.p.pid, signal.SIGKILL)
        agent.p.wait(timeout=10)
        assert _gone(private), f"{private} still there after the agent's SIGKILL"
    finally:
        agent.kill()
    assert not pid_alive(agent.p.pid)
