"""A member that reported a loopback address, in a round whose other members connect from
elsewhere, is handed to the job at an address they can reach (issue 33: SkyPilot's recipe)."""

from __future__ import annotations

import pytest

from protocol import SUPPORTED_VERSIONS, Assignment, Hello, Join
from rdzv_server.machine.addresses import Seen, is_loopback, peer_host, plain, reachable_addrs
from rdzv_server.machine.state import Connected, Received, Rendezvous, Send


@pytest.mark.parametrize(
    "addr", ["127.0.0.1", "127.0.1.1", "127.255.255.254", "::1", "[::1]", "::ffff:127.0.1.1", "localhost"]
)
def test_loopback_is_all_of_127_8_and_ipv6_loopback(addr: str) -> None:
    assert is_loopback(addr)


@pytest.mark.parametrize(
    "addr", ["198.18.0.2", "10.0.0.1", "::ffff:10.0.0.1", "fe80::1", "head", "", "128.0.0.1"]
)
def test_other_addresses_are_not_loopback(addr: str) -> None:
    assert not is_loopback(addr)


def test_peer_host_and_plain() -> None:
    assert peer_host("198.18.0.2:41000") == "198.18.0.2"
    assert peer_host("::1:41000") == "::1"
    assert peer_host("198.18.0.2") == "198.18.0.2"  # the etcd backend's bare address
    assert peer_host("?") == "?"
    assert plain("::ffff:198.18.0.1") == "198.18.0.1"
    assert plain("fe80::1") == "fe80::1"


def test_node_on_the_server_machine_takes_the_address_the_others_reached() -> None:
    seen = {
        "head": Seen(addr="127.0.0.1", peer="127.0.0.1", local="127.0.0.1"),
        "w1": Seen(addr="198.18.1.2", peer="198.18.1.2", local="198.18.0.2"),
        "w2": Seen(addr="198.18.2.2", peer="198.18.2.2", local="198.18.0.2"),
    }
    assert reachable_addrs(seen) == {"head": "198.18.0.2"}


def test_debian_hostname_address_is_loopback_too() -> None:
    seen = {
        "head": Seen(addr="127.0.1.1", peer="127.0.1.1", local="127.0.1.1"),
        "w1": Seen(addr="10.0.0.7", peer="10.0.0.7", local="::ffff:10.0.0.5"),
    }
    assert reachable_addrs(seen) == {"head": "10.0.0.5"}


def test_the_address_most_others_reached_wins_then_the_smallest() -> None:
    seen = {
        "head": Seen(addr="127.0.0.1", peer="127.0.0.1", local="127.0.0.1"),
        "a": Seen(addr="10.1.0.2", peer="10.1.0.2", local="10.1.0.1"),
        "b": Seen(addr="10.2.0.2", peer="10.2.0.2", local="10.2.0.1"),
        "c": Seen(addr="10.2.0.3", peer="10.2.0.3", local="10.2.0.1"),
    }
    assert reachable_addrs(seen) == {"head": "10.2.0.1"}
    del seen["c"]
    assert reachable_addrs(seen) == {"head": "10.1.0.1"}


def test_a_loopback_report_from_afar_takes_its_own_peer_address() -> None:
    seen = {
        "odd": Seen(addr="127.0.0.1", peer="10.0.0.9", local="10.0.0.1"),  # --local-addr 127.0.0.1
        "w": Seen(addr="10.0.0.8", peer="10.0.0.8", local="10.0.0.1"),
    }
    assert reachable_addrs(seen) == {"odd": "10.0.0.9"}


def test_nothing_changes_on_one_machine_or_without_facts() -> None:
    local = Seen(addr="127.0.0.1", peer="127.0.0.1", local="127.0.0.1")
    assert reachable_addrs({"a": local, "b": local}) == {}  # all on the server's machine
    assert reachable_addrs({"a": Seen(addr="127.0.0.1", peer="10.0.0.9")}) == {}  # one node
    # The others' local address unknown (the etcd backend's replicas): nothing to offer.
    unknown = {"a": local, "b": Seen(addr="10.0.0.8", peer="10.0.0.8")}
    assert reachable_addrs(unknown) == {}
    fine = {"a": Seen(addr="10.0.0.7", peer="127.0.0.1"), "b": Seen(addr="10.0.0.8", peer="10.0.0.8")}
    assert reachable_addrs(fine) == {}


def _join(m: Rendezvous, conn: int, peer: str, local: str, addr: str) -> list[object]:
    m.handle(Connected(conn, peer, local=local), 0.0)
    m.handle(Received(conn, Hello(versions=SUPPORTED_VERSIONS, software="t")), 0.0)
    join = Join(
        job_id="sky",
        node_id=f"n{conn}",
        addr=addr,
        nproc=1,
        min_nodes=2,
        max_nodes=2,
        entrypoint="w.py",
        master_port=30000 + conn,
        max_restarts=0,
        last_call_timeout=5.0,
        heartbeat_interval=1.0,
        heartbeat_timeout=5.0,
    )
    return list(m.handle(Received(conn, join), 0.0))


def test_the_round_hands_the_head_the_address_node_1_reached_and_says_so() -> None:
    m = Rendezvous()
    _join(m, 1, "127.0.0.1:40000", "127.0.0.1", "127.0.0.1")  # node 0: --rdzv-endpoint localhost
    out = _join(m, 2, "198.18.1.2:40001", "198.18.0.2", "198.18.1.2")  # node 1: HEAD_IP
    sent = {e.conn: e.msg for e in out if isinstance(e, Send) and isinstance(e.msg, Assignment)}
    assert {c: (a.group_rank, a.master_addr) for c, a in sent.items()} == {
        1: (0, "198.18.0.2"),
        2: (1, "198.18.0.2"),
    }
    assert m.jobs["sky"].members["n1"].addr == "198.18.0.2"  # the status and history say it too
    lines = [getattr(e, "text", "") for e in out]
    assert any("node n1 reported 127.0.0.1, a loopback address" in t and "198.18.0.2" in t for t in lines)


def test_the_state_log_and_snapshots_keep_the_servers_address() -> None:
    from rdzv_server.journal import RECORDS
    from rdzv_server.state_image import _dump_conn, _load_conn

    kind = RECORDS["connected"]
    event = Connected(3, "198.18.1.2:5", local="198.18.0.2")
    record = kind.write(event, [])
    assert record is not None
    assert kind.read(record) == [Connected(3, "198.18.1.2:5", local="198.18.0.2")]
    old = {"k": "connected", "conn": 3, "peer": "10.0.0.1:5"}  # a log from before
    assert kind.read(old) == [Connected(3, "10.0.0.1:5")]
    m = Rendezvous()
    m.handle(event, 0.0)
    dumped = _dump_conn(m.conns[3])
    assert _load_conn(dumped).local == "198.18.0.2"
    dumped.pop("local")
    assert _load_conn(dumped).local == ""
