"""Case 10: what the user waits for, up to every rank's first all_reduce.

The clock stops when every rank has done ``init_process_group("gloo")`` and one all_reduce
(``bench/workers/ready_gloo.py``'s ``ready`` event), not when the workers start: whatever the
replacement does before it can train (its ``import torch``, the store it connects to) counts.
Each trial runs torchrun, node-agent, or node-agent with ``--preload torch``.

Before a failure is injected the machine is left quiet: every rank ready, and with
``--preload`` every local rank's warm interpreter done importing (found in ``/proc``: the
agent's descendants that run ``node_agent/supervisor/warm_boot.py``, blocked reading their control
socket), so that a replacement finds what a job that has trained for a while would find.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Collection

from .launch_cases import Events, _by_rank, _of, _require_exit, c10d, exe, worker
from .procs import Launched, Trial, TrialFailed, children, free_port, pss_uss_mb, rss_mb

SCRIPT = "ready_gloo.py"
PRELOAD = ["--preload", "torch"]
SETTLE = 0.5  # quiet time before a failure, once its preconditions hold
WARM_BOUND = 90.0  # a warm-up imports torch; several at once on 2 cores
REPLACE_BOUND = 90.0
# A warm interpreter waiting for its handoff sleeps in a read of its control socket
# (/proc/PID/wchan: unix_stream_read_generic, or unix_stream_data_wait on older kernels).
IDLE_WCHAN = "unix_stream"
WARM_BOOT = b"warm_boot.py"
# A warm worker's ``import torch`` finds it in sys.modules; a cold one takes a second or more.
WARM_IMPORT = 0.5


def argv_of(launcher: str, preload: bool) -> list[str]:
    return [exe(launcher), *(PRELOAD if preload else [])]


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = [pid]
    while todo:
        kids = children(todo.pop())
        out.extend(kids)
        todo.extend(kids)
    return out


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def idle_warm(agent_pid: int, workers: Collection[int] = ()) -> list[int]:
    """The agent's warm interpreters that are done importing and wait for a worker to become."""
    found = []
    for pid in descendants(agent_pid):
        if pid in workers or WARM_BOOT not in _read(f"/proc/{pid}/cmdline"):
            continue
        if IDLE_WCHAN in _read(f"/proc/{pid}/wchan").decode(errors="replace"):
            found.append(pid)
    return found


def kill_node(trial: Trial, victim: Launched) -> float:
    """The node is gone: its launcher, workers, warm interpreters and store process SIGKILLed
    at one instant (torchrun's workers run in sessions of their own: found by their parent in
    the events); the marker tells a replacement to exit 0 once ready. Returns the kill's time."""
    doomed = set(descendants(victim.pid))
    doomed |= {e["pid"] for e in _of(trial.events(), "start") if e["ppid"] == victim.pid}
    trial.marker.write_text("node killed\n")
    t_kill = time.time()
    trial.kill(victim, signal.SIGKILL)
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return t_kill


def _worker_pids(evs: Events) -> set[int]:
    return {e["pid"] for e in _of(evs, "start")}


def quiet(trial: Trial, agents: list[Launched], preload: bool, per_agent: int) -> None:
    """Wait until each agent holds ``per_agent`` idle warm interpreters (``preload``), then SETTLE."""
    if preload:

        def warm() -> bool | None:
            workers = _worker_pids(trial.events())
            return True if all(len(idle_warm(a.pid, workers)) >= per_agent for a in agents) else None

        trial.until(f"{per_agent} idle warm interpreter(s) per agent", warm, WARM_BOUND)
    time.sleep(SETTLE)


def _ready(
    trial: Trial, procs: list[Launched], n: int, what: str, after: float = 0.0, **match: object
) -> dict[int, float]:
    """The earliest ``ready`` per rank after ``after``, once all ``n`` ranks have one (a
    TrialFailed at once if every one of ``procs``, the launchers, has exited)."""

    def done() -> dict[int, float] | None:
        got = _by_rank(_of(trial.events(), "ready", after=after, **match))
        if len(got) >= n:
            return got
        if all(p.poll() is not None for p in procs):
            rcs = [p.popen.returncode for p in procs]
            raise TrialFailed(f"{what}: the launchers exited (rc {rcs}) first\n{trial.describe()}")
        return None

    return trial.until(what, done, REPLACE_BOUND)


def _require_warm(trial: Trial, preload: bool, after: float = 0.0, **match: object) -> None:
    """With ``preload``, every worker started after ``after`` must have started warm: else the
    row would time cold workers under the preload label."""
    if not preload:
        return
    evs = trial.events()
    started = {e["pid"]: e for e in _of(evs, "start", after=after, **match)}
    for e in _of(evs, "imported", after=after):
        s = started.get(e["pid"])
        if s is not None and e["t"] - s["t"] > WARM_IMPORT:
            raise TrialFailed(
                f"rank {s['rank']}'s worker started cold (import torch took {e['t'] - s['t']:.2f} s)"
                f"\n{trial.describe()}"
            )


def _fail_rank0(trial: Trial, procs: list[Launched], world: int, preload: bool) -> dict[str, float]:
    """Let rank 0 fail; from its ``fail`` event to every replacement's start and ``ready``."""
    (trial.dir / "go").write_text("go\n")
    fail = trial.until_events("rank 0's failure", lambda e: _of(e, "fail") or None, 30.0)
    t_fail = fail[0]["t"]
    ready = _ready(trial, procs, world, "every replacement ready", after=t_fail, replacement=True)
    start = _by_rank(_of(trial.events(), "start", after=t_fail, replacement=True))
    _require_warm(trial, preload, t_fail, replacement=True)
    return {"start": max(start.values()) - t_fail, "ready": max(ready.values()) - t_fail}


