"""The agent-hosted TCPStore (node_agent/store/host.py): the socket listens before any store is
served, each round gets an empty store on the same port, a worker interpreter without torch
turns it off (said once, the port given up), and the store process never outlives its host."""

from __future__ import annotations

import asyncio
import datetime
import os
import shutil
import socket
import sys
from pathlib import Path

import pytest

from node_agent.store.host import StoreHost, StoreUnavailable, hosts_round
from protocol import Assignment

torch_dist = pytest.importorskip("torch.distributed")

NO_TORCH_PYTHON = shutil.which("python3", path="/usr/bin")


def _assignment(port: int, *, agent_store: bool = True, group_rank: int = 0) -> Assignment:
    return Assignment(
        job_id="j", round=1, group_rank=group_rank, group_world_size=2, rank_offset=group_rank,
        world_size=2, master_addr="127.0.0.1", master_port=port, restart_count=0, max_restarts=0,
        agent_store=agent_store,
    )  # fmt: skip


class Logged:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def __call__(self, text: str, level: str = "info") -> None:
        self.lines.append((text, level))


def _client(port: int) -> object:
    # A worker's own connection under TORCHELASTIC_USE_AGENT_STORE=True (torch's _create_c10d_store).
    timeout = datetime.timedelta(seconds=20)
    return torch_dist.TCPStore("127.0.0.1", port, world_size=2, is_master=False, timeout=timeout)


