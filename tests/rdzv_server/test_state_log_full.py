"""A full state disk (issue 42, item 6): the server goes read-only instead of stopping.

The disk is a ``wal.Disk`` whose writes and fsyncs a test fails: with ENOSPC after some bytes
(a partial write, as a file system that fills mid-write gives), at the fsync, or with EIO. The
checks: nothing acknowledged is lost (the files replay to what agents were told), the change
whose record failed is held, not lost (it is in the machine, and in the snapshot that ends
read-only mode), and EIO still stops the server.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import shutil
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
    JobDone,
    Join,
    Message,
    Welcome,
    WorkersSucceeded,
    encode,
)
from rdzv_server import journal, service, state_image, wal
from rdzv_server.journal import LOG_NAME, SNAP_NAME, StateLog
from rdzv_server.machine.state import Event, Rendezvous
from rdzv_server.service import RendezvousService

from .harness import Harness


class FullDisk(wal.Disk):
    """A disk that fills when told: ``room`` bytes more may be written (None: no limit), and an
    fsync fails while ``fail_fsync``; the error is ``error`` (ENOSPC unless told)."""

    def __init__(self) -> None:
        self.room: int | None = None
        self.fail_fsync = False
        self.error = errno.ENOSPC
        self.failures = 0

    def _fail(self) -> OSError:
        self.failures += 1
        return OSError(self.error, os.strerror(self.error))

    def write(self, fd: int, data: memoryview) -> int:
        if self.room is None:
            return super().write(fd, data)
        if self.room == 0:
            raise self._fail()
        n = super().write(fd, data[: self.room])
        self.room -= n
        return n

    def fsync(self, fd: int) -> None:
        if self.fail_fsync:
            raise self._fail()
        super().fsync(fd)


def state(m: Rendezvous) -> dict[str, Any]:
    """The machine's state, without what heartbeats alone change (not logged)."""
    d = state_image.dump(m)
    for c in d["conns"]:
        c.pop("last_seen")
    return d


def on_disk(directory: Path, tmp_path: Path) -> Rendezvous:
    """What a server that died now would restart from: the dir's snapshot and log, replayed
    (from a copy: replay truncates a torn tail, and the live log has the files open)."""
    copy = tmp_path / f"copy-{len(list(tmp_path.glob('copy-*')))}"
    copy.mkdir(mode=0o700)
    for name in (LOG_NAME, SNAP_NAME):
        if (directory / name).exists():
            shutil.copyfile(directory / name, copy / name)
    machine = Rendezvous(None, expire_silent=False)
    snap_seq, _, _ = journal._load_snapshot(copy / SNAP_NAME, machine)
    journal.replay_log(copy / LOG_NAME, machine, snap_seq)
    return machine


def wire(log: StateLog, h: Harness) -> list[OSError]:
    """Route a harness's events through the log as the service does, a sync per event; a
    failed write puts the log read-only (the service's ``_log_failed``). Returns the failures."""
    failures: list[OSError] = []
    machine = log.machine
    orig = machine.handle

    def handle(event: Event, now: float) -> list[Any]:
        effects = orig(event, now)
        log.record(event, effects, now)
        try:
            log.sync()
        except OSError as exc:
            failures.append(exc)
            assert log.enter_read_only(exc)
        return effects

    machine.handle = handle  # type: ignore[method-assign]
    h.machine = machine
    return failures


# --- the log ------------------------------------------------------------------------------


