"""Progress pages written badly, end to end (issue 30, part 3): a real ``node-agent`` with two
local ranks against a real ``rdzv-server``.

- Workers scribble any bytes and any values into their own pages for a while: the agent never
  hits an internal error, the server never closes its connection for a bad message nor loses
  it, a bad page is said at most once per rank, and the job ends with the workers' own exit
  code.
- One rank hangs while the other is inside a phase whose name holds a tab: the agent collects
  both ranks' stacks, writes its hang report and reports the hang (before, the phase name made
  the stacks message invalid and the agent crashed with no report).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from .live_job import get
from .procs import WORKERS, Proc, agent_cmd, start_server


@pytest.fixture
def server() -> Iterator[Proc]:
    srv, port = start_server()
    srv.port = port  # type: ignore[attr-defined]
    try:
        yield srv
        srv.signal(signal.SIGTERM)
        assert srv.wait(timeout=15) == 0, srv.stderr
    finally:
        srv.kill()


def agent(server: Proc, tmp_path: Path, job: str, script: str, *flags: str, env: dict[str, str]) -> Proc:
    port = server.port  # type: ignore[attr-defined]
    return Proc(
        agent_cmd(
            "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", job, "--log-dir", str(tmp_path), *flags, str(WORKERS / script),
        ),
        env=env,
    )  # fmt: skip


def assert_server_took_every_message(server: Proc, job: str) -> dict[str, object]:
    """The server closed no connection (a protocol violation or a flood is logged as "closing
    PEER: why") and lost no node; the job's view."""
    assert "closing " not in server.stderr, server.stderr
    assert "Traceback" not in server.stderr, server.stderr
    status, view = get(server.port, f"/v1/jobs/{job}")  # type: ignore[attr-defined]
    assert status == 200, view
    assert not [e for e in view["history"] if e["kind"] in ("lost", "left")], view["history"]
    return view  # type: ignore[no-any-return]


@pytest.mark.parametrize("seed", [1, 2])
def test_workers_scribbling_over_their_pages_never_break_the_agent(
    tmp_path: Path, server: Proc, seed: int
) -> None:
    job = f"scribble{seed}"
    env = {"SCRIBBLE_SEED": str(seed), "SCRIBBLE_SECONDS": "4", "SCRIBBLE_EXIT": "0"}
    a = agent(server, tmp_path, job, "scribble_page.py", env=env)
    try:
        assert a.wait(timeout=90) == 0, a.stderr  # the workers' own exit code
    finally:
        a.kill()
    assert "internal error" not in a.stderr, a.stderr
    assert "rendezvous server:" not in a.stderr, a.stderr  # no error reply from the server
    assert a.stdout.count("scribbled up to step") == 2, a.stdout
    for lr in range(2):
        said = [line for line in a.err if f"local rank {lr} (rank {lr}): its progress page holds" in line]
        assert len(said) <= 1, said
    view = assert_server_took_every_message(server, job)
    assert view["phase"] == "finished", view["outcome"]


def test_a_hang_beside_a_phase_named_with_a_tab_is_reported_with_every_ranks_stacks(
    tmp_path: Path, server: Proc
) -> None:
    flags = ("--hang-timeout", "2", "--max-restarts", "0")
    a = agent(server, tmp_path, "odd-phase", "odd_phase_hang.py", *flags, env={})
    try:
        rc = a.wait(timeout=90)
    finally:
        a.kill()
    assert "internal error" not in a.stderr, a.stderr
    assert "error     : hang: rank 1 (local 1): no progress for" in a.stderr, a.stderr  # the banner
    assert rc == 1, a.stderr
    (report,) = tmp_path.glob("*/attempt_*/hang_report.txt")
    text = report.read_text()
    assert "--- rank 0 " in text and "--- rank 1 " in text, text  # both ranks' stacks
    view = assert_server_took_every_message(server, "odd-phase")
    hang = view["hang"]
    assert hang["ranks"] == [1] and hang["nodes_reported"] == 1, hang  # type: ignore[index]
