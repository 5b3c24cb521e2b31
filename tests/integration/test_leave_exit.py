"""Exit codes a scheduler can trust, and ranks that follow --node-rank, with real processes.

- SIGTERM to an agent of an elastic job exits 0 only when the job goes on without it (the
  server's ``Left`` says so); the last node exits 1, as torchrun does on a signal. In a
  fixed-size job SIGTERM exits 1, as before.
- A hot spare that outlives its job exits 0 (EXIT_NOT_NEEDED) saying the job finished
  without it; one told that the job failed exits 1 with the job's reason.
- Two agents of a fixed-size job on our server, each given --node-rank in the reverse of
  address order, get GROUP_RANK = --node-rank.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

from .conftest import Rendezvous
from .procs import WORKERS, Proc, agent_cmd, start_server

SLEEPER = str(WORKERS / "sleeper.py")
DUMP_ENV = str(WORKERS / "dump_env.py")


def _stop(*procs: Proc | None) -> None:
    for p in procs:
        if p is not None:
            p.kill()


def test_sigterm_exits_zero_only_while_the_job_goes_on_without_the_node(
    tmp_path: Path, rdzv: Rendezvous
) -> None:
    args = ("--nnodes", "1:2", "--nproc-per-node", "1", *rdzv.args, "--rdzv-id", f"leave-{rdzv.backend}")
    args += ("--rdzv-conf", "last_call_timeout=1", SLEEPER)
    env = {"DUMP_DIR": str(tmp_path), "SLEEP_EXIT": "120"}
    a, b = Proc(agent_cmd(*args), env=env), Proc(agent_cmd(*args), env=env)
    try:
        for x in (a, b):
            x.wait_for_line(r"started \d 2 ", stream="out", timeout=60)
        b.signal(signal.SIGTERM)
        assert b.wait(timeout=60) == 0, b.stderr
        assert "goes on without this node (1 node(s) remain" in b.stderr
        # the other node goes on, alone: a new round of one node, no restart used
        a.wait_for_line(r"started 0 1 \d+ 0", stream="out", timeout=60)
        assert a.p.poll() is None
        a.signal(signal.SIGTERM)
        rc = a.wait(timeout=60)
        assert rc == 1, a.stderr  # torchrun's exit code on SIGTERM (SignalException)
        assert "does not go on without this node (this node was the last of the job)" in a.stderr
    finally:
        _stop(a, b)


def test_sigterm_in_a_fixed_size_job_stays_a_failure(tmp_path: Path) -> None:
    srv, port = start_server()
    args = ("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}")
    args += ("--rdzv-id", "fixed-term", SLEEPER)
    env = {"DUMP_DIR": str(tmp_path), "SLEEP_EXIT": "120"}
    a, b = Proc(agent_cmd(*args), env=env), Proc(agent_cmd(*args), env=env)
    try:
        for x in (a, b):
            x.wait_for_line(r"started \d 2 ", stream="out", timeout=60)
        b.signal(signal.SIGTERM)
        assert b.wait(timeout=60) == 1, b.stderr
        assert "received SIGTERM" in b.stderr
    finally:
        _stop(a, b, srv)


def test_a_spare_that_outlives_the_job_exits_zero_saying_so(tmp_path: Path) -> None:
    srv, port = start_server()
    release = tmp_path / "release"
    args = ("--nnodes", "1", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}")
    args += ("--rdzv-id", "outlived", SLEEPER)
    env = {"DUMP_DIR": str(tmp_path), "EXIT_WHEN_FILE": str(release)}
    job = Proc(agent_cmd(*args), env=env)
    spare = None
    try:
        job.wait_for_line(r"started 0 1 ", stream="out", timeout=60)
        spare = Proc(agent_cmd(*args), env=env)  # the same line again: the job is full
        spare.wait_for_line(r"spare: the job is full", timeout=60)
        release.touch()
        assert job.wait(timeout=60) == 0, job.stderr
        assert spare.wait(timeout=60) == 0, spare.stderr
        assert "finished without it" in spare.stderr
        assert "UnexpectedEvent" not in spare.stderr
        assert len((tmp_path / "started.txt").read_text().splitlines()) == 1  # the spare ran nothing
    finally:
        _stop(job, spare, srv)


def test_a_spare_told_the_job_failed_exits_nonzero_with_its_reason(tmp_path: Path) -> None:
    srv, port = start_server()
    fail = tmp_path / "fail"
    # Fails (exit 3) once the test says so: after the spare is waiting.
    script = f"while [ ! -e {fail} ]; do sleep 0.05; done; echo failing on purpose >&2; exit 3"
    args = ("--nnodes", "1", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}")
    args += ("--rdzv-id", "failed-under-spare", "--max-restarts", "0", "--no-python", "sh", "-c", script)
    job = Proc(agent_cmd(*args))
    spare = None
    try:
        job.wait_for_line(r"round 0: group rank 0 of 1", timeout=60)
        spare = Proc(agent_cmd(*args))
        spare.wait_for_line(r"spare: the job is full", timeout=60)
        fail.touch()
        assert job.wait(timeout=60) == 1, job.stderr
        assert spare.wait(timeout=60) == 1, spare.stderr
        assert "job failed while this node waited to join it" in spare.stderr
        assert "exit code 3" in spare.stderr
        assert "Traceback" not in spare.stderr
    finally:
        _stop(job, spare, srv)


def test_group_ranks_follow_node_ranks_given_in_reverse_of_address_order(tmp_path: Path) -> None:
    srv, port = start_server()
    common = ("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}")
    common += ("--rdzv-id", "by-node-rank")
    agents: list[Proc] = []
    try:
        # Address order would make 127.0.0.1 group rank 0; the node ranks say the reverse.
        for addr, node_rank in (("127.0.0.1", 1), ("127.0.0.2", 0)):
            out = tmp_path / addr
            out.mkdir()
            argv = agent_cmd(*common, "--local-addr", addr, "--node-rank", str(node_rank), DUMP_ENV)
            agents.append(Proc(argv, env={"DUMP_DIR": str(out)}))
        for a in agents:
            assert a.wait(timeout=90) == 0, a.stderr
        srv.wait_for_line(r"job by-node-rank: round 0 complete: .*group ranks by --node-rank", timeout=10)
    finally:
        _stop(*agents, srv)
    for addr, node_rank in (("127.0.0.1", 1), ("127.0.0.2", 0)):
        (dump,) = [json.loads(p.read_text()) for p in (tmp_path / addr).glob("env-*.json")]
        assert dump["GROUP_RANK"] == str(node_rank), (addr, dump["GROUP_RANK"])
        assert dump["RANK"] == str(node_rank)
        assert dump["MASTER_ADDR"] == "127.0.0.2"  # node rank 0's address
