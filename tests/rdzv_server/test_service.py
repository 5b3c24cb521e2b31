"""The server over real loopback sockets: our frames and HTTP on one port."""

from __future__ import annotations

import asyncio
import json

import pytest

from protocol import (
    MAGIC,
    SERVER_MESSAGES,
    SUPPORTED_VERSIONS,
    Assignment,
    Error,
    FrameDecoder,
    Hello,
    Join,
    Message,
    Waiting,
    Welcome,
    encode,
)
from rdzv_server.service import RendezvousService


class RawAgent:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = FrameDecoder(allowed=SERVER_MESSAGES, expect_magic=True)
        self.pending: list[Message] = []

    @classmethod
    async def open(cls, port: int, versions: tuple[int, ...] = SUPPORTED_VERSIONS) -> RawAgent:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        a = cls(r, w)
        w.write(MAGIC + encode(Hello(versions=versions, software="test")))
        return a

    async def recv(self) -> Message:
        while not self.pending:
            data = await asyncio.wait_for(self.reader.read(65536), timeout=5)
            if not data:
                raise ConnectionError("closed")
            self.pending.extend(self.decoder.feed(data))
        return self.pending.pop(0)

    def send(self, msg: Message) -> None:
        self.writer.write(encode(msg))


def join(node: str, port: int) -> Join:
    return Join(
        job_id="j",
        node_id=node,
        addr="127.0.0.1",
        nproc=1,
        min_nodes=2,
        max_nodes=2,
        entrypoint="x.py",
        master_port=port,
        max_restarts=0,
        last_call_timeout=0.0,
        heartbeat_interval=1.0,
        heartbeat_timeout=5.0,
    )


@pytest.fixture
async def service():
    svc = RendezvousService(http=True)
    port = await svc.start("127.0.0.1", 0)
    yield svc, port
    await svc.close()


async def test_two_agents_get_assignments_over_tcp(service) -> None:
    _, port = service
    a, b = await RawAgent.open(port), await RawAgent.open(port)
    assert isinstance(await a.recv(), Welcome)
    assert isinstance(await b.recv(), Welcome)
    a.send(join("a", 30001))
    assert isinstance(await a.recv(), Waiting)
    b.send(join("b", 30002))
    ga, gb = await a.recv(), await b.recv()
    if isinstance(gb, Waiting):
        gb = await b.recv()
    assert isinstance(ga, Assignment) and isinstance(gb, Assignment)
    assert (ga.group_rank, gb.group_rank) == (0, 1)
    assert ga.master_port == gb.master_port == 30001


async def test_http_healthz_on_the_same_port(service) -> None:
    _, port = service
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    raw = await asyncio.wait_for(r.read(), timeout=5)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert json.loads(body)["status"] == "ok"


async def test_version_mismatch_names_both_sides(service) -> None:
    _, port = service
    a = await RawAgent.open(port, versions=(42,))
    err = await a.recv()
    assert isinstance(err, Error) and err.code == "version_mismatch"
    assert "42" in err.message and str(SUPPORTED_VERSIONS[0]) in err.message
    assert await asyncio.wait_for(a.reader.read(), timeout=5) == b""


async def test_garbage_is_closed_and_server_keeps_serving(service) -> None:
    svc, port = service
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"\x00\x01garbage that is neither protocol")
    assert await asyncio.wait_for(r.read(), timeout=5) == b""
    # a malformed frame after a good magic gets a typed error, then the close
    r2, w2 = await asyncio.open_connection("127.0.0.1", port)
    w2.write(MAGIC + b"\x00\x00\x00\x03abc")
    data = await asyncio.wait_for(r2.read(), timeout=5)
    (err,) = FrameDecoder(expect_magic=True).feed(data)
    assert isinstance(err, Error) and err.code == "malformed_frame"
    a = await RawAgent.open(port)
    assert isinstance(await a.recv(), Welcome)
    assert svc.machine.jobs == {}


async def test_dropped_connection_is_noticed(service) -> None:
    svc, port = service
    a = await RawAgent.open(port)
    await a.recv()
    a.send(join("a", 30001))
    await a.recv()
    assert "a" in svc.machine.jobs["j"].members
    a.writer.close()
    for _ in range(100):
        if "j" not in svc.machine.jobs:
            break
        await asyncio.sleep(0.01)
    assert "j" not in svc.machine.jobs


async def test_connection_caps_refuse_the_excess_and_recover() -> None:
    svc = RendezvousService(max_per_address=2)
    port = await svc.start("127.0.0.1", 0)
    try:
        a, b = await RawAgent.open(port), await RawAgent.open(port)
        assert isinstance(await a.recv(), Welcome) and isinstance(await b.recv(), Welcome)
        c = await RawAgent.open(port)
        busy = await c.recv()  # told why, in our protocol (not a bare close: "not a server")
        assert isinstance(busy, Error) and busy.code == "server_busy" and not busy.fatal
        assert "connection limit" in busy.message and "2 per address" in busy.message
        assert await asyncio.wait_for(c.reader.read(), timeout=5) == b""
        a.writer.close()
        await asyncio.wait_for(a.reader.read(), timeout=5)
        for _ in range(200):  # the server notices a's close asynchronously
            if svc.gate.connections < 2:
                break
            await asyncio.sleep(0.005)
        d = await RawAgent.open(port)
        assert isinstance(await d.recv(), Welcome)
    finally:
        await svc.close()


async def test_going_away_ends_the_state_log_in_a_snapshot(tmp_path) -> None:
    """The next server on the dir (an upgrade) loads the state, not a replay under its rules."""
    from rdzv_server.journal import LOG_NAME, SNAP_NAME, StateLog
    from rdzv_server.wal import FILE_HEADER

    state = tmp_path / "state"
    log, _, _ = StateLog.open(state)
    svc = RendezvousService(state_log=log)
    port = await svc.start("127.0.0.1", 0)
    try:
        agents = [await RawAgent.open(port) for _ in range(2)]
        for i, a in enumerate(agents):
            assert isinstance(await a.recv(), Welcome)
            a.send(join(f"n{i}", 20001 + i))
        for a in agents:
            while not isinstance(await a.recv(), Assignment):
                pass
        await svc.go_away("received SIGTERM", grace=2.0)
    finally:
        await svc.close()
        log.close()
    assert (state / SNAP_NAME).exists()
    assert (state / LOG_NAME).stat().st_size == FILE_HEADER.size  # nothing left to replay
    again, found, _ = StateLog.open(state)
    try:
        assert found.replayed == 0 and found.jobs == 1
        assert again.machine.jobs["j"].phase.value == "running" and again.machine.jobs["j"].order == [
            "n0",
            "n1",
        ]
    finally:
        again.close()
