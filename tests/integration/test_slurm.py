"""The shipped deploy/slurm/train.sbatch on a real Slurm (slurm.py): two nodes, one cluster.

Each job runs a copy of the batch file changed only where this CPU-only cluster of two 2-core
nodes needs it (no GPUs, one CPU per task, a shorter time limit) and, for torchrun, with
``node-agent`` replaced by ``torchrun``. Options reach it as a user's would: TRAIN_SCRIPT,
NPROC_PER_NODE, RDZV_PORT, NNODES, MAX_RESTARTS in the job's environment. The training is
workers/slurm_train.py: real gloo all_reduces, one JSON-lines file of events per worker process.

Slurm signals every process of a step here (proctrack/linuxproc, as proctrack/cgroup on real
clusters): ``scancel`` and ``scancel --signal=USR1`` reach the agents, their helpers and the
workers at once. What each scenario gives (JobState, ExitCode) is what deploy/slurm/README.md
tells users.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .procs import ROOT, WORKERS
from .slurm import FINISHED, SlurmCluster, SlurmSetupError, slurm_cluster

SBATCH = ROOT / "deploy" / "slurm" / "train.sbatch"
WORKER = WORKERS / "slurm_train.py"
LAUNCHERS = ("node-agent", "torchrun")
# This cluster has no GPUs, 2 CPUs a node, and jobs of seconds.
CLUSTER_EDITS = (
    ("#SBATCH --gpus-per-node=8\n", ""),
    ("#SBATCH --cpus-per-task=32\n", "#SBATCH --cpus-per-task=1\n"),
    ("#SBATCH --time=04:00:00\n", "#SBATCH --time=00:10:00\n"),
)
# The job's processes on a node: launcher, its helpers, workers, slurmstepd.
JOB_PROCS = r"slurm_train\.py|node-agent|node_agent|torchrun|torch\.distributed|slurmstepd"
CAUSE = "RuntimeError: planned failure of rank 1 at step 2"
SIGKILL_STATUS = 9  # a wait status: killed by signal 9
EXIT_1_STATUS = 256  # a wait status: exit code 1

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(150)]
_ports = itertools.count(29500)


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    yield from slurm_cluster()


@dataclass
class Job:
    cluster: SlurmCluster
    id: int
    dir: Path  # the workers' event files
    launcher: str

    def events(self, name: str | None = None, **match: object) -> list[dict[str, Any]]:
        """The workers' events (each with "proc": ``<host>-<pid>``), those named ``name``."""
        found = []
        for path in sorted(self.dir.glob("*.jsonl")):
            for line in path.read_text().splitlines():
                if line.strip():
                    found.append({"proc": path.stem, **json.loads(line)})
        return [
            e
            for e in found
            if (name is None or e["event"] == name) and all(e.get(k) == v for k, v in match.items())
        ]

    def wait_events(self, name: str, count: int, timeout: float = 60.0, **match: object) -> None:
        """Until ``count`` events ``name`` (matching ``match``); fails at once if the job ends."""
        deadline = time.monotonic() + timeout
        while len(self.events(name, **match)) < count:
            state = self.cluster.job_info(self.id).get("JobState")
            if time.monotonic() > deadline or state in FINISHED:
                why = f"the job is {state}" if state in FINISHED else f"{timeout:g} s passed"
                raise AssertionError(
                    f"job {self.id}: fewer than {count} {name!r} events {match} ({why})\n{self.explain()}"
                )
            time.sleep(0.1)

    def stop(self) -> None:
        """Let the training end (TRAIN_UNTIL_STOP)."""
        (self.dir / "stop").write_text("")

    def output(self) -> str:
        return self.cluster.output(self.id)

    def done(self, timeout: float = 60.0) -> dict[str, str]:
        return self.cluster.wait_done(self.id, timeout)

    def state(self) -> tuple[str, str]:
        info = self.cluster.job_info(self.id)
        return info["JobState"], info["ExitCode"]

    def explain(self) -> str:
        info = self.cluster.job_info(self.id)
        facts = {k: info.get(k) for k in ("JobState", "ExitCode", "Reason", "Restarts", "NodeList")}
        return (
            f"job {self.id} ({self.launcher}): {facts}\ntask exits: {self.cluster.task_exits(self.id)}\n"
            f"events: {self.events()}\n--- output:\n{self.output()}"
        )


