"""The static backend's ranks when nodes give different --nproc-per-node, and how nodes learn them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from pathlib import Path

import pytest

from node_agent.cli.parse import parse_config
from node_agent.config import AgentConfig
from node_agent.rdzv import RendezvousError
from node_agent.rdzv.static import StaticBackend, StaticConnection, static_ranks
from protocol import Assignment, Join


@pytest.mark.parametrize(
    ("sizes", "node_rank", "expected"),
    [
        ((1, 2), 0, (0, 3)),
        ((1, 2), 1, (1, 3)),
        ((2, 1), 1, (2, 3)),
        ((4, 4, 4), 2, (8, 12)),
        ((3, 1, 2), 2, (4, 6)),
        ((5,), 0, (0, 5)),
    ],
)
def test_ranks_follow_node_rank_order_as_torchruns(
    sizes: tuple[int, ...], node_rank: int, expected: tuple[int, int]
) -> None:
    assert static_ranks(sizes, node_rank) == expected


def test_ranks_refuse_what_cannot_be_a_job() -> None:
    with pytest.raises(ValueError, match="node rank 2"):
        static_ranks((1, 2), 2)
    with pytest.raises(ValueError, match="at least one worker"):
        static_ranks((1, 0), 0)


def test_node_rank_0_bounds_what_a_peer_says(tmp_path: Path) -> None:
    from node_agent.rdzv.static import _refusal, _sizes_from
    from protocol import MAX_NPROC

    cfg = config(tmp_path, "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1")
    hello = {"node_rank": 1, "nnodes": 2, "run_id": cfg.rdzv_id, "role": cfg.role}
    assert _refusal(cfg, {**hello, "nproc_per_node": MAX_NPROC}) is None
    assert "1..4096" in str(_refusal(cfg, {**hello, "nproc_per_node": MAX_NPROC + 1}))
    assert "1..4096" in str(_refusal(cfg, {**hello, "nproc_per_node": 10**18}))
    # and node rank 1 bounds node rank 0's answer the same way
    node1 = config(tmp_path, "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1")
    answer = json.dumps({"sizes": [10**18, node1.nproc_per_node]}).encode()
    with pytest.raises(RendezvousError, match="no usable sizes"):
        _sizes_from(answer, node1, "127.0.0.1", 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(tmp_path: Path, *flags: str) -> AgentConfig:
    script = tmp_path / "train.py"
    script.write_text("")
    return parse_config([*flags, str(script)], {})


def static_node(tmp_path: Path, port: int, nnodes: int, rank: int, nproc: int, *more: str) -> AgentConfig:
    return config(
        tmp_path,
        *("--nnodes", str(nnodes), "--node-rank", str(rank), "--nproc-per-node", str(nproc)),
        *("--master-addr", "127.0.0.1", "--master-port", str(port), *more),
    )


def assignment(conn: StaticConnection) -> Assignment:
    conn.send(Join.__new__(Join))  # the static link reads nothing of the Join
    msg = conn._inbox.get_nowait()
    assert isinstance(msg, Assignment)
    return msg


def test_nodes_learn_every_size_and_take_torchruns_ranks(tmp_path: Path) -> None:
    port = free_port()
    sizes = (3, 1, 2)
    cfgs = [static_node(tmp_path, port, 3, r, n) for r, n in enumerate(sizes)]
    lines: list[str] = []

    async def scenario() -> list[StaticConnection]:
        deadline = time.monotonic() + 20
        # the other nodes first: they wait for node rank 0 to listen
        late = asyncio.create_task(
            StaticBackend(cfgs[0], log=lambda t, *a: lines.append(t)).connect(deadline)
        )
        others = [asyncio.create_task(StaticBackend(c).connect(deadline)) for c in cfgs[1:]]
        await asyncio.sleep(0.3)
        return [await late, *[await t for t in others]]

    conns = asyncio.run(scenario())
    assert [c.sizes for c in conns] == [[3, 1, 2]] * 3
    got = [(a.group_rank, a.rank_offset, a.world_size, a.group_world_size) for a in map(assignment, conns)]
    assert got == [(0, 0, 6, 3), (1, 3, 6, 3), (2, 4, 6, 3)]
    assert any("WORLD_SIZE 6" in line for line in lines)
    # node rank 0 no longer listens: worker rank 0 can bind the master port for torch's store
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", port))


def test_a_lone_node_of_a_static_job_needs_no_exchange(tmp_path: Path) -> None:
    cfg = config(tmp_path, "--rdzv-backend", "static", "--nproc-per-node", "3", "--master-port", "29999")
    conn = asyncio.run(StaticBackend(cfg).connect(time.monotonic() + 1))
    assert (conn.rank_offset, conn.world_size) == (0, 3)


def test_identical_workers_skip_the_exchange(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_ELASTIC_WORKER_IDENTICAL", "1")
    cfg = static_node(tmp_path, free_port(), 2, 1, 4)
    conn = asyncio.run(StaticBackend(cfg).connect(time.monotonic() + 1))  # nobody listens: no wait
    assert (conn.rank_offset, conn.world_size) == (4, 8)


def test_node_rank_0_names_the_node_ranks_it_waited_for(tmp_path: Path) -> None:
    cfg = static_node(tmp_path, free_port(), 3, 0, 2)
    with pytest.raises(
        RendezvousError, match=r"node rank 0 waited \d+ s on port \d+ for node rank\(s\) 1, 2 of 3"
    ):
        asyncio.run(StaticBackend(cfg).connect(time.monotonic() + 0.5))


def test_a_node_that_leaves_early_is_forgotten_and_its_rank_taken_again(tmp_path: Path) -> None:
    port = free_port()
    head = static_node(tmp_path, port, 3, 0, 1)

    async def scenario() -> list[list[int]]:
        deadline = time.monotonic() + 20
        task = asyncio.create_task(StaticBackend(head).connect(deadline))
        await asyncio.sleep(0.3)
        # a node rank 1 says hello and leaves before the job is complete
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await reader.readline()
        writer.write(
            b'{"run_id": "none", "node_rank": 1, "nnodes": 3, "nproc_per_node": 7, "role": "default"}\n'
        )
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()
        await asyncio.sleep(0.2)
        rest = [
            StaticBackend(static_node(tmp_path, port, 3, r, n)).connect(deadline) for r, n in ((1, 2), (2, 1))
        ]
        conns = await asyncio.gather(task, *rest)
        return [c.sizes for c in conns]

    assert asyncio.run(scenario()) == [[1, 2, 1]] * 3


async def hello_as(
    port: int, rank: int, nproc: int, nnodes: int = 3, **kw: object
) -> tuple[str, asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw connection saying a consistent hello for ``rank``: its address and its streams."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, **kw)  # type: ignore[arg-type]
    await reader.readline()  # the greeting
    hello = {
        "run_id": "none",
        "node_rank": rank,
        "nnodes": nnodes,
        "nproc_per_node": nproc,
        "role": "default",
    }
    writer.write(json.dumps(hello).encode() + b"\n")
    await writer.drain()
    host, local_port = writer.get_extra_info("sockname")[:2]
    return f"{host}:{local_port}", reader, writer


def test_a_second_claim_of_a_taken_node_rank_fails_every_node_naming_both(tmp_path: Path) -> None:
    """A static job has no secret: the first consistent hello takes a slot, and a second agent
    claiming it (a stranger, or --node-rank given twice) ends the exchange on every node at
    once, naming both addresses and sizes, rather than the job going on with either size."""
    port = free_port()
    head = static_node(tmp_path, port, 3, 0, 1)

    async def scenario() -> tuple[str, str, str, str, float]:
        started = time.monotonic()
        task = asyncio.create_task(StaticBackend(head).connect(started + 20))
        await asyncio.sleep(0.3)
        real = asyncio.create_task(StaticBackend(static_node(tmp_path, port, 3, 1, 2)).connect(started + 20))
        await asyncio.sleep(0.3)
        stranger, reader, writer = await hello_as(port, 1, 7)
        answer = json.loads(await asyncio.wait_for(reader.readline(), 10))
        writer.close()
        errors = []
        for t in (task, real):
            with pytest.raises(RendezvousError) as info:
                await t
            errors.append(str(info.value))
        return stranger, answer["error"], errors[0], errors[1], time.monotonic() - started

    stranger, to_stranger, at_head, at_real, took = asyncio.run(scenario())
    for text in (to_stranger, at_head, at_real):
        assert "--node-rank 1 is already taken by the agent at 127.0.0.1:" in text
        assert "(--nproc-per-node 2)" in text
        assert f"the agent at {stranger} claims it too (--nproc-per-node 7)" in text
    assert "node rank 0 on port" in at_head and "refused node rank 1" in at_real
    assert took < 10  # told at once, not at the 20 s deadline


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_idle_connections_are_capped_and_do_not_keep_a_node_out(tmp_path: Path) -> None:
    """200 connections that never say hello (from 25 addresses) hold at most _MAX_WAITING
    descriptors of node rank 0, the real node rank 1 still gets in, and none is left open once
    the sizes are known (the workers need the descriptors, worker rank 0 the port)."""
    port = free_port()
    head = static_node(tmp_path, port, 2, 0, 1)

    async def scenario() -> tuple[int, int, list[list[int]]]:
        deadline = time.monotonic() + 20
        task = asyncio.create_task(StaticBackend(head).connect(deadline))
        await asyncio.sleep(0.3)
        base = _open_fds()
        idle = []
        for i in range(200):
            source = f"127.0.0.{2 + i % 25}"
            idle.append(await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0)))
        await asyncio.sleep(0.5)
        held_by_head = _open_fds() - base - len(idle)  # our own ends are len(idle) of them
        node1 = await StaticBackend(static_node(tmp_path, port, 2, 1, 3)).connect(deadline)
        head_conn = await task
        await asyncio.sleep(0.3)
        left_open = _open_fds() - base - len(idle)
        for _, w in idle:
            w.close()
        return held_by_head, left_open, [head_conn.sizes, node1.sizes]

    held, left, sizes = asyncio.run(scenario())
    assert sizes == [[1, 3], [1, 3]]
    assert held <= 64 + 4, held  # _MAX_WAITING; was 200: one descriptor per stranger
    assert left <= 0, left


def test_one_address_holds_few_waiting_connections_and_each_only_briefly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from node_agent.rdzv import static

    monkeypatch.setattr(static, "_HELLO_TIMEOUT", 1.5)
    port = free_port()
    head = static_node(tmp_path, port, 2, 0, 1)

    async def ended(reader: asyncio.StreamReader) -> bool:
        """The greeting, then an end from node rank 0 (it closed this connection)?"""
        try:
            await asyncio.wait_for(reader.read(), 0.2)
        except (TimeoutError, ConnectionError) as exc:
            return isinstance(exc, ConnectionError)
        return True

    async def scenario() -> tuple[int, int]:
        task = asyncio.create_task(StaticBackend(head).connect(time.monotonic() + 20))
        await asyncio.sleep(0.3)
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(20)]
        await asyncio.sleep(0.2)
        closed = sum(await asyncio.gather(*(ended(r) for r, _ in idle)))
        await asyncio.sleep(1.5)  # past the hello deadline: the rest are closed too
        closed_late = sum(await asyncio.gather(*(ended(r) for r, _ in idle)))
        for _, w in idle:
            w.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return closed, closed_late

    closed, closed_late = asyncio.run(scenario())
    assert closed == 20 - 8  # _MAX_WAITING_PER_HOST: the oldest, each for a newer one
    assert closed_late == 20
