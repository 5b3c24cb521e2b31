"""Attacks on the rendezvous machine's state, against a live ``rdzv-server`` with a real job.

Each test runs ``LiveJob`` (a real server with ``--state-dir`` and a real two-node job whose
workers hold) and attacks the same port over real sockets with a scripted client, then checks
what an operator sees: the real job keeps its round and workers, ``/healthz`` answers, the
server's memory and state log stay under a bound, and its log holds no traceback.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import msgpack

from protocol import (
    HEADER,
    MAX_TEXT_LEN,
    Assignment,
    Drain,
    Error,
    Failure,
    Join,
    Leave,
    Left,
    Message,
    Restart,
    Resume,
    Resumed,
    WorkersFailed,
)
from rdzv_server.machine.state import FAILURES_KEPT

from .live_job import LiveJob, Peer, http
from .procs import Proc, server_cmd


def join(job_id: str, node_id: str, **kw: Any) -> Join:
    fields: dict[str, Any] = dict(
        job_id=job_id,
        node_id=node_id,
        addr="127.0.0.1",
        nproc=1,
        min_nodes=1,
        max_nodes=1,
        entrypoint="attack.py",
        master_port=29999,
        max_restarts=2**63 - 1,
        last_call_timeout=0.0,
        heartbeat_interval=1.0,
        heartbeat_timeout=30.0,
    )
    fields.update(kw)
    return Join(**fields)


def failure(node_id: str, message: str = "") -> Failure:
    return Failure(
        node_id=node_id, addr="127.0.0.1", rank=0, local_rank=0, exitcode=1, timestamp=1.0, message=message
    )


async def fail_loop(port: int, seconds: float, *, job_id: str = "bloat", text: int = 65536) -> int:
    """One connection: join a one-node job, fail, re-join when told to restart, for ``seconds``.
    Every failure carries a ``text``-character message. Returns the rounds it went through."""
    c = await Peer.open(port)
    rounds = 0
    try:
        msg = join(job_id, "looper")
        c.send(msg)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            got = await c.until(Assignment)
            if isinstance(got, Error) and got.code == "flooding":
                break  # the service's rate cap (a burst, then 50 frames/s) cut the attacker off
            if not isinstance(got, Assignment):
                raise AssertionError(f"the loop stopped: {got!r}")
            rounds += 1
            c.send(WorkersFailed(round=got.round, failure=failure("looper", "x" * text)))
            told = await c.until(Restart)
            if isinstance(told, Error) and told.code == "flooding":
                break
            if not isinstance(told, Restart):
                raise AssertionError(f"no restart: {told!r}")
            c.send(msg)
    finally:
        c.close()
    return rounds


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


RSS_GROWTH_KB = 32 * 1024  # the fail loop grew the server by ~110 MB in 2.5 s before the bounds
DETAIL_BYTES = 1024 * 1024  # one job's status: was 115 MB after 2.5 s of the loop


def test_item3_a_fail_restart_rejoin_loop_keeps_the_server_bounded(tmp_path: Path) -> None:
    with LiveJob(tmp_path) as live:
        rss = live.rss_kb()
        rounds = run(fail_loop(live.port, 3.0))
        assert rounds > 50, rounds  # the loop ran (before the bounds: ~700 rounds a second)
        status, job = asyncio.run(http(live.port, "GET", "/v1/jobs/bloat"))
        assert status == 200 and job["restart_count"] >= rounds - 1, job
        assert len(job["failures"]) <= FAILURES_KEPT + 1
        assert all(len(f["message"]) <= 4096 for f in job["failures"])
        assert len(str(job)) < DETAIL_BYTES
        assert live.rss_kb() - rss < RSS_GROWTH_KB, (rss, live.rss_kb())
        live.assert_intact()


async def _pair(port: int, job_id: str, **kw: Any) -> tuple[Peer, Peer]:
    a, b = await Peer.open(port), await Peer.open(port)
    a.send(join(job_id, "pair-a", min_nodes=2, max_nodes=2, **kw))
    b.send(join(job_id, "pair-b", min_nodes=2, max_nodes=2, **kw))
    for c in (a, b):
        assert isinstance(await c.until(Assignment), Assignment)
    return a, b


def test_item5_texts_the_server_builds_from_hostile_ones_fit_their_fields(tmp_path: Path) -> None:
    with LiveJob(tmp_path) as live:

        async def attack() -> None:
            long = "e" * MAX_TEXT_LEN
            a, b = await _pair(live.port, "texts", entrypoint=long)
            # A mismatch refusal quoting two entrypoints of 64 KiB.
            c = await Peer.open(live.port)
            c.send(join("texts", "pair-c", min_nodes=2, max_nodes=2, entrypoint="f" * MAX_TEXT_LEN))
            err = await c.until()
            assert isinstance(err, Error) and err.code == "job_mismatch", err
            # Drain reasons over HTTP: 200,000 characters are refused (400); 64 Ki reach the
            # member as a Drain that fits.
            for size, want in ((200_000, 400), (MAX_TEXT_LEN, 202)):
                status, body = await http(
                    live.port,
                    "POST",
                    "/v1/jobs/texts/nodes/pair-a/drain",
                    body=json.dumps({"reason": "d" * size}).encode(),
                    headers={"Content-Type": "application/json"},
                )
                assert status == want, (status, body)
            drain = await a.until(Drain)
            assert isinstance(drain, Drain) and len(drain.reason) <= MAX_TEXT_LEN
            # A Leave reason of 64 KiB: the other member hears a Restart that fits, the leaver Left.
            b.send(Leave(reason="r" * MAX_TEXT_LEN))
            left = await b.until(Left)
            assert isinstance(left, Left), left
            restart = await a.until(Restart)
            assert isinstance(restart, Restart) and "more characters]" in restart.reason
            for x in (a, b, c):
                x.close()

        run(attack())
        status, job = asyncio.run(http(live.port, "GET", "/v1/jobs/texts"))
        # Gathering again, or abandoned once the server has seen every member's connection close.
        assert status == 200 and job["phase"] in ("gathering", "abandoned"), job
        assert "internal error" not in live.srv.stderr
        live.assert_intact()


def test_item6_a_stranger_with_the_token_cannot_resume_a_real_node_after_a_restart(tmp_path: Path) -> None:
    token = "job-token-" + "7" * 24
    token_file = tmp_path / "tokens"
    token_file.write_text(token + "\n")
    with LiveJob(tmp_path, "--token-file", str(token_file), token=token) as live:
        status = live.job_status()
        victim = next(m for m in status["members"] if m["group_rank"] == 1)
        # The agents are stopped (their workers run on) so the stranger is surely first.
        for a in live.agents:
            os.kill(a.p.pid, signal.SIGSTOP)
        try:
            live.srv.signal(signal.SIGKILL)
            live.srv.wait(timeout=10)
            args = ["--host", "127.0.0.1", "--port", str(live.port), "--token-file", str(token_file)]
            again = Proc(server_cmd(*args, "--state-dir", str(live.state_dir)))
            live.server = again
            again.wait_for_line(r"record\(s\) replayed, 1 active job", timeout=20)
            again.wait_for_line(r"listening on ", timeout=20)

            async def steal() -> list[Message | None]:
                from protocol.auth import proof

                got = []
                for secret in ("", "f" * 32):
                    c = await Peer.open(live.port)
                    j = join(
                        live.job,
                        victim["node_id"],
                        min_nodes=2,
                        max_nodes=2,
                        max_restarts=0,
                        entrypoint="anything: the node secret is checked first",
                        node_secret=secret,
                        proof=proof(token, c.challenge, live.job, victim["node_id"]),
                    )
                    fake = Assignment(
                        job_id=live.job, round=0, group_rank=1, group_world_size=2, rank_offset=1,
                        world_size=2, master_addr="127.0.0.1", master_port=29500, restart_count=0,
                        max_restarts=0,
                    )  # fmt: skip
                    c.send(Resume(join=j, assignment=fake))
                    got.append(await c.until(Resumed, Restart))
                    c.close()
                return got

            for reply in run(steal()):
                assert isinstance(reply, Error) and reply.code == "duplicate_node", reply
        finally:
            for a in live.agents:
                os.kill(a.p.pid, signal.SIGCONT)
        for _ in live.agents:
            live.srv.wait_for_line(rf"job {live.job}: node .* resumed round 0; nothing restarts", timeout=30)
        live.assert_intact()
        live.finish()


def _raw_join_frame(node_id: str, proof: str) -> bytes:
    """A Join as msgpack, built by hand: the fields a hostile client may fill as it likes."""
    fields = dict(
        t="join", job_id="raw", node_id=node_id, addr="127.0.0.1", nproc=1, min_nodes=1, max_nodes=1,
        entrypoint="x", master_port=29999, max_restarts=0, last_call_timeout=0.0,
        heartbeat_interval=1.0, heartbeat_timeout=30.0, proof=proof,
    )  # fmt: skip
    payload = msgpack.packb(fields, use_bin_type=True)
    return HEADER.pack(len(payload)) + payload


def test_items_10_and_14_hostile_ids_proofs_and_duplicates_get_a_clear_error(tmp_path: Path) -> None:
    token = "job-token-" + "5" * 24
    token_file = tmp_path / "tokens"
    token_file.write_text(token + "\n")
    with LiveJob(tmp_path, "--token-file", str(token_file), token=token) as live:

        async def attack() -> list[Message | None]:
            got = []
            for node_id, proof in (
                ("evil\nINFO job live-job: node forged joined", ""),  # item 10: a forged log line
                ("evil\x1b[2J", ""),  # an ANSI escape
                ("n1", "\u00e9" * 64),  # item 14: a non-ASCII proof
            ):
                c = await Peer.open(live.port)
                c.writer.write(_raw_join_frame(node_id, proof))
                got.append(await c.until())
                c.close()
            # Item 14: a duplicate node id of the real job (the token holder's own Join).
            from protocol.auth import proof as make_proof

            real = live.nodes[0]
            c = await Peer.open(live.port)
            c.send(
                join(live.job, real, min_nodes=2, max_nodes=2, max_restarts=0,
                     proof=make_proof(token, c.challenge, live.job, real))
            )  # fmt: skip
            got.append(await c.until())
            c.close()
            return got

        replies = run(attack())
        codes = [r.code if isinstance(r, Error) else r for r in replies]
        assert codes[:3] == ["invalid_field"] * 3, replies
        assert "control characters" in replies[0].message and "printable ASCII" in replies[2].message  # type: ignore[union-attr]
        assert codes[3] in ("duplicate_node", "job_mismatch"), replies[3]
        err = live.srv.stderr
        assert "node forged joined" not in err.replace("\\n", "")  # no forged line in the log
        assert "\x1b" not in err
        live.assert_intact()


def test_item13_a_member_cannot_blame_another_node_for_its_failure(tmp_path: Path) -> None:
    with LiveJob(tmp_path) as live:

        async def attack() -> None:
            a, b = await _pair(live.port, "blame", max_restarts=5)
            forged = Failure(
                node_id="pair-b", addr="10.9.9.9", rank=1, local_rank=0, exitcode=1, timestamp=1.0
            )
            a.send(WorkersFailed(round=0, failure=forged))
            assert isinstance(await b.until(Restart), Restart)
            a.close()
            b.close()

        run(attack())
        status, job = asyncio.run(http(live.port, "GET", "/v1/jobs/blame"))
        assert status == 200
        assert [(f["node_id"], f["addr"]) for f in job["failures"]] == [("pair-a", "127.0.0.1")], job
        live.assert_intact()
