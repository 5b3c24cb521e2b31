"""Several listening sockets on one port: a deep accept queue, and still one server a port."""

from __future__ import annotations

import asyncio
import errno
import signal
import socket

import pytest

from protocol import Assignment
from rdzv_server.admission import (
    ACCEPT_QUEUE,
    MAX_LISTENERS,
    check_port_free,
    kernel_accept_cap,
    listeners_for,
)
from rdzv_server.service import RendezvousService

from .test_cli import CLI, serving_process
from .test_http import FakeAgent


def listening_sockets(port: int) -> int:
    """TCP sockets in LISTEN on this port, from /proc/net/tcp (every process's)."""
    count = 0
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            next(f)
            for line in f:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    count += 1
    return count


def test_enough_sockets_for_the_wanted_queue_under_the_kernel_cap() -> None:
    assert listeners_for(16384, 4096) == 4
    assert listeners_for(16384, 5000) == 4  # rounded up: 3 would hold 15,000
    assert listeners_for(16384, 65535) == 1
    assert listeners_for(16384, 16) == MAX_LISTENERS
    assert listeners_for(ACCEPT_QUEUE, None) == 1  # cap unknown (not Linux): one plain socket


def test_the_cap_is_read_from_the_kernel_file(tmp_path) -> None:
    f = tmp_path / "somaxconn"
    f.write_text("4096\n")
    assert kernel_accept_cap(str(f)) == 4096
    f.write_text("lots")
    assert kernel_accept_cap(str(f)) is None
    assert kernel_accept_cap(str(tmp_path / "missing")) is None


async def test_shared_listeners_serve_agents_on_every_socket() -> None:
    svc = RendezvousService(listeners=3)
    port = await svc.start("127.0.0.1", 0)
    try:
        assert listening_sockets(port) == 3
        # Enough connections that the kernel's hash puts some on each socket.
        agents = [await FakeAgent.connect(port, f"n{i}") for i in range(24)]
        for a in agents:
            a.join("big", min_nodes=24, max_nodes=24)
        ranks = sorted([(await a.expect(Assignment)).group_rank for a in agents])
        assert ranks == list(range(24))
        for a in agents:
            await a.kill()
    finally:
        await svc.close()
    assert listening_sockets(port) == 0


@pytest.mark.parametrize("listeners", [1, 3])
async def test_a_second_server_on_a_taken_port_fails_to_start(listeners: int) -> None:
    first = RendezvousService(listeners=3)
    port = await first.start("127.0.0.1", 0)
    try:
        second = RendezvousService(listeners=listeners)
        with pytest.raises(OSError) as err:
            await second.start("127.0.0.1", port)
        assert err.value.errno == errno.EADDRINUSE
        await second.close()
        assert listening_sockets(port) == 3  # the first one's, nobody else's
    finally:
        await first.close()
    check_port_free("127.0.0.1", port)  # and the port is free again once it closed


async def test_shared_listeners_refuse_a_port_a_plain_socket_holds() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        svc = RendezvousService(listeners=4)
        with pytest.raises(OSError, match="already in use"):
            await svc.start("127.0.0.1", port)
        await svc.close()
        assert listening_sockets(port) == 1


async def test_rdzv_server_on_a_taken_port_says_so_and_exits_nonzero() -> None:
    first, port = await serving_process()
    try:
        second = await asyncio.create_subprocess_exec(
            *CLI, "--host", "127.0.0.1", "--port", str(port), stderr=asyncio.subprocess.PIPE
        )
        _, err = await asyncio.wait_for(second.communicate(), 20)
        assert second.returncode != 0
        assert f"cannot listen on 127.0.0.1:{port}: port {port} is already in use" in err.decode()
    finally:
        first.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(first.wait(), 20) == 0
