"""Case 12: unplanned failures, the steps they lose and the time back to training, with a DCP
checkpoint every 50 steps (torchrun and ours) and with in-memory snapshots (ours); and what a
snapshot and a restore cost.

**Steps lost and time back.** One deterministic gloo script for every variant,
``bench/workers/train_snap.py`` (train_commit.py's loop: ``nn.Linear`` and Adam, a step every
50 ms, 90 steps, one log line per step with a checksum of the state). Four variants:

- (a) torchrun, a ``torch.distributed.checkpoint`` (DCP) checkpoint every K = 50 steps, resumed
  from the newest complete one;
- (b) node-agent, the same script and flags;
- (c) node-agent, no DCP, ``snapshot_torch.save(step, model=, optimizer=)`` every step, and
  ``snapshot_torch.load(...)`` at start;
- (d) the same every 5 steps.

The failure comes after step F = 73, the same for every variant: after step 73 (its checkpoint
and snapshot written, when it has one) every rank waits on a file; once every rank has logged
step 73 the bench SIGKILLs and then creates the file. 73 = 50 + 23: DCP loses 23 steps, about
the (K - 1)/2 = 24.5 a failure at a random step loses on average; snapshots every 5 steps lose
73 - 70 = 3 (on average 2), every step 0. The figures below are what each run did, not these
sums: "steps lost" is 73 less the step the next attempt restored (the same on every rank, or
the trial fails), "time back" is from the SIGKILL to the first step done by the next attempt on
every rank (the slowest rank's). Every trial also checks that all attempts logged the same
checksum at every step (a resume that restored the wrong state fails the trial).

- Worker kill: ``L --standalone --nproc-per-node 2 --max-restarts 3``; SIGKILL to local rank 1's
  worker process.
- Node kill: three launchers ``L --nnodes 2 --nproc-per-node 1 C10D --max-restarts 3
  --rdzv-conf last_call_timeout=1`` (plus ``is_host`` and case 5's keep-alive tuning
  ``keep_alive_interval=1,keep_alive_max_attempt=2`` for torchrun); the third is launched once
  the first two train, so it waits as a spare (the server says "spare"). The bench SIGKILLs the
  process group of node 2's launcher and each of node 2's worker processes (torchrun's run in
  sessions of their own) at one instant; the spare takes node 2's place and the job goes on
  with 2 nodes. Ours runs against an ``rdzv-server`` started first; the spare fetches the lost
  rank's snapshot from the replica the lost node had pushed to its peer. torchrun has no spare
  that works here: a third ``torchrun --nnodes 2`` started beside two training ones (it goes
  on its rendezvous's redundancy list) stopped the training once it was up, and then all three
  restarted their workers about once a second, no attempt getting through
  ``init_process_group``, for the 2 minutes the bench waited (torch 2.13, one trial). So for
  torchrun the bench starts the replacement node's launcher right after the SIGKILL, as a
  scheduler that replaces a lost node at once would: its column includes that launcher's
  start-up (its ``import torch``, about 2-3 s here), which a waiting spare has behind it. The
  bench kills as soon as every rank has done step 73: it does not wait for that step's
  replica, so the node-kill rows include the replication lag (the server names the step to
  copy, the agents push it in the background; a snapshot reaches the peer some hundreds of
  milliseconds after it is written).

torchrun gets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (see case 10: without it a restarted
worker can read the previous attempt's gloo addresses). All processes write to one host's
disk: the DCP checkpoints go to the trial's folder (the page cache, no network file system),
which favours the DCP variants.

**Snapshot cost** (ours alone, ``bench/workers/snap_cost.py`` under ``node-agent --standalone
--nproc-per-node 1 --snapshot-memory 12G``; one rank, so the 1 GiB file fits the per-file bound
of an eighth of a rank's share): the median of 3 ``snapshot_torch.save`` calls of a module whose
parameters hold 100 MiB and 1 GiB, into the agent's tmpfs, after 2 saves not counted (on this
VM a first write into memory the guest never touched was two to four times slower, 1.3-2.6 s
for 1 GiB against 0.7 s, probably the hypervisor backing each page at its first touch; a job snapshotting
every few steps reuses the pages its pruned snapshots freed). The interval follows CheckFreq's
reasoning (Mohan et al., FAST '21): a synchronous snapshot that costs ``c`` every ``N`` steps of
``T`` seconds costs ``c / (N T)`` of the training time, and a failure at a random step loses
about ``N / 2`` steps; so take the smallest ``N`` that keeps ``c / (N T)`` under a budget, 5 %
here. The rows give ``c / T`` (a snapshot every step) and that smallest ``N`` for a step of
T = 1 s, a plausible step of a job whose rank holds 1 GiB of state; with 100 MiB and T = 1 s
the budget allows a snapshot every ``ceil(c / 0.05 s)`` steps. (The 50 ms steps of the
training rows are far shorter than a real job's: there the state is 1.5 KB.)

**Restore**: of the 1 GiB file, the median of 3 reads each: ``torch.load`` from the tmpfs,
``torch.load(mmap=True)`` (maps the file: no bytes are read until used), that plus
``load_state_dict`` into the module (the complete restore, the bytes copied once); and the same
bytes copied to a file under ``/var/tmp`` (the VM's disk), fsynced and dropped from the page
cache before each read with ``posix_fadvise(DONTNEED)`` ("cold"; the hypervisor's cache may
still hold them), and read again without the drop ("warm"). Target: 1 GiB restored in 1 s.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tests.integration.workers.train_commit_log import Attempt, attempts

from .launch_cases import c10d, exe, start_server
from .procs import WORKERS, Launched, Trial, TrialFailed, free_port, wait_for_log

SCRIPT = WORKERS / "train_snap.py"
COST_SCRIPT = WORKERS / "snap_cost.py"
EVERY = 50  # the DCP interval K
STEPS = 90
KILL_AT = 73  # F: 50 + 23
STEP_SECONDS = 0.05
FIRST_STEPS_BOUND = 120.0  # launchers import torch, workers too, on 2 busy cores
JOB_BOUND = 120.0
COST_BOUND = 300.0
COST_MEMORY = "12G"
COST_STEP_T = 1.0  # the step time the cost rows assume
COST_BUDGET = 0.05  # of the training time


def _script(trial: Trial, dcp: bool, snap_every: int) -> list[str]:
    return [
        str(SCRIPT),
        "--ckpt-dir",
        str(trial.dir / "ckpt"),
        "--log-dir",
        str(trial.dir / "steps"),
        "--steps",
        str(STEPS),
        "--every",
        str(EVERY if dcp else 0),
        "--snap-every",
        str(snap_every),
        "--step-seconds",
        str(STEP_SECONDS),
        "--hold-at",
        str(KILL_AT),
        "--hold-file",
        str(trial.dir / "go"),
    ]


def _env(launcher: str, node: str = "A") -> dict[str, str]:
    env = {"NODE_TAG": node, "GLOO_SOCKET_IFNAME": "lo"}
    if launcher == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def _at_step(trial: Trial, step: int, ranks: int) -> list[Attempt] | None:
    """The attempts that did ``step``, once ``ranks`` of them did."""
    done = [a for a in attempts(trial.dir / "steps") if step in a.sums]
    return done if len(done) >= ranks else None


def _check_sums(runs: list[Attempt], trial: Trial) -> None:
    """Every attempt's state after step n is the same: a resume restored the right state."""
    seen: dict[int, str] = {}
    for a in runs:
        for step, h in a.sums.items():
            if seen.setdefault(step, h) != h:
                raise TrialFailed(f"step {step}: checksum {h} != {seen[step]} ({a})\n{trial.describe()}")


