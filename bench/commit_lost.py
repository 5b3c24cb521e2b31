"""Case 9: the steps a planned change loses, with and without the commit check, and torchrun.

One deterministic gloo training script for every launcher and variant,
``tests/integration/workers/train_commit.py``: a tiny model and Adam, a step every 50 ms, a
``torch.distributed.checkpoint`` checkpoint every 50 steps, 120 steps; with ``--commit`` it
adds the three lines ``if worker.should_stop(): save(); return``. Under torchrun
``node_agent.worker`` is a no-op and ``should_stop()`` is always False, so torchrun runs the
script as it is (its column is the same whether or not the flag is given: the "without" run).

Each worker appends a line per step (its pid, world size, the step, a time stamp) and one at
every load and save. "Steps lost" is what node 1 does twice: the last step of the attempt
running when the change came less the step the next attempt loaded. A change:

- scale-up 1 → 2: node 1 (``--nnodes 1:2``) trains alone; once it has done step 60, node 2's
  launcher starts. While node 1 is alone its steps after step 30 take 0.2 s, the same for every
  launcher: node 2 then joins well before step 100 however slow the machine (torchrun's agent
  imports torch first), and by the join node 1's step times are those 0.2 s ones, so the commit
  step is about one second ahead (the server's lead) as in a job of steady steps. Timed: node
  2's launch → the first step of the round of two done on both nodes.
- drain: both nodes train from step 1; at node 1's step 60, SIGTERM to node 2's launcher
  process (only it: its workers get what the launcher gives them). Timed: SIGTERM → node 1's
  first step in its next attempt.

Ours runs against an ``rdzv-server`` started before the trial; torchrun hosts its c10d store
on node 1 (``is_host=true``) with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (its scale-up
fails without it, see case 4). In the drain torchrun gets the keep-alive of case 5
(``keep_alive_interval=1,keep_alive_max_attempt=2``): with its defaults node 1 waits 15 s for
the drained node to expire before it trains again. Not in the scale-up: there, with that
tuning, node 2's torchrun formed a round of its own beside node 1's in 3 trials of 3 (two
worlds of one, on one checkpoint directory). torchrun needs ``--max-restarts`` for the drain
(node 1's worker fails in its next collective), so every launcher gets ``--max-restarts 3``.
With the check, a trial of ours where no worker stopped at a commit step (a hard restart
instead) counts as failed.
"""

from __future__ import annotations

import os
import signal
import time

from tests.integration.workers.train_commit_log import Attempt, attempts, last_step

from .launch_cases import c10d, exe, start_server
from .procs import ROOT, Launched, Trial, TrialFailed, free_port

SCRIPT = ROOT / "tests" / "integration" / "workers" / "train_commit.py"
EVERY = 50
STEPS = 120
CHANGE_AT = 60  # node 1's step when the change comes
STEP_SECONDS = 0.05
SLOW_FROM, SLOW_SECONDS = 30, 0.2  # node 1's steps after SLOW_FROM while it is alone (scale-up)
FIRST_STEPS_BOUND = 90.0  # launchers import torch, workers too, on 2 busy cores
JOB_BOUND = 120.0


def _lost(runs: list[Attempt], t_change: float) -> float:
    """Node 1's steps done twice: the attempt running at the change, against the next one."""
    mine = [a for a in runs if a.node == "A" and a.first_t is not None]
    before = [a for a in mine if a.first_t is not None and a.first_t <= t_change]
    after = [a for a in mine if a.first_t is not None and a.first_t > t_change]
    if not before or not after:
        raise TrialFailed(f"node 1 has no attempt across the change: {[(a.pid, a.world) for a in mine]}")
    old, new = before[-1], after[0]
    return float(max(0, old.steps[-1] - new.start_from))


def _launch(
    trial: Trial,
    launcher: str,
    node: str,
    port: int,
    *,
    check: bool,
    slow: bool,
    tune_keep_alive: bool = False,
) -> Launched:
    conf = "last_call_timeout=1"
    env = {"NODE_TAG": node, "GLOO_SOCKET_IFNAME": "lo"}
    if launcher == "torchrun":
        conf += f",is_host={'true' if node == 'A' else 'false'}"
        if tune_keep_alive:  # as in case 5, else node 1 waits 15 s for the drained node to expire
            conf += ",keep_alive_interval=1,keep_alive_max_attempt=2"
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    script = [str(SCRIPT), "--ckpt-dir", str(trial.dir / "ckpt"), "--log-dir", str(trial.dir / "steps")]
    script += ["--steps", str(STEPS), "--every", str(EVERY), "--step-seconds", str(STEP_SECONDS)]
    if slow:
        script += ["--slow-from", str(SLOW_FROM), "--slow-seconds", str(SLOW_SECONDS)]
    if check:
        script.append("--commit")
    argv = [exe(launcher), *c10d(port, "1:2"), "--rdzv-conf", conf, "--max-restarts", "3", *script]
    return trial.launch(f"agent{node}", argv, env)