@pytest.mark.parametrize("room", [0, 7, 40])
def test_a_write_that_fills_the_disk_cuts_the_log_back_and_a_snapshot_ends_read_only(
    tmp_path: Path, room: int
) -> None:
    disk = FullDisk()
    d = tmp_path / "state"
    log, _, _ = StateLog.open(d, disk=disk)
    h = Harness()
    failures = wire(log, h)
    a, b = h.join(), h.join()
    assert h.last(a, Assignment) is not None
    acknowledged = state(log.machine)
    size = (d / LOG_NAME).stat().st_size

    disk.room = room  # the next record fits only in part (or not at all)
    h.send(a, WorkersSucceeded(round=0))
    assert [f.errno for f in failures] == [errno.ENOSPC]
    assert log.read_only == f"No space left on device in {d}"
    assert (d / LOG_NAME).stat().st_size == size  # the torn part is cut away
    # The change is in memory (the service holds its effects), not on disk.
    assert log.machine.jobs["job"].members["node1"].state.value == "succeeded"
    assert state(on_disk(d, tmp_path)) != state(log.machine)
    restarted = on_disk(d, tmp_path)
    assert restarted.jobs["job"].members["node1"].state.value == "running"
    # Read-only, nothing is written: a change is counted, the file stays as it is.
    h.send(b, WorkersSucceeded(round=0))
    assert log.held == 2 and (d / LOG_NAME).stat().st_size == size and len(failures) == 1
    assert log.machine.jobs["job"].phase.value == "finished"
    assert acknowledged != state(log.machine)

    # Still full: recover fails, and the snapshot's tmp file gives its room back.
    disk.room = 5
    with pytest.raises(OSError) as exc:
        log.recover()
    assert log.enter_read_only(exc.value) and log.read_only
    assert not (d / (SNAP_NAME + ".tmp")).exists()
    disk.room = None
    assert log.recover() == 2 and log.read_only == "" and log.held == 0
    assert state(on_disk(d, tmp_path)) == state(log.machine)  # every held change is written
    h.join(job="after")  # and the log goes on after the snapshot
    log.close()
    again, found, _ = StateLog.open(d)
    try:
        assert found.snapshot_seq > 0 and found.replayed > 0
        assert again.machine.jobs["job"].phase.value == "finished" and "after" in again.machine.jobs
    finally:
        again.close()


def test_an_fsync_that_finds_the_disk_full_drops_what_it_did_not_make_durable(tmp_path: Path) -> None:
    disk = FullDisk()
    d = tmp_path / "state"
    log, _, _ = StateLog.open(d, disk=disk)
    h = Harness()
    failures = wire(log, h)
    a, _ = h.join(), h.join()
    size = (d / LOG_NAME).stat().st_size
    disk.fail_fsync = True  # the bytes went into the page cache; the file system had no room
    h.send(a, WorkersSucceeded(round=0))
    assert len(failures) == 1 and log.read_only
    # Written, not durable: cut away, so a restart cannot replay what nobody was told.
    assert (d / LOG_NAME).stat().st_size == size
    assert on_disk(d, tmp_path).jobs["job"].members["node1"].state.value == "running"
    disk.fail_fsync = False
    log.recover()
    assert on_disk(d, tmp_path).jobs["job"].members["node1"].state.value == "succeeded"
    log.close()


def test_a_compaction_that_finds_the_disk_full_keeps_the_old_files(tmp_path: Path) -> None:
    disk = FullDisk()
    d = tmp_path / "state"
    log, _, _ = StateLog.open(d, disk=disk, snapshot_every=1_000)
    h = Harness()
    wire(log, h)
    h.join(), h.join()
    before = state(log.machine)
    disk.room = 100  # less than a snapshot
    with pytest.raises(OSError) as exc:
        log.compact()
    assert log.enter_read_only(exc.value)
    assert not (d / SNAP_NAME).exists() and not (d / (SNAP_NAME + ".tmp")).exists()
    assert state(on_disk(d, tmp_path)) == before  # the log holds it all still
    disk.room = None
    log.recover()
    assert (d / SNAP_NAME).exists() and state(on_disk(d, tmp_path)) == before
    log.close()


def test_eio_is_not_waited_out(tmp_path: Path) -> None:
    disk = FullDisk()
    d = tmp_path / "state"
    log, _, _ = StateLog.open(d, disk=disk)
    disk.room, disk.error = 0, errno.EIO
    log.append({"k": "recover"}, log.clock())
    with pytest.raises(OSError) as exc:
        log.sync()
    assert not log.enter_read_only(exc.value)
    assert log.broken and not log.read_only
    disk.room = None
    log.append({"k": "recover"}, log.clock())
    assert not log.write()  # nothing more is written after such a failure
    log.close()  # and closing does not try (nor raise)


