"""The server's limits on what a hostile or broken peer can hold, over real loopback sockets.

Each limit is a RendezvousService argument, set small here so the tests take milliseconds;
tests/integration/test_server_fuzz.py fires the same inputs at a real server process.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from protocol import (
    HEADER,
    MAGIC,
    SERVER_MESSAGES,
    Error,
    FrameDecoder,
    Heartbeat,
    Hello,
    Welcome,
    encode,
)
from rdzv_server import cli
from rdzv_server.service import RendezvousService

from .test_service import RawAgent


async def eof_after(reader: asyncio.StreamReader, timeout: float = 10.0) -> float:
    """Seconds until the server closes the connection (reading and dropping what it sends)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while await asyncio.wait_for(reader.read(1 << 16), timeout=timeout):
        pass
    return loop.time() - t0


@pytest.fixture
async def limited():
    svc = RendezvousService(http=True, hello_timeout=0.3, auth_timeout=0.6)
    port = await svc.start("127.0.0.1", 0)
    yield svc, port
    await svc.close()


async def test_the_handshake_deadlines_close_real_sockets(limited, caplog) -> None:
    """The wiring: a socket that says nothing (the service's own deadline, before it is routed),
    a half-sent hello (the machine's hello deadline, counted from the accept) and a hello with
    no join (its auth deadline) are each closed, with the line an operator greps. When each
    deadline falls, to the tick, is scripted on a fake clock in test_deadlines.py."""
    _, port = limited
    caplog.set_level(logging.INFO, logger="rdzv_server")
    silent_r, silent_w = await asyncio.open_connection("127.0.0.1", port)
    half_r, half_w = await asyncio.open_connection("127.0.0.1", port)
    hello = encode(Hello(versions=(1,), software="t"))
    half_w.write(MAGIC + hello[: len(hello) // 2])
    a = await RawAgent.open(port)
    assert isinstance(await a.recv(), Welcome)
    a.send(Heartbeat())  # heartbeats do not buy time
    a.writer.write(HEADER.pack(100_000) + b"x" * 1000)  # nor does a frame that never completes
    took = await asyncio.gather(eof_after(silent_r), eof_after(half_r), eof_after(a.reader))
    assert all(t >= 0.25 for t in took), took  # not before (a late close is only load)
    lines = [rec.getMessage() for rec in caplog.records]
    assert sum("no hello within 0.3 s" in line for line in lines) == 2, lines
    assert sum("no join within 0.6 s of its hello" in line for line in lines) == 1, lines
    for w in (silent_w, half_w, a.writer):
        w.close()


async def test_a_peer_that_does_not_read_is_dropped() -> None:
    svc = RendezvousService(write_buffer_limit=64 << 10)
    port = await svc.start("127.0.0.1", 0)
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fill up quickly
        sock.connect(("127.0.0.1", port))
        sock.sendall(MAGIC + encode(Hello(versions=(1,), software="t")))  # and never read
        for _ in range(500):  # wait for the server to register the connection
            if svc._conns:
                break
            await asyncio.sleep(0.005)
        (conn,) = svc._conns.values()
        big = encode(Error(code="x", message="y" * 60_000))
        sent = 0
        while sent < 1000:  # ~60 MB at most; the limit must cut it long before
            conn.write(big)
            sent += 1
            if conn.transport is None or conn.transport.is_closing():
                break
        assert conn.transport is None or conn.transport.is_closing()
        assert sent * len(big) < 16 << 20, sent
        sock.close()
    finally:
        await svc.close()


async def test_the_total_connection_cap_refuses_the_excess() -> None:
    svc = RendezvousService(max_connections=2)
    port = await svc.start("127.0.0.1", 0)
    try:
        a, b = await RawAgent.open(port), await RawAgent.open(port)
        assert isinstance(await a.recv(), Welcome) and isinstance(await b.recv(), Welcome)
        c = await RawAgent.open(port)
        busy = await c.recv()
        assert isinstance(busy, Error) and busy.code == "server_busy" and not busy.fatal
        assert "at its connection limit (2 connections" in busy.message
        assert await asyncio.wait_for(c.reader.read(), timeout=5) == b""
    finally:
        await svc.close()


async def test_a_malformed_http_request_is_one_warning_not_a_traceback(limited, caplog) -> None:
    _, port = limited
    caplog.set_level(logging.DEBUG)
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET /healthz HTTP/1.1\r\n" + b"X-A: b\r\n" * 5_000 + b"\r\n")  # too many headers
    raw = await asyncio.wait_for(r.read(), timeout=5)
    w.close()
    assert raw.split(b" ", 2)[1] == b"400"
    bad = [rec for rec in caplog.records if "bad HTTP request" in rec.getMessage()]
    assert len(bad) == 1 and bad[0].levelno == logging.WARNING and bad[0].exc_info is None
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]


@pytest.mark.parametrize("flag", ["--hello-timeout", "--auth-timeout"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "4000"])
def test_timeout_flags_are_checked(flag: str, value: str, capsys) -> None:
    assert cli.main([flag, value]) == cli.EXIT_USAGE
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("behind", ["alone", "hello behind it"])
async def test_a_heartbeat_before_the_hello_is_still_a_protocol_error(limited, behind: str) -> None:
    # Heartbeats skip decoding on a fast path, alone in a read or among other frames; neither
    # path may skip the hello rule.
    _, port = limited
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    hello = encode(Hello(versions=(1,), software="t")) if behind != "alone" else b""
    writer.write(MAGIC + encode(Heartbeat()) + hello)
    assert await asyncio.wait_for(reader.readexactly(len(MAGIC)), 5) == MAGIC
    rest = await asyncio.wait_for(reader.read(1 << 16), 5)
    (reply,) = FrameDecoder(allowed=SERVER_MESSAGES).feed(rest)
    assert isinstance(reply, Error) and "expected hello first, got heartbeat" in reply.message
    assert await eof_after(reader) < 3
    writer.close()