def _measure(trial: Trial, t_kill: float, world: int) -> dict[str, float]:
    """Wait for the next attempt's first step on every rank: steps lost and time back."""

    def resumed() -> list[Attempt] | None:
        # After the kill no old process does a step (the survivors' next collective fails), so
        # every step line after it is the next attempt's.
        new = [a for a in attempts(trial.dir / "steps") if a.first_t is not None and a.first_t > t_kill]
        new.sort(key=lambda a: a.first_t or 0.0)
        return new[:world] if len(new) >= world else None

    new = trial.until("every rank training again", resumed, JOB_BOUND)
    starts = {a.start_from for a in new}
    if len(starts) != 1:
        raise TrialFailed(
            f"the ranks resumed from different steps {sorted(starts)}: {new}\n{trial.describe()}"
        )
    back = max(a.first_t or 0.0 for a in new) - t_kill
    return {"lost": float(KILL_AT - starts.pop()), "back": back}


def _finish(trial: Trial, procs: list[Launched], what: str) -> None:
    if not trial.wait_exit(procs, JOB_BOUND):
        raise TrialFailed(f"{what}: still running after {JOB_BOUND:g} s\n{trial.describe()}")
    bad = [(p.name, p.popen.returncode) for p in procs if p.popen.returncode != 0]
    if bad:
        raise TrialFailed(f"{what}: {bad} exited non-zero\n{trial.describe()}")
    runs = attempts(trial.dir / "steps")
    _check_sums(runs, trial)
    if not any(a.done for a in runs):
        raise TrialFailed(f"{what}: no worker finished the {STEPS} steps\n{trial.describe()}")


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def worker_kill(trial: Trial, launcher: str, *, dcp: bool, snap_every: int) -> dict[str, float]:
    """One node, 2 ranks; SIGKILL of local rank 1's worker after step 73."""
    argv = [exe(launcher), "--standalone", "--nproc-per-node", "2", "--max-restarts", "3"]
    agent = trial.launch("agent", [*argv, *_script(trial, dcp, snap_every)], _env(launcher))
    held = trial.until(
        f"both ranks at step {KILL_AT}", lambda: _at_step(trial, KILL_AT, 2), FIRST_STEPS_BOUND
    )
    victim = _rank1_pid(trial, held)
    t_kill = time.time()
    _kill([victim])
    (trial.dir / "go").touch()
    out = _measure(trial, t_kill, 2)
    _finish(trial, [agent], "worker kill")
    return out


