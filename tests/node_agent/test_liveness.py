"""TORCHELASTIC_HEALTH_CHECK_PORT's server against real sockets: answers, and stays bounded."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from node_agent.liveness import MAX_CONNECTIONS, HealthServer


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _get(port: int, request: bytes) -> bytes:
    """The whole reply; b"" when the server closed (or reset) the connection without one."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        return await asyncio.wait_for(reader.read(), 10)
    except ConnectionResetError:
        return b""
    finally:
        writer.close()


def test_answers_a_probe_with_the_phase() -> None:
    async def scenario() -> None:
        port = _port()
        server = HealthServer(port, lambda: "running")
        await server.start()
        try:
            reply = await _get(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK")
            assert json.loads(body)["phase"] == "running"
        finally:
            await server.close()

    asyncio.run(scenario())


def test_an_oversized_head_is_closed_without_an_answer() -> None:
    async def scenario() -> None:
        port = _port()
        server = HealthServer(port, lambda: "running")
        await server.start()
        try:
            assert await _get(port, b"GET /" + b"x" * 100_000 + b"\r\n\r\n") == b""
            assert (await _get(port, b"GET / HTTP/1.0\r\n\r\n")).startswith(b"HTTP/1.1 200 OK")
        finally:
            await server.close()

    asyncio.run(scenario())


def test_idle_connections_cannot_lock_out_a_probe() -> None:
    """Before: a cap's worth of idle connections (re-opened every few seconds) made the server
    abort every probe, so Kubernetes restarted a healthy pod. Now a newcomer past the cap
    closes the connection that has waited longest, and is answered."""

    async def scenario() -> None:
        port = _port()
        server = HealthServer(port, lambda: "running", deadline=60.0)  # idle ones stay: the cap acts
        await server.start()
        idle = []
        try:
            for _ in range(MAX_CONNECTIONS):
                idle.append(await asyncio.open_connection("127.0.0.1", port))
            for _ in range(3):  # probe after probe, the idle ones re-opened meanwhile
                reply = await _get(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert reply.startswith(b"HTTP/1.1 200 OK"), reply
                idle.append(await asyncio.open_connection("127.0.0.1", port))
            # The oldest waiters made room; the newest still wait: at most the cap are held.
            oldest, newest = idle[0][0], idle[-1][0]
            assert await asyncio.wait_for(oldest.read(), 10) == b""
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(newest.read(), 0.1)
        finally:
            for _, writer in idle:
                writer.close()
            await server.close()

    asyncio.run(scenario())


def test_each_connection_has_a_short_deadline_and_one_answer() -> None:
    async def scenario() -> None:
        port = _port()
        server = HealthServer(port, lambda: "joining", deadline=0.3)
        await server.start()
        try:
            silent_r, silent_w = await asyncio.open_connection("127.0.0.1", port)
            half_r, half_w = await asyncio.open_connection("127.0.0.1", port)
            half_w.write(b"GET / HTTP/1.1\r\n")  # a head that never ends
            t0 = time.monotonic()
            assert await asyncio.wait_for(silent_r.read(), 10) == b""
            assert await asyncio.wait_for(half_r.read(), 10) == b""
            assert time.monotonic() - t0 < 5
            silent_w.close()
            half_w.close()
            # Two requests on one connection: one answer, then the close.
            reply = await _get(port, b"GET / HTTP/1.1\r\n\r\nGET / HTTP/1.1\r\n\r\n")
            assert reply.count(b"HTTP/1.1 200 OK") == 1
            assert json.loads(reply.partition(b"\r\n\r\n")[2])["phase"] == "joining"
        finally:
            await server.close()

    asyncio.run(scenario())
