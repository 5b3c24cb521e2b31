"""Fixtures shared by the end-to-end tests: the rendezvous each backend runs on."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from .etcd import Etcd, agent_args
from .procs import Proc, start_server


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    """One real etcd per test module; each test uses its own rdzv id, so jobs never meet.

    Not per session: an etcd still running would count as a leaked child process in the
    later modules that check for those."""
    server = Etcd(tmp_path_factory.mktemp("etcd") / "data")
    server.start()
    try:
        yield server
    finally:
        server.kill()


@dataclass
class Rendezvous:
    """Where a test's agents meet: our rdzv-server, or a real etcd (--rdzv-backend etcd)."""

    backend: str
    args: tuple[str, ...]  # the agent flags that point at it
    server: Proc | None = None  # our server, whose job log a test may check

    def server_logs(self, pattern: str, timeout: float = 5.0) -> None:
        """The server logged a job event (etcd has no server: the agents' own lines show it)."""
        if self.server is not None:
            self.server.wait_for_line(pattern, timeout=timeout)


@pytest.fixture(params=["c10d", "etcd"])
def rdzv(request: pytest.FixtureRequest) -> Iterator[Rendezvous]:
    if request.param == "etcd":
        yield Rendezvous("etcd", agent_args(request.getfixturevalue("etcd")))
        return
    srv, port = start_server()
    try:
        yield Rendezvous("c10d", ("--rdzv-endpoint", f"127.0.0.1:{port}"), srv)
        srv.signal(signal.SIGTERM)
        assert srv.wait(timeout=15) == 0, srv.stderr
    finally:
        srv.kill()
