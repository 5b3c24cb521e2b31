"""Bad input gets a clear message and a non-zero exit, before anything slow, and leaves nothing."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from protocol import MAGIC, Error, encode

from .procs import WORKERS, Proc, agent_cmd, server_cmd, start_server

DUMP = str(WORKERS / "dump_env.py")


def run(argv: list[str], timeout: float = 30, env: dict[str, str] | None = None) -> tuple[Proc, float]:
    t0 = time.monotonic()
    p = Proc(argv, env=env)
    try:
        p.wait(timeout=timeout)
    finally:
        p.kill()
    return p, time.monotonic() - t0


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--nproc-per-node", "0", DUMP], "--nproc-per-node"),
        (["--nproc-per-node", "abc", DUMP], "abc"),
        (["--nnodes", "3:2", DUMP], "3:2"),
        (["--rdzv-backend", "zookeeper", DUMP], "zookeeper"),
        (["--nproc-per-node", "2", "no_such_script.py"], "no_such_script.py"),
        (["--rdzv-conf", "join_timeout=soon", DUMP], "join_timeout"),
        (["--rdzv-endpoint", "host:notaport", "--nnodes", "2", DUMP], "notaport"),
    ],
)
def test_bad_command_line_is_refused_at_once(args: list[str], needle: str) -> None:
    p, _ = run(agent_cmd(*args))
    assert p.p.returncode == 2
    assert "error" in p.stderr.lower() and needle in p.stderr
    assert "Traceback" not in p.stderr


def test_unreachable_endpoint_retries_then_fails_after_join_timeout() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    args = [
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-conf",
        "join_timeout=0.3,is_host=false",
    ]
    p, took = run(agent_cmd(*args, DUMP))
    assert p.p.returncode == 1
    assert p.stderr.count("waiting for the rendezvous server") == 1  # said once, not per retry
    assert "no rendezvous server answered" in p.stderr and "join timeout" in p.stderr
    assert took < 15


class SilentListener:
    """Accepts connections and answers nothing, or a fixed reply, like a wrong service."""

    def __init__(self, reply: bytes = b"") -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.reply = reply
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            if self.reply:
                c.recv(65536)
                c.sendall(self.reply)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.parametrize(
    ("reply", "needle", "read_timeout"),
    [
        # Silence ends at the read timeout: short, as the wait is the test. An answer must
        # beat it, so those keep a long one (they do not wait it out).
        (b"", "did not answer as a rendezvous server", 0.3),
        (b"HTTP/1.1 400 Bad Request\r\n\r\n", "does not speak the rendezvous protocol", 2),
        (MAGIC + encode(Error(code="version_mismatch", message="we speak versions [7]")), "versions [7]", 2),
    ],
)
def test_endpoint_that_is_not_our_server_is_named(reply: bytes, needle: str, read_timeout: float) -> None:
    srv = SilentListener(reply)
    try:
        args = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{srv.port}"]
        args += ["--rdzv-conf", f"read_timeout={read_timeout:g}"]
        p, took = run(agent_cmd(*args, DUMP))
    finally:
        srv.close()
    assert p.p.returncode == 1
    assert needle in p.stderr
    assert took < 15


def test_server_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p, _ = run(server_cmd("--host", "127.0.0.1", "--port", str(port)))
    assert p.p.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in p.stderr
    assert "Traceback" not in p.stderr


def test_agent_with_other_settings_than_its_job_is_refused(tmp_path: Path) -> None:
    srv, port = start_server()
    common = ["--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "same"]
    first = Proc(agent_cmd("--nnodes", "2", *common, DUMP), env={"DUMP_DIR": str(tmp_path)})
    try:
        first.wait_for_line(r"waiting for nodes: 1 of 2", timeout=30)
        second, _ = run(agent_cmd("--nnodes", "3", *common, DUMP), env={"DUMP_DIR": str(tmp_path)})
        assert second.p.returncode == 1
        assert "--nnodes 2" in second.stderr and "--nnodes 3" in second.stderr
        other, _ = run(agent_cmd("--nnodes", "2", *common, str(WORKERS / "sleeper.py")))
        assert other.p.returncode == 1
        assert "dump_env.py" in other.stderr and "sleeper.py" in other.stderr
    finally:
        first.kill()
        srv.kill()
