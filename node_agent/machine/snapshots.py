"""What the server knows of this node's snapshots (issue 35), and what it asks us to keep.

The I/O layer reads the node's holdings (its ranks' snapshots and the replicas it keeps for a
peer) after every poll and hands them in as :class:`SnapshotsRead`; the server hears them only
when they changed since it last did, and again after a reconnect (a restarted server knows
nothing of them); never while they are empty and were never said (a job that does not snapshot
sends what it sent before). Only while this node is in a round (from its assignment to its verdict):
before its first join a connection may send nothing else, and between rounds nothing changes.
``KeepSnapshot`` from the server becomes :class:`KeepSteps`: the steps every agent keeps (the
newest on two nodes, and the one being copied to the ring peer).
"""

from __future__ import annotations

from protocol import KeepSnapshot, SnapshotsHeld
from protocol.messages import MAX_HELD

from .events import Effect, KeepSteps, Phase, SnapshotsRead
from .link import Link

# The phases in which the server holds this node as a member of a round it runs.
_IN_ROUND = frozenset({Phase.STARTING, Phase.RUNNING, Phase.BARRIER, Phase.STOPPING, Phase.VERDICT})


class Snapshots:
    def __init__(self) -> None:
        self.sent: SnapshotsHeld | None = None  # what the server last heard from us
        self.last: SnapshotsRead | None = None  # what the I/O layer last read

    def read(self, event: SnapshotsRead, phase: Phase, link: Link) -> list[Effect]:
        self.last = event
        if phase not in _IN_ROUND or event.world_size < 1:
            return []
        pairs = event.pairs[:MAX_HELD]  # newest first: what a cut loses is the oldest
        if not pairs and self.sent is None:
            return []  # a job that never snapshots says nothing new on the wire
        digests = event.digests[: len(pairs)]
        msg = SnapshotsHeld(
            world_size=event.world_size,
            ranks=tuple(r for r, _ in pairs),
            steps=tuple(s for _, s in pairs),
            digests=digests if any(digests) and len(digests) == len(pairs) else (),
            replicated=event.replicated,
        )
        if msg == self.sent or link.quiet:
            return []
        self.sent = msg
        return link.send(msg)

    def reconnected(self) -> None:
        """A new connection (perhaps a restarted server): say everything again."""
        self.sent = None

    def owed(self, phase: Phase, link: Link) -> list[Effect]:
        """Back in our round after a reconnect: what we hold, said at once, before a failure
        report that waited for the connection (the restart it causes restores from it)."""
        return [] if self.last is None else self.read(self.last, phase, link)

    def keep(self, msg: KeepSnapshot) -> list[Effect]:
        return [KeepSteps(msg.step, msg.replicate)]
