"""Real launch lines, run under torchrun and under node-agent with nothing else changed.

Each line is copied from a project or document people launch from; the harness
(``dropin.py``) runs it both ways and compares what a user sees.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from .dropin import LAUNCHERS, Line, compare, launcher_lines, run_both, worker_lines
from .procs import WORKERS, Proc, agent_cmd, free_port
from .ptyrun import run_in_pty

STATIC_2 = ("--nnodes=2", "--node_rank={node_rank}", "--master_addr=127.0.0.1", "--master_port={port}")
PET_2 = {
    "PET_NNODES": "2",
    "PET_NODE_RANK": "{node_rank}",
    "PET_MASTER_ADDR": "127.0.0.1",
    "PET_MASTER_PORT": "{port}",
    "PET_NPROC_PER_NODE": "1",
}

LINES = [
    # nanoGPT, pytorch/examples: one node, torchrun's own standalone rendezvous.
    Line("standalone", ("--standalone", "--nproc_per_node=2", "--max-restarts", "2", "{script}")),
    # timm, fairseq2: one node, no rendezvous flags at all.
    Line("one-node-bare", ("--nproc_per_node=2", "{script}")),
    # torchtitan's run_train.sh: c10d on localhost:0, rank-filtered console, a role as the prefix.
    Line(
        "torchtitan",
        (
            "--nproc_per_node=2",
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint=localhost:0",
            "--local-ranks-filter",
            "0",
            "--role",
            "rank",
            "--tee",
            "3",
            "{script}",
            "--job.config_file",
            "x.toml",
        ),
        same_group_ranks=True,
    ),
    # pytorch/examples distributed/ddp-tutorial-series: c10d with a fixed single-node endpoint.
    Line(
        "examples-elastic-ddp",
        (
            "--nnodes=1",
            "--nproc_per_node=2",
            "--rdzv_id=100",
            "--rdzv_backend=c10d",
            "--rdzv_endpoint=127.0.0.1:{port}",
            "{script}",
        ),
    ),
    # Slurm recipes with c10d on the first node: two nodes, one endpoint.
    Line(
        "slurm-c10d-two-nodes",
        (
            "--nnodes",
            "2",
            "--nproc_per_node",
            "1",
            "--rdzv_id",
            "42",
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            "127.0.0.1:{port}",
            "{script}",
        ),
        nodes=2,
        same_group_ranks=False,
    ),  # torchrun orders nodes by host name and pid, we by address
    # A module, a command without python, a script run in the launcher's way.
    Line(
        "module",
        ("--standalone", "--nproc-per-node", "2", "-m", "tests.integration.workers.dump_env", "--lr", "0.1"),
    ),
    Line("no-python", ("--standalone", "--nproc-per-node", "2", "--no-python", "{python}", "{script}", "x")),
    Line("run-path", ("--standalone", "--nproc-per-node", "1", "--run-path", "{script}", "--epochs", "1")),
    # One node with a fixed port (many single-node recipes; torchrun then runs its static backend).
    Line(
        "one-node-master-port",
        ("--nproc-per-node", "2", "--master-port", "{port}", "{script}"),
        master_port_given=True,
    ),
    Line(
        "one-node-master-addr-port",
        ("--nproc_per_node=2", "--master_addr=127.0.0.1", "--master_port={port}", "{script}"),
        master_port_given=True,
    ),
    # nanoGPT's and Megatron's multi-node line, Slurm's --node_rank $SLURM_NODEID: no backend.
    Line("static-two-nodes", (*STATIC_2, "--nproc_per_node=1", "{script}"), nodes=2, master_port_given=True),
    # The same line running a real gloo job: worker rank 0 hosts the store on --master_port.
    Line(
        "static-two-nodes-gloo",
        (*STATIC_2, "--nproc-per-node=1", "{script}"),
        nodes=2,
        script="gloo_env_dump.py",
        master_port_given=True,
    ),
    # Kubeflow Trainer: the line is just the script; PET_* carry the rest.
    Line("kubeflow-pet", ("{script}",), env=PET_2, nodes=2, master_port_given=True),
    # Hugging Face examples take --token; nothing after the script is the launcher's.
    Line(
        "script-args",
        (
            "--standalone",
            "--nproc_per_node",
            "1",
            "{script}",
            "--token",
            "hf_x",
            "--health",
            "--pass",
            "p",
            "--tls",
            "--to",
            "x",
            "-m",
            "--nnodes",
            "3",
            "--",
            "--help",
        ),
    ),
    Line("double-dash", ("--nproc-per-node", "1", "--", "{script}", "--max-restarts", "1")),
    # torchrun's own log layout, asked for by name.
    Line(
        "logs-specs-default",
        (
            "--logs-specs",
            "default",
            "--log-dir",
            "{log_dir}",
            "--redirects",
            "3",
            "--nproc-per-node",
            "2",
            "{script}",
        ),
        log_files=True,
        console=False,
    ),
    Line(
        "tee", ("--log-dir", "{log_dir}", "--tee", "3", "--nproc-per-node", "2", "{script}"), log_files=True
    ),
    # Lines that match go to filtered_stdout.log / filtered_stderr.log as well.
    Line(
        "duplicate-filters",
        (
            "--log-dir",
            "{log_dir}",
            "--tee",
            "3",
            "--nproc-per-node",
            "2",
            "--duplicate-stdout-filters",
            "no,,such line,rank 1 of",
            "--duplicate-stderr-filters",
            "failing",
            "{script}",
        ),
        worker_env={"FAIL_RANK": "0", "EXIT_CODE": "4", "FAIL_AFTER_ALL_DUMPED": "1"},
        expect_exit=1,
        log_files=True,
    ),
    # A failing rank: the launcher's exit code.
    Line(
        "worker-fails",
        ("--nproc-per-node", "2", "{script}"),
        worker_env={"FAIL_RANK": "1", "EXIT_CODE": "3", "FAIL_AFTER_ALL_DUMPED": "1"},
        expect_exit=1,
    ),
    Line(
        "health-check-port",
        ("--nproc-per-node", "1", "{script}"),
        env={"TORCHELASTIC_HEALTH_CHECK_PORT": "{port2}"},
    ),
]


@pytest.mark.parametrize("line", LINES, ids=[line.id for line in LINES])
def test_launch_line_behaves_as_under_torchrun(line: Line, tmp_path: Path) -> None:
    theirs, ours = run_both(line, tmp_path)
    compare(theirs, ours, line)


def test_loglevel_silences_both_launchers(tmp_path: Path) -> None:
    line = Line(
        "loglevel",
        ("--nproc-per-node", "2", "--rdzv-endpoint", "127.0.0.1:{port}", "{script}"),
        env={"LOGLEVEL": "ERROR"},
    )
    theirs, ours = run_both(line, tmp_path)
    compare(theirs, ours, line)
    assert launcher_lines(theirs) == []
    assert launcher_lines(ours) == []


def _events(text: str) -> list[tuple[str, str]]:
    out = []
    for raw in text.splitlines():
        if raw.startswith("{") and "torchelastic.worker.status" in raw:
            event = json.loads(raw)
            out.append((event["name"], event["source"]))
    return out


@pytest.mark.parametrize("fail", [False, True], ids=["succeeds", "fails"])
def test_console_event_log_prints_torchruns_events(fail: bool, tmp_path: Path) -> None:
    worker_env = {"FAIL_RANK": "0", "EXIT_CODE": "2", "FAIL_AFTER_ALL_DUMPED": "1"} if fail else {}
    line = Line(
        "events",
        ("--standalone", "--nproc-per-node", "1", "--event-log-handler", "console", "{script}"),
        worker_env=worker_env,
        expect_exit=1 if fail else 0,
    )
    theirs, ours = run_both(line, tmp_path)
    compare(theirs, ours, line)
    assert _events(ours.stderr[0]) == _events(theirs.stderr[0])
    assert _events(ours.stderr[0])  # not vacuous


def test_python_dash_m_rdzv_server() -> None:
    p = Proc([sys.executable, "-m", "rdzv_server", "--help"])
    assert p.wait(timeout=30) == 0
    assert "usage: rdzv-server" in p.stdout


def test_health_check_port_answers(tmp_path: Path) -> None:
    """torchrun reads TORCHELASTIC_HEALTH_CHECK_PORT and starts nothing (open-source torch's
    server is a stub that says so); ours answers there while the job runs."""
    port, release = free_port(), tmp_path / "release"
    env = {"TORCHELASTIC_HEALTH_CHECK_PORT": str(port), "RELEASE_FILE": str(release)}
    agent = Proc(agent_cmd("--nproc-per-node", "1", str(WORKERS / "hold.py")), env=env)
    try:
        agent.wait_for_line(r"hold: rank 0 of 1 started", stream="out", timeout=30)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as reply:
            assert reply.status == 200
            body = json.loads(reply.read())
        assert body["phase"] == "running" and abs(body["alive"] - time.time()) < 60
        release.touch()
        assert agent.wait(timeout=30) == 0
    finally:
        agent.kill()


_TORCHRUN_REPORT_FIELDS = ("time      :", "host      :", "rank      :", "exitcode  :", "error_file:")


def test_the_agents_own_lines_on_a_terminal(tmp_path: Path) -> None:
    """Through a pty, as a person sees it: every line the agent prints (an argument warning
    included) starts with [node-agent], the round line names the rank range, and the failure
    report has each of torchrun's fields, the pid included."""
    flags = ("--nproc-per-node", "2", "--master-addr", "10.9.9.9", str(WORKERS / "dump_env.py"))
    env = {"DUMP_DIR": str(tmp_path), "FAIL_RANK": "1", "EXIT_CODE": "3", "FAIL_AFTER_ALL_DUMPED": "1"}
    env = {**os.environ, **env}
    theirs = run_in_pty([*LAUNCHERS["torchrun"], *flags], env=env, timeout=90)
    for dump in tmp_path.glob("env-*.json"):
        dump.unlink()
    ours = run_in_pty([*LAUNCHERS["ours"], *flags], env=env, timeout=90)
    assert theirs.code == ours.code == 1
    lines = [line for line in ours.text.splitlines() if line.strip()]
    own = [line for line in lines if not worker_lines(line)]
    assert own and all(line.startswith("[node-agent] ") for line in own), own
    assert any("--master-addr: ignored" in line for line in own)
    assert any(re.search(r"round 0: group rank 0 of 1, ranks 0-1, world size 2", line) for line in own)
    for name in _TORCHRUN_REPORT_FIELDS:
        assert name in theirs.text, name  # torchrun's report has it ...
        assert f"[node-agent] ERROR:   {name}" in ours.text, name  # ... and so does ours
    assert re.search(r"exitcode  : 3 \(pid: \d+\)", ours.text)
    assert "error_file: <N/A>" in ours.text  # dump_env.py writes no @record error file