# --- the service --------------------------------------------------------------------------


class RawAgent:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = FrameDecoder(allowed=SERVER_MESSAGES, expect_magic=True)
        self.pending: list[Message] = []

    @classmethod
    async def open(cls, port: int) -> RawAgent:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        a = cls(r, w)
        w.write(MAGIC + encode(Hello(versions=SUPPORTED_VERSIONS, software="test")))
        return a

    async def recv(self, timeout: float = 5.0) -> Message | None:
        """The next message; None once the server closed the connection."""
        while not self.pending:
            data = await asyncio.wait_for(self.reader.read(65536), timeout=timeout)
            if not data:
                return None
            self.pending.extend(self.decoder.feed(data))
        return self.pending.pop(0)

    def send(self, msg: Message) -> None:
        self.writer.write(encode(msg))


def join(node: str) -> Join:
    return Join(
        job_id="j",
        node_id=node,
        addr="127.0.0.1",
        nproc=1,
        min_nodes=2,
        max_nodes=2,
        entrypoint="x.py",
        master_port=29000,
        max_restarts=0,
        last_call_timeout=0.0,
        heartbeat_interval=1.0,
        heartbeat_timeout=30.0,
    )


async def http_get(port: int, path: str, method: str = "GET") -> tuple[int, str]:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    extra = "Content-Type: application/json\r\nContent-Length: 2\r\n" if method == "POST" else ""
    body = "{}" if method == "POST" else ""
    w.write(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}Connection: close\r\n\r\n{body}".encode())
    raw = await asyncio.wait_for(r.read(), timeout=5)
    w.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), payload.decode()


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