def _port(trial: Trial, launcher: str) -> int:
    if launcher == "torchrun":
        return free_port()
    _, port = start_server(trial)
    return port


def _committed(trial: Trial, launcher: str, check: bool) -> None:
    """With the check under node-agent, the change must have been a commit: say so if not."""
    if check and launcher != "torchrun" and not any(a.stopped for a in attempts(trial.dir / "steps")):
        raise TrialFailed(f"no worker stopped at a commit step (a hard restart instead)\n{trial.describe()}")


def _finish(trial: Trial, procs: list[Launched], what: str) -> None:
    if not trial.wait_exit(procs, JOB_BOUND):
        raise TrialFailed(f"{what}: still running after {JOB_BOUND:g} s\n{trial.describe()}")
    bad = [p.name for p in procs if p.popen.returncode != 0]
    if bad:
        raise TrialFailed(f"{what}: {bad} exited non-zero\n{trial.describe()}")


def scale_up(trial: Trial, launcher: str, *, check: bool) -> dict[str, float]:
    """Node 1 alone; at its step 60 node 2 starts. Steps lost, and node 2's launch → both training."""
    port = _port(trial, launcher)
    a = _launch(trial, launcher, "A", port, check=check, slow=True)
    trial.until(
        f"node 1 at step {CHANGE_AT}",
        lambda: True if last_step(trial.dir / "steps", "A", 1) >= CHANGE_AT else None,
        FIRST_STEPS_BOUND,
    )
    b = _launch(trial, launcher, "B", port, check=check, slow=True)

    def both() -> float | None:
        firsts = [x.first_t for x in attempts(trial.dir / "steps") if x.world == 2 and x.first_t]
        nodes = {x.node for x in attempts(trial.dir / "steps") if x.world == 2 and x.first_t}
        return max(firsts) if nodes == {"A", "B"} else None

    t_both = trial.until("both nodes training", both, JOB_BOUND)
    _finish(trial, [a, b], "scale-up")
    _committed(trial, launcher, check)
    return {"lost": _lost(attempts(trial.dir / "steps"), b.t_launch), "grow": t_both - b.t_launch}


def drain(trial: Trial, launcher: str, *, check: bool) -> dict[str, float]:
    """Both nodes from step 1; at node 1's step 60, SIGTERM to node 2's launcher process."""
    port = _port(trial, launcher)
    a = _launch(trial, launcher, "A", port, check=check, slow=False, tune_keep_alive=True)
    b = _launch(trial, launcher, "B", port, check=check, slow=False, tune_keep_alive=True)
    trial.until(
        f"both nodes at step {CHANGE_AT}",
        lambda: True if min(last_step(trial.dir / "steps", n, 2) for n in "AB") >= CHANGE_AT else None,
        FIRST_STEPS_BOUND,
    )
    if last_step(trial.dir / "steps", "A", 1):
        raise TrialFailed("node 1 trained alone first: the first round did not hold both nodes")
    t_term = time.time()
    os.kill(b.pid, signal.SIGTERM)

    def resumed() -> float | None:
        later = [
            x for x in attempts(trial.dir / "steps") if x.node == "A" and x.first_t and x.first_t > t_term
        ]
        return later[0].first_t if later else None

    t_resumed = trial.until("node 1 training again", resumed, JOB_BOUND)
    _finish(trial, [a], "drain")
    _committed(trial, launcher, check)
    # Node 2's launcher: ours exits 0 (the job goes on without it); torchrun's reports the signal.
    trial.wait_exit([b], 30.0)
    if launcher != "torchrun" and b.popen.returncode != 0:
        raise TrialFailed(f"the drained node's agent exited {b.popen.returncode}\n{trial.describe()}")
    return {"lost": _lost(attempts(trial.dir / "steps"), t_term), "resume": t_resumed - t_term}