def test_sigterm_to_a_fixed_size_run_exits_as_torchrun(tmp_path: Path) -> None:
    """A cancelled step must not look COMPLETED: both launchers exit 1 on SIGTERM."""
    codes = {}
    for launcher in ("torchrun", "ours"):
        release = tmp_path / f"release-{launcher}"
        argv = [*LAUNCHERS[launcher], "--standalone", "--nproc-per-node", "1", str(WORKERS / "hold.py")]
        p = Proc(argv, env={"RELEASE_FILE": str(release)})
        try:
            p.wait_for_line(r"hold: rank 0 of 1 started", stream="out", timeout=60)
            p.signal(signal.SIGTERM)
            codes[launcher] = p.wait(timeout=60)
        finally:
            p.kill()
    assert codes == {"torchrun": 1, "ours": 1}


def test_an_agent_hosting_the_rendezvous_waits_only_for_its_own_job(tmp_path: Path) -> None:
    port = free_port()
    endpoint = ("--rdzv-endpoint", f"127.0.0.1:{port}", "--nproc-per-node", "1")
    hold = str(WORKERS / "hold.py")
    host = Proc(agent_cmd(*endpoint, "--rdzv-id", "a", hold), env={"RELEASE_FILE": str(tmp_path / "a")})
    other = None
    try:
        host.wait_for_line(r"this agent hosts it", timeout=30)
        other = Proc(agent_cmd(*endpoint, "--rdzv-id", "b", hold), env={"RELEASE_FILE": str(tmp_path / "b")})
        host.wait_for_line(r"hold: rank 0 of 1 started", stream="out", timeout=30)
        other.wait_for_line(r"hold: rank 0 of 1 started", stream="out", timeout=30)
        (tmp_path / "a").touch()
        assert host.wait(timeout=30) == 0
        assert other.p.poll() is None  # job b still runs: the host did not wait for it ...
        assert "waiting up to" not in host.stderr  # ... nor said it would
    finally:
        (tmp_path / "b").touch()
        host.kill()
        if other is not None:
            other.kill()
