"""Attacks on a live ``rdzv-server`` through its HTTP side and its state log (issue 17, items
3, 7, 10, 11, 12), each while a real two-node job runs (``LiveJob``), over real sockets.

Each test asserts what an operator sees: the job keeps its round, members and workers,
``/healthz`` answers, the server logged no traceback, and the figure the item bounds (the
body of ``/v1/jobs``, the state log's size, a refused join's text, an HTTP status).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from protocol import (
    MAGIC,
    SERVER_MESSAGES,
    SUPPORTED_VERSIONS,
    Error,
    FrameDecoder,
    Hello,
    Join,
    Leave,
    Message,
    WorkersSucceeded,
    encode,
)
from protocol.auth import proof

from .live_job import LiveJob, get, http, wait_until

pytestmark = pytest.mark.timeout(120)


class Member:
    """A scripted agent of its own one-node job (not the live job)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = FrameDecoder(allowed=SERVER_MESSAGES, expect_magic=True)
        self.pending: list[Message] = []

    @classmethod
    async def join(cls, port: int, job: str, node: str, token: str | None = None) -> tuple[Member, Message]:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        m = cls(r, w)
        w.write(MAGIC + encode(Hello(versions=SUPPORTED_VERSIONS, software="attack")))
        welcome = await m.recv()
        given = proof(token, welcome.challenge, job, node) if token else ""  # type: ignore[attr-defined]
        m.send(
            Join(
                job_id=job,
                node_id=node,
                addr="127.0.0.1",
                nproc=1,
                min_nodes=1,
                max_nodes=1,
                entrypoint="attack.py",
                master_port=1,
                max_restarts=0,
                last_call_timeout=0.0,
                heartbeat_interval=1.0,
                heartbeat_timeout=60.0,
                proof=given,
            )
        )
        return m, await m.recv()

    async def recv(self, timeout: float = 15.0) -> Message:
        while not self.pending:
            data = await asyncio.wait_for(self.reader.read(65536), timeout)
            if not data:
                raise ConnectionError("the server closed the connection")
            self.pending.extend(self.decoder.feed(data))
        return self.pending.pop(0)

    def send(self, msg: Message) -> None:
        self.writer.write(encode(msg))

    def close(self) -> None:
        self.writer.transport.abort()


# --- 3: the job list is a bounded summary ---------------------------------------------------------


def test_many_jobs_give_a_bounded_job_list_naming_no_node(tmp_path: Path) -> None:
    with LiveJob(tmp_path) as live:

        async def attack() -> list[Member]:
            held = []
            for i in range(250):
                m, got = await Member.join(live.port, f"flood-{i}", f"n{i}")
                assert type(got).__name__ in ("Assignment", "Waiting"), got
                held.append(m)
            return held

        loop = asyncio.new_event_loop()
        try:
            held = loop.run_until_complete(attack())
            status, doc = get(live.port, "/v1/jobs")
            assert status == 200
            body = json.dumps(doc)
            assert len(doc["jobs"]) == 200 and doc["jobs_total"] == 251 and doc["truncated"]
            assert len(body) < 200 * 600, len(body)  # a few hundred bytes per job
            assert not [j for j in doc["jobs"] if "members" in j or "history" in j]
            assert "127.0.0.1" not in body and live.nodes[0] not in body
            # The live job is the oldest: left out of the list, found by its id.
            assert live.job_status()["phase"] == "running"
            for m in held:
                m.close()
        finally:
            loop.close()
        live.assert_intact()
        live.finish()


# --- 7: only changes are logged; a nearly full disk refuses new nodes ------------------------------


