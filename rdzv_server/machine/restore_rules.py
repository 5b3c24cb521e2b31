"""The in-memory snapshot rules (issue 35): one restore step for every rank, and who keeps what.

Agents that snapshot send what they hold (``SnapshotsHeld``: their own ranks' snapshots and the
replicas they keep for a peer); ``restore_points.py`` indexes it. From it:

- **Keep.** The newest step every rank of the running round has on two nodes (on one, in a job
  of one node) survives the loss of any one node. Every agent that snapshots is told it
  (``KeepSnapshot.step``) and keeps it from pruning until a newer one comes: the agents' own
  pruning keeps only their newest two, which the replicas lag.
- **Replicate.** Each node copies its ranks' snapshots to the next node of the round's order (a
  ring): every rank's snapshot is then on its own node and on the next one, so losing any one
  node leaves a copy of each. Which step is copied is chosen here, one for the whole job
  (``KeepSnapshot.replicate``: the newest step every rank has, kept from pruning too, fixed
  until every copy is done): if each node copied its own newest, ranks snapshotting every step
  would have their copies at different steps and no step would ever be on two nodes for all.
  A job of one node has no peer.
- **Restore.** A round that forms with the same world size as the snapshots restores every rank
  from the newest step every rank has on a node of the round. A round of another world size
  (a shrink) restores only from state every rank holds alike (``SnapshotsHeld.replicated``):
  the newest step at which every node of the round holds a snapshot of one of its own ranks of
  the old world; each node's ranks restore from that file (``Assignment.restore_world`` and
  ``restore_ranks``), which the node carries into its new ranks' folders, without a copy.
  Otherwise each node's Assignment says, per local rank, whether it holds that snapshot or
  which member does (its replica address and key), so a spare that took a lost node's place,
  or a node whose ranks moved, fetches them before its workers start. The history says from
  which step and how many steps that lost.

Volatile, like Progress: the holdings are not in the state log (a restarted server learns them
again from the agents, which send them again after reconnecting). The restore a round was given
is logged as a fact of the event that formed it, so replay writes the same history.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

from protocol import KeepSnapshot, SnapshotsHeld
from protocol.messages import MAX_ADDR_LEN, MAX_RESTORE_SOURCES

from . import history as said
from .commits import CommitRules
from .events import Effect, Send
from .faults import from_volatile
from .jobs import Job, JobPhase, Member


def replica_addr(m: Member) -> str:
    """Where ``m``'s agent takes replicas: "host:port" ("[v6]:port"); "" if it takes none."""
    if m.replica_port <= 0:
        return ""
    host = f"[{m.addr}]" if ":" in m.addr else m.addr
    addr = f"{host}:{m.replica_port}"
    return addr if len(addr) <= MAX_ADDR_LEN else ""  # an address the Assignment cannot carry


def durable_step(job: Job, world: int, order: Sequence[str], exclude: Collection[int] = ()) -> int:
    """The newest step every member of the round being formed offered from its snapshot
    directory for a job of ``world`` ranks (Join.durable_steps; -1: none). Deterministic
    (from the logged Joins), but taken with the volatile holdings, so logged with them."""
    common: set[int] | None = None
    for nid in order:
        m = job.members[nid]
        if m.durable_world != world or not m.durable_steps:
            return -1
        common = set(m.durable_steps) if common is None else common & set(m.durable_steps)
    return max((s for s in common or () if s not in exclude), default=-1)


class Choice(NamedTuple):
    """What a round being formed restores: ``step`` (-1: none), the step the job had reached
    (for the history; -1: not reported), whether from the snapshot directories; and for
    state every rank holds alike restored at another world size, that world and per node of
    the round's order the old rank whose snapshot it restores (0, (): the round's own world)."""

    step: int
    reached: int
    from_disk: bool = False
    world: int = 0
    ranks: tuple[int, ...] = ()