@pytest.fixture
def jobs(cluster: SlurmCluster) -> Iterator[list[Job]]:
    """The test's jobs; any still running at the end is cancelled, so the next test has the nodes."""
    started: list[Job] = []
    yield started
    for job in started:
        try:
            if job.cluster.job_info(job.id).get("JobState") not in FINISHED:
                job.cluster.scancel(job.id)
                job.cluster.wait_done(job.id, timeout=30)
        except (AssertionError, SlurmSetupError):
            pass


def batch_file(folder: Path, launcher: str) -> Path:
    """The shipped file, edited for this cluster (and for torchrun)."""
    text = SBATCH.read_text()
    edits = [*CLUSTER_EDITS]
    if launcher == "torchrun":
        edits.append(("    node-agent \\\n", "    torchrun \\\n"))
    for old, new in edits:
        assert text.count(old) == 1, f"train.sbatch no longer has {old!r} once"
        text = text.replace(old, new)
    path = folder / "train.sbatch"
    path.write_text(text)
    return path


def submit(cluster: SlurmCluster, jobs: list[Job], tmp_path: Path, launcher: str, **env: str) -> Job:
    results = tmp_path / "train"
    results.mkdir()
    env = {
        "TRAIN_SCRIPT": str(WORKER),
        "NPROC_PER_NODE": "1",
        "TRAIN_DIR": str(results),
        "RDZV_PORT": str(next(_ports)),  # what a failed test left behind cannot hold the next one
        **env,
    }
    job = Job(
        cluster, cluster.sbatch(batch_file(tmp_path, launcher), env=env, chdir=tmp_path), results, launcher
    )
    jobs.append(job)
    return job


def launcher_pid(cluster: SlurmCluster, node: str, launcher: str) -> int:
    """The launcher process srun started on ``node`` (its parent is slurmstepd)."""
    procs = cluster.node_processes(node)
    found = []
    for pid, cmd in procs.items():
        if launcher not in cmd:
            continue
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])
            parent = Path(f"/proc/{ppid}/comm").read_text().strip()
        except (OSError, IndexError, ValueError):
            continue
        if parent.startswith("slurmstepd"):
            found.append(pid)
    assert len(found) == 1, f"{node}: {launcher} processes under slurmstepd: {found}\n{procs}"
    return found[0]


# --- a. a training to its end ----------------------------------------------------------------


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_training_completes_on_two_nodes(
    cluster: SlurmCluster, jobs: list[Job], tmp_path: Path, launcher: str
) -> None:
    job = submit(cluster, jobs, tmp_path, launcher)
    info = job.done()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), job.explain()
    starts = job.events("start")
    assert sorted(e["rank"] for e in starts) == [0, 1], job.explain()
    assert {e["world_size"] for e in starts} == {2}
    assert sorted(str(e["host"]) for e in starts) == ["n1", "n2"]
    assert sorted(e["rank"] for e in job.events("done")) == [0, 1]
    out = job.output()
    assert "of 2 on n1: done" in out and "of 2 on n2: done" in out, out
    assert cluster.task_exits(job.id) == {("n1", 0): 0, ("n2", 1): 0}


