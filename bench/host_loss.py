"""Issue 45: the node hosting the rendezvous SIGKILLed, side by side in one run.

Two launchers on this machine, ``--nnodes 1:2 --nproc-per-node 1 --max-restarts 3``, an
all_reduce every 0.1 s (``workers/ready_gloo.py``, loop mode); once both ranks are ready and
0.5 s have passed, node 1 (its launcher and every process under it) is SIGKILLed at once.

- ``torchrun``: node 1 hosts the c10d rendezvous (``is_host=true``; node 2 ``is_host=false``),
  case 5's keep-alive tuning. Its survivor cannot reach the store again: timed to its exit.
- ``ours, agent-hosted``: node 1 hosts (``is_host=true``); node 2 is left to choose, so it
  offers a standby port (``node_agent/rdzv/takeover.py``). Timed to node 2's WORLD_SIZE=1
  replacement ready (init_process_group and a first all_reduce done).
- ``ours, rdzv-server``: a separate ``rdzv-server`` on the endpoint, no node special; the same
  kill, timed the same way: what the take-over is compared with (target: within 1 s of it).

Trials are interleaved (one of each per repeat). Run: ``python -m bench.host_loss [--repeat N]
[--out docs/benchmarks-host-loss.md]``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .launch_cases import _by_rank, _of, c10d, exe, worker
from .procs import BIN, Trial, TrialFailed, free_port
from .ready_cases import _ready, kill_node

SCRIPT = "ready_gloo.py"
SETTLE = 0.5
EXIT_BOUND = 120.0
SETUPS = ("torchrun", "ours-hosted", "ours-server")


def host_kill(trial: Trial, setup: str) -> dict[str, float]:
    port = free_port()
    launcher = "torchrun" if setup == "torchrun" else "ours"
    tuned = "last_call_timeout=1"
    if launcher == "torchrun":
        tuned += ",keep_alive_interval=1,keep_alive_max_attempt=2"
    if setup == "ours-server":
        server = [str(BIN / "rdzv-server"), "--host", "127.0.0.1", "--port", str(port)]
        trial.launch("server", server, {})
        trial.until("the rdzv-server listening", lambda: _listens(port), 30.0)
    # is_host of node 1 and node 2 ("": not given, so node 2 may stand by)
    hosts = {"torchrun": ("true", "false"), "ours-hosted": ("true", ""), "ours-server": ("false", "false")}
    agents = []
    for i, host in enumerate(hosts[setup]):
        conf = f"is_host={host},{tuned}" if host else tuned
        argv = [exe(launcher), *c10d(port, "1:2"), "--max-restarts", "3", "--rdzv-conf", conf, worker(SCRIPT)]
        agents.append(trial.launch(f"agent{i}", argv, {"BENCH_MODE": "loop"}))
        if i == 0 and setup == "ours-hosted":
            # node 1 listens first, so node 2 (not told either way) finds it and stands by
            trial.until("node 1 hosting", lambda: _listens(port), 30.0)
    _ready(trial, agents, 2, "both ranks ready with WORLD_SIZE=2", ws=2)
    time.sleep(SETTLE)
    victim, survivor = agents
    t_kill = kill_node(trial, victim)
    if setup == "torchrun":
        if not trial.wait_exit([survivor], EXIT_BOUND):
            raise TrialFailed(f"torchrun's survivor did not exit\n{trial.describe()}")
        assert survivor.t_exit is not None  # wait_exit polled it gone
        return {"down": survivor.t_exit - t_kill, "rc": float(survivor.popen.returncode)}
    ready = _ready(trial, [survivor], 1, "node 2's WORLD_SIZE=1 replacement ready", after=t_kill, ws=1)
    start = _by_rank(_of(trial.events(), "start", after=t_kill, ws=1))
    return {"ready": min(ready.values()) - t_kill, "start": min(start.values()) - t_kill}


def _listens(port: int) -> bool | None:
    import socket

    with socket.socket() as s:
        s.settimeout(0.2)
        return True if s.connect_ex(("127.0.0.1", port)) == 0 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.host_loss", description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", type=Path, help="write the Markdown table here too")
    p.add_argument("--setups", default=",".join(SETUPS), help=f"a subset of {','.join(SETUPS)}")
    p.add_argument("--keep", action="store_true", help="keep the trials' folders (logs, events)")
    args = p.parse_args(argv)
    setups = args.setups.split(",")
    if args.repeat < 1 or not set(setups) <= set(SETUPS):
        p.error(f"--repeat must be >= 1 and --setups a subset of {','.join(SETUPS)}")
    results: dict[str, list[dict[str, float]]] = {s: [] for s in SETUPS}
    failed: list[str] = []
    root = tempfile.mkdtemp(prefix="bench-host-loss-")
    try:
        if args.keep:
            print(f"trials kept in {root}", file=sys.stderr)
        for rep in range(args.repeat):
            for setup in setups:
                with Trial(Path(root) / f"{setup}-{rep}") as trial:
                    try:
                        results[setup].append(host_kill(trial, setup))
                    except TrialFailed as exc:
                        failed.append(f"{setup} #{rep}: {str(exc).splitlines()[0]}")
                got = results[setup][-1] if results[setup] else "failed"
                print(f"{setup} #{rep}: {got}", file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    text = report(results, failed, args.repeat)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0 if not failed else 1


def _med(rows: list[dict[str, float]], key: str) -> str:
    vals = [r[key] for r in rows if key in r]
    if not vals:
        return "n/a"
    return f"{statistics.median(vals):.2f} s (min {min(vals):.2f}, max {max(vals):.2f})"


def report(results: dict[str, list[dict[str, float]]], failed: list[str], repeat: int) -> str:
    server = [r["ready"] for r in results["ours-server"]]
    hosted = [r["ready"] for r in results["ours-hosted"]]
    gap = statistics.median(hosted) - statistics.median(server) if server and hosted else float("nan")
    lines = [
        "# The node hosting the rendezvous SIGKILLed (issue 45)",
        "",
        f"`python -m bench.host_loss --repeat {repeat}`: see `bench/host_loss.py` for the commands. "
        "Medians of the trials, interleaved in one run on this machine (CPU only).",
        "",
        "| setup | what the survivor does | time from the SIGKILL |",
        "|---|---|---|",
        f"| torchrun 2.13, node 1 hosts (`is_host=true`) | exits (rc {_rcs(results['torchrun'])}) | "
        f"{_med(results['torchrun'], 'down')} to its exit |",
        f"| ours, node 1 hosts, node 2 its standby | takes over, trains on at world 1 | "
        f"{_med(results['ours-hosted'], 'ready')} to its replacement ready "
        f"(running: {_med(results['ours-hosted'], 'start')}) |",
        f"| ours, a separate `rdzv-server` | trains on at world 1 | "
        f"{_med(results['ours-server'], 'ready')} to its replacement ready "
        f"(running: {_med(results['ours-server'], 'start')}) |",
        "",
        f"The take-over costs {gap:+.2f} s of median against a separate server (target: within 1 s).",
        "",
    ]
    if failed:
        lines += ["Failed trials:", "", *[f"- {f}" for f in failed], ""]
    return "\n".join(lines)


def _rcs(rows: list[dict[str, float]]) -> str:
    return ", ".join(sorted({str(int(r["rc"])) for r in rows})) or "n/a"


if __name__ == "__main__":
    sys.exit(main())
