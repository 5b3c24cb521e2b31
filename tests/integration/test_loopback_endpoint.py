"""SkyPilot's ``train-rdzv.yaml`` recipe on two real hosts (network namespaces, ``netns.py``).

The recipe gives node 0 ``--rdzv_endpoint=localhost:PORT`` and every other node
``HEAD_IP:PORT``, with no rendezvous server started beforehand. So node 0's agent hosts the
rendezvous, and must listen where the other node can reach it (every interface, as torchrun's
c10d store does), and node 0 reports 127.0.0.1 as its address, which must not become the
job's ``MASTER_ADDR`` (the server replaces it with the address node 1 reached it on:
``rdzv_server/machine/addresses.py``). Each host sees only its own veth and loopback, so a worker given
a loopback ``MASTER_ADDR`` on the other host fails instead of passing by accident.

The same recipe runs under torchrun in the same namespaces, and both must exit 0 on both nodes.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Mapping, Sequence

import pytest

from .netns import Host, Network, NsProc
from .procs import WORKERS, agent_cmd, free_port

WORKER = str(WORKERS / "gloo_master_addr.py")
LAUNCHERS = {
    "node-agent": agent_cmd(),
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}
RESULT = r"rank (\d) of 2: MASTER_ADDR=(\S+) all_reduce=3 expected=3"


@pytest.fixture(scope="module")
def net() -> Iterator[Network]:
    with Network.create(n_hosts=2) as n:
        yield n


def recipe(launcher: str, endpoint: str, job: str, *extra: str) -> list[str]:
    """One node's line of the recipe (its spelling: underscores, ``=``), with ``extra`` flags."""
    return [
        *LAUNCHERS[launcher],
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={endpoint}",
        f"--rdzv_id={job}",
        *extra,
        WORKER,
    ]


def run_recipe(
    net: Network,
    launcher: str,
    job: str,
    extra: Sequence[Sequence[str]] = ((), ()),
    env: Sequence[Mapping[str, str]] = ({}, {}),
) -> tuple[NsProc, NsProc]:
    head, other = net.hosts
    port = free_port()  # free in the root namespace; the hosts' namespaces are fresh

    def spawn(host: Host, endpoint: str, flags: Sequence[str], more: Mapping[str, str]) -> NsProc:
        # GLOO_SOCKET_IFNAME: the host name resolves to 127.0.0.1 in every namespace here, which
        # gloo would otherwise bind and advertise (test_multihost.py says more).
        env = {"GLOO_SOCKET_IFNAME": host.ifname, **more}
        return net.spawn(host.ns, recipe(launcher, endpoint, job, *flags), env=env)

    node0 = spawn(head, f"localhost:{port}", extra[0], env[0])
    node1 = spawn(other, f"{head.addr}:{port}", extra[1], env[1])
    for node in (node0, node1):
        node.wait(timeout=120)
    return node0, node1


def results(node: NsProc) -> dict[int, str]:
    """rank -> the MASTER_ADDR its worker printed after its all_reduce gave the right sum."""
    found = (re.search(RESULT, line) for line in node.lines("out"))
    return {int(m.group(1)): m.group(2) for m in found if m}


def test_localhost_endpoint_on_node_0_forms_a_job_across_hosts(net: Network) -> None:
    head = net.hosts[0]
    # LOGLEVEL on node 0 only: the rendezvous it hosts then says its lines too.
    node0, node1 = run_recipe(net, "node-agent", "sky", env=({"LOGLEVEL": "INFO"}, {}))
    assert (node0.p.returncode, node1.p.returncode) == (0, 0), node0.stderr + node1.stderr

    # Node 0 found nothing at localhost:PORT and hosted the rendezvous, reachable from node 1.
    hosts = r"no rendezvous server was listening on port \d+: this agent hosts it, on every interface"
    node0.wait_for_line(hosts)
    # Its reported 127.0.0.1 was replaced by the address node 1 reached it on, and said so.
    node0.wait_for_line(
        rf"node \S+ reported 127\.0\.0\.1, a loopback address, while other nodes connect from "
        rf"elsewhere: its address is {re.escape(head.addr)}, the address the other nodes reach "
        r"this server on"
    )
    # Both workers ran one all_reduce in one world of 2, given node 0's network address.
    got = results(node0) | results(node1)
    assert got == {0: head.addr, 1: head.addr}, node0.stdout + node1.stdout
    assert results(node0) == {0: head.addr}, "node 0 (the lower address once replaced) is group rank 0"
    master = rf"master {re.escape(head.addr)}:\d+, restart 0"
    node0.wait_for_line(rf"\[node-agent\] round 0: group rank 0 of 2, rank 0, world size 2, {master}")
    node1.wait_for_line(rf"\[node-agent\] round 0: group rank 1 of 2, rank 1, world size 2, {master}")
    for node in (node0, node1):
        assert not any("127.0.0.1" in line for line in node.lines("out")), node.stdout
        node.wait_for_line(r"\[node-agent\] done: all nodes finished")


def test_torchrun_runs_the_same_recipe(net: Network) -> None:
    pytest.importorskip("torch.distributed.run")
    head, other = net.hosts
    # torchrun hands workers rank 0's host name (socket.getfqdn()); every namespace here shares
    # one host name that resolves to 127.0.0.1, where a real cluster's DNS gives each node's own
    # address. --local_addr stands in for that resolution, and nothing else changes.
    extra = ((f"--local_addr={head.addr}",), (f"--local_addr={other.addr}",))
    node0, node1 = run_recipe(net, "torchrun", "sky-torchrun", extra)
    # Exit codes as ours: 0 on both nodes.
    assert (node0.p.returncode, node1.p.returncode) == (0, 0), node0.stderr + node1.stderr
    got = results(node0) | results(node1)
    assert set(got) == {0, 1}, node0.stdout + node1.stdout
    assert len(set(got.values())) == 1, got