# --- b. a failing rank ---------------------------------------------------------------------


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_failing_rank_fails_the_job_and_the_output_names_it(
    cluster: SlurmCluster, jobs: list[Job], tmp_path: Path, launcher: str
) -> None:
    job = submit(
        cluster, jobs, tmp_path, launcher, FAIL_RANK="1", FAIL_STEP="2", TRAIN_STEPS="5", MAX_RESTARTS="0"
    )
    info = job.done()
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "1:0"), job.explain()
    assert cluster.task_exits(job.id) == {("n1", 0): EXIT_1_STATUS, ("n2", 1): EXIT_1_STATUS}
    out = job.output()
    if launcher == "node-agent":
        # Every agent's report names the job's root cause, the other node's included.
        assert out.count(f"error     : {CAUSE}") == 2, job.explain()
        assert len(re.findall(r"job failed: rank 1 \(local rank 0\) on node n2:", out)) == 2, out
    else:
        # torchrun's report names each node's own failures: n1's is its rank 0's lost peer.
        assert CAUSE in out, job.explain()


# --- c. scancel ------------------------------------------------------------------------------


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_scancel_stops_every_agent_and_worker_of_an_elastic_job(
    cluster: SlurmCluster, jobs: list[Job], tmp_path: Path, launcher: str
) -> None:
    job = submit(cluster, jobs, tmp_path, launcher, NNODES="1:2", TRAIN_UNTIL_STOP="1")
    job.wait_events("running", 2, world_size=2)
    cluster.scancel(job.id)
    info = job.done()
    assert info["JobState"] == "CANCELLED", job.explain()
    for node in cluster.nodes:
        cluster.wait_no_processes(node, JOB_PROCS)
    out = job.output()
    stopped = (
        r"\[node-agent\] ERROR: drained: received SIGTERM"
        if launcher == "node-agent"
        else (r"Received 15 death signal, shutting down workers")
    )
    assert len(re.findall(stopped, out)) == 2, f"each agent says it stopped on SIGTERM\n{job.explain()}"
    # No agent takes the cancel for "the job goes on without me" (exit 0): Slurm cancels all.
    exits = cluster.task_exits(job.id)
    assert set(exits) == {("n1", 0), ("n2", 1)} and 0 not in exits.values(), job.explain()


# --- d. scancel --signal=USR1 ----------------------------------------------------------------


def test_usr1_reaches_each_worker_once_and_the_job_saves_and_completes(
    cluster: SlurmCluster, jobs: list[Job], tmp_path: Path
) -> None:
    """What ``--signal=USR1@90`` does before the time limit, sent now: Slurm signals the agents,
    their helpers and the workers. Each worker gets it once (from Slurm; the agent must not
    forward it again), the agents and their helpers survive it, nothing restarts."""
    job = submit(cluster, jobs, tmp_path, "node-agent", TRAIN_UNTIL_STOP="1", ON_USR1="exit")
    job.wait_events("running", 2, world_size=2)
    cluster.scancel(job.id, signal="USR1")
    try:
        job.done(timeout=20)
    except AssertionError:
        pass  # the facts below say what went wrong
    starts = job.events("start")
    usr1 = {str(e["proc"]): len(job.events("usr1", proc=e["proc"])) for e in starts}
    assert len(starts) == 2, f"workers started {len(starts)} times (a restart was spent)\n{job.explain()}"
    assert list(usr1.values()) == [1, 1], f"SIGUSR1s per worker: {usr1}\n{job.explain()}"
    assert sorted(e["rank"] for e in job.events("checkpoint")) == [0, 1], job.explain()
    assert job.state() == ("COMPLETED", "0:0"), job.explain()
    assert cluster.task_exits(job.id) == {("n1", 0): 0, ("n2", 1): 0}


def test_usr1_kills_torchrun(cluster: SlurmCluster, jobs: list[Job], tmp_path: Path) -> None:
    """The same notice with torchrun: it does not handle SIGUSR1, so the signal's default
    action ends it (and its workers, orphaned, finish on their own); the job fails."""
    job = submit(cluster, jobs, tmp_path, "torchrun", TRAIN_UNTIL_STOP="1", ON_USR1="exit")
    job.wait_events("running", 2, world_size=2)
    cluster.scancel(job.id, signal="USR1")
    job.done()
    assert job.state() == ("FAILED", f"{128 + signal.SIGUSR1}:0"), job.explain()
    usr1 = signal.SIGUSR1.value
    assert cluster.task_exits(job.id) == {("n1", 0): usr1, ("n2", 1): usr1}, job.explain()


