"""Several hosts for real: agents in their own network namespaces, the server in a hub between them.

Each agent sees only its own veth and loopback, so the address it reports is the one the server
and the other hosts reach it at, and a worker that connects to the wrong address (127.0.0.1, the
hostname's) fails instead of passing by accident. See ``netns.py`` for the topology.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .netns import Network, NsProc, listening_port
from .procs import WORKERS, agent_cmd, pid_alive, server_cmd

GLOO_DUMP = str(WORKERS / "gloo_env_dump.py")
SLEEPER = str(WORKERS / "sleeper.py")  # prints "started <rank> <world> <pid> <restart>", sleeps


@pytest.fixture
def net() -> Iterator[Network]:
    with Network.create(n_hosts=2) as n:
        yield n


def start_server(net: Network) -> tuple[NsProc, str, int]:
    """The rendezvous server in the hub, on its address on host 0's link (host 1 routes to it)."""
    addr = net.hosts[0].gateway
    srv = net.spawn(net.hub, server_cmd("--host", addr, "--port", "0"))
    return srv, addr, listening_port(srv, addr)


def stop_server(srv: NsProc) -> None:
    srv.signal(signal.SIGTERM)
    assert srv.wait(timeout=15) == 0, srv.stderr


def node_id_pattern(agent: NsProc) -> str:
    """The agent's node id ("<hostname>:<pid>:<hex>"); `ip netns exec` execs, so the pid is ours."""
    return rf"{re.escape(socket.gethostname())}:{agent.p.pid}:[0-9a-f]+"


def test_gloo_all_reduce_across_two_hosts(net: Network, tmp_path: Path) -> None:
    srv, addr, port = start_server(net)
    args = ("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"{addr}:{port}", "--rdzv-id", "mh")
    agents = [
        net.spawn(
            host.ns,
            agent_cmd(*args, GLOO_DUMP),
            # Needed (tried without): gloo then binds the address the hostname resolves to,
            # 127.0.0.1 here, advertises it to its peers, and rank 1 fails in init_process_group
            # with "Connection refused, remote=[127.0.0.1]:…". Naming the veth makes it bind and
            # advertise the host's own address, as on a real multi-homed machine.
            env={"DUMP_DIR": str(tmp_path), "GLOO_SOCKET_IFNAME": host.ifname},
        )
        for host in net.hosts
    ]
    for a in agents:
        assert a.wait(timeout=90) == 0, a.stderr
    stop_server(srv)

    by_inode = {h.netns_inode: h for h in net.hosts}
    dumps = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("node-*.json"))]
    assert sorted(int(d["RANK"]) for d in dumps) == [0, 1]
    assert {d["WORLD_SIZE"] for d in dumps} == {"2"}
    assert {d["GROUP_WORLD_SIZE"] for d in dumps} == {"2"}
    host_of = {int(d["RANK"]): by_inode[int(d["_netns"])] for d in dumps}
    assert sorted(h.ns for h in host_of.values()) == sorted(h.ns for h in net.hosts), "one rank per host"
    (master,) = [by_inode[int(d["_netns"])] for d in dumps if d["GROUP_RANK"] == "0"]
    # MASTER_ADDR is what group rank 0 reported: the local end of its connection to the server.
    assert {d["MASTER_ADDR"] for d in dumps} == {master.addr}
    # The first round orders nodes by reported address, so the lower one is group rank 0.
    assert master.addr == min((h.addr for h in net.hosts), key=socket.inet_aton)
    assert len({d["MASTER_PORT"] for d in dumps}) == 1
    for d in dumps:
        assert float(d["_sum"]) == float(d["_expected"]) == 3.0
        assert not pid_alive(int(d["_pid"]))


def test_silent_node_is_dropped_and_survivor_restarts_smaller(net: Network, tmp_path: Path) -> None:
    heartbeat_timeout, bound = 2.0, 15.0
    srv, addr, port = start_server(net)
    args = (
        *("--nnodes", "1:2", "--nproc-per-node", "1"),
        *("--rdzv-endpoint", f"{addr}:{port}", "--rdzv-id", "silent"),
        *("--rdzv-conf", f"heartbeat_timeout={heartbeat_timeout:g},last_call_timeout=1"),
    )
    host_a, host_b = net.hosts
    # sleeper.py also appends to $DUMP_DIR/started.txt, so each host gets its own folder.
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    a, b = (
        net.spawn(h.ns, agent_cmd(*args, SLEEPER), env={"DUMP_DIR": str(d)})
        for h, d in zip((host_a, host_b), dirs, strict=True)
    )

    # With a 1 s last call, one node may start alone first; wait until both run in one world of 2.
    alive2 = r"started (\d) 2 (\d+) \d+"
    ma = a.wait_for_line(alive2, stream="out", timeout=60)
    mb = b.wait_for_line(alive2, stream="out", timeout=60)
    assert {ma.group(1), mb.group(1)} == {"0", "1"}
    old_pid = int(ma.group(2))
    a_out, a_err, srv_err = a.mark("out"), a.mark("err"), srv.mark("err")

    cut_at = time.monotonic()
    net.cut(host_b)

    b_id = node_id_pattern(b)
    silent = rf"node {b_id} went silent \(no heartbeat for {heartbeat_timeout:g} s\) \(1 remain\)"
    srv.wait_for_line(silent, after=srv_err, timeout=bound)
    m = a.wait_for_line(
        r"started 0 1 (\d+) \d+",
        stream="out",
        after=a_out,
        timeout=max(0.0, bound - (time.monotonic() - cut_at)),
    )
    took = time.monotonic() - cut_at
    assert took < bound
    assert int(m.group(1)) != old_pid
    assert not pid_alive(old_pid), "the world-2 worker on A was not stopped"
    assert (dirs[0] / f"sigterm-{old_pid}").exists(), "A's world-2 worker was not stopped with SIGTERM"
    a.wait_for_line(
        rf"re-rendezvous after round \d+: node {b_id} \({re.escape(host_b.addr)}\) went silent",
        after=a_err,
        timeout=1,
    )
    # Dropped by the heartbeat sweep, not by a closed connection: the cut sent no FIN or RST.
    about_b = [ln for ln in srv.lines("err", after=srv_err) if re.search(b_id, ln)]
    assert not [ln for ln in about_b if "connection" in ln], about_b

    # B hears nothing either (its packets go nowhere until TCP gives up, minutes from now) and
    # would hang with its worker: kill its session (its worker dies with it, see supervisor.py).
    b.kill()
    a.kill()
    stop_server(srv)