def test_a_member_repeating_ignored_frames_does_not_grow_the_state_log(tmp_path: Path) -> None:
    with LiveJob(tmp_path) as live:
        before = live.state_log_bytes()

        async def attack() -> None:
            m, _ = await Member.join(live.port, "spam", "s1")
            frame = encode(WorkersSucceeded(round=7))  # a round that is not running: ignored
            # The server may close the flood before it is all sent (how soon depends on when it
            # reads): either way its state log must not grow with it.
            with contextlib.suppress(ConnectionError, TimeoutError):
                for _ in range(40):
                    m.writer.write(frame * 1000)
                    await m.writer.drain()
                m.send(Leave(reason="done"))
                while True:
                    await m.recv(5.0)
            m.close()

        asyncio.run(attack())
        grown = live.state_log_bytes() - before
        # The spam job's join, round and leave: a few records, not 40,000 (3.7 MB before).
        assert grown < 16 * 1024, grown
        live.assert_intact()
        live.finish()


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], check=True
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs (needs root): {exc}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None, reason="mounts a tmpfs: needs root")
def test_a_nearly_full_state_disk_refuses_new_nodes_and_keeps_the_job(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk", "4m") as disk:
        args = ("--state-dir", str(disk), "--state-min-free-mib", "2")
        with LiveJob(tmp_path, *args, state_dir=False) as live:
            st = os.statvfs(disk)
            free = st.f_bavail * st.f_frsize
            (disk / "filler").write_bytes(b"\1" * (free - (1 << 20)))  # leaves ~1 MiB of 4

            async def try_join(i: int) -> Message:
                m, got = await Member.join(live.port, f"new-{i}", "newcomer")
                m.close()
                return got

            refused: list[Message] = []

            def is_refused() -> bool:
                refused.append(asyncio.run(try_join(len(refused))))
                return isinstance(refused[-1], Error)

            wait_until("a new node refused for the disk", is_refused, 20)
            err = refused[-1]
            assert isinstance(err, Error) and err.code == "server_busy", err
            assert (
                err.message.startswith("the server's state disk is nearly full (")
                and str(disk) in err.message
            )
            assert err.message.endswith("no new nodes until space is freed")
            live.srv.wait_for_line("state disk is nearly full", timeout=10)
            live.assert_intact()  # the running job is served, and its agents keep beating
            (disk / "filler").unlink()
            wait_until("a new node accepted once space is freed", lambda: not is_refused(), 20)
            live.assert_intact()
            live.finish()


# --- 10: a peer's text cannot forge the server's log lines -----------------------------------------


def test_a_peers_control_characters_do_not_forge_log_lines(tmp_path: Path) -> None:
    with LiveJob(tmp_path) as live:

        async def attack() -> None:
            m, _ = await Member.join(live.port, "forger", "f1")
            m.send(Leave(reason="bye\n2030-01-01 00:00:00,000 ERROR rdzv_server: FORGED\x1b[2J\x1b]0;x\x07"))
            with contextlib.suppress(ConnectionError, TimeoutError):
                while True:
                    await m.recv(5.0)
            m.close()

        asyncio.run(attack())
        wait_until("the leave is logged", lambda: "FORGED" in live.srv.stderr, 10)
        err = live.srv.stderr
        assert "\x1b" not in err and "\x07" not in err
        assert not [line for line in err.splitlines() if "FORGED" in line and line.startswith("2030")]
        assert "bye\\n2030-01-01" in err
        live.assert_intact()
        live.finish()


# --- 11: no cross-site drain, no DNS rebinding -----------------------------------------------------


def test_a_web_pages_simple_post_and_a_rebound_host_are_refused(tmp_path: Path) -> None:
    with LiveJob(tmp_path) as live:
        drain = f"/v1/jobs/{live.job}/nodes/{live.nodes[0]}/drain"
        for ctype in ("text/plain", "application/x-www-form-urlencoded"):
            status, doc = asyncio.run(
                http(live.port, "POST", drain, headers={"Content-Type": ctype}, body=b"")
            )
            assert status == 403 and "application/json" in doc["message"], (status, doc)
        for path in (f"/v1/jobs/{live.job}", "/v1/jobs", "/"):
            status, doc = get(live.port, path, host="attacker.example")
            assert status == 421 and doc["error"] == "misdirected", (path, status, doc)
        status, doc = asyncio.run(
            http(
                live.port,
                "POST",
                drain,
                host="attacker.example",
                headers={"Content-Type": "application/json"},
            )
        )
        assert status == 421, (status, doc)
        assert get(live.port, "/healthz", host="attacker.example")[0] == 200
        live.assert_intact()  # never drained
        live.finish()


# --- 12: with tokens, a job's detail needs a token -------------------------------------------------


def test_with_tokens_detail_reads_need_a_token_and_the_open_reads_name_no_node(tmp_path: Path) -> None:
    tokens, reader = tmp_path / "tokens", tmp_path / "reader"
    tokens.write_text("job-token-0123456789\n")
    reader.write_text("read-token-0123456789\n")
    args = ("--token-file", str(tokens), "--read-token-file", str(reader))
    with LiveJob(tmp_path, *args, token="job-token-0123456789") as live:
        detail = f"/v1/jobs/{live.job}"
        assert get(live.port, detail)[0] == 401
        assert get(live.port, detail, token="a-guess")[0] == 403
        status, job = get(live.port, detail, token="read-token-0123456789")
        assert status == 200 and job["master"]["port"] > 0
        status, listed = get(live.port, "/v1/jobs")
        assert status == 200 and [j["id"] for j in listed["jobs"]] == [live.job]
        status, metrics = get(live.port, "/metrics")
        assert status == 200
        for open_body in (
            json.dumps(listed),
            metrics.decode() if isinstance(metrics, bytes) else str(metrics),
        ):
            assert not [n for n in live.nodes if n in open_body]
            assert str(job["master"]["port"]) not in json.dumps(listed)
        drain = f"/v1/jobs/{live.job}/nodes/{live.nodes[0]}/drain"
        assert asyncio.run(http(live.port, "POST", drain, token="read-token-0123456789"))[0] == 403
        live.assert_intact()
        live.finish()
