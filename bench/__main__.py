"""``python -m bench``: run every case for torchrun and node-agent, write docs/benchmarks.md.

    python -m bench                      # everything, 5 repeats (about 20 minutes on 2 quiet cores)
    python -m bench --repeat 1 --cases standalone,nnode
    python -m bench --smoke              # ours only, M=100, 1 repeat, a few fast cases (~20 s)

Trials of the two launchers alternate (torchrun first in even repeats, ours first in odd ones),
so a change in the machine's load during the run hits both alike.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import commit_lost, progress_cost, snapshot_lost, startup
from . import launch_cases as lc
from . import ready_cases as rc
from .procs import ROOT, Trial, TrialFailed, load_average, raise_nofile_limit
from .report import (
    LOAD_HANG,
    LOAD_SUMMARIES,
    Row,
    Target,
    at_most,
    failure_notes,
    markdown_table,
    plot_scale,
    ratio,
    rows_from_json,
    scale_load_table,
    scale_series,
    write_json,
)
from .scale import scale_trial

LAUNCHERS = ("torchrun", "ours")


@dataclass
class Metric:
    key: str  # the key in the trial's result dict
    label: str
    unit: str = "s"
    target: Target | None = None
    ours_only: bool = False  # measured in every trial, shown for ours alone (a floor, say)


@dataclass
class Variant:
    """One command (per launcher) whose trials give one or more metrics."""

    case: str
    name: str
    run: Callable[[Trial, str], dict[str, float]]
    metrics: list[Metric]
    launchers: tuple[str, ...] = LAUNCHERS
    smoke: bool = False
    compare_with: str | None = None  # take torchrun's column from this variant (same command for torchrun)


def variants(scale_ms: list[int], smoke: bool = False) -> dict[str, list[Variant]]:
    c1, c2, c3, c4, c5, c6 = (
        "1. standalone launch",
        "2. N-node rendezvous",
        "3. restart after a worker failure",
        "4. scale-up 1 → 2 nodes",
        "5. node SIGKILL",
        "6. agent footprint",
    )
    out: dict[str, list[Variant]] = {
        "standalone": [
            Variant(
                c1,
                "noimport",
                functools.partial(lc.standalone, script="noimport.py"),
                [
                    Metric(
                        "start", "no-import worker, nproc 2: launch → all workers started", target=ratio(0.1)
                    ),
                    Metric("wall", "no-import worker: launch → launcher exited"),
                ],
                smoke=True,
            ),
            Variant(
                c1,
                "floor",
                lc.python_floor,
                [
                    Metric(
                        "start",
                        "floor: python imports asyncio, starts 2 no-import workers (no agent): "
                        "launch → both started",
                    )
                ],
                launchers=("ours",),
                compare_with="noimport",
                smoke=True,
            ),
            Variant(
                c1,
                "gloo",
                functools.partial(lc.standalone, script="gloo_once.py"),
                [
                    Metric("start", "gloo worker, nproc 2: launch → all workers started", target=ratio(0.1)),
                    Metric("ready", "gloo worker: launch → all did init_process_group + all_reduce"),
                    # No target on "ready": most of it is the worker's own import torch, the
                    # same under either launcher (the next two rows show it).
                    Metric("import", "gloo worker's own import torch (slowest rank)"),
                    Metric("own", "gloo worker's own start → ready: import, init, all_reduce (slowest rank)"),
                    Metric("wall", "gloo worker: launch → launcher exited"),
                ],
            ),
        ],
        "nnode": [],
        "restart": [],
        "scaleup": [
            Variant(
                c4,
                "scaleup",
                lc.scale_up,
                [
                    Metric(
                        "grow",
                        "agent 2 launched → WORLD_SIZE=2 workers on both nodes",
                        target=at_most(2.0, "<= 1 s + 1 s settle"),
                    ),
                    Metric("alone", "agent 1 launched alone (1:2, last_call 1 s) → its worker runs"),
                ],
            )
        ],
        "nodekill": [
            Variant(
                c5,
                "nodekill",
                lc.node_kill,
                [
                    Metric(
                        "start",
                        "SIGKILL of node 2 → WORLD_SIZE=1 worker running on node 1",
                        target=at_most(1.0, "<= 1 s"),
                    ),
                    Metric("ready", "SIGKILL → that worker did init_process_group (after its import torch)"),
                    Metric("collective_error", "SIGKILL → node 1's old worker saw its collective fail"),
                ],
            )
        ],
        "footprint": [
            Variant(
                c6,
                "footprint",
                lc.footprint,
                [
                    Metric("rss", "agent RSS, supervising 2 idle workers", "MB", ratio(0.2)),
                    Metric("pss", "agent PSS", "MB"),
                    Metric("uss", "agent USS", "MB"),
                    Metric("rss_with_helpers", "agent + its helper processes (watchdog), RSS", "MB"),
                    Metric("cpu_idle", "agent CPU time per 10 s of idle supervision", "s CPU"),
                    Metric("cpu_startup", "agent CPU time from launch to steady state", "s CPU"),
                ],
            )
        ],
        "scale": [],
        "progress": [
            Variant(
                "8. watching the training (ours only)",
                "progress",
                progress_cost.measure,
                [
                    Metric(
                        "progress_attached_ns",
                        "worker.progress(step), attached",
                        "ns",
                        at_most(1000, "< 1 µs"),
                    ),
                    Metric("progress_noop_ns", "worker.progress(step), outside node-agent", "ns"),
                    Metric("phase_attached_ns", 'with worker.phase("compute"): enter + exit', "ns"),
                    Metric(
                        "import_ms", "import node_agent.worker, fresh interpreter", "ms", at_most(5, "< 5 ms")
                    ),
                    Metric("agent_read_ns", "agent: one page read (8 pages per poll)", "ns"),
                    Metric("agent_poll_pct", "agent: reading 8 ranks every 50 ms", "%"),
                ],
                launchers=("ours",),
                smoke=True,
            ),
            Variant(
                "8. watching the training (ours only)",
                "hang",
                lc.hang,
                [
                    Metric(
                        "report",
                        f"a rank hangs → its node's hang report written (--hang-timeout {lc.HANG_BUDGET:g}; "
                        "torchrun never notices: gloo waits 30 min, NCCL 10 min)",
                    ),
                    Metric("report_over_budget", "the same, beyond the hang budget"),
                    Metric("all", "a rank hangs → every rank's replacement running"),
                ],
                launchers=("ours",),
            ),
        ],
        "commit": [],
        "ready": [],
        "startup": [startup_variant(smoke)],
        "snapshots": snapshot_variants(),
    }
    # Case 9: each change twice, the script without the check (torchrun runs it as it is: its
    # should_stop() is always False) and with it (ours only, compared with torchrun's run).
    c9 = f"9. planned changes: steps lost (checkpoint every {commit_lost.EVERY} steps)"
    changes = (
        (
            "commit-up",
            "scale-up 1 → 2",
            commit_lost.scale_up,
            "grow",
            "node 2 launched → both nodes training",
        ),
        (
            "commit-drain",
            "drain (SIGTERM to node 2's launcher)",
            commit_lost.drain,
            "resume",
            "SIGTERM → node 1 training again",
        ),
    )
    for name, change, run, key, timed in changes:
        for check in (False, True):
            how = "with the check (`worker.should_stop()`)" if check else "without the check"
            out["commit"].append(
                Variant(
                    c9,
                    name if check else f"{name}-plain",
                    functools.partial(run, check=check),
                    [
                        Metric("lost", f"{change}, {how}: steps run again", "steps"),
                        Metric(key, f"{change}, {how}: {timed}"),
                    ],
                    launchers=("ours",) if check else LAUNCHERS,
                    compare_with=f"{name}-plain" if check else None,
                )
            )
    for n in (2, 4, 8):
        out["nnode"].append(
            Variant(
                c2,
                f"n{n}",
                functools.partial(lc.nnode, n=n),
                [
                    Metric(
                        "start",
                        f"N={n}, agents host the rendezvous: last agent launched → all workers started",
                        target=ratio(0.1),
                    ),
                    Metric("from_first", f"N={n}: first agent launched → all workers started"),
                ],
                smoke=n == 2,
            )
        )
    for n in (2, 4, 8):
        out["nnode"].append(
            Variant(
                c2,
                f"n{n}-server",
                functools.partial(lc.nnode, n=n, server=True),
                [
                    Metric(
                        "start",
                        f"N={n}, rdzv-server started first: last agent launched → all workers started",
                        target=ratio(0.1),
                    )
                ],
                launchers=("ours",),
                compare_with=f"n{n}",
            )
        )
    for nodes, frac in ((1, 0.2), (2, 0.05)):
        out["restart"].append(
            Variant(
                c3,
                f"restart{nodes}",
                functools.partial(lc.restart, nodes=nodes),
                [
                    Metric(
                        "all",
                        f"{nodes} node(s), rank 0 exits 1: failure → every rank's replacement running",
                        target=ratio(frac),
                    ),
                    Metric("first", f"{nodes} node(s): failure → first replacement running"),
                ],
                smoke=nodes == 1,
            )
        )
        if nodes == 1:
            out["restart"].append(
                Variant(
                    c3,
                    "restart-floor",
                    lc.restart_floor,
                    [
                        Metric(
                            "all",
                            "floor: a python parent reaps rank 0, stops rank 1, starts both again "
                            "(no agent): failure → both running",
                        )
                    ],
                    launchers=("ours",),
                    compare_with="restart1",
                    smoke=True,
                )
            )
    for m in scale_ms:
        big = m >= 10_000
        out["scale"].append(
            Variant(
                f"7. scale: {m:,} simulated agents (ours only)",
                f"m{m}",
                lambda t, _l, m=m: scale_trial(t, m),
                [
                    Metric(
                        "storm",
                        "cold join storm (--nnodes M:M): go → all hold their rank",
                        target=at_most(3.0, "< 3 s") if big else None,
                    ),
                    Metric("storm_connected", "storm: go → every socket connected (client side)"),
                    Metric("storm_cpu", "server CPU time during the storm", "s CPU"),
                    Metric("storm_clients_cpu", "the simulated agents' CPU time during the storm", "s CPU"),
                    Metric("storm_elastic", "join storm into an elastic job (1:M, forms at M)"),
                    Metric(
                        "rerdzv",
                        "1 % close their sockets → all survivors hold the next round",
                        target=at_most(0.5, "< 0.5 s") if big else None,
                    ),
                    Metric("rerdzv_cpu", "server CPU time during that re-rendezvous", "s CPU"),
                    Metric(
                        "send_floor",
                        "floor: plain socket.send of one Restart-sized frame to each of M sockets "
                        "(the re-rendezvous needs two such rounds, and M reads)",
                    ),
                    Metric(
                        "rss",
                        "server RSS with M agents joined",
                        "MB",
                        at_most(150, "< 150 MB") if big else None,
                    ),
                    Metric(
                        "hb_cpu_pct",
                        "server CPU, all M heartbeating at 1 Hz (5 s window)",
                        "%",
                        at_most(20, "< 20 % of a core") if big else None,
                    ),
                    Metric("hb_per_s", "heartbeats per second received during that window", "msg/s"),
                    Metric(
                        "sum_cpu_pct",
                        f"{LOAD_SUMMARIES}: server CPU, every node sending one 8-rank Progress a second "
                        "(its heartbeats replaced by them, as a real agent's), a straggler among them "
                        "(5 s window)",
                        "%",
                        at_most(20, "< 20 % of a core") if big else None,
                    ),
                    Metric(
                        "rss_sum",
                        f"{LOAD_SUMMARIES}: server RSS",
                        "MB",
                        at_most(150, "< 150 MB") if big else None,
                    ),
                    Metric("sum_per_s", "summaries per second received during that window", "msg/s"),
                    Metric(
                        "sum_hb_per_s",
                        "heartbeats per second in that window (a tick after a summary sends none)",
                        "msg/s",
                    ),
                    Metric("sum_bytes", "bytes per summary frame", "B"),
                    Metric(
                        "hang_verdict",
                        f"{LOAD_HANG}: every rank stops; first HangDetected → every node has the verdict "
                        "(Restart with the job's hang report)",
                    ),
                    Metric("hang_rejoined", "hang: first HangDetected → every node holds the next round"),
                    Metric(
                        "hang_cpu",
                        "hang: server CPU time from the hang to the next round (HangDetected, Stacks and "
                        "failures of every node, the verdict, M Joins)",
                        "s CPU",
                    ),
                    Metric("hang_stacks", "hang: Stacks messages the nodes sent", "msgs"),
                    Metric("hang_stacks_mb", "hang: their size in all", "MB"),
                    Metric("rss_hang_peak", "hang: server peak RSS (VmHWM) once it is over", "MB"),
                    Metric(
                        "hang_culprit_named",
                        "hang: the job-wide report names the culprit rank (1 yes, 0 no: it keeps 64 "
                        "nodes' stacks, favouring those unlike the kept ones)",
                        "yes=1",
                    ),
                ],
                launchers=("ours",),
                smoke=m == min(scale_ms),
            )
        )
    # Case 10: each scenario under torchrun and ours, then ours with --preload torch (compared
    # with the same torchrun figures, as case 9's checks are).
    c10 = "10. ready to train: every rank did init_process_group + a first all_reduce"
    ready_rows: tuple[
        tuple[str, Callable[..., dict[str, float]], list[tuple[str, str, float | None]]], ...
    ] = (
        (
            "ready-restart1",
            rc.restart_standalone,
            [
                ("ready", "1 node x 2 ranks, rank 0 exits 1: failure → every replacement ready", 0.1),
                ("start", "1 node x 2 ranks: failure → every replacement running", None),
            ],
        ),
        (
            "ready-restart2",
            rc.restart_nodes,
            [
                ("ready", "2 nodes x 1 rank, rank 0 exits 1: failure → every replacement ready", 0.1),
                ("start", "2 nodes x 1 rank: failure → every replacement running", None),
            ],
        ),
        *(
            (
                f"ready-n{n}",
                functools.partial(rc.nnode, n=n),
                [("launch", f"N={n} x 1 rank: last launcher started → every rank ready", 1 / 3)],
            )
            for n in (2, 4)
        ),
        (
            "ready-nodekill",
            rc.node_kill,
            [
                ("ready", "SIGKILL of node 2 → node 1's WORLD_SIZE=1 replacement ready", None),
                ("start", "SIGKILL of node 2 → that replacement running", None),
            ],
        ),
    )
    for name, run, metrics in ready_rows:
        for preload in (False, True):
            how = "`--preload torch`: " if preload else ""
            out["ready"].append(
                Variant(
                    c10,
                    f"{name}-preload" if preload else name,
                    functools.partial(run, preload=preload),
                    [
                        # The targets are the issue's, for the warm interpreters.
                        Metric(key, how + label, target=ratio(frac) if preload and frac else None)
                        for key, label, frac in metrics
                    ],
                    launchers=("ours",) if preload else LAUNCHERS,
                    compare_with=name if preload else None,
                )
            )
    out["ready"].append(
        Variant(
            c10,
            "ready-memory",
            rc.warm_memory,
            [
                Metric("rss", "one idle warm interpreter (`--preload torch`), RSS", "MB"),
                Metric("pss", "one idle warm interpreter: PSS", "MB"),
                Metric("uss", "one idle warm interpreter: USS", "MB"),
            ],
            launchers=("ours",),
        )
    )
    return out


def snapshot_variants() -> list[Variant]:
    """Case 12 (bench/snapshot_lost.py): steps lost and time back after a SIGKILL, DCP checkpoints
    (torchrun and ours) against in-memory snapshots (ours); a snapshot's and a restore's cost."""
    c12 = "12. unplanned failures: steps lost and time back (in-memory snapshots)"
    sl = snapshot_lost
    out: list[Variant] = []
    kills = (
        ("worker", sl.worker_kill, "SIGKILL of 1 of 2 ranks (1 node)", "kill → every rank's first step"),
        (
            "node",
            sl.node_kill,
            "SIGKILL of node 2 of 2 (launcher + worker; ours: a spare waits, torchrun: relaunched at once)",
            "kill → first step on both nodes",
        ),
    )
    how = (
        ("dcp", True, 0, f"DCP every {sl.EVERY} steps"),
        ("snap1", False, 1, "snapshots every step"),
        ("snap5", False, 5, "snapshots every 5 steps"),
    )
    for kill, run, what, timed in kills:
        for tag, dcp, snap_every, saved in how:
            name = f"snap-{kill}-{tag}"
            ours_only = tag != "dcp"
            out.append(
                Variant(
                    c12,
                    name,
                    functools.partial(run, dcp=dcp, snap_every=snap_every),
                    [
                        Metric("lost", f"{what} after step {sl.KILL_AT}, {saved}: steps run again", "steps"),
                        Metric("back", f"{what}, {saved}: {timed} of the next attempt"),
                    ],
                    launchers=("ours",) if ours_only else LAUNCHERS,
                    compare_with=f"snap-{kill}-dcp" if ours_only else None,
                )
            )
    t = f"{sl.COST_STEP_T:g} s"
    pct = f"{100 * sl.COST_BUDGET:g} %"
    cost_metrics = []
    for mib, size in ((100, "100 MiB"), (1024, "1 GiB")):
        cost_metrics += [
            Metric(f"save_{mib}", f"`snapshot_torch.save` of {size} (1 rank) into the agent's tmpfs"),
            Metric(f"pct_{mib}", f"{size}: a snapshot every step of {t}, share of the step", "%"),
            Metric(
                f"every_{mib}", f"{size}: the shortest interval keeping it <= {pct} of {t} steps", "steps"
            ),
        ]
    one_s = at_most(1.0, "<= 1 s")
    cost_metrics += [
        Metric("file_mib", "the 1 GiB state's snapshot file", "MiB"),
        Metric("restore_tmpfs", "restore 1 GiB: `torch.load` from the tmpfs snapshot", target=one_s),
        Metric("restore_mmap", "restore 1 GiB: `torch.load(mmap=True)` from the tmpfs (maps, reads nothing)"),
        Metric(
            "restore_mmap_copy",
            "restore 1 GiB: `torch.load(mmap=True)` + `load_state_dict` into the model",
            target=one_s,
        ),
        Metric("restore_disk_cold", "restore 1 GiB: `torch.load` from /var/tmp, page cache dropped"),
        Metric("restore_disk_warm", "restore 1 GiB: `torch.load` from /var/tmp, in the page cache"),
    ]
    out.append(Variant(c12, "snap-cost", sl.cost, cost_metrics, launchers=("ours",)))
    return out


def startup_variant(smoke: bool) -> Variant:
    """Case 11 (bench/startup.py): a standalone launch against no launcher at all."""
    budget = at_most(startup.BUDGET, f"<= {startup.BUDGET:g} s over the floor")
    what = "`--standalone --nproc-per-node 2`, no-import worker"
    return Variant(
        "11. start-up budget: a standalone launch against no launcher (medians of paired runs)",
        "startup",
        functools.partial(startup.measure, reps=3 if smoke else startup.REPS),
        [
            Metric("start", f"{what}: launch → every worker started"),
            Metric("wall", f"{what}: launch → launcher exited"),
            Metric(
                "floor_start",
                "floor: a bare python parent Popens the 2 workers (no agent, no asyncio): "
                "launch → both started",
                ours_only=True,
            ),
            Metric("floor_wall", "floor: launch → exited", ours_only=True),
            Metric("over_floor", "over the floor: launch → every worker started", target=budget),
            Metric("over_floor_wall", "over the floor: launch → exited", target=budget),
            Metric(
                "cpu_over_floor",
                "over the floor: CPU time of the launcher, its helpers and its workers (wait4)",
                "s CPU",
            ),
            Metric("bare", "`python -c pass`: start → exit", ours_only=True),
            Metric(
                "import_ms",
                "the launcher's imports over `python -c pass` (`import node_agent.runner` and the "
                "command's own; torchrun: `from torch.distributed.run import main`)",
                "ms",
            ),
            Metric(
                "imported_ms",
                "`-X importtime` of a launch: every module it imports beyond `python -c pass`'s",
                "ms",
            ),
        ],
        smoke=True,
    )


ALL_CASES = (
    "standalone",
    "nnode",
    "restart",
    "scaleup",
    "nodekill",
    "footprint",
    "scale",
    "progress",
    "commit",
    "ready",
    "startup",
    "snapshots",
)


def run_variant(
    v: Variant, repeat: int, root: Path, launchers: tuple[str, ...], log: Callable[[str], None]
) -> dict[str, dict[str, Any]]:
    """{launcher: {"values": {metric: [..]}, "failures": [..], "leftovers": n}}"""
    res: dict[str, dict[str, Any]] = {
        who: {"values": {m.key: [] for m in v.metrics}, "failures": [], "leftovers": 0}
        for who in v.launchers
        if who in launchers
    }
    order = [w for w in v.launchers if w in launchers]
    for rep in range(repeat):
        for who in order if rep % 2 == 0 else order[::-1]:
            trial = Trial(root / f"{v.name}-{who}-{rep}")
            t0 = time.monotonic()
            try:
                with trial:
                    values = v.run(trial, who)
            except TrialFailed as exc:
                res[who]["failures"].append(str(exc))
                log(f"  {v.name} {who} #{rep}: FAILED: {str(exc).splitlines()[0]}")
                continue
            except Exception as exc:  # a bench bug: keep going, but say so loudly
                res[who]["failures"].append(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                log(f"  {v.name} {who} #{rep}: ERROR {type(exc).__name__}: {exc}")
                continue
            finally:
                res[who]["leftovers"] += len(trial.leftovers)
            for m in v.metrics:
                if m.key in values:
                    res[who]["values"][m.key].append(values[m.key])
            shown = ", ".join(f"{m.key}={values[m.key]:.3f}" for m in v.metrics if m.key in values)
            log(f"  {v.name} {who} #{rep}: {shown} ({time.monotonic() - t0:.1f} s)")
    return res


def compile_sources() -> None:
    """Byte-compile our packages once, as an installed package (and torch's site-packages) is.

    This environment sets PYTHONDONTWRITEBYTECODE=1, so without this step every agent would
    compile some 7,000 lines of source at every start (about 0.1 s) while torchrun reads
    ready .pyc files. ``compileall`` writes the caches whatever that variable says.
    """
    import compileall

    for pkg in ("protocol", "edge", "rdzv_server", "node_agent", "bench"):
        compileall.compile_dir(str(ROOT / pkg), quiet=1)


def machine_info() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 1024 / 1024:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "memory": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "numpy": version("numpy"),
        "uvloop": version("uvloop"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeat", type=int, default=5, help="trials per case and launcher (default 5)")
    p.add_argument(
        "--cases", default=",".join(ALL_CASES), help=f"comma-separated subset of {','.join(ALL_CASES)}"
    )
    p.add_argument(
        "--scale-m", default="100,1000,10000", help="M values for the scale case (default 100,1000,10000)"
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="ours only, M=100, 1 repeat, the fast cases; writes to a temp dir",
    )
    p.add_argument("--no-torchrun", action="store_true", help="measure node-agent only")
    p.add_argument(
        "--out", type=Path, help="the Markdown report (default docs/benchmarks.md; smoke: a temp dir)"
    )
    p.add_argument("--json", type=Path, help="also write every value as JSON here")
    p.add_argument(
        "--plot", type=Path, help="the scale plot (default docs/rendezvous_scale.png; smoke: none)"
    )
    p.add_argument("--no-plot", action="store_true", help="draw no scale plot (needs no matplotlib)")
    p.add_argument("--keep", action="store_true", help="keep the trials' folders (logs, events)")
    p.add_argument("--render", type=Path, metavar="JSON", help="only rewrite the report from a --json file")
    args = p.parse_args(argv)
    if args.render is not None:
        return rerender(
            args.render,
            args.out or ROOT / "docs" / "benchmarks.md",
            args.plot or ROOT / "docs" / "rendezvous_scale.png",
        )

    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(ALL_CASES))
    if unknown:
        p.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(ALL_CASES)}")
    scale_ms = [int(x) for x in args.scale_m.split(",") if x.strip()]
    repeat = args.repeat
    launchers: tuple[str, ...] = LAUNCHERS
    if args.smoke:
        repeat, launchers, scale_ms = 1, ("ours",), [100]
    if args.no_torchrun:
        launchers = ("ours",)
    if repeat < 1:
        p.error("--repeat must be >= 1")
    root = Path(tempfile.mkdtemp(prefix="bench-"))
    trials = root / "trials"
    out_md = args.out or (root / "benchmarks.md" if args.smoke else ROOT / "docs" / "benchmarks.md")
    plot = args.plot if args.plot else (None if args.smoke else ROOT / "docs" / "rendezvous_scale.png")
    if args.no_plot:
        plot = None
    if plot is not None and "scale" in cases:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("the scale plot needs matplotlib: pip install -e '.[bench]' (or pass --smoke)")

    hard = raise_nofile_limit()
    compile_sources()

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    specs = variants(scale_ms, smoke=args.smoke)
    started = time.time()
    load_before = load_average()
    meta: dict[str, Any] = {
        "command": "python -m bench "
        + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "repeat": repeat,
        "launchers": list(launchers),
        "open_file_limit": hard,
        **machine_info(),
        "load_before": load_before,
    }
    log(
        f"bench: cases {','.join(cases)}, repeat {repeat}, launchers {','.join(launchers)}; "
        f"trials in {trials}"
    )
    rows: list[Row] = []
    raw: dict[str, Any] = {}
    medians_by_variant: dict[str, dict[str, list[float]]] = {}
    leftovers = 0
    for case in cases:
        for v in specs[case]:
            if args.smoke and not v.smoke:
                continue
            log(f"{v.case} / {v.name}")
            res = run_variant(v, repeat, trials, launchers, log)
            raw[v.name] = res
            if "torchrun" in res:
                medians_by_variant[v.name] = res["torchrun"]["values"]
            leftovers += sum(r["leftovers"] for r in res.values())
            for m in v.metrics:
                row = Row(v.case, m.label, m.unit, m.target)
                if "ours" in res:
                    row.ours = res["ours"]["values"][m.key]
                    if res["ours"]["failures"]:
                        row.failures["ours"] = res["ours"]["failures"]
                if m.ours_only:
                    row.torchrun = None
                elif "torchrun" in res:
                    row.torchrun = res["torchrun"]["values"][m.key]
                    if res["torchrun"]["failures"]:
                        row.failures["torchrun"] = res["torchrun"]["failures"]
                elif v.compare_with is not None and v.compare_with in medians_by_variant:
                    row.torchrun = medians_by_variant[v.compare_with].get(m.key, [])
                elif "torchrun" not in v.launchers:
                    row.torchrun = None
                if not any((row.ours, row.torchrun, row.failures)):
                    continue
                rows.append(row)
            if case == "scaleup" and "torchrun" in launchers:
                log("  torchrun scale-up with its defaults (TCPStore shared), once, bounded at 80 s")
                trial = Trial(trials / "scaleup-torchrun-default")
                with trial:
                    raw["scaleup_default"] = lc.scale_up_default_failure(trial, bound=80.0)
                leftovers += len(trial.leftovers)
                log(f"  -> {raw['scaleup_default']}")

    meta["load_after"] = load_average()
    meta["duration_s"] = round(time.time() - started, 1)
    meta["leftover_processes"] = leftovers
    plotted = plot is not None and "scale" in cases
    if plotted:
        assert plot is not None
        series: dict[str, dict[int, list[float]]] = {
            "cold join storm (M:M)": {},
            "join storm, elastic job (1:M)": {},
            "re-rendezvous after 1 % drop": {},
        }
        for m in scale_ms:
            ours = raw.get(f"m{m}", {}).get("ours", {}).get("values", {})
            series["cold join storm (M:M)"][m] = ours.get("storm", [])
            series["join storm, elastic job (1:M)"][m] = ours.get("storm_elastic", [])
            series["re-rendezvous after 1 % drop"][m] = ours.get("rerdzv", [])
        plot_scale(
            plot, series, f"rdzv-server on {meta['cpus']} cores, {repeat} trial(s) per M, {meta['date'][:10]}"
        )
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text(render(meta, rows, raw, plot if plotted else None, out_md))
    if args.json:
        write_json(args.json, meta, rows, {"scaleup_default": raw.get("scaleup_default")})
    log(f"bench: wrote {out_md} in {meta['duration_s']} s; leftover processes: {leftovers}")
    if not args.keep:
        shutil.rmtree(trials, ignore_errors=True)
        if not any(root.iterdir()):
            root.rmdir()
    else:
        log(f"bench: trial folders kept in {trials}")
    failed = sum(len(r.failures.get(w, [])) for r in rows for w in r.failures)
    return 1 if leftovers else 0 if not failed or not args.smoke else 1


def write_outputs(
    meta: dict[str, Any], rows: list[Row], raw: dict[str, Any], out_md: Path, plot: Path | None
) -> None:
    series = scale_series(rows)
    if plot is not None and any(series.values()):
        title = f"rdzv-server on {meta['cpus']} cores, {meta['repeat']} trial(s) per M, {meta['date'][:10]}"
        plot_scale(plot, series, title)
    else:
        plot = None
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text(render(meta, rows, raw, plot, out_md))


def rerender(path: Path, out_md: Path, plot: Path | None) -> int:
    """Write the report and plot again from a run's ``--json`` file, without measuring."""
    data = json.loads(path.read_text())
    rows = rows_from_json(data)
    raw = {"scaleup_default": data["scaleup_default"]} if data.get("scaleup_default") else {}
    write_outputs(data["meta"], rows, raw, out_md, plot)
    print(f"bench: wrote {out_md} from {path}", file=sys.stderr)
    return 0


def _git_rev() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def render(
    meta: dict[str, Any], rows: list[Row], raw: dict[str, Any], plot: Path | None, out_md: Path
) -> str:
    la, lb = meta["load_before"], meta["load_after"]
    lines = [
        "# Benchmarks: node-agent / rdzv-server against torchrun",
        "",
        "Generated by `python -m bench` (do not edit by hand; rerun it). "
        f"This run: `{meta['command']}` on {meta['date']}, commit {_git_rev() or '?'}, "
        f"{meta['duration_s']} s.",
        "",
        f"- Machine: {meta['cpus']} CPUs ({meta['cpu_model']}), {meta['memory']}, Linux {meta['kernel']}; "
        f"Python {meta['python']}, torch {meta['torch']}, numpy {meta['numpy']}, uvloop {meta['uvloop']}.",
        f"- Load average (1/5/15 min) before the run: {la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f}; "
        f"after: {lb[0]:.2f} / {lb[1]:.2f} / {lb[2]:.2f}.",
        f"- {meta['repeat']} trial(s) per case and launcher, alternating which launcher goes first. "
        f"Processes left behind after cleanup: {meta['leftover_processes']}.",
        "",
        "## Results",
        "",
        "Cells are min / **median** / max; the ratio and the targets use medians. A ratio of 0.05 reads "
        '"ours takes 1/20 of torchrun\'s time".',
        "",
        markdown_table(rows),
        "",
    ]
    load = scale_load_table(rows)
    if load:
        lines += [load, ""]
    if "scaleup_default" in raw:
        lines += [
            "torchrun scale-up with its defaults (`--nnodes 1:2 --rdzv-conf last_call_timeout=1`, TCPStore "
            f"shared, run once, bounded at 80 s): {raw['scaleup_default']}. The case-4 row above uses "
            "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` for torchrun.",
            "",
        ]
    notes = failure_notes(rows)
    if notes:
        lines += ["Failed trials (first line of each; `--keep` keeps their logs):", "", *notes, ""]
    if plot is not None:
        rel = os.path.relpath(plot, out_md.parent)
        lines += [f"![rendezvous time against M]({rel})", ""]
    lines += [METHOD, ""]
    return "\n".join(lines)


METHOD = """## How it is measured

As in the torchrun baseline (`shared/reference/torchrun-measured.md`), in one run, on the same
worker scripts (`bench/workers/`):

- Each worker's first statement is `T0 = time.time()`; it appends JSON events (`start`, `ready`,
  `fail`, `collective_error`) to one events file, each line a single `O_APPEND` write. The driver
  stamps `time.time()` just before each `Popen` and polls events and exits every 20 ms. Everything
  runs on one host, so all stamps share one clock. "Running" means the worker's `start` event.
- Both launchers are the console scripts of the same venv: `.venv/bin/torchrun` and
  `.venv/bin/node-agent`. All addresses are 127.0.0.1 (`--local-addr 127.0.0.1`,
  `GLOO_SOCKET_IFNAME=lo`).
- Every process is bounded by a timeout. Every process a trial starts carries a random
  `BENCH_TAG` in its environment; cleanup SIGTERMs the process groups it started, SIGKILLs them
  after 5 s, then kills by pid anything in `/proc` still carrying the tag (torchrun's workers run
  in sessions of their own and outlive their agent).

Cases and commands (`L` is `torchrun` or `node-agent`; `C10D` is `--rdzv-backend c10d
--rdzv-endpoint 127.0.0.1:PORT --rdzv-id job --local-addr 127.0.0.1`, PORT a free port):

1. `L --standalone --nproc-per-node 2 noimport.py` and `… gloo_once.py` (import torch,
   `init_process_group("gloo")`, one all_reduce). The floor row is no launcher: `python -c`
   that imports asyncio and starts the two no-import workers with `subprocess`, the least a
   launcher in Python with asyncio costs here. The worker's own rows are its `imported` and
   `ready` events less its `start`, for the slowest rank: no launcher can shorten its import.
   The rest of "own" differs: torchrun's agent hosts the workers' TCPStore
   (`TORCHELASTIC_USE_AGENT_STORE=True`), ours leaves it to rank 0, so a rank that finishes its
   import before rank 0 listens is refused and waits out torch's connect retry (0.1-0.3 s when
   it happens).
2. N copies of `L --nnodes N --nproc-per-node 1 C10D noimport.py`, launched back to back; timed
   from the last launch. Ours is measured two ways: the same command, where the first agent finds
   nothing listening on the loopback endpoint and hosts the rendezvous itself, as torchrun's first
   agent hosts the c10d store (the fair equivalent, and the ratio the target uses); and with an
   `rdzv-server` started before the clock starts (compared with the same torchrun figures).
3. `L --standalone --nproc-per-node 2 --max-restarts 1 fail_once.py`, and twice `L --nnodes 2
   --nproc-per-node 1 C10D --max-restarts 1 fail_once.py`. Rank 0 exits 1 one second after it
   starts (a marker file, not `TORCHELASTIC_RESTART_COUNT`, tells a replacement); timed from its
   `fail` event to the `start` of every rank's replacement. The floor row is no launcher: `python
   -c` that waits for rank 0, SIGTERMs and reaps rank 1 and starts both again with `subprocess`
   (vfork), the least a restart of two Python workers costs here.
4. `L --nnodes 1:2 --nproc-per-node 1 C10D --rdzv-conf last_call_timeout=1 idle.py`: agent 1
   alone; 2 s after its worker runs, agent 2; timed from agent 2's launch to a WORLD_SIZE=2 worker
   on both nodes. `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` is set for both launchers (node-agent
   ignores it); torchrun's default is run once as well.
5. `L --nnodes 1:2 --nproc-per-node 1 C10D --max-restarts 3 --rdzv-conf is_host=true|false,…
   gloo_loop.py` (an all_reduce every 0.5 s). torchrun: `last_call_timeout=1,keep_alive_interval=1,
   keep_alive_max_attempt=2` as in the baseline; ours: `last_call_timeout=1` and its heartbeat
   defaults (1 s, dead after 5 s). Once both workers are ready, 2 s later, agent 2 and its worker
   are SIGKILLed at the same instant (the node is gone); timed to node 1's WORLD_SIZE=1 worker.
6. `L --standalone --nproc-per-node 2 idle.py`; 2 s after both workers run, the agent's RSS, PSS
   and USS (`/proc/PID/status`, `smaps_rollup`) and its CPU time over 10 s (`/proc/PID/stat`).
7. Ours alone: one `rdzv-server --port 0` process and `python -m bench.simagents` processes (1
   for M=100, 2 for 1,000, 4 for 10,000, each connecting from an address of its own, 127.0.0.N:
   the server takes at most half its connections from one address, 9,359 at 20,000 open files):
   light asyncio clients on real loopback sockets, each an 8-rank node: MAGIC + Hello, Join on
   Welcome, then a heartbeat per second (spread over 50 slots). The cold
   storm is a job `min=max=M`; the driver stamps the time and tells every client process to go;
   timed to the last Assignment. Server CPU and RSS come from `/proc` of the server's pid. Then
   5 s of heartbeats (server CPU / wall time). Then what real agents of a training job add
   (`node_agent/machine/training.py`, `watch.py`): each node also sends one `Progress` a second (its
   page poll's period; about 207 bytes: steps advancing every 0.5 s, step-time p50/p90, the
   least recent rank's phase and age, 8 per-rank compute times; node M/2's rank 5 computes 1.6
   times as long, a straggler the server must flag, checked in its log); after 2 s, 5 s of
   server CPU. Then one hang: every rank stops (node M/3's rank 3 in its data loader, the others
   in a collective); each node finds its ranks hung 2 s later plus its poll's phase, sends
   `HangDetected`, collects its stacks (0.3-1.2 s, as py-spy on 8 ranks) and sends `Stacks`
   (py-spy dumps compacted to 2,048 characters a rank: about 16.6 KB a node), then its failure
   (`WorkersFailed`, signal HUNG, with its node report); the server's `CollectStacks` starts a
   node's collection at once, and a node that finds its own hang meanwhile collects again, as
   a real agent does. Timed from the first HangDetected to the last verdict (`Restart`, with the
   job's hang report) and to every node holding the next round; the server's CPU time over the
   phase and its peak RSS after it. Then everyone disconnects and joins an elastic job
   (`min=1, max=M, last_call_timeout=30`, so the first round forms when all M are in: with a
   zero last call the first joiner would form a round alone); then the agents numbered 99 mod 100
   close their sockets, the survivors get Restart, join again, and the time to the last
   Assignment of the next round is the re-rendezvous. The bench raises its open-file limit to
   the hard limit (inherited by the server and the clients). Last, with the agents gone, the
   floor: one process's plain `socket.send` of a Restart-sized frame to each of M loopback
   sockets held and read by as many receiver processes (`bench/send_floor.py`): a
   re-rendezvous costs the server two such rounds of sends (Restart, then the Assignments) and M
   reads (the Joins), and on loopback each send also does the receiver's TCP work.
8. Ours alone (`bench/progress_cost.py`): the cost of `worker.progress()`, `phase()` and
   `should_stop()` in a loop (attached to a real page, and outside node-agent), the agent's page
   reads and watch per poll, and `--hang-timeout 2` against `bench/workers/hang_once.py`: timed
   from the rank's last progress to the node's hang report and to every rank's replacement.
9. `tests/integration/workers/train_commit.py` (Adam on `nn.Linear`, a DCP checkpoint every 50
   steps, 50 ms steps, 120 steps; `--commit` adds the `worker.should_stop()` check; torchrun runs
   the same script, where `should_stop()` is always False). Scale-up: `L --nnodes 1:2 C10D
   --rdzv-conf last_call_timeout=1 --max-restarts 3`, node 2 launched at node 1's step 60 (node
   1's steps after 30 take 0.2 s while it is alone). Drain: both nodes from step 1, SIGTERM to
   node 2's launcher at step 60; torchrun with `keep_alive_interval=1,keep_alive_max_attempt=2`.
   Steps lost = node 1's last step before the change - the step its next attempt loaded; ours
   uses an `rdzv-server`. "Both nodes training" is the first step of the 2-node attempt.
10. `ready_gloo.py`: `start` at its first statement, then import torch, `init_process_group("gloo")`
   and one all_reduce: `ready`, the moment training can go on; every row stops the clock at
   every rank's `ready`. Ours runs twice, as it is and with `--preload torch` (compared with
   the same torchrun figures). Worker failure: `L --standalone --nproc-per-node 2 --max-restarts
   1`, and twice `L --nnodes 2 --nproc-per-node 1 C10D --max-restarts 1`; once every rank is
   ready (with `--preload`, also every local rank's warm interpreter idle: its `warm_boot.py`
   process sleeping in a read of its control socket, `/proc/PID/wchan`) and 0.5 s more, the
   driver creates a file on which rank 0 exits 1; timed from its `fail` event. torchrun gets
   `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` in these two (node-agent ignores it): torch 2.13
   keeps one TCPStore for all rounds and its workers no longer prefix their keys per attempt,
   so a replacement can read the previous attempt's gloo addresses and fail ("Gloo
   connectFullMesh failed ... Connection refused": about half of our torchrun restarts
   did). Node SIGKILL: case 5's two agents and tuning, an all_reduce every 0.1 s; node 2's
   agent and every process under it (workers, warm interpreters, store) SIGKILLed at one
   instant; timed to node 1's WORLD_SIZE=1 replacement's `ready`. N-node launch: N copies of
   `L --nnodes N --nproc-per-node 1 C10D ready_gloo.py` back to back (torchrun's defaults),
   timed from the last launch. Memory: one `node-agent --preload torch --nnodes 2
   --nproc-per-node 2 C10D idle.py` alone, waiting for its peer; once both warm interpreters
   are idle, the RSS, PSS and USS of each (`/proc/PID/status`, `smaps_rollup`), the mean of the
   two (they share torch's pages, so PSS counts half of those to each).

11. Both launchers, `L --standalone --nproc-per-node 2 noimport.py` against the floor: no
   launcher, a bare `python -c` parent that starts the same two workers with `subprocess.Popen`
   and waits (no asyncio: the least any launcher in Python costs). `bench/startup.py`: 15
   pairs per trial (3 in `--smoke`), the order alternating, each process reaped by `wait4` (so
   its exit is exact, not polled, and its CPU time, workers included, comes with it), with the
   workers' `start` stamps in an events file per run. "Over the floor" is the median of the
   paired differences; the budget is 0.03 s. Beside them: `python -c pass`, the launcher's
   imports (`python -c` importing what the command imports before it starts anything, less
   `python -c pass`), and one launch under `python -X importtime` per pair, its modules
   beyond `python -c pass`'s summed (whoever imports them, whenever).
12. `bench/workers/train_snap.py` (case 9's deterministic loop, 50 ms steps, 90 steps; its
   docstring and `bench/snapshot_lost.py`'s say the rest): (a) torchrun and (b) ours with a DCP
   checkpoint every 50 steps, ours with `snapshot_torch.save` (c) every step and (d) every 5
   steps. Every rank waits after step 73 (its checkpoint or snapshot written); the bench then
   SIGKILLs and lets them go. Worker: `L --standalone --nproc-per-node 2 --max-restarts 3`,
   local rank 1's worker killed. Node: `L --nnodes 2 --nproc-per-node 1 C10D --max-restarts 3
   --rdzv-conf last_call_timeout=1` (torchrun: `is_host` and case 5's keep-alive tuning) and a
   third such launcher started once both train, waiting as a spare (torchrun: its redundancy
   list); node 2's launcher group and worker SIGKILLed at one instant, without waiting for its
   step-73 snapshot to reach the peer; ours against an `rdzv-server`. Steps lost = 73 - the
   step the next attempt restored; time back = kill → that attempt's first step done on every
   rank; every attempt's checksums must agree step by step. Cost (ours, one rank,
   `--snapshot-memory 12G`, `bench/workers/snap_cost.py`): medians of 3 `snapshot_torch.save`
   of 100 MiB and 1 GiB of parameters (after 2 not counted: this VM's first touch of a page is
   slow), their share of a 1 s step and the shortest interval
   keeping it under 5 % (CheckFreq's reasoning); 1 GiB read back from the tmpfs (`torch.load`,
   `mmap=True`, `mmap=True` + `load_state_dict`) and from a copy under `/var/tmp` (fsynced,
   dropped with `posix_fadvise(DONTNEED)` before each read, and warm).

- The bench byte-compiles `protocol/`, `edge/`, `rdzv_server/`, `node_agent/` and `bench/` before it
  starts: this environment sets `PYTHONDONTWRITEBYTECODE=1`, and torch's site-packages comes
  compiled from its wheel, so without it every node-agent start would also compile our sources
  (about 0.1 s), a cost an installed package does not have.
- `python -m bench --json FILE` keeps every value; `python -m bench --render FILE` rewrites this
  page and the plot from it without measuring. To see where the server spends its time, attach
  `py-spy record --pid <rdzv-server pid> --format raw -o out.txt` during case 7 (`--keep` keeps
  the trial folders with every process's log).

Limits of the method: the machine has 2 cores; the workers, the launchers and (in case 7) the
simulated agents share them with the server, as they would share a node. numpy is installed in
this venv (matplotlib needs it); the baseline had none, so torch imports it here, which adds a
little to every `import torch`, torchrun's agent included."""


if __name__ == "__main__":
    sys.exit(main())
