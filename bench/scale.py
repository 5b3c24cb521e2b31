"""Case 7: M simulated agents against one rdzv-server process (ours alone).

One trial, for one M:

1. a fresh ``rdzv-server --port 0`` and a few ``bench.simagents`` processes (M/P agents each);
2. cold join storm: a job with ``--nnodes M:M``; every agent connects, says hello and joins at
   once; timed from the driver's stamp to the last Assignment received; the server's CPU time
   and RSS are read from ``/proc/<pid>``;
3. heartbeats: all M agents at 1 Hz, server CPU over a 5 s window; then the same with what
   real agents of a training job add (``simagents``: one Progress summary per node a second,
   8 ranks each, a straggler among them), server CPU over a 5 s window after 2 s of warm-up;
   then one hang: every rank stops, every node finds its ranks hung, sends HangDetected, its
   stacks (the server's CollectStacks asks too) and its failure; timed to the verdict
   (Restart, with the job's hang report) and to the next round, with the server's CPU time
   and its peak RSS;
4. everyone disconnects, then a second storm into an elastic job (``min 1, max M``): it
   forms when all M are in;
5. re-rendezvous: 1 % of the agents close their sockets; the survivors get Restart, join
   again and get the next round's Assignment; timed from the driver's stamp;
6. with the agents gone, the floor under that: plain sends to M sockets (``send_floor.py``).
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import time
import urllib.request
from typing import Any

from . import send_floor
from .launch_cases import start_server
from .procs import Trial, TrialFailed, cpu_seconds, rss_mb, shares, status_kb

HB_WINDOW = 5.0
SUMMARY_WARMUP = 2.0  # the server's view of the round fills within a summary interval or two
STEP_S = 0.5  # the simulated training's step time
HANG_BUDGET = 2.0  # as case 8's --hang-timeout 2: the budget changes nothing the server does
NPROC = 8  # ranks per simulated node


class Clients:
    """The simulated-agent processes, driven over their stdin/stdout in lock step."""

    def __init__(self, trial: Trial, port: int, m: int, procs: int) -> None:
        self.trial = trial
        self.popens: list[subprocess.Popen[bytes]] = []
        first = 0
        for i, count in enumerate(shares(m, procs)):
            argv = [sys.executable, "-m", "bench.simagents", "--port", str(port), "--count", str(count)]
            # One source address per process: the server takes at most half of its connections
            # from one peer address (9,359 of 18,718 at this machine's 20,000 open files).
            argv += ["--first", str(first), "--source", f"127.0.0.{1 + i}"]
            p = trial.launch(f"sim{i}", argv, pipes=True).popen
            self.popens.append(p)
            first += count
        self._bufs = {p.stdout.fileno(): b"" for p in self.popens if p.stdout is not None}
        self.replies(timeout=60)  # "ready"

    def send(self, cmd: dict[str, Any]) -> None:
        line = (json.dumps(cmd) + "\n").encode()
        for p in self.popens:
            assert p.stdin is not None
            p.stdin.write(line)
            p.stdin.flush()

    def replies(self, timeout: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        got: dict[int, dict[str, Any]] = {}
        while len(got) < len(self.popens):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TrialFailed(
                    f"simulated agents: {len(got)} of {len(self.popens)} answered in {timeout:g} s"
                )
            fds = [fd for fd in self._bufs if fd not in got]
            ready, _, _ = select.select(fds, [], [], left)
            for fd in ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise TrialFailed(f"a simulated-agent process exited:\n{self._stderr()}")
                self._bufs[fd] += chunk
                if b"\n" in self._bufs[fd]:
                    line, _, rest = self._bufs[fd].partition(b"\n")
                    self._bufs[fd] = rest
                    got[fd] = json.loads(line)
        return list(got.values())

    def cpu_seconds(self) -> float:
        return sum(cpu_seconds(p.pid) for p in self.popens)

    def command(self, cmd: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
        self.send(cmd)
        return self.replies(timeout)

    def _stderr(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-1500:] for p in self.trial.dir.glob("sim*.log"))

    def stop(self) -> None:
        for p in self.popens:
            try:
                if p.stdin is not None:
                    p.stdin.write(b'{"cmd": "exit"}\n')
                    p.stdin.close()
            except OSError:
                pass
        for p in self.popens:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _check(replies: list[dict[str, Any]], what: str) -> None:
    bad = [r for r in replies if not r.get("ok")]
    if bad:
        raise TrialFailed(f"{what}: {bad[0]}")


def _healthz(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
        return json.loads(r.read())


def _wait_quiet(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = _healthz(port)
        if h.get("connections") == 0 and h.get("jobs") == 0:
            return
        time.sleep(0.1)
    raise TrialFailed(f"the server still has connections or jobs after {timeout:g} s: {_healthz(port)}")


def _stragglers_flagged(trial: Trial) -> list[str]:
    """The nodes the server's log names as stragglers (its STRAGGLER events)."""
    found = re.findall(
        r"node (sim-\d+) has straggler", (trial.dir / "server.log").read_text(errors="replace")
    )
    return sorted(set(found))


def client_procs(m: int) -> int:
    return 1 if m <= 100 else 2 if m <= 1000 else 4


