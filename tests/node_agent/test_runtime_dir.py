"""The agent's private folder (node_agent/runtime_dir.py): node-local, 0700, attempts replace
each other, removed at the end; a dead agent's folder is swept by the next agent, never a live
one's (its lock tells, from any PID namespace), never through a symlink; a live agent whose
folder was removed makes it again and says so."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_agent import runtime_dir
from node_agent.runtime_dir import (
    LOCK_NAME,
    LOCKLESS_AFTER_S,
    PREFIX,
    RuntimeDir,
    base_dir,
    ensure_dir,
    remove_tree,
    sweep,
)

ROOT = Path(__file__).resolve().parents[2]

# A process that holds an exclusive flock on argv[1] until its stdin closes: a live agent,
# wherever its pid is (or is not) visible.
HOLD = (
    "import fcntl, os, sys\n"
    "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n"
)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid  # reaped: no process has it (reuse within this test is not a concern)


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def _hold(procs: list[subprocess.Popen[str]], lock: Path) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    procs.append(p)
    assert p.stdout is not None and p.stdout.readline() == "held\n"
    return p


def _folder(base: Path, pid: int, tag: str, lock: bool = True, age: float = 0.0) -> Path:
    """An agent's folder as an agent makes it; ``lock``: with a lock file (nobody holds it);
    ``age``: last changed that many seconds ago."""
    path = base / f"{PREFIX}{pid}-{tag}"
    (path / "attempt_0" / "0").mkdir(parents=True)
    (path / "attempt_0" / "0" / "progress.page").write_text("page")
    if lock:
        (path / LOCK_NAME).touch(0o600)
    if age:
        then = time.time() - age
        os.utime(path, (then, then))
    return path


def test_private_folder_is_0700_and_each_attempt_replaces_the_last(tmp_path: Path) -> None:
    rt = RuntimeDir(str(tmp_path))
    assert Path(rt.path).parent == tmp_path and Path(rt.path).name.startswith(f"{PREFIX}{os.getpid()}-")
    assert stat.S_IMODE(os.stat(rt.path).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(Path(rt.path) / LOCK_NAME).st_mode) == 0o600
    first = Path(rt.attempt(0))
    (first / "0").mkdir()
    (first / "0" / "progress.page").write_bytes(b"x" * 4096)
    second = Path(rt.attempt(1))
    assert not first.exists() and second.is_dir()
    assert stat.S_IMODE(second.stat().st_mode) == 0o700
    assert sorted(p.name for p in Path(rt.path).iterdir()) == [LOCK_NAME, "attempt_1"]
    rt.close()
    assert not Path(rt.path).exists()


def test_a_live_agents_folder_is_kept_whatever_its_pid_says(
    tmp_path: Path, holders: list[subprocess.Popen[str]]
) -> None:
    # Another PID namespace: the pid in the name is nobody's here, but its agent holds the lock.
    elsewhere = _folder(tmp_path, _dead_pid(), "aaaa", age=2 * LOCKLESS_AFTER_S)
    _hold(holders, elsewhere / LOCK_NAME)
    assert sweep(str(tmp_path)) == []
    assert (elsewhere / "attempt_0" / "0" / "progress.page").read_text() == "page"


def test_a_folder_whose_lock_is_free_is_swept_whatever_its_pid_says(
    tmp_path: Path, holders: list[subprocess.Popen[str]]
) -> None:
    dead = _folder(tmp_path, _dead_pid(), "abcd")
    # Its pid is somebody's here (ours: alive), yet nobody holds its lock: its agent is gone.
    reused = _folder(tmp_path, os.getpid(), "beef")
    released = _folder(tmp_path, _dead_pid(), "cafe")
    p = _hold(holders, released / LOCK_NAME)
    p.kill()  # as a SIGKILL of its agent: the kernel lets the lock go
    p.wait()
    assert sorted(sweep(str(tmp_path))) == sorted(map(str, (dead, reused, released)))
    assert list(tmp_path.iterdir()) == []


def test_a_folder_without_lock_is_swept_only_when_dead_and_quiet_for_long(tmp_path: Path) -> None:
    old_dead = _folder(tmp_path, _dead_pid(), "0001", lock=False, age=LOCKLESS_AFTER_S + 60)
    young_dead = _folder(tmp_path, _dead_pid(), "0002", lock=False, age=LOCKLESS_AFTER_S - 60)
    old_live = _folder(tmp_path, os.getpid(), "0003", lock=False, age=2 * LOCKLESS_AFTER_S)
    assert sweep(str(tmp_path)) == [str(old_dead)]
    assert young_dead.is_dir() and old_live.is_dir()


def test_the_sweep_never_follows_a_symlink_nor_opens_a_strange_lock(tmp_path: Path) -> None:
    dead = _folder(tmp_path, _dead_pid(), "abcd")
    other = tmp_path / "node-agent-notapid"
    other.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("a user's file")
    (outside / LOCK_NAME).touch()
    os.symlink(outside, dead / "link")  # removed as a link, never followed
    linked = tmp_path / f"{PREFIX}{_dead_pid()}-link"
    os.symlink(outside, linked)  # a folder that is a symlink: not ours to sweep
    fifo = _folder(tmp_path, _dead_pid(), "f1f0", lock=False)
    os.mkfifo(fifo / LOCK_NAME)  # opening it must not block, nor count as a free lock
    sym = _folder(tmp_path, _dead_pid(), "5111", lock=False, age=2 * LOCKLESS_AFTER_S)
    os.symlink(outside / LOCK_NAME, sym / LOCK_NAME)
    assert sweep(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and other.is_dir() and linked.is_symlink() and fifo.is_dir() and sym.is_dir()
    assert (outside / "keep").read_text() == "a user's file"


def test_the_next_agent_sweeps_at_its_start_and_never_a_live_one(tmp_path: Path) -> None:
    dead = _folder(tmp_path, _dead_pid(), "0000")
    first = RuntimeDir(str(tmp_path))
    assert first.swept == [str(dead)] and not dead.exists()
    # Even in one process (flock is per open file, not per process), a live folder stays.
    second = RuntimeDir(str(tmp_path))
    assert second.swept == [] and os.path.isdir(first.path)
    second.close()
    first.close()
    assert list(tmp_path.iterdir()) == []


def test_the_lock_dies_with_the_agent_not_with_its_children(tmp_path: Path) -> None:
    # An agent that starts a child inheriting every inheritable descriptor, then is SIGKILLed:
    # the child lives on, the lock must not (close-on-exec).
    agent = (
        "import subprocess, sys, time\n"
        "from node_agent.runtime_dir import RuntimeDir\n"
        f"rt = RuntimeDir({str(tmp_path)!r})\n"
        "child = subprocess.Popen(['sleep', '60'], close_fds=False)\n"
        "print(rt.path, child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", agent], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    path, child = p.stdout.readline().split()
    try:
        assert sweep(str(tmp_path)) == []  # its agent lives
        p.kill()
        p.wait()
        os.kill(int(child), 0)  # the child still runs
        assert sweep(str(tmp_path)) == [path]
    finally:
        p.kill()
        p.wait()
        os.kill(int(child), signal.SIGKILL)


def test_the_orphan_watchdog_removes_the_folder_of_an_agent_gone(tmp_path: Path) -> None:
    # The watchdog runs -I -S from node_agent/supervisor/ and imports runtime_dir from the
    # folder above: the agent's death (its pipe's EOF) removes the folder, lock and all.
    from node_agent.supervisor import procutil

    rt = RuntimeDir(str(tmp_path))
    Path(rt.attempt(0), "0").mkdir()
    read_fd, write_fd = os.pipe()
    try:
        p = subprocess.Popen(procutil.watchdog_argv(read_fd, rt.path), pass_fds=(read_fd,))
    finally:
        os.close(read_fd)
    os.close(write_fd)  # as the agent's SIGKILL would
    assert p.wait(timeout=30) == 0
    assert not os.path.exists(rt.path)
    rt.close()


def test_a_folder_removed_under_a_live_agent_is_made_again_and_said_once(tmp_path: Path) -> None:
    said: list[tuple[str, str]] = []
    rt = RuntimeDir(str(tmp_path), log=lambda text, level: said.append((text, level)))
    try:
        assert not os.get_inheritable(rt._lock)
        rt.attempt(0)
        assert not rt.ensure() and not ensure_dir(os.path.join(rt.path, "attempt_0")) and said == []
        remove_tree(rt.path)  # an older agent's sweep, from another PID namespace
        second = Path(rt.attempt(1))
        assert second.is_dir() and stat.S_IMODE(Path(rt.path).stat().st_mode) == 0o700
        Path(rt.attempt(2))
        snaps = os.path.join(rt.path, "snapshots", "r0")
        assert ensure_dir(snaps) and stat.S_IMODE(os.stat(snaps).st_mode) == 0o700
        assert not ensure_dir(snaps)
        assert len(said) == 1 and said[0][1] == "warning" and rt.path in said[0][0], said
        assert rt.remade == 1
        # Locked again: another agent's sweep keeps it.
        assert sweep(str(tmp_path)) == [] and os.path.isdir(rt.path)
        # Removed again, and made again by a makedirs below it (the umask's mode, no lock):
        # ensure_dir puts the mode and the lock back, and says so.
        remove_tree(rt.path)
        os.makedirs(os.path.join(rt.path, "snapshots"), 0o755)
        os.chmod(rt.path, 0o755)
        assert ensure_dir(os.path.join(rt.path, "snapshots", "r1"))
        assert stat.S_IMODE(os.stat(rt.path).st_mode) == 0o700 and len(said) == 2 and rt.remade == 2
        assert sweep(str(tmp_path)) == []
    finally:
        rt.close()
    assert not os.path.exists(rt.path) and rt.path not in runtime_dir._live


def test_ensure_dir_never_goes_through_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "base").mkdir()
    rt = RuntimeDir(str(tmp_path / "base"))
    try:
        outside = tmp_path / "outside"
        outside.mkdir()
        os.symlink(outside, os.path.join(rt.path, "snapshots"))
        with pytest.raises(NotADirectoryError):
            ensure_dir(os.path.join(rt.path, "snapshots", "r0"))
        assert list(outside.iterdir()) == []
        # Outside any private folder: the missing levels, 0700.
        made = tmp_path / "a" / "b"
        assert ensure_dir(str(made)) and stat.S_IMODE(made.stat().st_mode) == 0o700
        assert not ensure_dir(str(made))
    finally:
        rt.close()


def test_a_sweep_in_another_pid_namespace_keeps_a_live_agents_folder(tmp_path: Path) -> None:
    """The real case: an agent in its own PID namespace (a container with --ipc=host, a Slurm
    step) shares the base; there, this agent's pid is nobody's."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare")
    probe = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no PID namespace here: {probe.stderr.decode(errors='replace').strip()}")
    rt = RuntimeDir(str(tmp_path))
    dead = _folder(tmp_path, _dead_pid(), "dead")
    other = (
        "import os, sys\n"
        "from node_agent.runtime_dir import _pid_alive, sweep\n"
        "print(os.getpid(), _pid_alive(int(sys.argv[2])), sweep(sys.argv[1]))\n"
    )
    try:
        out = subprocess.run(
            [
                unshare,
                "--pid",
                "--fork",
                "--mount-proc",
                sys.executable,
                "-c",
                other,
                str(tmp_path),
                str(os.getpid()),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.split(" ", 2)
        # There this agent looks dead (the old pid rule would have swept it) ...
        assert out[0] == "1" and out[1] == "False", out
        # ... yet only the folder whose lock is free went.
        assert out[2].strip() == repr([str(dead)])
        assert os.path.isdir(rt.path) and not dead.exists()
        rt.attempt(0)
    finally:
        rt.close()


def test_base_is_node_local_memory_where_usable() -> None:
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        assert base_dir() == "/dev/shm"