class RestoreRules(CommitRules):
    def _on_held(self, job: Job, member: Member, msg: SnapshotsHeld, now: float, out: list[Effect]) -> None:
        member.snapshots = True
        digests = msg.digests or ("",) * len(msg.ranks)
        claims = list(zip(msg.ranks, msg.steps, digests, strict=True))
        prov, spans = job.provenance, job.round_spans
        believed, again = prov.claim(
            member.node_id, msg.world_size, claims, spans.get(member.node_id, range(0)), job.world_size
        )
        changed = job.restore_points.update(
            member.node_id, msg.world_size, believed, replicated=msg.replicated
        )
        for nid in sorted(again):  # replicas waiting for this owner's digest, or made false by it
            world, pairs = prov.recheck(nid, spans.get(nid, range(0)), job.world_size)
            changed |= job.restore_points.update(nid, world, pairs)
        if changed:
            self._snapshot_news(job, now, out)

    def _snapshot_news(self, job: Job, now: float, out: list[Effect]) -> None:
        """The holdings changed: the job's newest restorable step, the step kept and the step
        being replicated."""
        if job.phase is not JobPhase.RUNNING or job.world_size <= 0:
            return
        points, world = job.restore_points, job.world_size
        newest = points.newest(world)
        if newest != job.snapshot_step:
            job.snapshot_step, job.snapshot_since = newest, now
        ring = len(job.order) > 1
        keep, replicate = job.kept_step, job.replicate_step
        if not ring:
            keep, replicate = max(keep, newest), -1  # one node: nothing to copy, nowhere to
        else:
            if replicate >= 0 and points.complete(world, replicate, twice=True):
                keep, replicate = max(keep, replicate), -1  # copied everywhere: it is the kept one
            keep = max(keep, points.newest(world, twice=True))
            # The step every agent copies: one that every rank has, fixed until it is copied
            # (a newer one each time would never finish under a snapshot every step), or until
            # it is no longer held everywhere (a node pruned it before it was pinned).
            if replicate <= keep or not points.complete(world, replicate):
                replicate = newest if newest > keep else -1
        if (keep, replicate) != (job.kept_step, job.replicate_step):
            if replicate >= 0 and replicate != job.replicate_step:
                self._ask_replicas(job, world, replicate)
            job.kept_step, job.replicate_step = keep, replicate
            msg = KeepSnapshot(step=keep, replicate=replicate)
            for nid in job.order:
                m = job.members.get(nid)
                if m is not None and m.snapshots:
                    out.append(Send(m.conn, msg))

    @staticmethod
    def _ask_replicas(job: Job, world: int, step: int) -> None:
        """Each node of the ring is asked to hold its predecessor's ranks at ``step``: the only
        replicas of them it may claim (``provenance.py``)."""
        order = [nid for nid in job.order if nid in job.round_spans]
        n = len(order)
        holders = {order[(i + 1) % n]: job.round_spans[nid] for i, nid in enumerate(order) if n > 1}
        job.provenance.ask(world, step, holders)

    @from_volatile("restore")
    def _restore_step(self, job: Job, world: int, order: Sequence[str]) -> Choice:
        """What the round being formed restores. Live, from the holdings and the progress,
        both volatile, so logged as a fact; replaying, from the fact."""
        if self.logged_facts is not None:
            logged = self.logged_facts.get("restore", [])
            mine = [e for e in logged if e[0] == job.id]
            if not mine:
                return Choice(-1, -1)
            self.logged_facts["restore"] = [e for e in logged if e is not mine[0]]  # used once
            fact = [*mine[0], -1, False, 0, []][:6]  # older logs: no reached, durable, world
            ranks = tuple(int(r) for r in fact[5]) if int(fact[4]) else ()
            return Choice(int(fact[1]), int(fact[2]), fact[3] is True, int(fact[4]), ranks)
        bad = {s for w, s in job.unrestorable if w == world}
        step = job.restore_points.newest_among(world, set(order), exclude=bad)
        durable = durable_step(job, world, order, exclude=bad)
        from_disk = durable > step  # memory wins a tie: no disk read
        step = max(step, durable)
        reached = job.progress.max_step
        old, ranks = job.world_size, ()
        if 0 < old != world and all(nid in job.round_spans for nid in order):
            # A shrink: state every rank holds alike restores at the new world size.
            gone = bad | {s for w, s in job.unrestorable if w == old}
            spans = {nid: job.round_spans[nid] for nid in order}
            alike, picks = job.restore_points.newest_alike(old, spans, exclude=gone)
            if alike > step:
                step, from_disk, ranks = alike, False, tuple(picks[nid] for nid in order)
        choice = Choice(step, reached, from_disk, old if ranks else 0, ranks)
        if step >= 0:
            self._add_fact("restore", [job.id, step, reached, from_disk, choice.world, list(ranks)])
        return choice

    def _restore_fields(
        self,
        job: Job,
        choice: Choice,
        world: int,
        order: Sequence[str],
        offsets: Sequence[int],
        now: float,
        out: list[Effect],
    ) -> list[dict[str, object]]:
        """Each node's restore plan and ring peer, as Assignment fields (in ``order``)."""
        n = len(order)
        step = choice.step
        members = [job.members[nid] for nid in order]
        job.round_spans = {
            nid: range(offsets[i], offsets[i] + members[i].nproc) for i, nid in enumerate(order)
        }
        plans: list[dict[str, object]] = []
        for i, m in enumerate(members):
            fields: dict[str, object] = {}
            peer = members[(i + 1) % n] if n > 1 else None
            if peer is not None and m.replica_port > 0 and replica_addr(peer):
                fields["replica_to"], fields["replica_key"] = replica_addr(peer), peer.replica_key
                if peer.replica_cert:
                    fields["replica_cert"] = peer.replica_cert
            before = members[i - 1] if n > 1 else None
            if before is not None and m.replica_port > 0 and before.replica_port > 0:
                # Whose replicas this node takes: any other push it refuses.
                fields["replica_from"], fields["replica_count"] = offsets[i - 1], before.nproc
            if step >= 0 and choice.world:
                # Its own snapshot of an old rank, for every local rank (it holds it).
                fields.update(
                    restore_step=step, restore_world=choice.world, restore_ranks=(choice.ranks[i],) * m.nproc
                )
            elif step >= 0 and choice.from_disk:
                fields.update(restore_step=step, restore_durable=True)  # each node reads its own
            elif step >= 0:
                fields.update(self._sources(job, step, world, m, offsets[i], set(order)))
            plans.append(fields)
        if step >= 0:
            event = said.restored(now, job.round, step, choice.reached, choice.from_disk, choice.world)
            said.note(job, event, out)
        job.world_size = world
        job.restore_step = step
        job.kept_step = job.replicate_step = -1  # the agents prune by the new round's holdings
        return plans

    def _sources(
        self, job: Job, step: int, world: int, m: Member, offset: int, among: set[str]
    ) -> dict[str, object]:
        """Where each of ``m``'s ranks restores from: itself (-1) or a member's replica store,
        with a second holder to try when the first fails, and the owner's digest every copy
        must have (``provenance.py``: only believed claims are in the holdings)."""
        points, prov = job.restore_points, job.provenance
        addrs: list[str] = []
        keys: list[str] = []
        certs: list[str] = []
        source: list[int] = []
        alt: list[int] = []
        digests: list[str] = []

        def index(holder: Member) -> int:
            addr = replica_addr(holder)
            if addr in addrs:
                return addrs.index(addr)
            if len(addrs) >= MAX_RESTORE_SOURCES:
                return -1
            addrs.append(addr)
            keys.append(holder.replica_key)
            certs.append(holder.replica_cert)
            return len(addrs) - 1

        for rank in range(offset, offset + m.nproc):
            digests.append(prov.digest(world, rank, step))
            if points.holds(m.node_id, world, step, rank):
                source.append(-1)
                alt.append(-1)
                continue
            holders = [
                job.members[h]
                for h in sorted(points.holders(world, step, rank))
                if h in among and replica_addr(job.members[h])
            ]
            if not digests[-1]:
                # No digest to check a copy against: only the node that made the snapshot
                # may send it (it is trusted about its own ranks).
                maker = prov.maker(world, rank, step)
                holders = [h for h in holders if h.node_id == maker]
            # held where nobody can fetch it: -1, and the worker says it is missing
            picked = [i for i in (index(h) for h in holders[:2]) if i >= 0]
            source.append(picked[0] if picked else -1)
            alt.append(picked[1] if len(picked) > 1 else -1)
        fields: dict[str, object] = {
            "restore_step": step,
            "restore_source": tuple(source),
            "restore_addrs": tuple(addrs),
            "restore_keys": tuple(keys),
        }
        if any(a >= 0 for a in alt):
            fields["restore_alt"] = tuple(alt)
        if any(digests):
            fields["restore_digests"] = tuple(digests)
        if any(certs):
            fields["restore_certs"] = tuple(certs)
        return fields
