"""``rdzv.server.connect`` against servers that misbehave at the first byte."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest

from node_agent.rdzv import NotARendezvousServer
from node_agent.rdzv import server as client

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


def test_a_torch_tcpstore_at_the_endpoint_is_named_before_the_handshake_timeout(tmp_path) -> None:
    """The usual tenant of port 29500 (a TCPStore of torchrun's or of a job) accepts our hello
    and never answers; the agent asks it a TCPStore question instead of waiting out the
    handshake timeout, and says what it found."""
    import subprocess
    import sys

    store = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from torch.distributed import TCPStore; "
            "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
            "print(s.port, flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert store.stdout is not None
        port = int(store.stdout.readline())

        async def scenario() -> None:
            # A handshake timeout far beyond the test's own: only the probe can end this early.
            with pytest.raises(NotARendezvousServer, match="is a torch TCPStore"):
                await asyncio.wait_for(
                    client.connect(
                        "127.0.0.1", port, deadline=time.monotonic() + 300, handshake_timeout=300, log=print
                    ),
                    timeout=60,
                )

        asyncio.run(scenario())
    finally:
        store.kill()
        store.wait(timeout=10)


def test_a_silent_listener_that_is_no_tcpstore_waits_out_the_handshake() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]

    async def scenario() -> None:
        with pytest.raises(NotARendezvousServer, match=r"did not answer as a rendezvous server within 1\.5"):
            await client.connect(
                "127.0.0.1", port, deadline=time.monotonic() + 5, handshake_timeout=1.5, log=print
            )

    try:
        asyncio.run(scenario())
    finally:
        listener.close()