async def until(what: str, check: Any, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("where", ["write", "fsync"])
async def test_a_full_disk_makes_the_server_read_only_until_a_snapshot_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    monkeypatch.setattr(service, "RETRY", 0.05)
    monkeypatch.setattr(service, "RETRY_MAX", 0.1)
    caplog.set_level(logging.INFO, logger="rdzv_server")
    disk = FullDisk()
    d = tmp_path / "state"
    log, _, _ = StateLog.open(d, disk=disk)
    fatal: list[str] = []
    svc = RendezvousService(http=True, state_log=log, on_fatal=fatal.append)
    port = await svc.start("127.0.0.1", 0)
    try:
        a, b = await RawAgent.open(port), await RawAgent.open(port)
        for i, x in enumerate((a, b)):
            assert isinstance(await x.recv(), Welcome)
            x.send(join(f"n{i}"))
        for x in (a, b):
            while not isinstance(await x.recv(), Assignment):
                pass
        acknowledged = state(svc.machine)
        # One says hello and does not join yet: its records are written, not fsync'd (a
        # welcome promises nothing), and the failure below cuts them away with the rest.
        ready = await RawAgent.open(port)
        assert isinstance(await ready.recv(), Welcome)
        await until("its hello written", lambda: not log.pending)

        # Another process fills the disk: the next write fails.
        if where == "write":
            disk.room = 0
        else:
            disk.fail_fsync = True
        a.send(WorkersSucceeded(round=0))
        await until("read-only", lambda: log.read_only)
        assert not fatal and svc.read_only.startswith("No space left on device in ")
        b.send(WorkersSucceeded(round=0))  # the job is done, in memory: JobDone is held
        for x in (a, b):
            notice = await x.recv()
            assert isinstance(notice, Error) and not notice.fatal and notice.code == "server_busy", notice
            assert (
                "cannot write its state log" in notice.message
                and "waits until there is room" in notice.message
            )
        assert svc.machine.jobs["j"].phase.value == "finished"
        with pytest.raises(TimeoutError):
            await a.recv(timeout=0.3)  # nothing more: its JobDone waits for the disk
        # A server that died now restarts from what the agents were told.
        assert state(on_disk(d, tmp_path)) == acknowledged

        # A new agent is told at once, non-fatally (an agent tries again until its deadline).
        c = await RawAgent.open(port)
        refused = await c.recv()
        assert isinstance(refused, Error) and refused.code == "server_busy" and not refused.fatal
        assert "takes no new agents until there is room" in refused.message
        assert await c.recv() is None  # closed
        # One that said hello before is told the same when it joins (it comes back later).
        ready.send(join("n2"))
        refused = await ready.recv()
        assert isinstance(refused, Error) and refused.code == "server_busy" and not refused.fatal
        assert "takes no new agents" in refused.message and await ready.recv() is None

        status, body = await http_get(port, "/healthz")
        health = json.loads(body)
        assert status == 200 and health["status"] == "read_only" and health["alarms"] == ["NOSPACE"]
        assert health["read_only"]["held_changes"] >= 1 and health["read_only"]["refused_connections"] == 2
        assert health["read_only"]["reason"].startswith("No space left on device")
        status, body = await http_get(port, "/metrics")
        assert metric(body, "rdzv_state_log_read_only") == 1
        assert metric(body, "rdzv_state_log_read_only_entered_total") == 1
        status, body = await http_get(port, "/v1/jobs/j/nodes/n0/drain", "POST")
        assert status == 503 and json.loads(body)["error"] == "read_only"

        await asyncio.sleep(0.4)  # a few retries fail: said once, not per try
        assert disk.failures >= 3
        disk.room, disk.fail_fsync = None, False  # the other process frees its file
        for x in (a, b):
            assert isinstance(await x.recv(), JobDone)  # the held answers, now
        assert not log.read_only
        assert state(on_disk(d, tmp_path)) == state(svc.machine)
        status, body = await http_get(port, "/healthz")
        assert json.loads(body)["status"] == "ok" and json.loads(body)["alarms"] == []
        status, body = await http_get(port, "/metrics")
        assert metric(body, "rdzv_state_log_read_only") == 0
        c = await RawAgent.open(port)
        assert isinstance(await c.recv(), Welcome)  # new agents are welcome again
    finally:
        await svc.close()
        log.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len([x for x in lines if "read-only until there is room" in x]) == 1
    assert len([x for x in lines if "read-only mode is over" in x]) == 1
    assert not fatal
    again, _, _ = StateLog.open(d)
    try:  # (its agents closed their connections since: it is a finished job now)
        assert [(j.id, j.phase.value) for j in again.machine.finished_jobs] == [("j", "finished")]
    finally:
        again.close()


async def test_eio_still_stops_the_server(tmp_path: Path) -> None:
    disk = FullDisk()
    log, _, _ = StateLog.open(tmp_path / "state", disk=disk)
    fatal: list[str] = []
    svc = RendezvousService(state_log=log, on_fatal=fatal.append)
    port = await svc.start("127.0.0.1", 0)
    try:
        disk.room, disk.error = 0, errno.EIO
        await RawAgent.open(port)
        await until("stopped", lambda: fatal)
        assert fatal == [f"cannot write the state log in {tmp_path / 'state'}: Input/output error"]
        assert not log.read_only and log.broken
    finally:
        await svc.close()
        log.close()


async def test_shutdown_while_read_only_keeps_what_was_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(service, "RETRY", 0.05)
    disk = FullDisk()
    d = tmp_path / "state"
    log, _, _ = StateLog.open(d, disk=disk)
    svc = RendezvousService(state_log=log)
    port = await svc.start("127.0.0.1", 0)
    try:
        a, b = await RawAgent.open(port), await RawAgent.open(port)
        for i, x in enumerate((a, b)):
            assert isinstance(await x.recv(), Welcome)
            x.send(join(f"n{i}"))
        for x in (a, b):
            while not isinstance(await x.recv(), Assignment):
                pass
        disk.room = 0
        a.send(WorkersSucceeded(round=0))
        await until("read-only", lambda: log.read_only)
        await svc.go_away("received SIGTERM", grace=1.0)
    finally:
        await svc.close()
        log.close()
    assert any(
        "were never acknowledged to an agent and are not kept" in r.getMessage() for r in caplog.records
    )
    again, _, _ = StateLog.open(d)
    try:
        assert again.machine.jobs["j"].members["n0"].state.value == "running"  # as the agents know
    finally:
        again.close()
