"""Standby rendezvous hosts (issue 45): no node is special.

A rendezvous an agent hosts dies with that agent. So that its job outlives it, the server names
each job's standbys with every round: the first ``STANDBYS`` members of the round's order (the
order the ranks follow) that offered a port (``Join.standby_port``), never the node hosting
now. Every agent of the job tries the same list in the same order after the host is lost
(``node_agent/rdzv/takeover.py``): the host first, then each standby; a standby that reaches its
own name before reaching anyone hosts, and the others find it there. ``term`` counts the
take-overs (the host's, then one more at each): an agent takes a list only from a term at least
its own, so no late message sends it back to a host that was replaced.

What the new host knows is what the agents tell it (``recovery.py``: the round rebuilt from
their ``Resume``): the old host's node never comes back, so the rebuilt round waits for it no
longer than its workers' failure or the resume window, then goes on with whoever came back.
"""

from __future__ import annotations

from protocol import MAX_ADDR_LEN, Standbys
from protocol.records import record

from .jobs import Job, Member

STANDBYS = 2  # enough for one more loss while a take-over is under way; at most MAX_STANDBYS


@record(frozen=True, slots=True)
class TakeOver:
    """What a standby that took over knows of the loss: its job, the lost host's node when it
    held a place in the job's round ("" otherwise), and the standbys before it that did not
    answer. The round rebuilt from the agents' Resume waits for none of them."""

    job: str
    host: str = ""
    passed: tuple[str, ...] = ()

    def lost(self, job: Job) -> tuple[str, ...]:
        """The nodes of ``job``'s round it knows are lost (none that came back after all)."""
        if job.id != self.job:
            return ()
        return tuple(n for n in (self.host, *self.passed) if n and n not in job.members)

    def describe(self, lost: tuple[str, ...]) -> str:
        parts = [f"node {self.host}, which hosted the rendezvous, is lost"] if self.host in lost else []
        others = [n for n in lost if n != self.host]
        if others:
            parts.append(f"its standby {', '.join(others)} did not answer")
        return "; ".join(parts)


def endpoint(m: Member) -> str:
    """Where ``m``'s agent would host: "host:port" ("[v6]:port"); "" if it would not."""
    if m.standby_port <= 0:
        return ""
    host = f"[{m.addr}]" if ":" in m.addr else m.addr
    addr = f"{host}:{m.standby_port}"
    return addr if len(addr) <= MAX_ADDR_LEN else ""  # an address Standbys cannot carry


def standbys_of(job: Job, host_node: str, term: int) -> Standbys:
    """The job's standbys for the round it just formed (``job.order``)."""
    picked = [
        m
        for m in (job.members[nid] for nid in job.order if nid in job.members)
        if endpoint(m) and m.node_id != host_node
    ][:STANDBYS]
    return Standbys(
        term=term,
        host_node=host_node,
        host_in_round=host_node in job.members and host_node in job.order,
        endpoints=tuple(endpoint(m) for m in picked),
        nodes=tuple(m.node_id for m in picked),
    )
