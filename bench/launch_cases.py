"""Cases 1-6: the same worker scripts under torchrun and under node-agent, measured the same way.

Each function runs one trial for one launcher and returns its measurements (seconds, MB).
Both launchers get the same command line wherever the flags mean the same thing; the few
differences (torchrun's keep-alive tuning, its TCPStore-sharing opt-out) are the ones the
torchrun baseline used, and are stated in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from .procs import (
    BIN,
    WORKERS,
    Launched,
    Trial,
    TrialFailed,
    children,
    cpu_seconds,
    free_port,
    pss_uss_mb,
    rss_mb,
    wait_for_log,
)

Events = list[dict[str, Any]]

LAUNCH_BOUND = 90.0  # torchrun needs ~3 s per agent of CPU to import torch; 8 agents on 2 cores
EXIT_BOUND = 60.0


def exe(launcher: str) -> str:
    return str(BIN / ("torchrun" if launcher == "torchrun" else "node-agent"))


def worker(name: str) -> str:
    return str(WORKERS / name)


def c10d(port: int, nnodes: str) -> list[str]:
    return [
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "job",
        "--local-addr",
        "127.0.0.1",
    ]


def _of(evs: Events, ev: str, after: float = 0.0, **match: Any) -> Events:
    return [
        e for e in evs if e["ev"] == ev and e["t"] > after and all(e.get(k) == v for k, v in match.items())
    ]


def _by_rank(evs: Events) -> dict[int, float]:
    """The earliest time of each rank among ``evs``."""
    out: dict[int, float] = {}
    for e in evs:
        r = e["rank"]
        out[r] = min(out.get(r, e["t"]), e["t"])
    return out


def _require_exit(trial: Trial, procs: list[Launched], what: str) -> None:
    if not trial.wait_exit(procs, EXIT_BOUND):
        raise TrialFailed(f"{what}: launcher(s) still running after {EXIT_BOUND:g} s\n{trial.describe()}")
    bad = [p for p in procs if p.popen.returncode != 0]
    if bad:
        raise TrialFailed(
            f"{what}: launcher exit codes {[p.popen.returncode for p in bad]}\n{trial.describe()}"
        )


# --- 1. standalone launch -------------------------------------------------------------------


def standalone(trial: Trial, launcher: str, script: str) -> dict[str, float]:
    gloo = script.startswith("gloo")
    p = trial.launch("agent", [exe(launcher), "--standalone", "--nproc-per-node", "2", worker(script)])
    need = "ready" if gloo else "start"
    evs = trial.until_events(
        f"2 workers {need}", lambda e: e if len(_of(e, need)) >= 2 else None, LAUNCH_BOUND
    )
    out = {"start": max(e["t"] for e in _of(evs, "start")) - p.t_launch}
    if gloo:
        out["ready"] = max(e["t"] for e in _of(evs, "ready")) - p.t_launch
        # The worker's own part, which no launcher can shorten: its import torch, and all of
        # start -> ready (import, init_process_group, all_reduce), for the slowest rank.
        started = _by_rank(_of(evs, "start"))
        for key, ev in (("import", "imported"), ("own", "ready")):
            done = _by_rank(_of(evs, ev))
            out[key] = max(done[r] - started[r] for r in done if r in started)
    _require_exit(trial, [p], "standalone")
    assert p.t_exit is not None
    out["wall"] = p.t_exit - p.t_launch
    return out


# The least a launcher written in Python with asyncio can take here: its interpreter and the
# asyncio import, then two no-import workers started one after the other (no rendezvous, no
# supervision). What node-agent adds on top is its own work.
_START_TWO = """
import os, subprocess, sys
def start():
    return [subprocess.Popen([sys.executable, "-u", sys.argv[1]], env=dict(os.environ, RANK=str(r)))
            for r in range(2)]
