"""Real processes for end-to-end tests: a server, agents, and bounded waits on their output."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from node_agent.supervisor.procutil import pdeathsig_preexec

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"


def agent_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "node_agent.cli", *args]


def server_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "rdzv_server.cli", *args]


class Proc:
    """A child process whose stderr/stdout lines are collected by reader threads."""

    def __init__(
        self, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> None:
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        self.argv = list(argv)
        self.p = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full_env,
            cwd=cwd or ROOT,
            start_new_session=True,
            # Nothing the suite starts outlives a killed test run (a server is a daemon: it
            # would). Only from the main thread: the signal follows the spawning thread's end.
            preexec_fn=pdeathsig_preexec() if threading.current_thread() is threading.main_thread() else None,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._cond = threading.Condition()
        self._threads = [
            threading.Thread(target=self._pump, args=(self.p.stdout, self.out), daemon=True),
            threading.Thread(target=self._pump, args=(self.p.stderr, self.err), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _pump(self, stream, sink: list[str]) -> None:  # type: ignore[no-untyped-def]
        for raw in iter(stream.readline, b""):
            with self._cond:
                sink.append(raw.decode(errors="replace").rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for_line(self, pattern: str, *, stream: str = "err", timeout: float = 30.0) -> re.Match[str]:
        rx = re.compile(pattern)
        sink = self.err if stream == "err" else self.out
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in sink[seen:]:
                    m = rx.search(line)
                    if m:
                        return m
                seen = len(sink)
                left = deadline - time.monotonic()
                if left <= 0 or (self.p.poll() is not None and all(not t.is_alive() for t in self._threads)):
                    if seen == len(sink):
                        raise AssertionError(
                            f"no line matching {pattern!r} within {timeout} s from {self.argv}\n"
                            f"stdout:\n{self.stdout}\nstderr:\n{self.stderr}"
                        )
                self._cond.wait(timeout=min(max(left, 0.01), 0.5))

    def wait(self, timeout: float = 60.0) -> int:
        try:
            rc = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"{self.argv} did not exit within {timeout} s\nstderr:\n{self.stderr}"
            ) from None
        for t in self._threads:
            t.join(timeout=5)
        return rc

    @property
    def stdout(self) -> str:
        return "\n".join(self.out)

    @property
    def stderr(self) -> str:
        return "\n".join(self.err)

    def signal(self, sig: int) -> None:
        if self.p.poll() is None:
            self.p.send_signal(sig)

    def kill(self) -> None:
        """Kill the whole session (agent and anything it left)."""
        kill_session(self.p)


def kill_session(p: subprocess.Popen[bytes]) -> None:
    """SIGKILL a child started with start_new_session (its whole process group) and reap it."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def free_port() -> int:
    """A loopback port free right now (nothing listens there until someone binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*extra: str) -> tuple[Proc, int]:
    srv = Proc(server_cmd("--host", "127.0.0.1", "--port", "0", *extra))
    m = srv.wait_for_line(r"listening on [^ ]+:(\d+)", timeout=20)
    return srv, int(m.group(1))


def read_env_dumps(folder: Path) -> list[dict[str, str]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("env-*.json"))]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False
