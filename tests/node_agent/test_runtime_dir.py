"""The agent's private folder (node_agent/runtime_dir.py): node-local, 0700, attempts replace
each other, removed at the end; a dead agent's folder is swept by the next agent, never a live
one's, never through a symlink."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from node_agent.runtime_dir import PREFIX, RuntimeDir, base_dir, sweep


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid  # reaped: no process has it (reuse within this test is not a concern)


def test_private_folder_is_0700_and_each_attempt_replaces_the_last(tmp_path: Path) -> None:
    rt = RuntimeDir(str(tmp_path))
    assert Path(rt.path).parent == tmp_path and Path(rt.path).name.startswith(f"{PREFIX}{os.getpid()}-")
    assert stat.S_IMODE(os.stat(rt.path).st_mode) == 0o700
    first = Path(rt.attempt(0))
    (first / "0").mkdir()
    (first / "0" / "progress.page").write_bytes(b"x" * 4096)
    second = Path(rt.attempt(1))
    assert not first.exists() and second.is_dir()
    rt.close()
    assert not Path(rt.path).exists()


def test_a_dead_agents_folder_is_swept_a_live_ones_kept(tmp_path: Path) -> None:
    dead = tmp_path / f"{PREFIX}{_dead_pid()}-abcd"
    (dead / "attempt_0" / "0").mkdir(parents=True)
    (dead / "attempt_0" / "0" / "progress.page").write_text("page")
    live = tmp_path / f"{PREFIX}{os.getpid()}-beef"
    live.mkdir()
    other = tmp_path / "node-agent-notapid"
    other.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("a user's file")
    os.symlink(outside, dead / "link")  # removed as a link, never followed
    assert sweep(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and live.is_dir() and other.is_dir()
    assert (outside / "keep").read_text() == "a user's file"


def test_the_next_agent_sweeps_at_its_start(tmp_path: Path) -> None:
    dead = tmp_path / f"{PREFIX}{_dead_pid()}-0000"
    dead.mkdir()
    rt = RuntimeDir(str(tmp_path))
    assert rt.swept == [str(dead)] and not dead.exists()
    rt.close()


def test_base_is_node_local_memory_where_usable() -> None:
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        assert base_dir() == "/dev/shm"
