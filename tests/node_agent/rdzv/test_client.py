"""``rdzv.server.connect`` against servers that misbehave at the first byte."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from typing import Any

import pytest

from node_agent.rdzv import NotARendezvousServer, RendezvousRefused
from node_agent.rdzv import server as client

uvloop = pytest.importorskip("uvloop")


def test_a_connection_reset_before_the_hello_is_retried_under_uvloop(monkeypatch) -> None:
    """A RuntimeError from uvloop's write on the closed transport crashed the agent (seen when a
    SIGKILLed server's port was reused). A reset without a word, which no other protocol
    answers either, is what a full server does: tried again until the deadline."""
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
        with pytest.raises(RendezvousRefused, match=r"is full .*gave up when the time to connect ran out"):
            await client.connect(
                "127.0.0.1",
                port,
                deadline=time.monotonic() + 1,
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


# --- a server at its connection cap (issue 31, finding 5) ----------------------------------


async def _full_server(tls: ssl.SSLContext | None = None) -> tuple[Any, int, list[asyncio.StreamWriter]]:
    """A real server of one connection, held by an idle peer, that closes the excess at once
    (no busy reply: as when the replies are crowded out)."""
    from rdzv_server.service import RendezvousService

    svc = RendezvousService(max_connections=1, tls=tls)
    svc.gate.max_refusing = 0
    port = await svc.start("127.0.0.1", 0)
    _, held = await asyncio.open_connection("127.0.0.1", port, ssl=_probe_ctx() if tls else None)
    for _ in range(500):  # until the server has counted it
        if svc.gate.connections == 1:
            break
        await asyncio.sleep(0.01)
    assert svc.gate.connections == 1
    return svc, port, [held]


def _probe_ctx() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


async def _joins_once_a_place_frees(port: int, held: list[asyncio.StreamWriter], **kw: Any) -> list[str]:
    """connect() against the full server: it says the server is full and waits; once the idle
    peer leaves, it gets through. Returns the lines it logged."""
    lines: list[str] = []
    said_full = asyncio.Event()

    def log(line: str) -> None:
        lines.append(line)
        if "is full" in line:
            said_full.set()

    task = asyncio.ensure_future(
        client.connect("127.0.0.1", port, deadline=time.monotonic() + 30, handshake_timeout=5, log=log, **kw)
    )
    said = asyncio.ensure_future(said_full.wait())
    await asyncio.wait({task, said}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    said.cancel()
    # Before: "closed the connection during the hello: it is not a rendezvous server", at once.
    assert said_full.is_set() and not task.done(), (lines, task.done() and task.exception())
    for w in held:
        w.transport.abort()
    conn = await asyncio.wait_for(task, 10)
    assert conn.version >= 1
    await conn.close()
    return lines


def test_a_full_server_that_closes_without_a_word_is_waited_for() -> None:
    async def scenario() -> None:
        svc, port, held = await _full_server()
        try:
            lines = await _joins_once_a_place_frees(port, held)
            assert lines[0] == (
                f"the rendezvous server at 127.0.0.1:{port} is full (connection cap): it closed the "
                "connection without answering; retrying"
            )
            assert not any("not a rendezvous server" in line for line in lines), lines
        finally:
            await svc.close()

    asyncio.run(scenario())


def test_a_server_full_until_the_deadline_is_named_as_full() -> None:
    async def scenario() -> None:
        svc, port, held = await _full_server()
        try:
            with pytest.raises(RendezvousRefused) as caught:
                await client.connect(
                    "127.0.0.1", port, deadline=time.monotonic() + 1, handshake_timeout=5, log=print
                )
            assert str(caught.value) == (
                f"the rendezvous server at 127.0.0.1:{port} is full (connection cap): it closed the "
                "connection without answering; gave up when the time to connect ran out (it closed "
                "every connection without answering: a rendezvous server at its connection cap, or a "
                "listener that is not a rendezvous server)"
            )
        finally:
            for w in held:
                w.transport.abort()
            await svc.close()

    asyncio.run(scenario())


def test_a_full_tls_server_is_waited_for_and_a_plain_agent_is_still_told_to_use_tls(tmp_path) -> None:
    from edge.tls import client_context, server_context
    from tests.pki import make_pki

    pki = make_pki(tmp_path)

    async def scenario() -> None:
        svc, port, held = await _full_server(server_context(str(pki.server_cert), str(pki.server_key)))
        try:
            # A TLS server shakes hands before it counts a connection: a plain hello is told at once.
            with pytest.raises(NotARendezvousServer, match=r"answers TLS: .*give --tls-ca"):
                await client.connect(
                    "127.0.0.1", port, deadline=time.monotonic() + 10, handshake_timeout=5, log=print
                )
            await _joins_once_a_place_frees(port, held, tls=client_context(str(pki.ca)))
        finally:
            await svc.close()

    asyncio.run(scenario())


def test_a_tls_agent_at_a_full_plain_server_is_waited_for(tmp_path) -> None:
    from edge.tls import client_context
    from tests.pki import make_pki

    pki = make_pki(tmp_path)

    async def scenario() -> None:
        svc, port, held = await _full_server()
        try:
            # Before: "closed the connection during the TLS handshake: it does not speak TLS".
            lines: list[str] = []
            with pytest.raises(RendezvousRefused, match="is full"):
                await client.connect(
                    "127.0.0.1", port, deadline=time.monotonic() + 1, handshake_timeout=5,
                    log=lines.append, tls=client_context(str(pki.ca)),
                )  # fmt: skip
            for w in held:
                w.transport.abort()
            for _ in range(500):
                if svc.gate.connections == 0:
                    break
                await asyncio.sleep(0.01)
            # With a place free, the plain server is named at once.
            with pytest.raises(NotARendezvousServer, match="does not speak TLS"):
                await client.connect(
                    "127.0.0.1", port, deadline=time.monotonic() + 10, handshake_timeout=5,
                    log=print, tls=client_context(str(pki.ca)),
                )  # fmt: skip
        finally:
            await svc.close()

    asyncio.run(scenario())
