"""--preload end to end: workers made from warm interpreters are cold starts' twins.

The same probe (tests/node_agent/workers/warm_probe.py, test_warm.py's) runs under node-agent
cold, under node-agent with --preload, and under torchrun; what it saw of its start must be the
same, and so must exit codes, the @record error file and the agent's failure report.  A warm
worker's agent SIGKILLed leaves nothing behind (workers, grandchildren, idle warm interpreters),
and real gloo training with --max-restarts finishes on warm restarts.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from .procs import ROOT, Proc, agent_cmd, pid_alive

PROBE = str(ROOT / "tests" / "node_agent" / "workers" / "warm_probe.py")
# Worker variables that differ between two runs whatever the launcher: a run's own values.
PER_RUN = {
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
    "NODE_AGENT_PROGRESS_PAGE",
    "NODE_AGENT_SNAPSHOT_DIR",  # in the run's private folder
    "NODE_AGENT_PLACE_DIR",  # in the run's private folder too
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    "TORCH_FR_DUMP_TEMP_FILE",
    "TORCH_NCCL_DEBUG_INFO_PIPE_FILE",
    "TORCH_FR_DEBUG_INFO_PIPE_FILE",
    "TORCHELASTIC_USE_AGENT_STORE",
    "DUMP_DIR",
}


def run(argv: list[str], out: Path) -> Proc:
    out.mkdir()
    p = Proc(argv, env={"DUMP_DIR": str(out)})
    try:
        p.wait(timeout=120)
    finally:
        p.kill()
    return p


def states(out: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("state-*.json"))}


def comparable(s: dict[str, Any]) -> dict[str, Any]:
    s = dict(s)
    s["environ"] = {k: v for k, v in s["environ"].items() if k not in PER_RUN}
    return s  # the descriptors too: cold and warm workers start with 0, 1 and 2 only


def test_warm_workers_see_what_cold_ones_see(tmp_path: Path) -> None:
    flags = ["--standalone", "--nproc-per-node", "2"]
    cold = run(agent_cmd(*flags, PROBE), tmp_path / "cold")
    warm = run(agent_cmd(*flags, "--preload", "json", PROBE), tmp_path / "warm")
    assert cold.p.returncode == warm.p.returncode == 0, warm.stderr
    assert "(2 warm: local ranks [0, 1])" in warm.stderr
    c, w = states(tmp_path / "cold"), states(tmp_path / "warm")
    assert sorted(c) == sorted(w) == ["state-0-0", "state-1-0"]
    for key in c:
        assert comparable(w[key]) == comparable(c[key]), key
        assert w[key]["pgid_is_pid"] and w[key]["sid_is_pid"]
        assert w[key]["fds"] == [0, 1, 2, 3, 4]  # stdio, the state file, the listing
    # torchrun's workers: the same start, as far as the launcher does not differ on purpose
    # (its environment is test_env_parity.py's business).
    theirs = run([sys.executable, "-m", "torch.distributed.run", *flags, PROBE], tmp_path / "torchrun")
    assert theirs.p.returncode == 0, theirs.stderr
    t = states(tmp_path / "torchrun")
    for key in t:
        for field in ("argv", "path0", "file", "spec", "cwd", "signals", "fds"):
            assert w[key][field] == t[key][field], (key, field)
    # Both ranks write the agent's stdout themselves (unprefixed, as torchrun's): lines may
    # interleave, so compare what was written, not the order.
    assert sorted(cold.stdout) == sorted(warm.stdout)
    assert "probe ok rank 0" in warm.stdout.replace("probe ok rank 1", "")


def test_record_error_file_and_report_are_a_cold_workers(tmp_path: Path) -> None:
    flags = ["--standalone", "--nproc-per-node", "1", "--tee", "3"]
    cold = run(agent_cmd(*flags, PROBE, "record"), tmp_path / "cold")
    warm = run(agent_cmd(*flags, "--preload", "torch", PROBE, "record"), tmp_path / "warm")
    assert cold.p.returncode == warm.p.returncode == 1
    assert "(1 warm: local ranks [0])" in warm.stderr
    for p in (cold, warm):
        assert "RuntimeError: probe rank 0 failed on purpose" in p.stderr
        assert "error_file:" in p.stderr and "/error.json" in p.stderr, p.stderr
    # The tee'd lines carry the same prefix.
    assert "[default0]:probe record rank 0" in cold.stdout and "[default0]:probe record rank 0" in warm.stdout


def _warm_interpreters(mark: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if b"warm_boot.py" in cmd and f"PRELOAD_MARK={mark}".encode() in env and pid_alive(int(name)):
            found.append(int(name))
    return found


def test_agent_sigkilled_leaves_no_warm_worker_or_interpreter_behind(tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    out = tmp_path / "out"
    out.mkdir()
    agent = Proc(
        agent_cmd("--standalone", "--nproc-per-node", "1", "--preload", "json", PROBE, "hold"),
        env={"DUMP_DIR": str(out), "PRELOAD_MARK": mark},
    )
    try:
        agent.wait_for_line(r"1 warm", timeout=60)
        deadline = time.monotonic() + 60
        pids_file = out / "hold-0.pids"
        while not (pids_file.exists() and pids_file.read_text().endswith("\n")):
            assert time.monotonic() < deadline, agent.stderr
            time.sleep(0.05)
        worker, grandchild = (int(x) for x in pids_file.read_text().split())
        # The replacement interpreter warms at once after the handoff: wait for it too.
        while len(_warm_interpreters(mark)) < 2:  # the worker itself is one (its cmdline stays)
            assert time.monotonic() < deadline, "no replacement warm interpreter appeared"
            time.sleep(0.05)
        idle = [p for p in _warm_interpreters(mark) if p != worker]
        # The replacement warms at the idle policy (its first statement sets it), the worker
        # runs at the normal one.
        while [os.sched_getscheduler(p) for p in idle] != [os.SCHED_IDLE] * len(idle):
            assert time.monotonic() < deadline, "the replacement interpreter is not at SCHED_IDLE"
            time.sleep(0.05)
        assert os.sched_getscheduler(worker) == os.SCHED_OTHER
        os.kill(agent.p.pid, signal.SIGKILL)
        agent.p.wait(timeout=10)
        gone_by = time.monotonic() + 10
        while any(pid_alive(p) for p in (worker, grandchild, *idle)):
            assert time.monotonic() < gone_by, [p for p in (worker, grandchild, *idle) if pid_alive(p)]
            time.sleep(0.05)
    finally:
        agent.kill()


def test_gloo_training_finishes_on_warm_restarts(tmp_path: Path) -> None:
    flags = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--preload", "torch"]
    p = run(agent_cmd(*flags, PROBE, "train"), tmp_path / "out")
    assert p.p.returncode == 0, p.stderr
    started = [line for line in p.stderr.splitlines() if "started 2 worker(s)" in line]
    assert len(started) == 2 and all("(2 warm" in line for line in started), started
    for rank in (0, 1):
        assert f"step 20 rank {rank} restart 1" in p.stdout
        # The restart's workers were refills, warmed at SCHED_IDLE (issue 44 item 4) and put
        # back to the normal policy, every thread, before they took over.
        for restart in (0, 1):
            assert f"policy rank {rank} restart {restart}: OTHER\n" in p.stdout, p.stdout
