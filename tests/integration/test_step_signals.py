"""Signals as schedulers send them: to every process of a job step, or to the agent alone.

Slurm's proctrack/cgroup and linuxproc (``scancel``, ``scancel --signal=USR1``,
``--signal=USR1@N``) and systemd's ``KillMode=control-group`` signal every process of the
step; a plain ``kill``, Kubernetes and Slurm's proctrack/pgid reach the agent only. Either way
each worker gets each signal exactly once, the agent's helpers (store process, orphan watchdog)
outlive it, and no restart is spent. ``test_slurm.py`` checks the same on a real Slurm.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from .procs import WORKERS, Proc, agent_cmd, pid_alive

WORKER = str(WORKERS / "signal_count.py")
NPROC = 2


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (the step's processes under it, as Slurm finds them)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def signal_step(agent: Proc, sig: int) -> list[int]:
    """What Slurm's linuxproc does: the signal to the agent and everything below it."""
    procs = [agent.p.pid, *descendants(agent.p.pid)]
    for pid in procs:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return procs


class Job:
    def __init__(self, tmp: Path, *args: str, env: dict[str, str] | None = None, nproc: int = NPROC) -> None:
        self.dir = tmp / "signals"
        self.dir.mkdir()
        self.nproc = nproc
        self.agent = Proc(
            agent_cmd("--standalone", "--nproc-per-node", str(nproc), *args, WORKER),
            env={"SIGNAL_DIR": str(self.dir), **(env or {})},
        )
        self.wait_ready()

    def wait_ready(self) -> None:
        _wait_files(self.dir, self.agent, self.nproc)

    def lines(self, rank: int, what: str) -> list[str]:
        path = self.dir / f"rank{rank}.{what}"
        return path.read_text().split() if path.exists() else []

    def go(self) -> None:
        (self.dir / "go").touch()

    def close(self) -> None:
        self.agent.kill()


def test_a_signal_to_every_process_of_the_step_reaches_each_worker_once(tmp_path: Path) -> None:
    # One worker: the agent starts its store process only with a core to spare beside them.
    job = Job(tmp_path, "--max-restarts", "2", nproc=1)
    try:
        _wait_for(lambda: _store_pid(job.agent.p.pid) is not None, job)  # it starts beside the round
        helpers = [p for p in descendants(job.agent.p.pid) if p not in _worker_pids(job)]
        assert helpers, "the agent runs no helper process (watchdog, store) to test"
        signal_step(job.agent, signal.SIGUSR1)
        job.agent.wait_for_line(r"SIGUSR1; the workers have it too, from its sender", timeout=20)
        assert [pid for pid in helpers if not pid_alive(pid)] == [], "a helper died of SIGUSR1"
        for pid in helpers:  # each ignores it (uvloop resets a preexec_fn's dispositions)
            assert _ignores(pid, signal.SIGUSR1), f"helper {pid} does not ignore SIGUSR1"
        job.go()
        assert job.agent.wait(60) == 0, job.agent.stderr
    finally:
        job.close()
    for rank in range(job.nproc):
        assert job.lines(rank, "signals") == ["SIGUSR1"], f"rank {rank}"
        assert len(job.lines(rank, "started")) == 1, "a restart was spent"
    assert "no longer guarded" not in job.agent.stderr
    assert "store process exited" not in job.agent.stderr
    assert "forwarding SIGUSR1" not in job.agent.stderr


def test_a_signal_to_the_agent_alone_is_forwarded_once(tmp_path: Path) -> None:
    job = Job(tmp_path)
    try:
        job.agent.signal(signal.SIGUSR1)
        job.agent.wait_for_line(rf"forwarding SIGUSR1 to {NPROC} worker\(s\)", timeout=20)
        _wait_for(lambda: all(job.lines(r, "signals") for r in range(NPROC)), job)
        job.go()
        assert job.agent.wait(60) == 0, job.agent.stderr
    finally:
        job.close()
    for rank in range(NPROC):
        assert job.lines(rank, "signals") == ["SIGUSR1"], f"rank {rank}"


