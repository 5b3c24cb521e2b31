"""``rdzv-server --state-dir``: the server dies or is stopped mid-job and comes back with its state.

A real two-node gloo job (two workers per node, an all_reduce per step) runs the whole time.
The restarted server replays its state log and takes each agent back into the round it
kept: no worker restarts (same PIDs, TORCHELASTIC_RESTART_COUNT still 0), and the job's
status after the restart is what it was before, give or take heartbeat times.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

from .procs import WORKERS, Proc, agent_cmd, server_cmd, start_server

STEPS = str(WORKERS / "gloo_steps.py")
JOB = "durable"


def started(folder: Path) -> list[tuple[int, ...]]:
    p = folder / "started.txt"
    if not p.exists():
        return []
    return sorted(tuple(int(x) for x in line.split()) for line in p.read_text().splitlines() if line)


def wait_for_starts(folder: Path, n: int, within: float = 60.0) -> list[tuple[int, ...]]:
    """Workers write their start line themselves: a bounded wait for n of them."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if len(rows := started(folder)) >= n:
            return rows
        time.sleep(0.02)
    raise AssertionError(f"fewer than {n} workers started within {within} s")


def job_status(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/jobs/{JOB}", timeout=5) as resp:
        return json.loads(resp.read())


VOLATILE_MEMBER = ("last_heartbeat_at", "last_heartbeat_ago", "peer")


def assert_same_job(before: dict[str, Any], after: dict[str, Any]) -> None:
    """Equal but for heartbeat times and ages; wall times within clock-reading error; the
    history goes on (the restart and the resumes are noted after what was there)."""
    b, a = json.loads(json.dumps(before)), json.loads(json.dumps(after))
    for d in (b, a):
        d.pop("age")
        for m in d["members"]:
            for k in VOLATILE_MEMBER:
                m.pop(k)
    # Goodput (issue 47) goes on counting over the restart; its logged figures are kept.
    gb, ga = b.pop("goodput"), a.pop("goodput")
    assert (ga["stage"], ga["rendezvous_s"], ga["causes"]) == (gb["stage"], gb["rendezvous_s"], gb["causes"])
    hb, ha = b.pop("history"), a.pop("history")
    assert [(e["kind"], e["text"]) for e in ha[: len(hb)]] == [(e["kind"], e["text"]) for e in hb]
    assert all(abs(x["time"] - y["time"]) < 0.05 for x, y in zip(hb, ha, strict=False))
    assert {e["kind"] for e in ha[len(hb) :]} <= {"recovered", "resumed"}

    def times(d: dict[str, Any]) -> list[float]:
        out = [d.pop("created_at")]
        for m in d["members"]:
            out.append(m.pop("joined_at"))
        for r in d["rounds"]:
            out += [r.pop("gathering_since"), r.pop("started_at")]
        return out

    assert all(abs(x - y) < 0.05 for x, y in zip(times(b), times(a), strict=True))
    assert a == b


def agents_args(port: int) -> tuple[str, ...]:
    return (
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        JOB,
        STEPS,
    )


def start_job(tmp_path: Path, port: int) -> tuple[list[Proc], list[tuple[int, ...]]]:
    env = {"DUMP_DIR": str(tmp_path), "RELEASE_FILE": str(tmp_path / "release")}
    agents = [Proc(agent_cmd(*agents_args(port)), env=env) for _ in range(2)]
    before = wait_for_starts(tmp_path, 4)
    for a in agents:
        a.wait_for_line(r"step 3 rank", stream="out", timeout=60)
    return agents, before


def finish(tmp_path: Path, agents: list[Proc], before: list[tuple[int, ...]], server: Proc) -> None:
    """Training goes on after the restart; released, it finishes, and nothing was restarted."""
    steps = [int(a.wait_for_line(r"step (\d+) rank", stream="out").group(1)) for a in agents]
    for a, n in zip(agents, steps, strict=True):
        a.wait_for_line(rf"step {n + 3} rank", stream="out", timeout=30)
    (tmp_path / "release").touch()
    for a in agents:
        assert a.wait(timeout=60) == 0, a.stderr
    assert started(tmp_path) == before  # the same worker processes, each started once
    assert {row[3] for row in before} == {0}  # TORCHELASTIC_RESTART_COUNT
    server.wait_for_line(rf"job {JOB}: finished", timeout=10)


def test_server_sigkilled_mid_job_resumes_from_its_state_dir(tmp_path: Path) -> None:
    state = tmp_path / "state"
    srv, port = start_server("--state-dir", str(state))
    again: Proc | None = None
    agents: list[Proc] = []
    try:
        agents, before = start_job(tmp_path, port)
        status_before = job_status(port)
        assert status_before["phase"] == "running" and status_before["restart_count"] == 0
        srv.signal(signal.SIGKILL)
        srv.wait(timeout=10)
        for a in agents:
            a.wait_for_line(r"lost the connection .* workers keep running; reconnecting", timeout=10)
        again = Proc(server_cmd("--host", "127.0.0.1", "--port", str(port), "--state-dir", str(state)))
        again.wait_for_line(r"state dir .*record\(s\) replayed, 1 active job", timeout=20)
        try:
            for _ in agents:
                again.wait_for_line(rf"job {JOB}: node .* resumed round 0; nothing restarts", timeout=30)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nagents:\n" + "\n---\n".join(a.stderr for a in agents)) from None
        for a in agents:
            a.wait_for_line(r"resumed round 0 \(the server kept it\); workers were not restarted", timeout=10)
        assert_same_job(status_before, job_status(port))
        finish(tmp_path, agents, before, again)
    finally:
        for a in agents:
            a.kill()
        srv.kill()
        if again is not None:
            again.kill()


def test_sigterm_drains_and_a_new_server_on_the_state_dir_resumes_the_job(tmp_path: Path) -> None:
    state = tmp_path / "state"
    srv, port = start_server("--state-dir", str(state))
    again: Proc | None = None
    agents: list[Proc] = []
    try:
        agents, before = start_job(tmp_path, port)
        srv.signal(signal.SIGTERM)
        assert srv.wait(timeout=15) == 0, srv.stderr
        for pattern in (r"draining \(received SIGTERM\)", r"state log flushed", r"told 2 agent"):
            srv.wait_for_line(pattern, timeout=1)
        for a in agents:
            a.wait_for_line(r"server is going away \(received SIGTERM\); workers keep running", timeout=10)
            a.wait_for_line(r"lost the connection .* reconnecting", timeout=10)
        again = Proc(server_cmd("--host", "127.0.0.1", "--port", str(port), "--state-dir", str(state)))
        for a in agents:
            a.wait_for_line(r"resumed round 0 \(the server kept it\)", timeout=30)
        finish(tmp_path, agents, before, again)
    finally:
        for a in agents:
            a.kill()
        srv.kill()
        if again is not None:
            again.kill()