"""
FLOOR_LAUNCHER = "import asyncio" + _START_TWO + "sys.exit(max(w.wait() for w in start()))\n"


def python_floor(trial: Trial, launcher: str) -> dict[str, float]:
    p = trial.launch("floor", [sys.executable, "-c", FLOOR_LAUNCHER, worker("noimport.py")])
    evs = trial.until_events(
        "2 workers start", lambda e: e if len(_of(e, "start")) >= 2 else None, LAUNCH_BOUND
    )
    out = {"start": max(e["t"] for e in _of(evs, "start")) - p.t_launch}
    _require_exit(trial, [p], "python floor")
    return out


# --- 2. N-node rendezvous -------------------------------------------------------------------


def start_server(trial: Trial) -> tuple[Launched, int]:
    srv = trial.launch(
        "server", [sys.executable, "-m", "rdzv_server.cli", "--host", "127.0.0.1", "--port", "0"]
    )
    m = wait_for_log(srv, r"listening on 127\.0\.0\.1:(\d+)", 30.0)
    return srv, int(m[1])


def nnode(trial: Trial, launcher: str, n: int, server: bool = False) -> dict[str, float]:
    if server:
        _, port = start_server(trial)
    else:
        port = free_port()
    argv = [exe(launcher), *c10d(port, str(n)), worker("noimport.py")]
    agents = [trial.launch(f"agent{i}", argv) for i in range(n)]
    t_last = agents[-1].t_launch
    evs = trial.until_events(f"{n} workers started", lambda e: e if len(_of(e, "start")) >= n else None, 120)
    starts = [e["t"] for e in _of(evs, "start")]
    ranks = sorted(e["rank"] for e in _of(evs, "start"))
    if ranks != list(range(n)):
        raise TrialFailed(f"ranks {ranks}, expected 0..{n - 1}")
    out = {"start": max(starts) - t_last, "from_first": max(starts) - agents[0].t_launch}
    _require_exit(trial, agents, f"{n}-node")
    return out


# --- 3. restart after a worker failure ------------------------------------------------------


def restart(trial: Trial, launcher: str, nodes: int) -> dict[str, float]:
    if nodes == 1:
        argv = [exe(launcher), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
        agents = [trial.launch("agent", [*argv, worker("fail_once.py")])]
    else:
        port = free_port()
        argv = [exe(launcher), *c10d(port, str(nodes)), "--max-restarts", "1", worker("fail_once.py")]
        agents = [trial.launch(f"agent{i}", argv) for i in range(nodes)]
    return _replacements(trial, agents, world=2)


# The least a restart costs here: a plain Python parent that waits for rank 0's exit, stops
# rank 1 (SIGTERM, reap) and starts both again with subprocess (vfork). No rendezvous, no
# PDEATHSIG (which makes each spawn a fork), no output pumps.
RESTART_FLOOR = (
    "import signal"
    + _START_TWO
    + """ws = start()
ws[0].wait()
ws[1].send_signal(signal.SIGTERM)
ws[1].wait()
sys.exit(max(w.wait() for w in start()))
"""
)


def restart_floor(trial: Trial, launcher: str) -> dict[str, float]:
    p = trial.launch("floor", [sys.executable, "-c", RESTART_FLOOR, worker("fail_once.py")])
    return _replacements(trial, [p], world=2)


def _replacements(trial: Trial, procs: list[Launched], world: int) -> dict[str, float]:
    """From rank 0's ``fail`` event to the ``start`` of the first and of every replacement."""

    def replaced(evs: Events) -> tuple[float, dict[int, float]] | None:
        fails = _of(evs, "fail")
        if not fails:
            return None
        t_fail = fails[0]["t"]
        new = _by_rank(_of(evs, "start", after=t_fail))
        return (t_fail, new) if len(new) >= world else None

    t_fail, new = trial.until("failure, then every rank replaced", lambda: replaced(trial.events()), 120)
    _require_exit(trial, procs, "restart")
    return {"first": min(new.values()) - t_fail, "all": max(new.values()) - t_fail}


# --- 4. scale-up ----------------------------------------------------------------------------