# --- e. elastic node loss --------------------------------------------------------------------


@pytest.mark.parametrize("lost", ["n2", "n1"], ids=["a-node", "the-node-hosting-the-rendezvous"])
def test_elastic_job_loses_a_node_the_other_finishes_and_slurm_says_completed(
    cluster: SlurmCluster, jobs: list[Job], tmp_path: Path, lost: str
) -> None:
    """SIGKILL of one node's agent while training with ``--nnodes 1:2``: the other node goes on
    alone and finishes. n1's agent hosts the rendezvous: when it is the one lost, n2's takes it
    over (issue 45). srun returns the killed task's 128 + 9, but the surviving agent wrote
    ``succeeded`` into the batch file's outcome folder and none wrote ``failed``: the batch
    file says so and ends COMPLETED, 0.

    node-agent only: a SIGKILLed torchrun leaves its worker running (no orphan watchdog), which
    proctrack/linuxproc then loses track of, so the training goes on with two ranks here."""
    job = submit(cluster, jobs, tmp_path, "node-agent", NNODES="1:2", TRAIN_UNTIL_STOP="1")
    job.wait_events("running", 2, world_size=2)
    os.kill(launcher_pid(cluster, lost, "node-agent"), signal.SIGKILL)
    job.wait_events("running", 1, world_size=1, timeout=90)
    job.stop()
    job.done()
    assert job.state() == ("COMPLETED", "0:0"), job.explain()
    kept = "n2" if lost == "n1" else "n1"
    task = {"n1": 0, "n2": 1}
    assert cluster.task_exits(job.id) == {(lost, task[lost]): SIGKILL_STATUS, (kept, task[kept]): 0}, (
        job.explain()
    )
    (done,) = job.events("done")
    assert (done["rank"], done["world_size"], str(done["proc"]).split("-")[0]) == (0, 1, kept), job.explain()
    out = job.output()
    assert "rank 0 of 1 on " + kept + ": done" in out, out
    assert f"srun: error: {lost}: task" in out and "Killed" in out, out
    assert (
        "srun exited 137 (a node was lost), the other nodes finished the training: the job succeeded" in out
    )
    assert not list(tmp_path.glob(".node-agent-outcome-*")), "the outcome folder is left behind"


def test_a_failed_elastic_job_stays_failed_whatever_the_outcome_folder_holds(
    cluster: SlurmCluster, jobs: list[Job], tmp_path: Path
) -> None:
    """The folder only ever turns a lost node's code into success when an agent saw the job
    succeed: a rank that fails every attempt fails the elastic job as before."""
    job = submit(
        cluster, jobs, tmp_path, "node-agent", NNODES="1:2", MAX_RESTARTS="0", FAIL_RANK="1", FAIL_STEP="2",
        TRAIN_STEPS="5",
    )  # fmt: skip
    job.done()
    state, code = job.state()
    assert state == "FAILED" and code != "0:0", job.explain()
    assert "the job succeeded" not in job.output(), job.output()


# --- f. requeue ------------------------------------------------------------------------------


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_requeued_job_runs_again_and_completes(
    cluster: SlurmCluster, jobs: list[Job], tmp_path: Path, launcher: str
) -> None:
    job = submit(cluster, jobs, tmp_path, launcher, TRAIN_UNTIL_STOP="1")
    job.wait_events("running", 2, world_size=2)
    assert sorted(e["slurm_restart_count"] for e in job.events("start")) == [0, 0]
    cluster.requeue(job.id)
    job.wait_events("start", 2, slurm_restart_count=1)
    job.wait_events("running", 4, world_size=2)
    job.stop()
    info = job.done()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), job.explain()
    again = job.events("start", slurm_restart_count=1)
    assert sorted(e["rank"] for e in again) == [0, 1], job.explain()
    assert {str(e["proc"]) for e in job.events("done")} == {str(e["proc"]) for e in again}
