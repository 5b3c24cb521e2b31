"""The order agents try the rendezvous in after its host is lost (``rdzv/takeover.py``)."""

from __future__ import annotations

import socket

from node_agent.rdzv.takeover import Target, newer, reserve_port, split_endpoint, walk
from protocol import Standbys

LIST = Standbys(term=1, host_node="h", endpoints=("10.0.0.2:29500", "[fd00::3]:4000"), nodes=("b", "c"))


def test_every_agent_tries_the_host_then_the_standbys_and_stops_at_its_own_turn() -> None:
    first = ("head", 29500)
    assert walk(LIST, first, "x") == [
        Target("head", 29500, "h"),
        Target("10.0.0.2", 29500, "b"),
        Target("fd00::3", 4000, "c"),
    ]
    assert walk(LIST, first, "b") == [Target("head", 29500, "h"), Target("10.0.0.2", 29500, "b", mine=True)]
    assert walk(LIST, first, "c")[-1] == Target("fd00::3", 4000, "c", mine=True)
    assert len(walk(LIST, first, "c")) == 3  # the first standby first: it may have taken over


def test_a_list_from_an_older_host_is_never_taken() -> None:
    assert newer(None, LIST)
    assert newer(LIST, LIST)
    later = Standbys(term=2, host_node="b", endpoints=("[fd00::3]:4000",), nodes=("c",))
    assert newer(LIST, later) and not newer(later, LIST)


def test_split_endpoint_takes_v4_names_and_bracketed_v6() -> None:
    assert split_endpoint("10.0.0.2:29500") == ("10.0.0.2", 29500)
    assert split_endpoint("[::1]:7") == ("::1", 7)
    assert split_endpoint("head.example:1") == ("head.example", 1)


def test_the_reserved_port_is_the_endpoints_where_free_else_another_and_held() -> None:
    taken = socket.socket()
    taken.bind(("", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    try:
        got = reserve_port(busy)
        assert got is not None
        port = got.getsockname()[1]
        assert port != busy
        # listening: a peer can tell this agent is alive (the kernel accepts; nobody answers)
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
        # held: a second reservation of that port gets another one
        again = reserve_port(port)
        assert again is not None and again.getsockname()[1] != port
        again.close()
        got.close()
        free = reserve_port(port)  # released: the preferred port is taken when free
        assert free is not None and free.getsockname()[1] == port
        free.close()
    finally:
        taken.close()
