"""A live ``rdzv-server`` process with a real two-node job on it, for attack tests.

``LiveJob`` starts the server (with whatever flags a test gives, a ``--state-dir`` by default),
then two real ``node-agent`` processes whose workers (``workers/hold.py``) run until the test
releases them. A test attacks the server's port over real sockets while the job runs, then
asks what an operator would see:

- ``assert_intact()``: the job is still in its first round with the same two members, no
  failure and no restart; both workers are alive; ``/healthz`` answers; the server process
  is alive and has logged no traceback;
- ``rss_kb()`` / ``state_log_bytes()``: the server's memory and its state log's size, to
  compare with a stated bound;
- ``finish()``: release the workers; both agents exit 0 and the job is finished.

The context manager kills every process it started, whatever happened.
"""

from __future__ import annotations

import asyncio
import json
import signal
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from protocol import (
    MAGIC,
    SERVER_MESSAGES,
    Error,
    FrameDecoder,
    Hello,
    Message,
    ProtocolError,
    Welcome,
    encode,
)

from .procs import WORKERS, Proc, agent_cmd, pid_alive, start_server

JOB = "live-job"


async def http(
    port: int,
    method: str,
    path: str,
    *,
    token: str | None = None,
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
    host: str = "127.0.0.1",
    tls: ssl.SSLContext | None = None,
    source: str | None = None,
) -> tuple[int, Any]:
    """One HTTP/1.1 request on its own connection (HTTPS with ``tls``): (status, decoded JSON
    or the raw body). ``source``: the loopback address to connect from (another machine's
    probe, say)."""
    local = (source, 0) if source is not None else None
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=tls, local_addr=local)
    try:
        extra = dict(headers or {})
        if token:
            extra.setdefault("Authorization", f"Bearer {token}")
        if body is None:
            body = b"{}" if method == "POST" else b""
            if method == "POST":
                extra.setdefault("Content-Type", "application/json")
        lines = "".join(f"{k}: {v}\r\n" for k, v in extra.items())
        head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{lines}Content-Length: {len(body)}\r\n"
        writer.write(head.encode() + b"Connection: close\r\n\r\n" + body)
        raw = await asyncio.wait_for(reader.read(), timeout=15)
    finally:
        writer.transport.abort()
    head_bytes, _, payload = raw.partition(b"\r\n\r\n")
    status = int(head_bytes.split(b" ", 2)[1])
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload


def get(port: int, path: str, **kw: Any) -> tuple[int, Any]:
    return asyncio.run(http(port, "GET", path, **kw))


def rss_kb(pid: int, key: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} for pid {pid}")


def wait_until(what: str, check: Callable[[], bool], timeout: float) -> None:
    """Poll a condition of another process (there is no event to await across processes)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.05)


class Peer:
    """A scripted agent: hello on open, then whatever the test sends."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, read_timeout: float
    ) -> None:
        self.reader, self.writer = reader, writer
        self.read_timeout = read_timeout  # a reply from a live server on 2 busy cores
        self.decoder = FrameDecoder(allowed=SERVER_MESSAGES, expect_magic=True)
        self.pending: list[Message] = []
        self.challenge = ""

    @classmethod
    async def open(cls, port: int, *, software: str = "attacker", read_timeout: float = 15.0) -> Peer:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(MAGIC + encode(Hello(versions=(1,), software=software)))
        peer = cls(reader, writer, read_timeout)
        first = await peer.recv()
        if not isinstance(first, Welcome):
            raise ProtocolError(f"expected a welcome, got {first!r}")
        peer.challenge = first.challenge
        return peer

    def send(self, msg: Message) -> None:
        self.writer.write(encode(msg))

    async def recv(self) -> Message | None:
        """The next message, or None once the server closed."""
        while not self.pending:
            try:
                data = await asyncio.wait_for(self.reader.read(1 << 16), timeout=self.read_timeout)
            except ConnectionResetError:
                return None
            if not data:
                return None
            self.pending += self.decoder.feed(data)
        return self.pending.pop(0)

    async def until(self, *types: type) -> Message | None:
        """The next message of one of ``types`` (or an Error, or None when closed)."""
        while True:
            msg = await self.recv()
            if msg is None or isinstance(msg, (Error, *types)):
                return msg

    async def expect(self, *types: type) -> Message:
        """The next message of ``types[0]``, skipping the others of ``types``; else ProtocolError."""
        while True:
            msg = await self.recv()
            if msg is None or isinstance(msg, Error):
                raise ProtocolError(f"expected {[t.__name__ for t in types]}, got {msg!r}")
            if isinstance(msg, types[0]):
                return msg
            if not isinstance(msg, types):
                raise ProtocolError(f"expected {types[0].__name__}, got {msg!r}")

    async def drain(self) -> tuple[list[str], bool]:
        """Error codes until the server closes (waiting at most the read timeout)."""
        codes = []
        try:
            while (msg := await self.recv()) is not None:
                if isinstance(msg, Error):
                    codes.append(msg.code)
        except TimeoutError:
            return codes, False
        return codes, True

    def close(self) -> None:
        self.writer.transport.abort()