def scale_up(trial: Trial, launcher: str, share_store: bool = False, bound: float = 60.0) -> dict[str, float]:
    """Agent 0 alone under --nnodes 1:2; 2 s after its worker runs, agent 1 starts.

    ``share_store=False`` sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (torchrun needs it here;
    node-agent ignores it).
    """
    env = {} if share_store else {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    port = free_port()
    argv = [exe(launcher), *c10d(port, "1:2"), "--rdzv-conf", "last_call_timeout=1", worker("idle.py")]
    a0 = trial.launch("agent0", argv, env)
    evs = trial.until_events(
        "worker with WORLD_SIZE=1", lambda e: _of(e, "start", ws=1) or None, LAUNCH_BOUND
    )
    alone = evs[0]["t"] - a0.t_launch
    time.sleep(2.0)
    a1 = trial.launch("agent1", argv, env)

    def grown() -> float | None:
        ranks = _by_rank(_of(trial.events(), "start", after=a1.t_launch, ws=2))
        if {0, 1} <= ranks.keys():
            return max(ranks[0], ranks[1]) - a1.t_launch
        if a0.poll() is not None and a1.poll() is not None:
            assert a0.t_exit is not None and a1.t_exit is not None
            after = max(a0.t_exit, a1.t_exit) - a1.t_launch
            raise TrialFailed(
                f"both agents exited (rc {a0.popen.returncode}, {a1.popen.returncode}) "
                f"{after:.1f} s after agent 2's launch, no WORLD_SIZE=2 worker"
            )
        return None

    return {"grow": trial.until("WORLD_SIZE=2 on both nodes", grown, bound), "alone": alone}


def scale_up_default_failure(trial: Trial, bound: float = 80.0) -> str:
    """torchrun's default scale-up, run once: what happens within ``bound`` seconds."""
    try:
        r = scale_up(trial, "torchrun", share_store=True, bound=bound)
    except TrialFailed as exc:
        first = str(exc).splitlines()[0]
        errs = []
        for p in trial.procs:
            for line in p.log_text().splitlines():
                if "DistStoreError" in line or "wait timeout" in line:
                    errs.append(line.strip()[:300])
                    break
        detail = f"; {errs[0]}" if errs else ""
        return f"fails: {first}{detail}"
    return f"succeeded: agent 1 launch -> WORLD_SIZE=2 on both in {r['grow']:.3f} s"


# --- 5. node SIGKILL ------------------------------------------------------------------------


def node_kill(trial: Trial, launcher: str) -> dict[str, float]:
    """Both agents up with gloo workers; SIGKILL agent 1 and its worker at the same instant."""
    port = free_port()
    tuned = "last_call_timeout=1"
    if launcher == "torchrun":
        tuned += ",keep_alive_interval=1,keep_alive_max_attempt=2"
    agents = []
    for i, host in enumerate(("true", "false")):
        argv = [
            exe(launcher),
            *c10d(port, "1:2"),
            "--max-restarts",
            "3",
            "--rdzv-conf",
            f"is_host={host},{tuned}",
            worker("gloo_loop.py"),
        ]
        agents.append(trial.launch(f"agent{i}", argv))
    a0, a1 = agents
    evs = trial.until_events(
        "both workers ready with WORLD_SIZE=2",
        lambda e: e if len(_by_rank(_of(e, "ready", ws=2))) >= 2 else None,
        120,
    )
    time.sleep(2.0)
    victims = {e["pid"] for e in _of(evs, "start", ws=2) if e["ppid"] == a1.pid}
    t_kill = time.time()
    trial.kill(a1, signal.SIGKILL)
    for pid in victims:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    ev = trial.until_events(
        "a WORLD_SIZE=1 worker on node 0",
        lambda e: _of(e, "start", after=t_kill, ws=1) or None,
        90,
    )
    out = {"start": ev[0]["t"] - t_kill}
    try:
        ready = trial.until_events(
            "that worker ready", lambda e: _of(e, "ready", after=t_kill, ws=1) or None, 60
        )
        out["ready"] = ready[0]["t"] - t_kill
    except TrialFailed:
        pass
    errs = _of(trial.events(), "collective_error", after=t_kill)
    if errs:
        out["collective_error"] = errs[0]["t"] - t_kill
    _ = a0
    return out


# --- 6. agent footprint ---------------------------------------------------------------------


def footprint(trial: Trial, launcher: str, seconds: float = 10.0) -> dict[str, float]:
    p = trial.launch("agent", [exe(launcher), "--standalone", "--nproc-per-node", "2", worker("idle.py")])
    evs = trial.until_events(
        "2 idle workers", lambda e: e if len(_of(e, "start")) >= 2 else None, LAUNCH_BOUND
    )
    time.sleep(2.0)
    workers = {e["pid"] for e in _of(evs, "start")}
    helpers = [c for c in children(p.pid) if c not in workers]
    cpu0, t0 = cpu_seconds(p.pid), time.monotonic()
    rss0 = rss_mb(p.pid)
    time.sleep(seconds)
    cpu1, t1 = cpu_seconds(p.pid), time.monotonic()
    rss1 = rss_mb(p.pid)
    pss, uss = pss_uss_mb(p.pid)
    helper_rss = 0.0
    for h in helpers:
        try:
            helper_rss += rss_mb(h)
        except OSError:
            pass
    if p.poll() is not None:
        raise TrialFailed("the agent exited while supervising")
    return {
        "rss": max(rss0, rss1),
        "pss": pss,
        "uss": uss,
        "rss_with_helpers": max(rss0, rss1) + helper_rss,
        "helpers": float(len(helpers)),
        "cpu_idle": (cpu1 - cpu0) * seconds / (t1 - t0),
        "cpu_startup": cpu0,
    }


# --- 8. a hung rank -------------------------------------------------------------------------

HANG_BUDGET = 2.0  # --hang-timeout of the hang case: the budget is part of what is measured


def hang(trial: Trial, launcher: str) -> dict[str, float]:
    """Two ranks; rank 1 hangs outside any collective while rank 0 waits in all_reduce. From
    the hang to the node's hang report written, and to every rank's replacement running.

    Ours only: torchrun never notices a hung rank; its job waits for the collective's own
    timeout (gloo 30 min, NCCL 10 min by default) and then fails without stacks.
    """
    logs = trial.dir / "logs"
    argv = [exe(launcher), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    argv += ["--hang-timeout", str(HANG_BUDGET), "--log-dir", str(logs), worker("hang_once.py")]
    p = trial.launch("agent", argv, {"PYTHONPATH": str(WORKERS.parents[1])})

    def replaced(evs: Events) -> tuple[float, dict[int, float]] | None:
        hangs = _of(evs, "hang")
        if not hangs:
            return None
        new = _by_rank(_of(evs, "start", after=hangs[0]["t"]))
        return (hangs[0]["t"], new) if len(new) >= 2 else None

    t_hang, new = trial.until("a hang, then both ranks replaced", lambda: replaced(trial.events()), 120)
    _require_exit(trial, [p], "hang")
    (report,) = logs.glob("*/attempt_*/hang_report.txt")
    return {
        "report": report.stat().st_mtime - t_hang,
        "report_over_budget": report.stat().st_mtime - t_hang - HANG_BUDGET,
        "all": max(new.values()) - t_hang,
    }