def _env(trial: Trial, mode: str) -> dict[str, str]:
    return {"BENCH_MODE": mode, "BENCH_GO": str(trial.dir / "go"), **NO_SHARED_STORE}


# torchrun 2.13 keeps one shared TCPStore for every round, and its workers' store has no
# per-attempt prefix any more: a replacement can read the previous attempt's gloo addresses
# and fail to connect (half of our torchrun restarts did). As in case 4, torchrun gets
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store per attempt, hosted by rank 0);
# node-agent ignores it.
NO_SHARED_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


# --- the rows -------------------------------------------------------------------------------


def restart_standalone(trial: Trial, launcher: str, preload: bool = False) -> dict[str, float]:
    """1 node x 2 ranks: rank 0 exits 1; every replacement ready."""
    argv = [*argv_of(launcher, preload), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    agents = [trial.launch("agent", [*argv, worker(SCRIPT)], _env(trial, "fail"))]
    _ready(trial, agents, 2, "both ranks ready")
    quiet(trial, agents, preload, 2)
    out = _fail_rank0(trial, agents, 2, preload)
    _require_exit(trial, agents, "restart")
    return out


def restart_nodes(trial: Trial, launcher: str, preload: bool = False) -> dict[str, float]:
    """2 nodes x 1 rank (two launchers, ``--nnodes 2``): rank 0 exits 1; every replacement ready."""
    argv = [*argv_of(launcher, preload), *c10d(free_port(), "2"), "--max-restarts", "1", worker(SCRIPT)]
    agents = [trial.launch(f"agent{i}", argv, _env(trial, "fail")) for i in range(2)]
    _ready(trial, agents, 2, "both ranks ready")
    quiet(trial, agents, preload, 1)
    out = _fail_rank0(trial, agents, 2, preload)
    _require_exit(trial, agents, "restart")
    return out


def nnode(trial: Trial, launcher: str, n: int, preload: bool = False) -> dict[str, float]:
    """N launchers (``--nnodes N``, 1 rank each) back to back: from the last Popen to every
    rank's first all_reduce. torchrun keeps its defaults here (its agent hosts the store)."""
    argv = [*argv_of(launcher, preload), *c10d(free_port(), str(n)), worker(SCRIPT)]
    agents = [trial.launch(f"agent{i}", argv, {"BENCH_MODE": "once"}) for i in range(n)]
    ready = _ready(trial, agents, n, f"{n} ranks ready")
    if sorted(ready) != list(range(n)):
        raise TrialFailed(f"ranks {sorted(ready)}, expected 0..{n - 1}")
    _require_warm(trial, preload)
    _require_exit(trial, agents, f"{n}-node")
    return {"launch": max(ready.values()) - agents[-1].t_launch}


def node_kill(trial: Trial, launcher: str, preload: bool = False) -> dict[str, float]:
    """Case 5's two nodes (``--nnodes 1:2``, torchrun's defaults), an all_reduce every 0.1 s;
    node 2's agent and every process under it SIGKILLed at once; node 1's WORLD_SIZE=1
    replacement ready."""
    port = free_port()
    tuned = "last_call_timeout=1"
    if launcher == "torchrun":
        tuned += ",keep_alive_interval=1,keep_alive_max_attempt=2"
    agents = []
    for i, host in enumerate(("true", "false")):
        argv = [*argv_of(launcher, preload), *c10d(port, "1:2"), "--max-restarts", "3"]
        argv += ["--rdzv-conf", f"is_host={host},{tuned}", worker(SCRIPT)]
        agents.append(trial.launch(f"agent{i}", argv, {"BENCH_MODE": "loop"}))
    _ready(trial, agents, 2, "both ranks ready with WORLD_SIZE=2", ws=2)
    quiet(trial, agents, preload, 1)
    survivor, victim = agents
    t_kill = kill_node(trial, victim)
    what = "node 1's WORLD_SIZE=1 replacement ready"
    ready = _ready(trial, [survivor], 1, what, after=t_kill, ws=1)
    start = _by_rank(_of(trial.events(), "start", after=t_kill, ws=1))
    _require_warm(trial, preload, t_kill, ws=1)
    return {"start": min(start.values()) - t_kill, "ready": min(ready.values()) - t_kill}


def warm_memory(trial: Trial, launcher: str) -> dict[str, float]:
    """RSS, PSS and USS of one idle warm interpreter (``--preload torch``): one agent of a
    2-node job (``--nproc-per-node 2``) waiting for its peer, its two warm-ups done (their
    shared pages split between them in PSS). The mean over the two."""
    argv = [*argv_of(launcher, True), *c10d(free_port(), "2"), "--nproc-per-node", "2", worker("idle.py")]
    agent = trial.launch("agent", argv)
    quiet(trial, [agent], True, 2)
    warm = idle_warm(agent.pid)
    if len(warm) < 2:
        raise TrialFailed(f"{len(warm)} idle warm interpreter(s) after the settle, expected 2")
    rss = [rss_mb(pid) for pid in warm]
    pss, uss = zip(*(pss_uss_mb(pid) for pid in warm), strict=True)
    if agent.poll() is not None:
        raise TrialFailed(f"the agent exited (rc {agent.popen.returncode}) while waiting for its peer")
    return {"rss": sum(rss) / len(rss), "pss": sum(pss) / len(pss), "uss": sum(uss) / len(uss)}