class LiveJob:
    """``with LiveJob(tmp_path, ...) as live:`` a server and a running two-node job."""

    def __init__(
        self,
        tmp_path: Path,
        *server_args: str,
        token: str | None = None,
        state_dir: bool = True,
        agent_env: dict[str, str] | None = None,
        job: str = JOB,
    ) -> None:
        self.tmp = tmp_path
        self.job = job
        self.token = token
        self.release = tmp_path / "release"
        self.state_dir = tmp_path / "state" if state_dir else None
        args = list(server_args)
        if self.state_dir is not None:
            args += ["--state-dir", str(self.state_dir)]
        self._server_args = args
        self._agent_env = dict(agent_env or {})
        self.server: Proc | None = None
        self.port = 0
        self.agents: list[Proc] = []
        self.nodes: list[str] = []
        self.worker_pids: list[int] = []

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> LiveJob:
        try:
            self.server, self.port = start_server(*self._server_args)
            self.start_agents()
        except BaseException:
            self.kill()
            raise
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.kill()

    def agent_args(self) -> list[str]:
        return [
            "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "0",
            "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", self.job,
        ]  # fmt: skip

    def start_agents(self) -> None:
        env = {"RELEASE_FILE": str(self.release), "HOLD_TIMEOUT": "300", **self._agent_env}
        if self.token is not None:
            env["RDZV_TOKEN"] = self.token
        cmd = agent_cmd(*self.agent_args(), str(WORKERS / "hold.py"))
        self.agents = [Proc(cmd, env=env) for _ in range(2)]
        for a in self.agents:
            a.wait_for_line(r"hold: rank \d of 2 started \(restart 0\)", stream="out", timeout=60)
        job = self.job_status()
        assert job["phase"] == "running", job
        self.nodes = sorted(m["node_id"] for m in job["members"])
        assert len(self.nodes) == 2, job
        self.worker_pids = [pid for a in self.agents for pid in _worker_pids(a.p.pid)]
        assert len(self.worker_pids) == 2, self.worker_pids

    def kill(self) -> None:
        for a in self.agents:
            a.kill()
        if self.server is not None:
            self.server.kill()

    # -- what an operator sees -----------------------------------------------------------------

    @property
    def srv(self) -> Proc:
        assert self.server is not None
        return self.server

    def job_status(self) -> dict[str, Any]:
        status, job = get(self.port, f"/v1/jobs/{self.job}", token=self.token)
        assert status == 200, (status, job)
        return job

    def healthz(self) -> dict[str, Any]:
        status, health = get(self.port, "/healthz")
        assert status == 200, (status, health)
        return health

    def rss_kb(self, key: str = "VmRSS") -> int:
        return rss_kb(self.srv.p.pid, key)

    def state_log_bytes(self) -> int:
        assert self.state_dir is not None
        return sum(p.stat().st_size for p in self.state_dir.iterdir() if p.is_file())

    def assert_no_traceback(self) -> None:
        err = self.srv.stderr
        assert "Traceback" not in err, err[max(0, err.index("Traceback") - 500) :][:4000]

    def assert_intact(self) -> None:
        """The job never noticed: same round and members, no failure or restart, workers alive."""
        assert self.srv.p.poll() is None, f"the server died\n{self.srv.stderr[-3000:]}"
        self.healthz()
        job = self.job_status()
        assert job["phase"] == "running" and job["round"] == 0 and job["restart_count"] == 0, job
        assert sorted(m["node_id"] for m in job["members"]) == self.nodes, job["members"]
        assert not job["failures"], job
        for pid in self.worker_pids:
            assert pid_alive(pid), f"worker {pid} is gone"
        for a in self.agents:
            assert a.p.poll() is None, f"an agent exited {a.p.returncode}\n{a.stderr[-3000:]}"
        self.assert_no_traceback()

    def finish(self) -> None:
        """Release the workers: both agents exit 0, the job finished, the server stops cleanly."""
        self.release.touch()
        for a in self.agents:
            assert a.wait(timeout=60) == 0, f"an agent failed\n{a.stderr[-3000:]}"
            assert "released" in a.stdout
        job = self.job_status()
        assert job["phase"] == "finished" and job["restart_count"] == 0, job
        self.srv.signal(signal.SIGTERM)
        assert self.srv.wait(timeout=15) == 0, self.srv.stderr[-3000:]
        self.assert_no_traceback()


def _worker_pids(agent_pid: int) -> list[int]:
    """The agent's children that run the worker script (not the agent's own helpers)."""
    pids = []
    for task in Path(f"/proc/{agent_pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            try:
                cmd = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"hold.py" in cmd:
                pids.append(int(child))
    return pids
