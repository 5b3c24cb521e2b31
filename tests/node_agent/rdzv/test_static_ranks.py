"""The static backend's ranks when nodes give different --nproc-per-node, and how nodes learn them."""

from __future__ import annotations

import asyncio
import json
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
    assert _refusal(cfg, {**hello, "nproc_per_node": MAX_NPROC}, {}) is None
    assert "1..4096" in str(_refusal(cfg, {**hello, "nproc_per_node": MAX_NPROC + 1}, {}))
    assert "1..4096" in str(_refusal(cfg, {**hello, "nproc_per_node": 10**18}, {}))
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


def test_a_taken_node_rank_is_refused_naming_its_holder(tmp_path: Path) -> None:
    port = free_port()
    head = static_node(tmp_path, port, 3, 0, 1)

    async def scenario() -> str:
        task = asyncio.create_task(StaticBackend(head).connect(time.monotonic() + 3))
        await asyncio.sleep(0.3)
        first = asyncio.create_task(
            StaticBackend(static_node(tmp_path, port, 3, 1, 1)).connect(time.monotonic() + 3)
        )
        await asyncio.sleep(0.3)
        try:
            await StaticBackend(static_node(tmp_path, port, 3, 1, 1)).connect(time.monotonic() + 3)
        except RendezvousError as exc:
            why = str(exc)
        for t in (task, first):
            with pytest.raises(RendezvousError):
                await t
        return why

    assert "--node-rank 1 is already taken by the agent at 127.0.0.1:" in asyncio.run(scenario())