def test_sigterm_to_every_process_stops_the_workers_without_a_second_sigterm(tmp_path: Path) -> None:
    job = Job(tmp_path, "--max-restarts", "2")
    try:
        signal_step(job.agent, signal.SIGTERM)
        assert job.agent.wait(60) == 1, job.agent.stderr
    finally:
        job.close()
    assert "(they have the signal already)" in job.agent.stderr
    for rank in range(NPROC):
        assert job.lines(rank, "signals") == ["SIGTERM"], f"rank {rank}"
        assert len(job.lines(rank, "started")) == 1


def test_a_worker_killed_by_a_passed_on_signal_is_not_restarted(tmp_path: Path) -> None:
    # No SIGUSR1 handler in the workers: the notice kills them. torchrun itself dies of an
    # unhandled SIGUSR1; we stop the job as for a handled signal, never retry it.
    job = Job(tmp_path, "--max-restarts", "2", env={"HANDLE": "SIGTERM"})
    try:
        job.agent.signal(signal.SIGUSR1)
        assert job.agent.wait(60) == 1, job.agent.stderr
    finally:
        job.close()
    assert "was killed by SIGUSR1" in job.agent.stderr
    for rank in range(NPROC):
        assert len(job.lines(rank, "started")) == 1, "a restart was spent on the notice"


@pytest.mark.parametrize("launcher", ["node-agent", "torchrun"])
def test_a_listed_signal_stops_the_job_as_torchrun_does(tmp_path: Path, launcher: str) -> None:
    """--signals-to-handle names SIGUSR1 (PyTorch's own test line): stop, exit 1, no restart."""
    args = ("--max-restarts", "2", "--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1")
    quick = {"HANDLE": "SIGTERM"}  # SIGUSR1 ends the workers: no wait for a stop's grace
    if launcher == "torchrun":
        out = tmp_path / "signals"
        out.mkdir()
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        env = {"SIGNAL_DIR": str(out), **quick}
        proc = Proc([*torchrun, "--nproc-per-node", str(NPROC), *args, WORKER], env=env)
        job = None
    else:
        job = Job(tmp_path, *args, env=quick)
        proc, out = job.agent, job.dir
    try:
        if job is None:
            _wait_files(out, proc)
        proc.signal(signal.SIGUSR1)
        code = proc.wait(90)
    finally:
        proc.kill()
    assert code == 1, proc.stderr
    for rank in range(NPROC):
        assert len((out / f"rank{rank}.started").read_text().split()) == 1


def test_a_warm_worker_has_a_cold_workers_dispositions(tmp_path: Path) -> None:
    # The warm interpreter ignored the step's signals while it waited; as a worker it has them
    # at their defaults again, as a cold start has.
    job = Job(tmp_path, "--preload", "json", env={"HANDLE": ""})
    try:
        job.go()
        assert job.agent.wait(60) == 0, job.agent.stderr
    finally:
        job.close()
    for rank in range(NPROC):
        assert job.lines(rank, "dispositions") == ["SIGUSR1=default", "SIGTERM=default", "SIGINT=python"]


def _store_pid(agent: int) -> int | None:
    for pid in descendants(agent):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"The agent's store process" in f.read():
                    return pid
        except OSError:
            pass
    return None


def _ignores(pid: int, sig: int) -> bool:
    """``sig`` ignored or caught by ``pid`` (the watchdog catches it to report it)."""
    with open(f"/proc/{pid}/status") as f:
        masks = dict(line.split(":", 1) for line in f if line.startswith(("SigIgn", "SigCgt")))
    bit = 1 << (sig - 1)
    return any(int(masks[k], 16) & bit for k in ("SigIgn", "SigCgt"))


def _worker_pids(job: Job) -> set[int]:
    return {int(p) for r in range(job.nproc) for p in job.lines(r, "started")}


def _wait_for(cond: Callable[[], bool], job: Job, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s\n{job.agent.stderr}")
        time.sleep(0.02)


def _wait_files(out: Path, proc: Proc, nproc: int = NPROC) -> None:
    deadline = time.monotonic() + 60
    while not all((out / f"rank{r}.ready").exists() for r in range(nproc)):
        if proc.p.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"workers not ready\n{proc.stderr}")
        time.sleep(0.02)
