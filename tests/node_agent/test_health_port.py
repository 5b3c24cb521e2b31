"""TORCHELASTIC_HEALTH_CHECK_PORT's server against real sockets: answers, and stays bounded."""

from __future__ import annotations

import asyncio
import json
import socket

from node_agent.health_port import MAX_CONNECTIONS, HealthServer


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


def test_an_oversized_head_and_idle_connections_do_not_lock_it_out() -> None:
    async def scenario() -> None:
        port = _port()
        server = HealthServer(port, lambda: "running")
        await server.start()
        idle = []
        try:
            assert await _get(port, b"GET /" + b"x" * 100_000 + b"\r\n\r\n") == b""  # closed, no answer
            for _ in range(MAX_CONNECTIONS):  # as many idle peers as it serves at once
                idle.append(await asyncio.open_connection("127.0.0.1", port))
            assert await _get(port, b"GET / HTTP/1.0\r\n\r\n") == b""  # one more: turned away
            for _, writer in idle:
                writer.close()
            # The idle peers' slots come back as the server reads their EOFs.
            for _ in range(200):
                reply = await _get(port, b"GET / HTTP/1.0\r\n\r\n")
                if reply:
                    break
                await asyncio.sleep(0.01)
            assert reply.startswith(b"HTTP/1.1 200 OK")
        finally:
            await server.close()

    asyncio.run(scenario())
