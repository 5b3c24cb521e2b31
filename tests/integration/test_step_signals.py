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
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from .procs import WORKERS, Proc, agent_cmd, pid_alive, start_server

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


# --- a notice at any moment of the agent's life (issue 42, item 7d) ---------------------------
#
# Slurm's --signal=USR1@90 came 4 s into a job with a short --time and killed both agents
# (FAILED 138:0): the agent handled the notices only while its loop ran. It holds them from the
# first instruction of its main to its exit now (node_agent/step_notices.py).

# The agent with Python's import log on stderr: the line of node_agent.agent_log, the first
# module main imports, says that main runs (its first act, holding the notices, is done). Its
# workers do not log imports (-X is not passed on).
IMPORT_LOG = (sys.executable, "-X", "importtime", "-m", "node_agent.cli")
IN_MAIN = r"\| node_agent\.agent_log$"


class Notices:
    """Send ``sig`` to ``pid`` every ``every`` seconds from a thread, until the block ends or
    the process is gone (the sender of a scheduler's notice, at every moment of a window)."""

    def __init__(self, pid: int, sig: int | None, every: float = 0.01) -> None:
        self.pid, self.sig, self.every = pid, sig, every
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while self.sig is not None and not self._stop.is_set():
            try:
                os.kill(self.pid, self.sig)
            except ProcessLookupError:
                return
            self.sent += 1
            self._stop.wait(self.every)

    def __enter__(self) -> Notices:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _two_node_args(port: int, tmp: Path) -> tuple[str, ...]:
    return (
        "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-id", "notices",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--log-dir", str(tmp / "logs"), WORKER,
    )  # fmt: skip


@pytest.mark.parametrize(
    "sig", [None, signal.SIGUSR1, signal.SIGUSR2], ids=["no-signal", "SIGUSR1", "SIGUSR2"]
)
def test_a_notice_at_any_moment_of_the_agents_life_changes_nothing(tmp_path: Path, sig: int | None) -> None:
    """Notices to the agent from its main's first instructions (imports, command line) through
    its connect and rendezvous, between two rounds (its node lost its peer) and during its
    end (exit barrier, shutdown, exit): the agent outlives every one, none is passed on to
    workers started after it, and the job ends as it does without them (no-signal: the same
    scenario, the exit code to match)."""
    out = tmp_path / "signals"
    out.mkdir()
    env = {"SIGNAL_DIR": str(out), "HANDLE": "SIGUSR1,SIGUSR2,SIGTERM", "HOLD_S": "120"}
    srv, port = start_server()
    args = _two_node_args(port, tmp_path)
    a = Proc([*IMPORT_LOG, *args], env=env)
    others: list[Proc] = []
    try:
        a.wait_for_line(IN_MAIN, timeout=60)
        # Early: imports, the command line, the connect, the rendezvous (node a waits for b).
        with Notices(a.p.pid, sig) as early:
            a.wait_for_line(r"waiting for nodes: 1 of 2 joined", timeout=60)
            time.sleep(0.3)
        others.append(b := Proc(agent_cmd(*args), env=env))
        _wait_files(out, a, 2)
        first = _worker_pids_in(out)
        # Between rounds: node b is lost; a stops its worker and waits for a second node.
        b.kill()
        a.wait_for_line(r"stopping 1 worker\(s\)", timeout=60)
        _until(lambda: not any(pid_alive(p) for p in first), a)
        with Notices(a.p.pid, sig) as between:
            time.sleep(1.0)
        for r in range(2):
            (out / f"rank{r}.ready").unlink()
        others.append(Proc(agent_cmd(*args), env=env))
        _wait_files(out, a, 2)
        (out / "go").touch()
        # The end: a's worker is done, it waits for the other node, stops, exits.
        a.wait_for_line(r"workers finished", timeout=60)
        with Notices(a.p.pid, sig) as end:
            code = a.wait(60)
        for o in others[1:]:
            assert o.wait(60) == 0, o.stderr
    finally:
        for proc in (a, *others):
            proc.kill()
        srv.kill()
    assert code == 0, a.stderr  # as without a notice (the no-signal case)
    if sig is None:
        return
    assert early.sent and between.sent and end.sent, (early.sent, between.sent, end.sent)
    name = signal.Signals(sig).name
    assert f"received {name} while no workers of this node ran" in a.stderr
    assert f"forwarding {name}" not in a.stderr  # no worker started after a notice got it
    for rank in range(2):
        received = out / f"rank{rank}.signals"
        got = received.read_text().split() if received.exists() else []
        assert name not in got, f"rank {rank}: {got}"


@pytest.mark.parametrize("moment", ["early", "rendezvous"])
def test_sigterm_still_stops_the_agent_at_any_moment(tmp_path: Path, moment: str) -> None:
    """Held notices change nothing for SIGTERM: before the agent's loop handles signals it ends
    the agent at once by its default action (as torchrun before it starts workers); once it
    does, the agent leaves the rendezvous and exits 1."""
    srv, port = start_server()
    a = Proc([*IMPORT_LOG, *_two_node_args(port, tmp_path)], env={"SIGNAL_DIR": str(tmp_path)})
    try:
        a.wait_for_line(IN_MAIN if moment == "early" else r"waiting for nodes: 1 of 2 joined", timeout=60)
        a.signal(signal.SIGTERM)
        code = a.wait(30)
    finally:
        a.kill()
        srv.kill()
    assert code == (-signal.SIGTERM if moment == "early" else 1), a.stderr


def test_a_notice_listed_in_signals_to_handle_stops_the_agent_before_its_loop_as_sigterm_does(
    tmp_path: Path,
) -> None:
    srv, port = start_server()
    args = ("--signals-to-handle", "SIGTERM,SIGUSR1", *_two_node_args(port, tmp_path))
    a = Proc([*IMPORT_LOG, *args], env={"SIGNAL_DIR": str(tmp_path)})
    try:
        a.wait_for_line(IN_MAIN, timeout=60)
        a.signal(signal.SIGUSR1)
        code = a.wait(30)
    finally:
        a.kill()
        srv.kill()
    assert code == -signal.SIGUSR1, a.stderr


def _worker_pids_in(out: Path) -> set[int]:
    return {int(p) for f in out.glob("rank*.started") for p in f.read_text().split()}


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
    _until(cond, job.agent, timeout)


def _until(cond: Callable[[], bool], agent: Proc, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s\n{agent.stderr}")
        time.sleep(0.02)


def _wait_files(out: Path, proc: Proc, nproc: int = NPROC) -> None:
    deadline = time.monotonic() + 60
    while not all((out / f"rank{r}.ready").exists() for r in range(nproc)):
        if proc.p.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"workers not ready\n{proc.stderr}")
        time.sleep(0.02)