async def _until(cond: object, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_a_connect_before_the_store_is_served_is_queued_not_refused() -> None:
    async def main() -> None:
        host = StoreHost(sys.executable, os.environ, log=Logged())
        try:
            # Not started: no store process at all, yet a worker's connect is accepted (queued).
            with socket.create_connection(("127.0.0.1", host.port), timeout=5):
                pass
            assert host.hosting
        finally:
            await host.close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", host.port), timeout=5).close()

    asyncio.run(main())


def test_each_round_gets_an_empty_store_on_the_same_port() -> None:
    async def main() -> None:
        log = Logged()
        host = StoreHost(sys.executable, os.environ, log=log)
        await host.start()
        try:
            assert await host.verdict() is True
            a = _assignment(host.port)
            await host.serve_round(a)  # maybe still importing torch: the client waits in the backlog
            c = await asyncio.to_thread(_client, host.port)
            await asyncio.to_thread(c.set, "default_pg/key", "round 1")  # type: ignore[attr-defined]
            assert await asyncio.to_thread(c.get, "default_pg/key") == b"round 1"  # type: ignore[attr-defined]
            del c
            await _until(lambda: host.phase.value == "ready")
            await host.serve_round(a)
            c2 = await asyncio.to_thread(_client, host.port)
            assert await asyncio.to_thread(c2.check, ["default_pg/key"]) is False  # type: ignore[attr-defined]
            del c2
            assert log.lines == []
        finally:
            pid = host.pid
            await host.close()
        assert pid is not None and not _alive(pid)

    asyncio.run(main())


@pytest.mark.skipif(NO_TORCH_PYTHON is None, reason="needs a python3 without torch in /usr/bin")
def test_an_interpreter_without_torch_turns_it_off_once_and_gives_up_the_port() -> None:
    async def main() -> None:
        log = Logged()
        lost: list[str] = []
        assert NO_TORCH_PYTHON is not None
        host = StoreHost(NO_TORCH_PYTHON, os.environ, log=log, on_lost=lost.append)
        port = host.port
        await host.start()
        try:
            assert await host.verdict() is False
            assert not host.hosting
            assert "no torch" in host.why_off
            # Worker rank 0 can host the store on that port now.
            with socket.socket() as s:
                s.bind(("", port))
            with pytest.raises(StoreUnavailable, match="no torch"):
                await host.serve_round(_assignment(port))
            assert len(log.lines) == 1 and log.lines[0][1] == "warning"
            assert "no torch" in log.lines[0][0] and "worker rank 0 hosts" in log.lines[0][0]
        finally:
            await host.close()

    asyncio.run(main())


def test_a_store_process_that_dies_is_reported_and_the_port_given_up() -> None:
    async def main() -> None:
        log = Logged()
        lost: list[str] = []
        host = StoreHost(sys.executable, os.environ, log=log, on_lost=lost.append)
        await host.start()
        try:
            assert host.pid is not None
            os.kill(host.pid, 9)
            await _until(lambda: bool(lost))
            assert not host.hosting and "exited" in lost[0]
            assert len(log.lines) == 1
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", host.port), timeout=5).close()
        finally:
            await host.close()

    asyncio.run(main())


def test_the_store_process_dies_with_its_agent(tmp_path: Path) -> None:
    # An agent SIGKILLed: its store process must not linger (PDEATHSIG, and stdin's EOF).
    script = tmp_path / "agent.py"
    script.write_text(
        "import asyncio, os, sys\n"
        "from node_agent.store.host import StoreHost\n"
        "async def main():\n"
        "    h = StoreHost(sys.executable, os.environ, log=print)\n"
        "    await h.start()\n"
        "    print(h.pid, flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    import subprocess

    agent = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[3]
    )
    try:
        assert agent.stdout is not None
        pid = int(agent.stdout.readline())
        assert _alive(pid)
        agent.kill()
        agent.wait(10)

        async def gone() -> None:
            await _until(lambda: not _alive(pid))

        asyncio.run(gone())
    finally:
        agent.kill()
        agent.wait()


def test_only_the_group_rank_0_node_serves_and_only_when_the_round_says_so() -> None:
    assert hosts_round(_assignment(29500))
    assert not hosts_round(_assignment(29500, group_rank=1))
    assert not hosts_round(_assignment(29500, agent_store=False))


def test_a_round_whose_port_is_not_ours_is_refused() -> None:
    async def main() -> None:
        host = StoreHost(sys.executable, os.environ, log=Logged())
        await host.start()
        try:
            with pytest.raises(StoreUnavailable, match="not ours"):
                await host.serve_round(_assignment(host.port % 65535 + 1))
        finally:
            await host.close()

    asyncio.run(main())


def _queued(port: int) -> int:
    """Connections waiting in the accept queue of our listening socket on ``port`` (the kernel
    shows a listening socket's accept queue as its rx_queue in /proc/net/tcp6 and tcp)."""
    total = 0
    for table in ("/proc/net/tcp6", "/proc/net/tcp"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, state, queues = fields[1], fields[3], fields[4]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    total += int(queues.split(":")[1], 16)
    return total


def test_a_next_rounds_worker_that_connects_before_the_new_store_waits_for_it() -> None:
    """Another node's warm worker connects the moment the next round forms, before this node
    serves the new store: it must wait in the backlog (the last round's store was dropped before
    this node's Join), never be accepted by the old store and cut off at ``fresh``."""

    async def main() -> None:
        log = Logged()
        host = StoreHost(sys.executable, os.environ, log=log)
        await host.start(eager=True)
        try:
            a = _assignment(host.port)
            await _until(lambda: host.phase.value == "ready")
            await host.serve_round(a)
            c = await asyncio.to_thread(_client, host.port)
            await asyncio.to_thread(c.set, "default_pg/key", "round 1")  # type: ignore[attr-defined]
            del c
            await host.end_round()  # the runner does this before its next Join

            def next_rounds_worker() -> bool:
                c2 = _client(host.port)  # returns only once a store answers
                c2.set("default_pg/mine", "round 2")  # type: ignore[attr-defined]
                return c2.check(["default_pg/key"])  # type: ignore[attr-defined,no-any-return]

            worker = asyncio.ensure_future(asyncio.to_thread(next_rounds_worker))
            await _until(lambda: _queued(host.port) >= 1)  # its connect waits: nothing accepts it
            assert not worker.done()
            await host.serve_round(a)
            assert await asyncio.wait_for(worker, 20) is False  # served by the new, empty store
            assert log.lines == []
        finally:
            await host.close()

    asyncio.run(main())
