"""A real etcd for the tests: Debian's etcd-server, on free loopback ports, in a temporary dir."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from .procs import Proc, free_port


class Etcd:
    """One etcd member; stop() and start() again keep its data dir, as a restart would."""

    def __init__(self, data_dir: Path) -> None:
        if shutil.which("etcd") is None:
            pytest.fail("etcd is not installed: scripts/test.sh installs Debian's etcd-server")
        self.data_dir = data_dir
        self.port = free_port()
        self.peer_port = free_port()
        self.proc: Proc | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        url, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        self.proc = Proc(
            [
                "etcd",
                "--name",
                "test",
                "--data-dir",
                str(self.data_dir),
                "--listen-client-urls",
                url,
                "--advertise-client-urls",
                url,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"test={peer}",
            ]
        )
        self.proc.wait_for_line(r"ready to serve client requests", timeout=30)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc = None


def agent_args(etcd: Etcd) -> tuple[str, ...]:
    return ("--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoint)
