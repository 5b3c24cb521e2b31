"""Another process fills the disk under ``rdzv-server --state-dir`` while a job runs (issue 42,
item 6): the server goes read-only instead of stopping, and comes back once the disk has room.

A real two-node job (``LiveJob``) runs the whole time; the state dir is on a 4 MiB tmpfs, and
the test fills that file system with a file of its own until writes fail with ENOSPC. Scripted
agents then join new one-node jobs until the server's next log write fails. Checked while
read-only: the server is up and said so once; the running job keeps its round, members and
workers; ``/healthz`` (still 200) and ``/metrics`` say read-only; a new agent connection gets
the non-fatal ``server_busy`` Error (a real agent retries it); a drain gets 503. The filler is
deleted: the server says it is writable again (once), the held answers arrive, the waiting real
agent joins. Then the server is SIGKILLed and restarted on the same dir: every job that was
acknowledged is there as it was, and the running job's agents resume it without a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from protocol import (
    MAGIC,
    SERVER_MESSAGES,
    SUPPORTED_VERSIONS,
    Assignment,
    Error,
    FrameDecoder,
    Hello,
    Join,
    Message,
    Welcome,
    encode,
)

from .live_job import LiveJob, get, http
from .procs import WORKERS, Proc, agent_cmd, server_cmd

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("mount") is None, reason="mounts a tmpfs: needs root"
    ),
]

REFUSED = "takes no new agents until there is room"  # the answer to a new connection
HELD = "waits until there is room again"  # the notice to an agent whose answer is held


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs (needs root): {exc}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> int:
    """Write ``path`` until its file system has no room left (ENOSPC); returns its size."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    written = 0
    try:
        for chunk in (b"\1" * 65536, b"\1" * 512, b"\1"):
            while True:
                try:
                    n = os.write(fd, chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
                written += n
                if n < len(chunk):
                    break
    finally:
        os.close(fd)
    return written


class Knock:
    """A scripted agent of a one-node job of its own: hello, then join when welcomed."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, job: str) -> None:
        self.reader, self.writer, self.job = reader, writer, job
        self.decoder = FrameDecoder(allowed=SERVER_MESSAGES, expect_magic=True)
        self.pending: list[Message] = []
        self.got: list[Message] = []
        self.joined = False

    @classmethod
    async def open(cls, port: int, job: str) -> Knock:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(MAGIC + encode(Hello(versions=SUPPORTED_VERSIONS, software="disk-full-test")))
        return cls(r, w, job)

    async def recv(self, timeout: float) -> Message | None:
        """The next message (kept in ``got``); None once closed. TimeoutError if none comes."""
        while not self.pending:
            data = await asyncio.wait_for(self.reader.read(65536), timeout)
            if not data:
                return None
            self.pending.extend(self.decoder.feed(data))
        msg = self.pending.pop(0)
        self.got.append(msg)
        if isinstance(msg, Welcome) and not self.joined:
            self.joined = True
            self.writer.write(
                encode(
                    Join(
                        job_id=self.job,
                        node_id="k",
                        addr="127.0.0.1",
                        nproc=1,
                        min_nodes=1,
                        max_nodes=1,
                        entrypoint="knock.py",
                        master_port=29999,
                        max_restarts=0,
                        last_call_timeout=0.0,
                        heartbeat_interval=1.0,
                        heartbeat_timeout=600.0,  # it never beats: the server must not drop it
                    )
                )
            )
        return msg

    async def until_assigned(self, timeout: float) -> Assignment:
        deadline = time.monotonic() + timeout
        while True:
            msg = await self.recv(max(0.1, deadline - time.monotonic()))
            if isinstance(msg, Assignment):
                return msg
            assert msg is not None, f"{self.job}: closed; got {self.got}"
            assert not isinstance(msg, Error) or (HELD in msg.message and not msg.fatal), msg

    def close(self) -> None:
        self.writer.transport.abort()


async def knock(port: int, job: str) -> tuple[str, Knock]:
    """'refused' (the server is read-only: a new connection is turned away), 'held' (its
    answer waits for the disk) or 'assigned'."""
    k = await Knock.open(port, job)
    try:
        while True:
            msg = await k.recv(3.0)
            if msg is None or (isinstance(msg, Error) and REFUSED in msg.message):
                assert msg is None or (msg.code == "server_busy" and not msg.fatal), msg
                return "refused", k
            if isinstance(msg, Error):
                assert HELD in msg.message and msg.code == "server_busy" and not msg.fatal, msg
                return "held", k
            if isinstance(msg, Assignment):
                return "assigned", k
    except TimeoutError:
        return "held", k


def health(port: int) -> dict[str, Any]:
    status, body = get(port, "/healthz")
    assert status == 200, (status, body)  # alive and serving, read-only or not
    return body


def metric(port: int, name: str) -> float:
    status, body = get(port, "/metrics")
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def summary(port: int, job: str) -> tuple[str, int, int, list[str]]:
    status, view = get(port, f"/v1/jobs/{job}")
    assert status == 200, (status, view)
    return view["phase"], view["round"], view["restart_count"], sorted(m["node_id"] for m in view["members"])


def test_a_full_state_disk_makes_the_server_read_only_until_space_is_freed(tmp_path: Path) -> None:
    loop = asyncio.new_event_loop()
    late: Proc | None = None
    again: Proc | None = None
    knocks: list[tuple[str, Knock]] = []
    with tmpfs(tmp_path / "disk", "4m") as disk:
        state = disk / "state"
        args = ("--state-dir", str(state), "--state-min-free-mib", "0")
        try:
            with LiveJob(tmp_path, *args, state_dir=False) as live:
                port = live.port
                assert health(port)["status"] == "ok" and metric(port, "rdzv_state_log_read_only") == 0

                # Another process fills the file system.
                filler = disk / "filler"
                assert fill(filler) > 0

                # New jobs join until a write of the state log fails.
                for i in range(100):
                    how, k = loop.run_until_complete(knock(port, f"knock-{i}"))
                    knocks.append((how, k))
                    if how == "refused":
                        break
                else:
                    raise AssertionError(f"the server never went read-only: {[h for h, _ in knocks]}")
                live.srv.wait_for_line(
                    r"cannot write the state log \(No space left on device in ", timeout=10
                )

                # Read-only: up, serving the running job from memory, saying so.
                h = health(port)
                assert h["status"] == "read_only" and h["alarms"] == ["NOSPACE"], h
                assert h["read_only"]["reason"] == f"No space left on device in {state}", h
                assert metric(port, "rdzv_state_log_read_only") == 1
                assert metric(port, "rdzv_state_log_read_only_entered_total") == 1

                # A new agent connection: the clear, non-fatal error, at once.
                how, k = loop.run_until_complete(knock(port, "newcomer"))
                assert how == "refused" and isinstance(k.got[0], Error), k.got
                err = k.got[0]
                assert err.code == "server_busy" and not err.fatal, err
                assert err.message.startswith("the rendezvous server cannot write its state log (No space")
                k.close()
                # A real agent of a new job is told the same, and keeps trying.
                late_args = ["--nnodes", "1", "--nproc-per-node", "1", "--max-restarts", "0"]
                late_args += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "late"]
                late = Proc(
                    agent_cmd(*late_args, str(WORKERS / "hold.py")),
                    env={"RELEASE_FILE": str(tmp_path / "release-late"), "HOLD_TIMEOUT": "300"},
                )
                late.wait_for_line(r"is busy: the rendezvous server cannot write its state log", timeout=30)
                status, body = loop.run_until_complete(
                    http(port, "POST", f"/v1/jobs/{live.job}/nodes/{live.nodes[0]}/drain")
                )
                assert status == 503 and body["error"] == "read_only", (status, body)

                time.sleep(3)  # several retries fail, several heartbeat sweeps pass
                live.assert_intact()  # same round and members, workers alive, no traceback
                assert health(port)["status"] == "read_only"
                assert live.srv.stderr.count("cannot write the state log") == 1  # said once

                # The other process frees its file: the server writes its state again.
                filler.unlink()
                live.srv.wait_for_line(r"read-only mode is over", timeout=20)
                assert health(port)["status"] == "ok" and metric(port, "rdzv_state_log_read_only") == 0
                for how, k in knocks:
                    if how == "held":  # its answers were held: they come now
                        loop.run_until_complete(k.until_assigned(15))
                late.wait_for_line(r"hold: rank 0 of 1 started", stream="out", timeout=60)
                live.assert_intact()
                assert live.srv.stderr.count("read-only mode is over") == 1

                # Every fact acknowledged is in the log: a server killed now restarts with it.
                jobs = [live.job, "late"] + [k.job for how, k in knocks if how != "refused"]
                before = {job: summary(port, job) for job in jobs}
                assert before[live.job] == ("running", 0, 0, live.nodes)
                assert before["late"][0] == "running"
                live.srv.signal(signal.SIGKILL)
                live.srv.wait(timeout=10)
                again = Proc(server_cmd("--host", "127.0.0.1", "--port", str(port), *args))
                again.wait_for_line(rf"record\(s\) replayed, {len(jobs)} active job", timeout=20)
                again.wait_for_line(r"listening on", timeout=20)
                live.server = again
                assert {job: summary(port, job) for job in jobs} == before
                for a in live.agents:
                    a.wait_for_line(r"resumed round 0 \(the server kept it\)", timeout=30)
                late.wait_for_line(r"resumed round 0 \(the server kept it\)", timeout=30)
                (tmp_path / "release-late").touch()
                assert late.wait(timeout=60) == 0, late.stderr[-3000:]
                for _, k in knocks:
                    k.close()
                live.finish()  # released: both agents exit 0, the job finished, no restart
        finally:
            for _, k in knocks:
                k.close()
            if late is not None:
                late.kill()
            if again is not None:
                again.kill()
            loop.close()