def _rank1_pid(trial: Trial, held: list[Attempt]) -> int:
    """The pid of local rank 1's worker (its log file is ``A-1.log``)."""
    text = (trial.dir / "steps" / "A-1.log").read_text()
    pids = {a.pid for a in held}
    for m in re.finditer(r"^start pid=(\d+)", text, re.M):
        if int(m[1]) in pids:
            return int(m[1])
    raise TrialFailed(f"no pid for local rank 1 among {held}")


def node_launcher(
    trial: Trial, launcher: str, nnodes: str, script: list[str], flags: tuple[str, ...] = ()
) -> Callable[[str], Launched]:
    """Launch node A, B or C of a c10d job (torchrun: node A hosts, case 5's keep-alive tuning;
    ours: against an ``rdzv-server`` started now); ``flags`` go after the launcher's own."""
    if launcher == "torchrun":
        port = free_port()
    else:
        _, port = start_server(trial)

    def launch(node: str) -> Launched:
        c = "last_call_timeout=1"
        if launcher == "torchrun":
            host = "true" if node == "A" else "false"
            c += f",is_host={host},keep_alive_interval=1,keep_alive_max_attempt=2"
        argv = [exe(launcher), *c10d(port, nnodes), "--rdzv-conf", c, "--max-restarts", "3", *flags]
        return trial.launch(f"agent{node}", [*argv, *script], _env(launcher, node))

    return launch


def kill_node_b(trial: Trial, b: Launched, held: list[Attempt]) -> float:
    """SIGKILL node B's launcher and its workers (``held``: the attempts at the kill step) at
    one instant; returns when."""
    victims = [x.pid for x in held if x.node == "B"]
    if not victims:
        raise TrialFailed(f"node 2 ran no rank at step {KILL_AT}: {held}")
    t_kill = time.time()
    trial.kill(b, signal.SIGKILL)
    _kill(victims)
    return t_kill


def node_kill(trial: Trial, launcher: str, *, dcp: bool, snap_every: int) -> dict[str, float]:
    """Two nodes of one rank and a spare; SIGKILL of node 2 (launcher and worker) after step 73."""
    launch = node_launcher(trial, launcher, "2", _script(trial, dcp, snap_every))
    a, b = launch("A"), launch("B")
    trial.until("both nodes training", lambda: _at_step(trial, 1, 2), FIRST_STEPS_BOUND)
    spare = None
    if launcher != "torchrun":  # torchrun: see the module's docstring (a spare makes it loop)
        spare = launch("C")
        wait_for_log(spare, r"spare", 60)
    held = trial.until(
        f"both nodes at step {KILL_AT}", lambda: _at_step(trial, KILL_AT, 2), FIRST_STEPS_BOUND
    )
    t_kill = kill_node_b(trial, b, held)
    if spare is None:
        spare = launch("C")  # the replacement node, as a scheduler would start it (at once)
    (trial.dir / "go").touch()
    out = _measure(trial, t_kill, 2)
    if {x.node for x in attempts(trial.dir / "steps") if x.first_t and x.first_t > t_kill} != {"A", "C"}:
        raise TrialFailed(f"the spare did not take node 2's place\n{trial.describe()}")
    _finish(trial, [a, spare], "node kill")
    return out


def cost(trial: Trial, launcher: str) -> dict[str, float]:
    """Ours alone: snapshot_torch.save of 100 MiB and 1 GiB, and restores of 1 GiB."""
    if launcher != "ours":
        raise TrialFailed("the cost rows are node-agent's alone")
    out_file = trial.dir / "cost.json"
    disk = Path(tempfile.mkdtemp(prefix="bench-snap-", dir="/var/tmp"))
    try:
        argv = [exe("ours"), "--standalone", "--nproc-per-node", "1", "--snapshot-memory", COST_MEMORY]
        env = {"SNAP_COST_OUT": str(out_file), "SNAP_COST_DISK": str(disk)}
        p = trial.launch("agent", [*argv, str(COST_SCRIPT)], env)
        if not trial.wait_exit([p], COST_BOUND) or p.popen.returncode != 0:
            raise TrialFailed(f"snap_cost.py did not finish (rc {p.popen.returncode})\n{trial.describe()}")
    finally:
        for f in disk.glob("*"):
            f.unlink()
        disk.rmdir()
    res: dict[str, float] = json.loads(out_file.read_text())
    for mib in (100, 1024):
        c = res[f"save_{mib}"]
        res[f"pct_{mib}"] = 100 * c / COST_STEP_T
        res[f"every_{mib}"] = float(max(1, math.ceil(c / (COST_BUDGET * COST_STEP_T))))
    return res
