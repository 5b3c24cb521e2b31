"""The etcd backend's log, without etcd: entries, and replicas that must agree."""

from __future__ import annotations

import msgpack
import pytest

from node_agent.rdzv.etcd import (
    CONNECTED,
    DISCONNECTED,
    RECEIVED,
    TICK,
    BadLogEntry,
    Entry,
    EtcdConnection,
    Replica,
    decode_entry,
    encode_entry,
)
from node_agent.rdzv.etcd_client import prefix_end
from protocol import SUPPORTED_VERSIONS, Assignment, Hello, Join, Waiting, Welcome
from rdzv_server.machine.state import Send

A, B = 0x1111, 0x2222  # lease ids stand for connections


def join(node: str, *, nnodes: str = "2", addr: str = "10.0.0.1", last_call: float = 5.0) -> Join:
    lo, _, hi = nnodes.partition(":")
    return Join(
        job_id="job",
        node_id=node,
        addr=addr,
        nproc=2,
        min_nodes=int(lo),
        max_nodes=int(hi or lo),
        entrypoint="train.py",
        master_port=20000,
        max_restarts=0,
        last_call_timeout=last_call,
        heartbeat_interval=1.0,
        heartbeat_timeout=5.0,
    )


def hello() -> Hello:
    return Hello(versions=SUPPORTED_VERSIONS, software="t")


def two_node_log() -> list[Entry]:
    return [
        Entry(CONNECTED, 100.0, A, peer="10.0.0.1"),
        Entry(RECEIVED, 100.0, A, msg=hello()),
        Entry(CONNECTED, 100.1, B, peer="10.0.0.2"),
        Entry(RECEIVED, 100.1, B, msg=hello()),
        Entry(RECEIVED, 100.2, A, msg=join("a", addr="10.0.0.1")),
        Entry(RECEIVED, 100.3, B, msg=join("b", addr="10.0.0.2")),
    ]


def sends(replica: Replica, entries: list[Entry]) -> list[tuple[int, object]]:
    out: list[tuple[int, object]] = []
    for entry in entries:
        out += [(e.conn, e.msg) for e in replica.apply(entry) if isinstance(e, Send)]
    return out


@pytest.mark.parametrize(
    "entry",
    [
        Entry(CONNECTED, 1.5, A, peer="10.0.0.1"),
        Entry(RECEIVED, 2.0, A, msg=join("a")),
        Entry(DISCONNECTED, 3.0, B, reason="went silent"),
        Entry(TICK, 4.25, A),
    ],
)
def test_entries_survive_the_round_trip(entry: Entry) -> None:
    assert decode_entry(encode_entry(entry)) == entry


def test_unreadable_entries_are_named_not_misread() -> None:
    with pytest.raises(BadLogEntry, match="not msgpack"):
        decode_entry(b"\xc1")
    with pytest.raises(BadLogEntry, match="entry version 9; this agent reads version 1"):
        decode_entry(msgpack.packb({"v": 9, "k": TICK, "now": 1.0, "c": 1}))
    with pytest.raises(BadLogEntry, match="malformed"):
        decode_entry(msgpack.packb({"v": 1, "k": "explode", "now": 1.0, "c": 1}))
    bad_join = msgpack.packb({"v": 1, "k": RECEIVED, "now": 1.0, "c": 1, "m": msgpack.packb({"t": "join"})})
    with pytest.raises(BadLogEntry, match="bad message in entry"):
        decode_entry(bad_join)


def test_replicas_fed_the_same_log_send_the_same_messages() -> None:
    first, second = Replica(), Replica()
    log = two_node_log()
    out = sends(first, log)
    assert out == sends(second, log)
    assigned = {conn: msg for conn, msg in out if isinstance(msg, Assignment)}
    assert {conn: a.group_rank for conn, a in assigned.items()} == {A: 0, B: 1}
    assert {a.master_addr for a in assigned.values()} == {"10.0.0.1"}
    assert isinstance(out[0][1], Welcome) and out[0][0] == A


def test_a_message_logged_after_its_senders_disconnect_is_ignored() -> None:
    replica = Replica()
    sends(replica, two_node_log()[:4])
    sends(replica, [Entry(DISCONNECTED, 100.2, A, reason="went silent")])
    # A's join was appended before it learned it was gone: every replica skips it alike.
    assert sends(replica, [Entry(RECEIVED, 100.3, A, msg=join("a"))]) == []
    assert sends(replica, [Entry(DISCONNECTED, 100.4, A)]) == []  # a second report of it too


def test_time_never_runs_backwards_across_proposers_clocks() -> None:
    replica = Replica()
    log = [*two_node_log()[:4], Entry(RECEIVED, 100.0, A, msg=join("a", nnodes="1:2", last_call=1.0))]
    out = sends(replica, log)
    assert any(isinstance(m, Waiting) for _, m in out)
    deadline = replica.machine.next_deadline()
    assert deadline is not None and deadline == pytest.approx(101.1)  # last call from the latest time, 100.1
    # a tick proposed by a node whose clock lags is applied at the replica's time: too early
    assert [m for _, m in sends(replica, [Entry(TICK, 99.0, B)]) if isinstance(m, Assignment)] == []
    out = sends(replica, [Entry(TICK, deadline, B)])
    assert [type(m) for c, m in out if c == A] == [Assignment]


def test_silence_is_not_a_departure_when_leases_keep_liveness() -> None:
    replica = Replica()
    sends(replica, two_node_log())
    assert replica.machine.next_deadline() is None  # no heartbeat sweep is due, ever
    assert sends(replica, [Entry(TICK, 10_000.0, A)]) == []
    assert set(replica.machine.conns) == {A, B}


@pytest.mark.parametrize(
    ("prefix", "end"),
    [(b"/a/", b"/a0"), (b"a", b"b"), (b"a\xff", b"b"), (b"\xff\xff", b"\0")],
)
def test_prefix_end_covers_exactly_the_prefix(prefix: bytes, end: bytes) -> None:
    assert prefix_end(prefix) == end


def test_a_connections_entries_and_ticks_carry_its_injected_wall_clock() -> None:
    """No entry reads the host's clock by itself: replicas agree on the proposers' stated time."""
    import asyncio

    from node_agent.rdzv.etcd_client import EtcdClient

    async def scenario() -> list[tuple[Entry, bytes | None]]:
        conn = EtcdConnection(
            EtcdClient("http://etcd.invalid:2379"),
            b"p/job/",
            A,
            10,
            "10.0.0.1",
            lambda *a: None,
            lambda: 1234.5,
        )
        conn.send(join("n1"))
        await conn._tick_when_due(1000.0)  # due long ago on this clock: at once, stamped with it
        out = []
        while not conn._outbox.empty():
            entry, guard, _ = conn._outbox.get_nowait()
            out.append((entry, guard))
        await conn.client.close()
        return out

    (sent, _), (tick, guard) = asyncio.run(scenario())
    assert (sent.kind, sent.now) == (RECEIVED, 1234.5)
    assert (tick.kind, tick.now, guard) == (TICK, 1234.5, b"p/job/tick/1000.0")
