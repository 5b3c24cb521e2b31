"""c10d without a server: the first agent on the endpoint's machine hosts the rendezvous."""

from __future__ import annotations

from pathlib import Path

from .procs import WORKERS, Proc, agent_cmd, free_port, read_env_dumps

SLEEPER = str(WORKERS / "sleeper.py")


def test_two_agents_racing_for_the_port_end_with_one_host(tmp_path: Path) -> None:
    port = free_port()
    args = ("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}")
    args += ("--rdzv-id", "race", str(WORKERS / "dump_env.py"))
    agents = [Proc(agent_cmd(*args), env={"DUMP_DIR": str(tmp_path)}) for _ in "ab"]
    try:
        for a in agents:
            assert a.wait(timeout=60) == 0, a.stderr
    finally:
        for a in agents:
            a.kill()
    hosts = [a for a in agents if "this agent hosts it" in a.stderr]
    assert len(hosts) == 1
    assert sorted(int(e["RANK"]) for e in read_env_dumps(tmp_path)) == [0, 1, 2, 3]


def test_hosting_agent_finishing_first_does_not_strand_the_other(tmp_path: Path) -> None:
    port = free_port()
    args = ("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}")
    args += ("--rdzv-id", "early")
    release = tmp_path / "release"
    host = Proc(agent_cmd(*args, SLEEPER), env={"DUMP_DIR": str(tmp_path), "SLEEP_EXIT": "0"})
    other = None
    try:
        host.wait_for_line("this agent hosts it", timeout=30)
        other = Proc(
            agent_cmd(*args, SLEEPER), env={"DUMP_DIR": str(tmp_path), "EXIT_WHEN_FILE": str(release)}
        )
        # The host's part is done first; the other node's worker finishes only once it is.
        host.wait_for_line(r"workers finished; waiting for the other nodes", timeout=60)
        release.touch()
        assert other.wait(timeout=60) == 0, other.stderr
        assert host.wait(timeout=60) == 0, host.stderr
    finally:
        release.touch()
        host.kill()
        if other is not None:
            other.kill()
    assert "all nodes finished" in other.stderr
