"""Processes for one trial: launch with a time stamp, poll, read events, and leave nothing behind.

Every process a trial starts gets ``BENCH_TAG=<random>`` in its environment, and so does
everything it starts in turn (workers, watchdogs), whatever session or process group they put
themselves in. Cleanup signals the process groups we started, then looks in ``/proc`` for any
process still carrying the tag and kills it by pid. torchrun's workers need this: they run in
sessions of their own and outlive a SIGKILLed agent.

Times are ``time.time()`` throughout, as in the torchrun baseline: the driver stamps it just
before ``Popen``, workers stamp it as their first statement, and on one host they share a clock.
"""

from __future__ import annotations

import json
import os
import re
import resource
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

POLL = 0.02  # seconds between polls of events and exits, as in the baseline driver
TERM_GRACE = 5.0  # SIGTERM, then this long, then SIGKILL
ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"
BIN = Path(sys.executable).parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


class TrialFailed(Exception):
    """A trial did not reach the state it waits for within its bound."""


def raise_nofile_limit() -> int:
    """Raise this process's soft open-file limit to its hard limit; children inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def shares(m: int, procs: int) -> list[int]:
    """``m`` agents (or sockets) over at most ``procs`` processes, as evenly as ceil allows."""
    per = -(-m // procs)
    return [min(per, m - i * per) for i in range(procs) if m - i * per > 0]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- /proc ----------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process, from /proc (10 ms resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rpartition(")")[2].split()
    return (int(rest[11]) + int(rest[12])) / CLK_TCK


def status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def rss_mb(pid: int) -> float:
    return status_kb(pid, "VmRSS") / 1024


def pss_uss_mb(pid: int) -> tuple[float, float]:
    """PSS and USS (private clean + dirty) from smaps_rollup."""
    vals: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0].endswith(":"):
                try:
                    vals[parts[0][:-1]] = int(parts[1])
                except ValueError:
                    continue
    uss = vals.get("Private_Clean", 0) + vals.get("Private_Dirty", 0)
    return vals.get("Pss", 0) / 1024, uss / 1024


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
    except OSError:
        pass
    return out


def tagged_pids(tag: str) -> list[int]:
    """Every process whose environment carries BENCH_TAG=tag (ours to kill)."""
    needle = f"BENCH_TAG={tag}".encode()
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.append(int(name))
    return found


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


# --- one launched process -------------------------------------------------------------------


@dataclass
class Launched:
    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes]
    t_launch: float  # time.time() just before Popen
    log: Path
    t_exit: float | None = None  # first poll that saw it gone (20 ms resolution)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        rc = self.popen.poll()
        if rc is not None and self.t_exit is None:
            self.t_exit = time.time()
        return rc

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""


@dataclass
class Trial:
    """One run of one case for one launcher: its folder, events file, processes and cleanup."""

    dir: Path
    tag: str = field(default_factory=lambda: secrets.token_hex(8))
    procs: list[Launched] = field(default_factory=list)
    leftovers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.events_path = self.dir / "events.jsonl"
        self.marker = self.dir / "failed-once"

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            BENCH_TAG=self.tag,
            BENCH_EVENTS=str(self.events_path),
            BENCH_MARKER=str(self.marker),
            GLOO_SOCKET_IFNAME="lo",  # loopback only
            PYTHONUNBUFFERED="1",
        )
        env.pop("LOGLEVEL", None)
        env.update(extra or {})
        return env

    def launch(
        self, name: str, argv: Sequence[str], env: dict[str, str] | None = None, *, pipes: bool = False
    ) -> Launched:
        """Start a process in a session of its own; its output goes to ``<name>.log``.

        ``pipes=True`` gives it a stdin and stdout pipe instead (stderr still to the log).
        """
        log = self.dir / f"{name}.log"
        full_env = self.env(env)
        out = open(log, "wb")  # handed to the child, closed right after Popen
        try:
            t = time.time()
            p = subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
                stdout=subprocess.PIPE if pipes else out,
                stderr=out if pipes else subprocess.STDOUT,
                env=full_env,
                cwd=ROOT,
                start_new_session=True,
            )
        finally:
            out.close()
        launched = Launched(name, list(argv), p, t, log)
        self.procs.append(launched)
        return launched

    # -- waiting ---------------------------------------------------------------------------

    def events(self) -> list[dict[str, Any]]:
        try:
            raw = self.events_path.read_text()
        except FileNotFoundError:
            return []
        out = []
        for line in raw.splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line being written right now
        return out

    def until(self, what: str, cond: Callable[[], T | None], timeout: float) -> T:
        """Poll ``cond`` every 20 ms (noting exits as we go) until it returns a value."""
        deadline = time.monotonic() + timeout
        while True:
            for p in self.procs:
                p.poll()
            value = cond()
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise TrialFailed(f"{what}: not within {timeout:g} s\n{self.describe()}")
            time.sleep(POLL)

    def until_events(self, what: str, cond: Callable[[list[dict[str, Any]]], T | None], timeout: float) -> T:
        return self.until(what, lambda: cond(self.events()), timeout)

    def wait_exit(self, procs: Sequence[Launched], timeout: float) -> bool:
        """True when all of ``procs`` exited within ``timeout``."""
        try:
            self.until("exit", lambda: True if all(p.poll() is not None for p in procs) else None, timeout)
        except TrialFailed:
            return False
        return True

    def describe(self) -> str:
        lines = []
        for p in self.procs:
            tail = "\n      ".join(p.log_text().splitlines()[-6:])
            lines.append(f"  {p.name} pid {p.pid} rc {p.popen.poll()}:\n      {tail}")
        lines.append(f"  events: {len(self.events())} in {self.events_path}")
        return "\n".join(lines)

    # -- cleanup ---------------------------------------------------------------------------

    def kill(self, p: Launched, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass

    def cleanup(self) -> None:
        """SIGTERM our groups, SIGKILL after a grace, then kill anything still tagged."""
        alive = [p for p in self.procs if p.poll() is None]
        for p in alive:
            self.kill(p, signal.SIGTERM)
        if alive:
            self.wait_exit(alive, TERM_GRACE)
        for p in self.procs:
            if p.poll() is None:
                self.kill(p, signal.SIGKILL)
            try:
                p.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for _ in range(50):
            pids = tagged_pids(self.tag)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        self.leftovers = tagged_pids(self.tag)

    def __enter__(self) -> Trial:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def wait_for_log(p: Launched, pattern: str, timeout: float) -> re.Match[str]:
    rx = re.compile(pattern)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = rx.search(p.log_text())
        if m:
            return m
        if p.poll() is not None:
            break
        time.sleep(POLL)
    raise TrialFailed(f"{p.name}: no line matching {pattern!r} within {timeout:g} s:\n{p.log_text()[-2000:]}")
