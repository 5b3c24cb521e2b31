"""``client.connect`` against servers that misbehave at the first byte."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest

from node_agent import client
from node_agent.client import NotARendezvousServer

uvloop = pytest.importorskip("uvloop")


def test_a_connection_reset_before_the_hello_is_a_closed_hello_under_uvloop(monkeypatch) -> None:
    """The agent's reconnect retries NotARendezvousServer; a RuntimeError from uvloop's write on
    the closed transport crashed the agent (seen when a SIGKILLed server's port was reused)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    real_open = asyncio.open_connection

    async def open_then_reset(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        reader, writer = await real_open(*args, **kwargs)
        writer.transport.abort()  # as an RST from the peer would leave it
        await asyncio.sleep(0)
        return reader, writer

    monkeypatch.setattr(client.asyncio, "open_connection", open_then_reset)

    async def scenario() -> None:
        assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
        with pytest.raises(NotARendezvousServer, match="closed the connection during the hello"):
            await client.connect(
                "127.0.0.1",
                port,
                deadline=time.monotonic() + 5,
                handshake_timeout=5,
                log=print,
            )

    try:
        uvloop.run(scenario())
    finally:
        listener.close()
