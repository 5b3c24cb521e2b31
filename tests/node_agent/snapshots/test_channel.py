"""The snapshot channel (node_agent/snapshots/wire.py, server.py, client.py) on real loopback
sockets: a push and a pull round-trip; a stranger, a malformed or oversized request, a lying or
short or stalled stream are each refused with nothing left behind while the server keeps
serving; the pacing and the Replicator's skipping.
Issue 42's: a former round's key, a push the server did not ask for, idle strangers filling the
connections, TLS pinned to an ephemeral certificate, a pull's deadline and the owner's digest.

No test measures time tightly: a pause is judged by the pacer's own count, and an elapsed time
only from below (a loaded machine makes things slower, never faster)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from edge.tls import client_context, server_context
from node_agent.snapshots.client import ReplicaError, Replicator, TokenBucket, pull, push
from node_agent.snapshots.holdings import Holdings, file_sha256, snap_name
from node_agent.snapshots.replica_tls import ReplicaTLS, make_server_tls
from node_agent.snapshots.replica_tls import client_context as pinning_context
from node_agent.snapshots.server import ReplicaServer, new_key
from node_agent.snapshots.wire import MAGIC, reply_mac, request_mac
from tests.pki import make_pki

HOST = "127.0.0.1"
LIMIT = 4 << 20  # bytes a file may have
MEMORY = 10 << 20
TIMEOUT = 20.0  # generous: only a broken test waits this long
ANY_RANK, ANY_STEP = range(64), range(1000)  # what most tests' servers take pushes of


def _holdings(root: Path, memory: int = MEMORY) -> Holdings:
    return Holdings(root, memory=memory, file_limit=LIMIT)


def _snapshot(h: Holdings, rank: int, step: int, size: int) -> Path:
    path = h.rank_dir(rank) / snap_name(step)
    path.write_bytes(os.urandom(size))
    return path


def _parts(h: Holdings) -> list[Path]:
    return list(h.root.glob("r*/*.part"))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def _until(done: Callable[[], bool]) -> None:
    """Wait for a handler to end by itself (a closed connection's is not awaited)."""
    for _ in range(400):
        if done():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("not done in 20 s")


class Peer:
    def __init__(self, server: ReplicaServer, port: int, key: str) -> None:
        self.server, self.port, self.key = server, port, key
        self.holdings = server.holdings


async def _start(
    root: Path, *, idle_timeout: float = TIMEOUT, handshake_timeout: float = TIMEOUT, **kw: Any
) -> Peer:
    key = new_key()
    server = ReplicaServer(
        _holdings(root), key=key, idle_timeout=idle_timeout, handshake_timeout=handshake_timeout, **kw
    )
    server.allow_pushes(ANY_RANK, ANY_STEP)
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


async def test_a_full_server_of_authenticated_transfers_closes_a_newcomer_at_once(
    tmp_path: Path, here: Holdings
) -> None:
    """The bound stays: max_connections authenticated transfers and a newcomer is closed (before
    the challenge); a newcomer never evicts an authenticated transfer, which then finishes."""
    p = await _start(tmp_path / "peer", max_connections=2)
    try:
        data = [os.urandom(1000), os.urandom(1000)]
        held = []
        for step, body in enumerate(data, 1):  # two pushes, authenticated, stalled after "go"
            reader, writer = await _raw(p, _push_doc(step=step, size=len(body), sha=_sha(body)))
            assert (await _reply(reader)).get("go") is True
            held.append((reader, writer))
        reader, writer = await asyncio.open_connection(HOST, p.port)
        assert await asyncio.wait_for(reader.read(), TIMEOUT) == b""  # no challenge, just closed
        writer.close()
        assert p.server.refused_busy == 1 and p.server.evicted == 0 and p.server.connections == 2
        for (reader, writer), body in zip(held, data, strict=True):
            writer.write(body)
            assert (await _reply(reader))["ok"] is True
            writer.close()
        assert p.holdings.inventory() == {0: (2, 1)}
        await _until(lambda: p.server.connections == 0)
        await _honest_round_trip(p, here, step=3)
    finally:
        await p.server.close()


async def test_close_ends_a_receive_and_leaves_no_part(tmp_path: Path) -> None:
    key = new_key()
    server = ReplicaServer(_holdings(tmp_path / "peer"), key=key)
    server.allow_pushes(ANY_RANK, ANY_STEP)
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
    server.allow_pushes(ANY_RANK, ANY_STEP)
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


# -- keys per round (issue 42) -------------------------------------------------------------------


async def test_a_former_key_is_refused_as_stale(peer: Peer, here: Holdings, tmp_path: Path) -> None:
    """A node that left keeps the key it was given: after the next Join's key, it can neither
    push nor pull here."""
    old, peer.key = peer.key, new_key()
    peer.server.set_key(peer.key)
    with pytest.raises(ReplicaError, match="stale key") as info:
        await push(HOST, peer.port, old, 0, 1, _snapshot(here, 0, 1, 1000), timeout=TIMEOUT)
    assert info.value.remote
    _snapshot(peer.holdings, 5, 2, 100)
    with pytest.raises(ReplicaError, match="stale key"):
        await pull(HOST, peer.port, old, 5, 2, here, timeout=TIMEOUT)
    assert peer.holdings.inventory() == {5: (2,)} and here.inventory() == {0: (1,)}
    assert _parts(peer.holdings) == [] and _parts(here) == []
    with pytest.raises(ReplicaError, match="not authenticated"):  # a key never ours says so
        await pull(HOST, peer.port, new_key(), 5, 2, here, timeout=TIMEOUT)
    await _honest_round_trip(peer, here)
    got = await pull(HOST, peer.port, peer.key, 5, 2, _holdings(tmp_path / "back"), timeout=TIMEOUT)
    assert got.read_bytes() == (peer.holdings.path(5, 2) or Path("/")).read_bytes()
    with pytest.raises(ValueError, match="too short"):
        peer.server.set_key("short")


async def test_a_transfer_authenticated_before_a_key_change_finishes(peer: Peer) -> None:
    data = os.urandom(5000)
    reader, writer = await _raw(peer, _push_doc(size=len(data), sha=_sha(data)))
    assert (await _reply(reader)).get("go") is True
    peer.server.set_key(new_key())
    writer.write(data)
    assert (await _reply(reader))["ok"] is True
    writer.close()
    held = peer.holdings.path(0, 1)
    assert held is not None and held.read_bytes() == data


# -- pushes only where the server asked ----------------------------------------------------------


async def test_a_push_not_asked_is_refused_before_a_byte_is_written(tmp_path: Path, here: Holdings) -> None:
    key = new_key()
    server = ReplicaServer(_holdings(tmp_path / "peer"), key=key, handshake_timeout=TIMEOUT)
    port = await server.start(HOST)  # allow_pushes not called yet: no push at all
    try:
        src = _snapshot(here, 2, 7, 1000)
        with pytest.raises(ReplicaError, match=r"push not asked: .*takes no replica") as info:
            await push(HOST, port, key, 2, 7, src, timeout=TIMEOUT)
        assert info.value.remote and server.refused_pushes == 1
        assert list(server.holdings.root.iterdir()) == []  # not even a rank folder

        server.allow_pushes(range(0, 4), {7})  # the predecessor's ranks 0-3, the step copied: 7
        for rank, step in ((4, 7), (2, 6), (2, 8), (2**31 - 1, 7)):
            with pytest.raises(ReplicaError, match=f"push not asked: rank {rank} step {step}"):
                await push(
                    HOST, port, key, rank, step, _snapshot(here, min(rank, 9), step, 100), timeout=TIMEOUT
                )
        assert server.refused_pushes == 5 and list(server.holdings.root.iterdir()) == []
        # Refused before the "go": a raw client that streams anyway gets the refusal first.
        reader, writer = await asyncio.open_connection(HOST, port)
        greeting = await reader.readexactly(len(MAGIC) + 32)
        header = json.dumps(_push_doc(rank=5, step=7, size=3)).encode()
        writer.write(
            struct.pack(">I", len(header)) + header + request_mac(key, greeting[len(MAGIC) :], header)
        )
        writer.write(b"abc")
        answer = await _reply(reader)
        assert answer["ok"] is False and "push not asked" in str(answer["error"])
        writer.close()
        assert list(server.holdings.root.iterdir()) == []

        assert await push(HOST, port, key, 2, 7, src, timeout=TIMEOUT) == _sha(src.read_bytes())
        assert server.holdings.inventory() == {2: (7,)}
        server.allow_pushes(range(0, 4), range(8, 10))  # the next step copied: 7 is no more taken
        with pytest.raises(ReplicaError, match="push not asked"):  # even held: refused, not "held"
            await push(HOST, port, key, 2, 7, src, timeout=TIMEOUT)
        # A pull reads any held rank and step with the key.
        own = _snapshot(server.holdings, 40, 3, 500)
        got = await pull(HOST, port, key, 40, 3, _holdings(tmp_path / "back"), timeout=TIMEOUT)
        assert got.read_bytes() == own.read_bytes()
        with pytest.raises(TypeError):
            server.allow_pushes([1, 2], {7})  # type: ignore[arg-type]
    finally:
        await server.close()


# -- caps a stranger cannot fill -----------------------------------------------------------------
#
# Each scenario is an async function of (tmp_path, tls_pair): a test runs it on asyncio's loop,
# and test_on_uvloop on the agent's loop, uvloop, counting the descriptors left open.

TlsPair = tuple[ReplicaTLS, ReplicaTLS]


@pytest.fixture(scope="module")
def tls_pair(tmp_path_factory: pytest.TempPathFactory) -> TlsPair:
    folder = tmp_path_factory.mktemp("replica-tls")
    return make_server_tls(folder), make_server_tls(folder)


async def _idle(port: int, source: str = HOST) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stranger's connection from ``source`` that reads the challenge and then says nothing."""
    reader, writer = await asyncio.open_connection(HOST, port, local_addr=(source, 0))
    await asyncio.wait_for(reader.readexactly(len(MAGIC) + 32), TIMEOUT)
    return reader, writer


def _no_errors(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert bad == []


async def _eight_idle_strangers(tmp_path: Path, _tls: TlsPair) -> None:
    p = await _start(tmp_path / "peer")  # max_connections 8, as the agent's
    try:
        src = _snapshot(p.holdings, 1, 4, 2000)
        strangers = [await _idle(p.port) for _ in range(8)]
        got = await pull(HOST, p.port, p.key, 1, 4, _holdings(tmp_path / "spare"), timeout=TIMEOUT)
        assert got.read_bytes() == src.read_bytes()
        assert p.server.evicted >= 1 and p.server.refused_busy == 0
        for _, w in strangers:
            w.close()
        await _until(lambda: p.server.connections == 0)
    finally:
        await p.server.close()


async def test_eight_idle_strangers_do_not_keep_a_pull_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 42: eight connections that never speak (no key needed) filled a node's replica
    server of max_connections=8, and a spare's restore fetch was closed at once."""
    await _eight_idle_strangers(tmp_path, _NO_TLS)
    _no_errors(caplog)


async def _fifty_idle_strangers(tmp_path: Path, _tls: TlsPair) -> None:
    p = await _start(tmp_path / "peer")
    try:
        src = _snapshot(p.holdings, 1, 4, 2000)
        strangers = [await _idle(p.port, f"127.0.0.{2 + i}") for i in range(50)]
        assert p.server.connections == 8 and p.server.unauthenticated == 8 and p.server.evicted == 42
        for reader, _ in strangers[:42]:  # the oldest were closed, silently
            assert await asyncio.wait_for(reader.read(), TIMEOUT) == b""
        got = await pull(HOST, p.port, p.key, 1, 4, _holdings(tmp_path / "spare"), timeout=TIMEOUT)
        assert got.read_bytes() == src.read_bytes() and p.server.evicted == 43
        for _, w in strangers:
            w.close()
        await _until(lambda: p.server.connections == 0)
    finally:
        await p.server.close()


async def test_fifty_idle_strangers_then_a_pull_succeeds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Fifty strangers from fifty addresses: the eight newest are served (until their deadline),
    each newcomer evicting the oldest; a peer that proves the key gets in and is not evicted."""
    before = _open_fds()
    await _fifty_idle_strangers(tmp_path, _NO_TLS)
    await _until(lambda: _open_fds() <= before)
    _no_errors(caplog)


async def test_one_address_holds_at_most_four_unauthenticated_connections(tmp_path: Path) -> None:
    p = await _start(tmp_path / "peer")
    try:
        strangers = [await _idle(p.port, "127.0.0.2") for _ in range(6)]
        assert p.server.connections == 4 and p.server.evicted == 2  # its own oldest two went
        for reader, _ in strangers[:2]:
            assert await asyncio.wait_for(reader.read(), TIMEOUT) == b""
        others = [await _idle(p.port, "127.0.0.3") for _ in range(4)]  # another address: room
        assert p.server.connections == 8 and p.server.evicted == 2
        for _, w in strangers + others:
            w.close()
    finally:
        await p.server.close()


async def test_a_stranger_is_evicted_before_an_authenticated_transfer(tmp_path: Path) -> None:
    p = await _start(tmp_path / "peer", max_connections=2)
    try:
        data = os.urandom(1000)
        reader, writer = await _raw(p, _push_doc(size=len(data), sha=_sha(data)))
        assert (await _reply(reader)).get("go") is True  # authenticated, stalled
        stranger, s_writer = await _idle(p.port, "127.0.0.2")
        _, n_writer = await _idle(p.port, "127.0.0.3")  # full: the stranger goes
        assert await asyncio.wait_for(stranger.read(), TIMEOUT) == b""
        assert p.server.evicted == 1 and p.server.refused_busy == 0 and p.server.connections == 2
        writer.write(data)
        assert (await _reply(reader))["ok"] is True
        for w in (writer, s_writer, n_writer):
            w.close()
    finally:
        await p.server.close()


async def test_a_connection_has_three_seconds_to_authenticate(tmp_path: Path) -> None:
    """The deadline runs from the accept (the agent's default: 3 s, was 10), not per read: a
    client that trickles its header is closed at it."""
    assert ReplicaServer(_holdings(tmp_path / "default"), key=new_key()).handshake_timeout == 3.0
    p = await _start(tmp_path / "peer", handshake_timeout=0.5)
    try:
        reader, writer = await asyncio.open_connection(HOST, p.port)
        await reader.readexactly(len(MAGIC) + 32)
        writer.write(struct.pack(">I", 100))

        async def trickle() -> None:  # a byte every 0.05 s: each read is quick, the whole is not
            with contextlib.suppress(OSError):
                for _ in range(100):
                    writer.write(b" ")
                    await writer.drain()
                    await asyncio.sleep(0.05)

        task = asyncio.create_task(trickle())
        answer = await _reply(reader)
        assert answer["ok"] is False and "timed out" in str(answer["error"])
        task.cancel()
        writer.close()
    finally:
        await p.server.close()


# -- TLS, pinned to an ephemeral certificate -----------------------------------------------------


async def _tls_push_and_pull(tmp_path: Path, tls_pair: TlsPair) -> None:
    a_tls, b_tls = tls_pair
    assert a_tls.cert_sha256 != b_tls.cert_sha256
    a = await _start(tmp_path / "a", ssl=a_tls.context)
    b = await _start(tmp_path / "b", ssl=b_tls.context)
    rep = Replicator(timeout=TIMEOUT)
    try:
        src = _snapshot(a.holdings, 0, 3, 300_000)
        digest = await push(HOST, b.port, b.key, 0, 3, src, timeout=TIMEOUT, cert_sha256=b_tls.cert_sha256)
        assert digest == _sha(src.read_bytes()) and b.server.received == {(0, 3): digest}
        mine = _snapshot(a.holdings, 1, 3, 200_000)
        got = await pull(
            HOST, a.port, a.key, 1, 3, b.holdings, timeout=TIMEOUT, cert_sha256=a_tls.cert_sha256,
            expected_sha256=_sha(mine.read_bytes()),
        )  # fmt: skip
        assert got.read_bytes() == mine.read_bytes()
        rep.set_peer(HOST, b.port, b.key, b_tls.cert_sha256)
        rep.offer(2, 3, _snapshot(a.holdings, 2, 3, 1000))
        await asyncio.wait_for(rep.drain(), TIMEOUT)
        assert rep.failures == 0 and rep.replicated == {2: 3}
        assert rep.peer == (HOST, b.port, b.key, b_tls.cert_sha256)
        assert b.holdings.inventory() == {0: (3,), 1: (3,), 2: (3,)}
        # Another fingerprint: refused right after the handshake, before a byte of the request.
        with pytest.raises(ReplicaError, match="certificate mismatch") as info:
            await push(
                HOST,
                b.port,
                b.key,
                0,
                4,
                _snapshot(a.holdings, 0, 4, 10),
                timeout=TIMEOUT,
                cert_sha256=a_tls.cert_sha256,
            )
        assert not info.value.remote
        with pytest.raises(ReplicaError, match="certificate mismatch"):
            await pull(HOST, a.port, a.key, 0, 4, b.holdings, timeout=TIMEOUT, cert_sha256=b_tls.cert_sha256)
        assert b.holdings.inventory() == {0: (3,), 1: (3,), 2: (3,)} and _parts(b.holdings) == []
        with pytest.raises(ReplicaError, match="cert_sha256: not 64"):
            await pull(HOST, a.port, a.key, 0, 4, b.holdings, timeout=TIMEOUT, cert_sha256="AB" * 32)
        await _until(lambda: a.server.connections == 0 and b.server.connections == 0)
    finally:
        await rep.close()
        await a.server.close()
        await b.server.close()


async def test_tls_push_and_pull_between_two_servers_pinned(
    tmp_path: Path, tls_pair: TlsPair, caplog: pytest.LogCaptureFixture
) -> None:
    await _tls_push_and_pull(tmp_path, tls_pair)
    _no_errors(caplog)


async def _tls_and_plain_ends(tmp_path: Path, tls_pair: TlsPair) -> None:
    a_tls, _ = tls_pair
    tls = await _start(tmp_path / "tls", ssl=a_tls.context, handshake_timeout=0.5)
    plain = await _start(tmp_path / "plain")
    here = _holdings(tmp_path / "here")
    try:
        src = _snapshot(here, 0, 3, 1000)
        with pytest.raises(ReplicaError):  # a plain client: the server's handshake deadline ends it
            await push(HOST, tls.port, tls.key, 0, 3, src, timeout=TIMEOUT)
        with pytest.raises(ReplicaError, match="cannot connect"):  # a TLS client to a plain server
            await push(HOST, plain.port, plain.key, 0, 3, src, timeout=TIMEOUT, cert_sha256=a_tls.cert_sha256)
        await _until(lambda: tls.server.connections == 0 and plain.server.connections == 0)
        assert tls.holdings.inventory() == {} and plain.holdings.inventory() == {}
        await push(HOST, tls.port, tls.key, 0, 3, src, timeout=TIMEOUT, cert_sha256=a_tls.cert_sha256)
        assert tls.holdings.inventory() == {0: (3,)}
    finally:
        await tls.server.close()
        await plain.server.close()


async def test_tls_and_plain_ends_fail_cleanly(
    tmp_path: Path, tls_pair: TlsPair, caplog: pytest.LogCaptureFixture
) -> None:
    await _tls_and_plain_ends(tmp_path, tls_pair)
    _no_errors(caplog)


async def _tls_strangers(tmp_path: Path, tls_pair: TlsPair) -> None:
    a_tls, _ = tls_pair
    p = await _start(tmp_path / "peer", ssl=a_tls.context)
    try:
        src = _snapshot(p.holdings, 1, 4, 2000)
        strangers = [
            await asyncio.open_connection(HOST, p.port, local_addr=(f"127.0.0.{2 + i}", 0)) for i in range(12)
        ]
        await _until(lambda: p.server.evicted == 4)
        assert p.server.connections == 8 and p.server.unauthenticated == 8
        for reader, _ in strangers[:4]:  # evicted in their handshake: closed
            assert await asyncio.wait_for(reader.read(), TIMEOUT) == b""
        spare = _holdings(tmp_path / "spare")
        got = await pull(HOST, p.port, p.key, 1, 4, spare, timeout=TIMEOUT, cert_sha256=a_tls.cert_sha256)
        assert got.read_bytes() == src.read_bytes() and p.server.evicted == 5
        for _, w in strangers:
            w.close()
        await _until(lambda: p.server.connections == 0)
    finally:
        await p.server.close()


async def test_strangers_in_the_tls_handshake_count_and_are_evicted(
    tmp_path: Path, tls_pair: TlsPair, caplog: pytest.LogCaptureFixture
) -> None:
    """A connection that never starts its TLS handshake counts against the caps (the handshake
    is its handler's), is evicted for a newcomer, and is closed at the deadline."""
    await _tls_strangers(tmp_path, tls_pair)
    _no_errors(caplog)


async def _close_mid_receive(tmp_path: Path, tls_pair: TlsPair) -> None:
    """close() ends an authenticated receive, a stranger in its handshake and an idle one."""
    p = await _start(tmp_path / "peer", ssl=tls_pair[0].context)
    try:
        reader, writer = await asyncio.open_connection(HOST, p.port, ssl=pinning_context())
        greeting = await reader.readexactly(len(MAGIC) + 32)
        header = json.dumps(_push_doc(size=100_000)).encode()
        writer.write(
            struct.pack(">I", len(header)) + header + request_mac(p.key, greeting[len(MAGIC) :], header)
        )
        assert (await _reply(reader)).get("go") is True
        writer.write(b"x" * 1000)
        stranger = await asyncio.open_connection(HOST, p.port)
        await _until(lambda: p.server.connections == 2 and _parts(p.holdings) != [])
    finally:
        await p.server.close()
    assert _parts(p.holdings) == [] and p.server.connections == 0
    assert await asyncio.wait_for(stranger[0].read(), TIMEOUT) == b""
    with contextlib.suppress(OSError):
        assert await asyncio.wait_for(reader.read(), TIMEOUT) == b""
    writer.close()
    stranger[1].close()


async def test_close_ends_every_connection(
    tmp_path: Path, tls_pair: TlsPair, caplog: pytest.LogCaptureFixture
) -> None:
    await _close_mid_receive(tmp_path, tls_pair)
    _no_errors(caplog)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


_NO_TLS: Any = None  # the scenarios that take no TLS


@pytest.mark.parametrize(
    "scenario",
    [
        _eight_idle_strangers,
        _fifty_idle_strangers,
        _tls_push_and_pull,
        _tls_and_plain_ends,
        _tls_strangers,
        _close_mid_receive,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_on_uvloop(
    scenario: Callable[[Path, TlsPair], Coroutine[Any, Any, None]],
    tmp_path: Path,
    tls_pair: TlsPair,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The agent's loop is uvloop: the same scenarios there, and no descriptor left open."""
    uvloop = pytest.importorskip("uvloop")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(asyncio.sleep(0))  # uvloop's first loop opens descriptors it keeps: not ours
    before = _open_fds()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario(tmp_path, tls_pair))
    assert _open_fds() <= before
    _no_errors(caplog)


# -- a pull's deadline and the owner's digest ----------------------------------------------------


@contextlib.asynccontextmanager
async def _holder(
    key: str, size: int, sha: str, send: Callable[[asyncio.StreamWriter], Awaitable[None]]
) -> AsyncIterator[int]:
    """A holder that answers any pull with ``size`` and ``sha`` (authenticated) and then
    ``send``s what it likes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        challenge = os.urandom(32)
        writer.write(MAGIC + challenge)
        (n,) = struct.unpack(">I", await reader.readexactly(4))
        header = await reader.readexactly(n)
        await reader.readexactly(32)
        body = json.dumps({"ok": True, "size": size, "sha256": sha}).encode()
        writer.write(struct.pack(">I", len(body)) + body + reply_mac(key, 0, challenge, header, body))
        with contextlib.suppress(OSError):
            await send(writer)
        writer.close()

    server = await asyncio.start_server(handle, HOST, 0)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        server.close()


async def test_a_pull_past_its_deadline_fails_and_keeps_nothing(here: Holdings) -> None:
    """Each read comes in time (the 20 s timeout never fires): only the deadline ends it."""
    key = new_key()

    async def trickle(writer: asyncio.StreamWriter) -> None:
        for _ in range(10_000):
            writer.write(b"x" * 100)
            await writer.drain()
            await asyncio.sleep(0.05)

    async with _holder(key, 1 << 20, "0" * 64, trickle) as port:
        start = time.monotonic()
        with pytest.raises(ReplicaError, match="passed its deadline") as info:
            await pull(HOST, port, key, 0, 1, here, timeout=TIMEOUT, deadline=time.monotonic() + 0.5)
        assert not info.value.remote
        assert time.monotonic() - start < TIMEOUT / 2  # the deadline ended it, not a timeout
        with pytest.raises(ReplicaError, match="passed its deadline"):  # past already: no connect
            await pull(HOST, port, key, 0, 1, here, timeout=TIMEOUT, deadline=time.monotonic() - 1)
    assert here.inventory() == {} and _parts(here) == [] and here.used_bytes() == 0


async def test_a_pull_takes_only_the_owners_digest(peer: Peer, here: Holdings, tmp_path: Path) -> None:
    src = _snapshot(peer.holdings, 3, 9, 300_000)
    wrong = _sha(b"what the owner announced")
    with pytest.raises(ReplicaError, match="sha256 mismatch") as info:
        await pull(HOST, peer.port, peer.key, 3, 9, here, timeout=TIMEOUT, expected_sha256=wrong)
    assert not info.value.remote
    assert here.inventory() == {} and _parts(here) == [] and here.used_bytes() == 0
    with pytest.raises(ReplicaError, match="expected_sha256: not 64"):
        await pull(HOST, peer.port, peer.key, 3, 9, here, timeout=TIMEOUT, expected_sha256="x")
    got = await pull(
        HOST, peer.port, peer.key, 3, 9, here, timeout=TIMEOUT, expected_sha256=_sha(src.read_bytes()),
        deadline=time.monotonic() + TIMEOUT,
    )  # fmt: skip
    assert got.read_bytes() == src.read_bytes()


async def test_a_holder_sending_other_bytes_than_the_owners_is_refused(here: Holdings) -> None:
    key, owners = new_key(), os.urandom(3000)

    async def lie(writer: asyncio.StreamWriter) -> None:
        writer.write(os.urandom(len(owners)))
        await writer.drain()

    async with _holder(key, len(owners), _sha(owners), lie) as port:
        with pytest.raises(ReplicaError, match="sha256 mismatch"):
            await pull(HOST, port, key, 0, 1, here, timeout=TIMEOUT, expected_sha256=_sha(owners))
    assert here.inventory() == {} and _parts(here) == [] and here.used_bytes() == 0


# -- the digests the agent announces -------------------------------------------------------------


async def test_digests_of_pushes_and_of_received_replicas(peer: Peer, here: Holdings) -> None:
    rep = Replicator(timeout=TIMEOUT)
    try:
        rep.set_peer(HOST, peer.port, peer.key)
        files = {rank: _snapshot(here, rank, 3, 2000 + rank) for rank in (0, 1)}
        for rank, path in files.items():
            rep.offer(rank, 3, path)
        await asyncio.wait_for(rep.drain(), TIMEOUT)
        want = {rank: (3, _sha(path.read_bytes())) for rank, path in files.items()}
        assert rep.replicated_digest == want
        assert peer.server.received == {(rank, 3): sha for rank, (_, sha) in want.items()}
        rep.set_peer(None)  # the digest is the file's: it stays
        assert rep.replicated_digest == want and rep.replicated == {}
        held = peer.holdings.path(0, 3)
        assert held is not None
        held.unlink()  # pruned: no longer held, no longer listed
        assert peer.server.received == {(1, 3): want[1][1]}
    finally:
        await rep.close()


def test_file_sha256_reads_in_chunks_and_follows_no_link(tmp_path: Path) -> None:
    data = os.urandom(100_000)
    path = tmp_path / "f.snap"
    path.write_bytes(data)
    assert file_sha256(path, chunk=4096) == file_sha256(path) == _sha(data)
    (tmp_path / "link").symlink_to(path)
    with pytest.raises(OSError):
        file_sha256(tmp_path / "link")