def scale_trial(trial: Trial, m: int, procs: int | None = None) -> dict[str, float]:
    srv, port = start_server(trial)
    pid = srv.pid
    out: dict[str, float] = {"rss_idle": rss_mb(pid)}
    procs = procs or client_procs(m)
    clients = Clients(trial, port, m, procs)
    bound = 30.0 + m / 200  # generous: a bound, not a target
    try:
        # 2. cold join storm, --nnodes M:M
        cpu0, ccpu0 = cpu_seconds(pid), clients.cpu_seconds()
        t0 = time.time()
        r = clients.command(
            {
                "cmd": "join",
                "job": "storm",
                "min": m,
                "max": m,
                "last_call": 0,
                "timeout": bound,
                "nproc": NPROC,
                "max_restarts": 1,  # the hang below restarts the round
            },
            bound + 10,
        )
        _check(r, "join storm")
        out["storm"] = max(x["t_last_assigned"] for x in r) - t0
        out["storm_connected"] = max(x["t_connected"] for x in r) - t0
        out["storm_welcomed"] = max(x["t_last_welcome"] for x in r) - t0
        out["storm_cpu"] = cpu_seconds(pid) - cpu0
        out["storm_clients_cpu"] = clients.cpu_seconds() - ccpu0
        out["connect_retries"] = float(sum(x["connect_retries"] for x in r))
        ws = {w for x in r for w in x["world_sizes"]}
        if ws != {m}:
            raise TrialFailed(f"join storm: world sizes {ws}, expected {{{m}}}")
        # 3. heartbeats, 1 Hz from all M
        time.sleep(1.0)
        cpu0, t0m = cpu_seconds(pid), time.monotonic()
        r = clients.command({"cmd": "window", "seconds": HB_WINDOW}, HB_WINDOW + 30)
        elapsed = time.monotonic() - t0m
        out["hb_cpu_pct"] = 100 * (cpu_seconds(pid) - cpu0) / elapsed
        out["hb_per_s"] = sum(x["hb_sent"] for x in r) / elapsed
        out["rss"] = rss_mb(pid)
        # 3b. heartbeats + summaries, as the agents of a training job send them
        _check(clients.command({"cmd": "train", "step_s": STEP_S, "straggler": m // 2}, 30), "train")
        time.sleep(SUMMARY_WARMUP)
        cpu0, t0m = cpu_seconds(pid), time.monotonic()
        r = clients.command({"cmd": "window", "seconds": HB_WINDOW}, HB_WINDOW + 30)
        elapsed = time.monotonic() - t0m
        out["sum_cpu_pct"] = 100 * (cpu_seconds(pid) - cpu0) / elapsed
        out["sum_per_s"] = sum(x["progress_sent"] for x in r) / elapsed
        out["sum_bytes"] = sum(x["progress_bytes"] for x in r) / max(1, sum(x["progress_sent"] for x in r))
        out["sum_hb_per_s"] = sum(x["hb_sent"] for x in r) / elapsed
        out["rss_sum"] = rss_mb(pid)
        flagged = _stragglers_flagged(trial)
        if flagged != [f"sim-{m // 2:06d}"]:
            raise TrialFailed(
                f"summaries: the server flagged {flagged[:5]} as stragglers, expected sim-{m // 2:06d}"
            )
        # 3c. one hang: every rank stops; stacks from every node; the verdict restarts the round
        hwm0, cpu0 = status_kb(pid, "VmHWM") / 1024, cpu_seconds(pid)
        t0 = time.time()
        r = clients.command(
            {"cmd": "hang", "budget": HANG_BUDGET, "culprit": m // 3, "timeout": bound}, bound + 10
        )
        _check(r, "hang")
        ws = {w for x in r for w in x["world_sizes"]}
        if ws != {m}:
            raise TrialFailed(f"hang: the next round's sizes {ws}, expected {{{m}}}")
        first = min(x["t_first_detected"] for x in r)
        out["hang_verdict"] = max(x["t_last_restart"] for x in r) - first
        out["hang_rejoined"] = max(x["t_last_assigned"] for x in r) - first
        out["hang_cpu"] = cpu_seconds(pid) - cpu0
        out["hang_wall"] = time.time() - t0
        out["hang_stacks"] = float(sum(x.get("stacks", 0) for x in r))
        out["hang_stacks_mb"] = sum(x.get("stacks_bytes", 0) for x in r) / 1e6
        out["hang_failures"] = float(sum(x.get("failures", 0) for x in r))
        out["hang_report_chars"] = float(max(x["report_chars"] for x in r))
        out["hang_culprit_named"] = float(any(x["culprit_named"] for x in r))
        out["rss_hang"] = rss_mb(pid)
        out["rss_hang_peak"] = status_kb(pid, "VmHWM") / 1024
        out["rss_peak_before_hang"] = hwm0
        # 4. a second storm, into an elastic job that forms when all M are in
        _check(clients.command({"cmd": "close"}, 60), "close")
        _wait_quiet(port)
        t0 = time.time()
        r = clients.command(
            {"cmd": "join", "job": "elastic", "min": 1, "max": m, "last_call": 30, "timeout": bound},
            bound + 10,
        )
        _check(r, "elastic join storm")
        out["storm_elastic"] = max(x["t_last_assigned"] for x in r) - t0
        # 5. 1 % drop out; the survivors form the next round
        time.sleep(1.0)
        cpu0 = cpu_seconds(pid)
        t0 = time.time()
        r = clients.command({"cmd": "drop", "every": 100, "timeout": bound}, bound + 10)
        _check(r, "re-rendezvous")
        dropped = sum(x["dropped"] for x in r)
        ws = {w for x in r for w in x["world_sizes"]}
        if ws != {m - dropped}:
            raise TrialFailed(f"re-rendezvous: world sizes {ws}, expected {{{m - dropped}}}")
        out["rerdzv"] = max(x["t_last_assigned"] for x in r) - t0
        out["rerdzv_cpu"] = cpu_seconds(pid) - cpu0
        out["dropped"] = float(dropped)
        out["rss_peak"] = status_kb(pid, "VmHWM") / 1024
    finally:
        clients.stop()
    # 6. what the kernel alone costs for one of the re-rendezvous's two rounds of sends
    out["send_floor"] = send_floor.measure(trial, m, procs)
    return out
