"""node_agent/snapshots/channel.py on real loopback sockets: a push and a pull round-trip; a
stranger, a malformed or oversized request, a lying or short or stalled stream are each refused
with nothing left behind while the server keeps serving; the pacing and the Replicator's skipping.

No test measures time tightly: a pause is judged by the pacer's own count, and an elapsed time
only from below (a loaded machine makes things slower, never faster)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import struct
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from edge.tls import client_context, server_context
from node_agent.snapshots.channel import (
    MAGIC,
    ReplicaError,
    ReplicaServer,
    Replicator,
    TokenBucket,
    new_key,
    pull,
    push,
    request_mac,
)
from node_agent.snapshots.holdings import Holdings, snap_name
from tests.pki import make_pki

HOST = "127.0.0.1"
LIMIT = 4 << 20  # bytes a file may have
MEMORY = 10 << 20
TIMEOUT = 20.0  # generous: only a broken test waits this long


def _holdings(root: Path, memory: int = MEMORY) -> Holdings:
    return Holdings(root, memory=memory, file_limit=LIMIT)


def _snapshot(h: Holdings, rank: int, step: int, size: int) -> Path:
    path = h.rank_dir(rank) / snap_name(step)
    path.write_bytes(os.urandom(size))
    return path


def _parts(h: Holdings) -> list[Path]:
    return list(h.root.glob("r*/*.part"))


class Peer:
    def __init__(self, server: ReplicaServer, port: int, key: str) -> None:
        self.server, self.port, self.key = server, port, key
        self.holdings = server.holdings


async def _start(root: Path, *, idle_timeout: float = TIMEOUT, handshake_timeout: float = TIMEOUT) -> Peer:
    key = new_key()
    server = ReplicaServer(
        _holdings(root), key=key, idle_timeout=idle_timeout, handshake_timeout=handshake_timeout
    )
    return Peer(server, await server.start(HOST), key)


@pytest.fixture
async def peer(tmp_path: Path) -> AsyncIterator[Peer]:
    p = await _start(tmp_path / "peer")
    yield p
    await p.server.close()


@pytest.fixture
async def stalls(tmp_path: Path) -> AsyncIterator[Peer]:
    """A short idle timeout, for the test that waits for it (the others never should)."""
    p = await _start(tmp_path / "stalls", idle_timeout=0.3)
    yield p
    await p.server.close()


@pytest.fixture
async def hasty(tmp_path: Path) -> AsyncIterator[Peer]:
    """A short handshake timeout, for the test that waits for it."""
    p = await _start(tmp_path / "hasty", handshake_timeout=0.3)
    yield p
    await p.server.close()


@pytest.fixture
def here(tmp_path: Path) -> Holdings:
    return _holdings(tmp_path / "here")


async def _honest_round_trip(peer: Peer, here: Holdings, rank: int = 0, step: int = 1) -> None:
    """The server still serves: a push lands whole."""
    src = _snapshot(here, rank, step, 3000)
    await push(HOST, peer.port, peer.key, rank, step, src, timeout=TIMEOUT)
    held = peer.holdings.path(rank, step)
    assert held is not None and held.read_bytes() == src.read_bytes()


# -- a raw client, to send what an honest one never would ----------------------------------------


async def _raw(
    peer: Peer, doc: object | bytes, *, key: str | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(HOST, peer.port)
    greeting = await reader.readexactly(len(MAGIC) + 32)
    assert greeting.startswith(MAGIC)
    header = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    mac = request_mac(key or peer.key, greeting[len(MAGIC) :], header)
    writer.write(struct.pack(">I", len(header)) + header + mac)
    await writer.drain()
    return reader, writer


async def _reply(reader: asyncio.StreamReader) -> dict[str, object]:
    (n,) = struct.unpack(">I", await asyncio.wait_for(reader.readexactly(4), TIMEOUT))
    body = await reader.readexactly(n)
    await reader.readexactly(32)
    doc = json.loads(body)
    assert isinstance(doc, dict)
    return doc


def _push_doc(rank: int = 0, step: int = 1, size: int = 10, sha: str = "0" * 64) -> dict[str, object]:
    return {"v": 1, "op": "push", "rank": rank, "step": step, "size": size, "sha256": sha, "nonce": "ab" * 16}


async def _refused(peer: Peer, doc: object | bytes, match: str, *, key: str | None = None) -> None:
    reader, writer = await _raw(peer, doc, key=key)
    answer = await _reply(reader)
    assert answer["ok"] is False and match in str(answer["error"]), answer
    assert await asyncio.wait_for(reader.read(), TIMEOUT) == b""  # and closed
    writer.close()


# -- the honest paths ----------------------------------------------------------------------------


async def test_push_then_pull_round_trip(peer: Peer, here: Holdings, tmp_path: Path) -> None:
    src = _snapshot(here, 3, 500, 2_500_000)  # more than two chunks
    told: list[Path | None] = []
    peer.server.on_received = lambda: told.append(peer.holdings.path(3, 500))  # the agent's wake-up
    await push(HOST, peer.port, peer.key, 3, 500, src, timeout=TIMEOUT)
    held = peer.holdings.path(3, 500)
    assert held is not None and held.read_bytes() == src.read_bytes()
    assert told == [held]  # once, with the replica in place
    assert peer.holdings.inventory() == {3: (500,)} and _parts(peer.holdings) == []

    again = _holdings(tmp_path / "again")
    got = await pull(HOST, peer.port, peer.key, 3, 500, again, timeout=TIMEOUT)
    assert got == again.path(3, 500)
    assert hashlib.sha256(got.read_bytes()).digest() == hashlib.sha256(src.read_bytes()).digest()
    assert await pull(HOST, 1, peer.key, 3, 500, again, timeout=TIMEOUT) == got  # held: no connect


async def test_a_second_push_of_a_held_step_sends_nothing(peer: Peer, here: Holdings) -> None:
    await _honest_round_trip(peer, here)
    reader, writer = await _raw(peer, _push_doc(size=3000))
    assert (await _reply(reader)).get("held") is True
    writer.close()


async def test_pull_of_what_is_not_held(peer: Peer, here: Holdings) -> None:
    with pytest.raises(ReplicaError, match="not held") as info:
        await pull(HOST, peer.port, peer.key, 0, 9, here, timeout=TIMEOUT)
    assert info.value.remote
    assert here.inventory() == {} and _parts(here) == []


async def test_pull_without_room_here(peer: Peer, tmp_path: Path) -> None:
    await push(
        HOST,
        peer.port,
        peer.key,
        0,
        1,
        _snapshot(_holdings(tmp_path / "src"), 0, 1, 200_000),
        timeout=TIMEOUT,
    )
    small = _holdings(tmp_path / "small", memory=100_000)
    with pytest.raises(ReplicaError, match="no room here") as info:
        await pull(HOST, peer.port, peer.key, 0, 1, small, timeout=TIMEOUT)
    assert not info.value.remote and _parts(small) == []


# -- strangers and malformed requests ------------------------------------------------------------


async def test_the_wrong_key_is_refused(peer: Peer, here: Holdings) -> None:
    src = _snapshot(here, 0, 1, 1000)
    with pytest.raises(ReplicaError, match="not authenticated") as info:
        await push(HOST, peer.port, new_key(), 0, 1, src, timeout=TIMEOUT)
    assert info.value.remote
    with pytest.raises(ReplicaError, match="not authenticated"):
        await pull(HOST, peer.port, new_key(), 0, 2, here, timeout=TIMEOUT)
    assert peer.holdings.inventory() == {} and _parts(peer.holdings) == []
    assert list(peer.holdings.root.iterdir()) == []  # not even a rank folder
    await _honest_round_trip(peer, here)


async def test_a_header_too_large_is_refused_on_its_length(peer: Peer, here: Holdings) -> None:
    reader, writer = await asyncio.open_connection(HOST, peer.port)
    await reader.readexactly(len(MAGIC) + 32)
    writer.write(struct.pack(">I", 4097))  # the body is never sent: it is not waited for either
    answer = await _reply(reader)
    assert answer["ok"] is False and "header over 4096" in str(answer["error"])
    writer.close()
    await _honest_round_trip(peer, here)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"rank": -1}, "rank"),
        ({"rank": 2**31}, "rank"),
        ({"rank": "0"}, "rank"),
        ({"rank": True}, "rank"),
        ({"step": 2**63}, "step"),
        ({"step": 1.5}, "step"),
        ({"op": "delete"}, "op"),
        ({"sha256": "0" * 63}, "sha256"),
        ({"sha256": "G" * 64}, "sha256"),
        ({"nonce": None}, "nonce"),
        ({"v": 2}, "version"),
        ({"size": -5}, "size"),
    ],
)
async def test_a_bad_field_is_refused(
    peer: Peer, here: Holdings, change: dict[str, object], match: str
) -> None:
    await _refused(peer, {**_push_doc(), **change}, match)
    assert list(peer.holdings.root.iterdir()) == []
    await _honest_round_trip(peer, here)


@pytest.mark.parametrize(("raw", "match"), [(b"{not json", "not JSON"), (b"[1, 2]", "not an object")])
async def test_a_header_that_is_no_object_is_refused(peer: Peer, raw: bytes, match: str) -> None:
    await _refused(peer, raw, match)


async def test_sizes_over_the_file_limit_or_the_memory_are_refused(peer: Peer, here: Holdings) -> None:
    await _refused(peer, _push_doc(size=LIMIT + 1), "per-file limit")
    for step in (1, 2):  # 7 MiB of 10 held: 4 MiB more do not fit
        _snapshot(peer.holdings, 7, step, 3_670_016)
    await _refused(peer, _push_doc(rank=1, size=LIMIT), "no room")
    assert _parts(peer.holdings) == [] and peer.holdings.inventory() == {7: (2, 1)}
    await _honest_round_trip(peer, here)  # a small one still fits


async def test_a_lying_sha256_is_refused(peer: Peer, here: Holdings) -> None:
    data = os.urandom(5000)
    reader, writer = await _raw(peer, _push_doc(size=len(data), sha=hashlib.sha256(b"other").hexdigest()))
    assert (await _reply(reader)).get("go") is True
    writer.write(data)
    answer = await _reply(reader)
    assert answer["ok"] is False and "sha256 mismatch" in str(answer["error"])
    writer.close()
    assert _parts(peer.holdings) == [] and peer.holdings.inventory() == {}
    await _honest_round_trip(peer, here)


async def test_a_short_stream_is_refused(peer: Peer, here: Holdings) -> None:
    reader, writer = await _raw(peer, _push_doc(size=1000))
    assert (await _reply(reader)).get("go") is True
    writer.write(b"x" * 400)
    writer.write_eof()
    answer = await _reply(reader)
    assert answer["ok"] is False and "600 bytes short" in str(answer["error"])
    writer.close()
    assert _parts(peer.holdings) == [] and peer.holdings.inventory() == {}
    await _honest_round_trip(peer, here)


async def test_a_stalled_stream_times_out(stalls: Peer) -> None:
    reader, writer = await _raw(stalls, _push_doc(size=1000))
    assert (await _reply(reader)).get("go") is True
    writer.write(b"x" * 400)  # then nothing: the server's idle timeout ends it
    answer = await _reply(reader)
    assert answer["ok"] is False and "no bytes for" in str(answer["error"])
    writer.close()
    assert _parts(stalls.holdings) == [] and stalls.holdings.inventory() == {}


async def test_a_silent_client_times_out_in_the_handshake(hasty: Peer) -> None:
    reader, writer = await asyncio.open_connection(HOST, hasty.port)
    await reader.readexactly(len(MAGIC) + 32)
    answer = await _reply(reader)  # sends nothing: the handshake timeout answers
    assert answer["ok"] is False and "timed out" in str(answer["error"])
    writer.close()


async def test_too_many_connections_are_closed_at_once(tmp_path: Path, here: Holdings) -> None:
    key = new_key()
    server = ReplicaServer(_holdings(tmp_path / "peer"), key=key, max_connections=2)
    port = await server.start(HOST)
    try:
        held = [await asyncio.open_connection(HOST, port) for _ in range(2)]
        for reader, _ in held:
            await reader.readexactly(len(MAGIC) + 32)  # both are being served, and wait
        reader, writer = await asyncio.open_connection(HOST, port)
        assert await asyncio.wait_for(reader.read(), TIMEOUT) == b""  # no challenge, just closed
        writer.close()
        assert server.refused_busy == 1 and server.connections == 2
        for _, w in held:
            w.close()
        for _ in range(200):
            if server.connections == 0:
                break
            await asyncio.sleep(0.05)
        await _honest_round_trip(Peer(server, port, key), here)
    finally:
        await server.close()


async def test_close_ends_a_receive_and_leaves_no_part(tmp_path: Path) -> None:
    key = new_key()
    server = ReplicaServer(_holdings(tmp_path / "peer"), key=key)
    port = await server.start(HOST)
    reader, writer = await asyncio.open_connection(HOST, port)
    greeting = await reader.readexactly(len(MAGIC) + 32)
    header = json.dumps(_push_doc(size=1000)).encode()
    writer.write(struct.pack(">I", len(header)) + header + request_mac(key, greeting[len(MAGIC) :], header))
    writer.write(b"x" * 10)
    assert (await _reply(reader)).get("go") is True
    await server.close()
    assert _parts(server.holdings) == []
    writer.close()


# -- pacing --------------------------------------------------------------------------------------


async def test_the_token_bucket_paces_without_sleeping() -> None:
    now = [0.0]

    async def sleep(delay: float) -> None:
        now[0] += delay

    bucket = TokenBucket(100.0, burst=50.0, clock=lambda: now[0], sleep=sleep)
    for _ in range(5):
        await bucket.take(50)
    # The first 50 bytes go from the full bucket; each next 50 waits half a second.
    assert bucket.waits == 4 and now[0] == pytest.approx(2.0)
    now[0] += 10.0  # idle: the bucket refills to its burst, not beyond
    await bucket.take(50)
    await bucket.take(50)
    assert bucket.waits == 5


async def test_a_paced_push_waits(peer: Peer, here: Holdings) -> None:
    src = _snapshot(here, 0, 1, 1 << 20)
    pacer = TokenBucket(4 << 20, burst=128 << 10)
    start = time.monotonic()
    await push(HOST, peer.port, peer.key, 0, 1, src, timeout=TIMEOUT, chunk=128 << 10, pacer=pacer)
    # 1 MiB at 4 MiB/s with 128 KiB free at once cannot end before 0.22 s, however slow or
    # fast the machine (the waits' count depends on it: the fake-clock test counts them).
    assert pacer.waits >= 1
    assert time.monotonic() - start >= 0.2
    assert peer.holdings.path(0, 1) is not None


# -- TLS -----------------------------------------------------------------------------------------


async def test_push_and_pull_over_tls(tmp_path: Path, here: Holdings) -> None:
    pki = make_pki(tmp_path / "pki")
    key = new_key()
    server = ReplicaServer(
        _holdings(tmp_path / "peer"), key=key, ssl=server_context(str(pki.server_cert), str(pki.server_key))
    )
    port = await server.start(HOST)
    try:
        tls = client_context(str(pki.ca))
        src = _snapshot(here, 2, 8, 300_000)
        await push(HOST, port, key, 2, 8, src, timeout=TIMEOUT, ssl=tls)
        back = _holdings(tmp_path / "back")
        got = await pull(HOST, port, key, 2, 8, back, timeout=TIMEOUT, ssl=tls)
        assert got.read_bytes() == src.read_bytes()
        with pytest.raises(ReplicaError):  # a plain client cannot talk to a TLS server
            await push(HOST, port, key, 2, 9, _snapshot(here, 2, 9, 10), timeout=1.0)
        assert _parts(server.holdings) == []
    finally:
        await server.close()


# -- the Replicator ------------------------------------------------------------------------------


async def test_the_replicator_skips_to_the_newest_offer(peer: Peer, here: Holdings) -> None:
    rep = Replicator(timeout=TIMEOUT)
    try:
        rep.set_peer(HOST, peer.port, peer.key)
        for step in (1, 2, 3):  # offered faster than pushed: only the newest is sent
            rep.offer(0, step, _snapshot(here, 0, step, 2000))
        rep.offer(1, 5, _snapshot(here, 1, 5, 2000))
        rep.offer(0, 2, here.path(0, 2) or "")  # an older offer never replaces a newer one
        assert rep.pending() == {0: 3, 1: 5}
        await asyncio.wait_for(rep.drain(), TIMEOUT)
        assert rep.replicated == {0: 3, 1: 5}
        assert peer.holdings.inventory() == {0: (3,), 1: (5,)}
        rep.offer(0, 3, here.path(0, 3) or "")  # already confirmed: nothing queued
        assert rep.pending() == {}
    finally:
        await rep.close()


async def test_the_replicator_logs_a_failure_and_retries_at_the_next_offer(
    peer: Peer, here: Holdings, caplog: pytest.LogCaptureFixture
) -> None:
    rep = Replicator(timeout=TIMEOUT)
    try:
        rep.set_peer(HOST, peer.port, new_key())  # a key the peer does not know
        rep.offer(0, 1, _snapshot(here, 0, 1, 100))
        await asyncio.wait_for(rep.drain(), TIMEOUT)
        assert rep.failures == 1 and rep.replicated == {} and rep.pending() == {}
        assert any(
            "not authenticated" in r.getMessage() for r in caplog.records if r.name == "node_agent.snapshots"
        )
        rep.set_peer(HOST, peer.port, peer.key)
        rep.offer(0, 2, _snapshot(here, 0, 2, 100))
        await asyncio.wait_for(rep.drain(), TIMEOUT)
        assert rep.replicated == {0: 2} and peer.holdings.inventory() == {0: (2,)}
        rep.set_peer(None)  # no peer: offers wait, drain does not
        rep.offer(0, 3, _snapshot(here, 0, 3, 100))
        await asyncio.wait_for(rep.drain(), TIMEOUT)
        assert rep.pending() == {0: 3} and rep.replicated == {}
    finally:
        await rep.close()
