"""A job's training progress, its stragglers and its latest hang, as the server sees them (pure).

The agents send one ``Progress`` per node while their ranks' steps move (with their
heartbeats), a ``HangDetected`` when a rank of theirs stops, and their ranks' ``Stacks``
after a hang. This module keeps what the status surfaces show of them and scores stragglers;
``rounds.py`` routes the messages here and decides what follows (a HANG or STRAGGLER history
event, ``CollectStacks``, leaving a straggler out of the next round).

Volatile on purpose: Progress and Stacks are never written to the state log (they change
nothing a replay needs, and a node sends one a second), so nothing here is in a snapshot, and
a decision taken from it is written into the log as a fact of the event that took it (see
``Rendezvous.facts``). After a server restart the view starts empty and fills again within a
heartbeat interval.

Bounds: a job keeps one :class:`NodeProgress` per member of its round (O(nodes), compute
times O(world size) floats) and one :class:`HangState` (at most HANG_NODES_KEPT nodes' stacks
and HANG_TEXT_KEPT characters of them, HANG_RANKS_KEPT hung ranks, the ids of the nodes whose
stacks it did not keep, and the groups of HANG_KEYS_KEPT stack texts).

Straggler scores. Ranks spend the same wall time per step in synchronous training (the
collectives wait for the slowest), so the score is from the time a step spent in the
"compute" phase, each rank's median over the agent's window (``Progress.compute_ms``):
score = job median / rank's value (1.0: the median; 0.5: twice as slow). A rank with no
compute time (0: it does not mark the phase) is not scored, and with fewer than two known
ranks nobody is. A score is at most :data:`SCORE_MAX`: compute times are whatever an agent
sends within Progress's bounds (1e10 ms beside 5e-324 ms is a valid pair), and their ratio
must stay a finite number for every surface that shows it (JSON has no Infinity).

Bounds on what comes in. Whatever an agent sends within Progress's bounds, what the server
computes from it (the commit step S, a commit's deadline, steps/s, scores) must stay in its
own range. So steps are taken up to :data:`MAX_STEP` (a float holds every step up to it
exactly; 2**53 steps is 285 years at a million steps a second), a step time is at least
:data:`MIN_STEP_MS` (a shorter one is no measurement), and steps/s is at most the rate that
step time gives.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Collection, Iterable, Mapping
from dataclasses import field
from itertools import chain

from protocol import Progress, Stacks
from protocol.records import record

HANG_NODES_KEPT = 64  # nodes whose stacks a hang report keeps (the others are counted)
HANG_TEXT_KEPT = 1 << 20  # characters of stacks a hang report keeps in all
HANG_RANKS_KEPT = 256  # hung ranks a hang report names
HANG_KEYS_KEPT = 256  # different stack texts a hang's choice of stacks to keep tells apart
RATE_WINDOW = 10.0  # seconds over which steps/s is measured
STRAGGLER_CHECK_EVERY = 1.0  # seconds between a job's straggler checks (each is O(world size))
SCORE_MAX = 1000.0  # a rank "a thousand times the median speed" or more: no finer score is real
MAX_STEP = 2**53  # the highest step taken from a Progress (a higher one counts as this)
MIN_STEP_MS = 1e-3  # the shortest step time taken from a Progress (0 stays 0: not measured)
MAX_STEPS_PER_S = 1000.0 / MIN_STEP_MS  # the highest rate the job's progress is measured at


def _step_ms(ms: float) -> float:
    """A step time as the server takes it: 0 (not measured), or at least MIN_STEP_MS."""
    return 0.0 if ms <= 0.0 else max(ms, MIN_STEP_MS)


@record(slots=True)
class NodeProgress:
    """One node's last Progress of the round (see ``protocol.Progress``)."""

    round: int
    min_step: int
    max_step: int
    step_p50_ms: float
    step_p90_ms: float
    phase: str  # a peer's text: escape it to show it
    age_ms: float  # the agent's age of its least recent rank's progress, when it sent this
    received_at: float  # the machine's clock when this arrived
    compute_ms: tuple[float, ...]  # by local rank; 0.0: unknown
    rank_offset: int  # global rank of local rank 0 in the round
    checks: bool = False  # every local rank calls worker.should_stop(): it can stop at a commit point
    first_at: float = 0.0  # when the node's first Progress of the round arrived (machine clock)

    def age_s(self, now: float) -> float:
        """Seconds since the node's least recent rank last made progress, as of ``now``."""
        return self.age_ms / 1000.0 + max(0.0, now - self.received_at)


@record(slots=True)
class JobProgress:
    """The progress of a job's current round (per node) and of the job (highest step, rate)."""

    round: int = -1  # the round ``nodes`` belong to (-1: none yet)
    nodes: dict[str, NodeProgress] = field(default_factory=dict)
    offsets: dict[str, int] = field(default_factory=dict)  # node -> rank offset in ``round``
    max_step: int = -1  # highest step ever reported in the job, any round
    steps_per_s: float = 0.0  # of the round's fastest node; 0.0: not known yet
    # node -> its global ranks flagged as stragglers in ``round`` (a STRAGGLER event was noted)
    flagged: dict[str, tuple[int, ...]] = field(default_factory=dict)
    checked_at: float = float("-inf")  # the last straggler check (machine clock)
    median_hint: float = 0.0  # the median compute time of the round's last sort (may_flag)
    decided_round: int = -1  # the last forming round stragglers were left out of
    _rate_at: float = 0.0  # the rate's anchor: when, and the fastest step then
    _rate_step: int = -1
    _fastest: int = -1  # highest max_step of the round

    def start_round(self, rnd: int, offsets: dict[str, int]) -> None:
        """The first Progress of round ``rnd`` arrived: the previous round's view goes."""
        self.round = rnd
        self.nodes.clear()
        self.offsets = offsets
        self.flagged.clear()
        self.steps_per_s, self._rate_step, self._fastest = 0.0, -1, -1
        self.checked_at = float("-inf")
        self.median_hint = 0.0

    def update(self, node_id: str, msg: Progress, nproc: int, now: float) -> NodeProgress:
        """Keep ``msg`` as the node's latest (its compute times cut to its ``nproc`` ranks)."""
        compute = msg.compute_ms if len(msg.compute_ms) <= nproc else msg.compute_ms[:nproc]
        max_step = min(msg.max_step, MAX_STEP)
        np = self.nodes.get(node_id)
        if np is None:
            np = self.nodes[node_id] = NodeProgress(
                round=msg.round,
                min_step=min(msg.min_step, MAX_STEP),
                max_step=max_step,
                step_p50_ms=_step_ms(msg.step_p50_ms),
                step_p90_ms=_step_ms(msg.step_p90_ms),
                phase=msg.phase,
                age_ms=msg.age_ms,
                received_at=now,
                compute_ms=compute,
                rank_offset=self.offsets.get(node_id, 0),
                checks=msg.checks,
                first_at=now,
            )
        else:
            # Rewritten in place (every node's, every second: no new record each time); its
            # first_at stays, as does its rank offset (both the round's, and so is the entry).
            np.round = msg.round
            np.min_step = min(msg.min_step, MAX_STEP)
            np.max_step = max_step
            p50, p90 = msg.step_p50_ms, msg.step_p90_ms  # _step_ms, written out
            np.step_p50_ms = 0.0 if p50 <= 0.0 else p50 if p50 >= MIN_STEP_MS else MIN_STEP_MS
            np.step_p90_ms = 0.0 if p90 <= 0.0 else p90 if p90 >= MIN_STEP_MS else MIN_STEP_MS
            np.phase = msg.phase
            np.age_ms = msg.age_ms
            np.received_at = now
            np.compute_ms = compute
            np.checks = msg.checks
        if max_step > self.max_step:
            self.max_step = max_step
        if max_step > self._fastest:
            self._fastest = max_step
            self._observe_rate(now)
        return np

    def _observe_rate(self, now: float) -> None:
        # Two points: an anchor and now; the anchor moves on once it is RATE_WINDOW old, so
        # the estimate covers the last 10 to 20 s of steps at O(1) memory.
        if self._rate_step < 0:
            self._rate_at, self._rate_step = now, self._fastest
            return
        dt = now - self._rate_at
        if dt > 0:
            # Bounded: two reports a nanosecond apart must not make a step take no time.
            self.steps_per_s = min((self._fastest - self._rate_step) / dt, MAX_STEPS_PER_S)
        if dt >= RATE_WINDOW:
            self._rate_at, self._rate_step = now, self._fastest

    def forget(self, node_id: str) -> None:
        self.nodes.pop(node_id, None)
        self.flagged.pop(node_id, None)

    def fastest(self) -> int:
        """The highest step any node reported in the round (-1: none)."""
        return max((n.max_step for n in self.nodes.values()), default=-1)

    def min_step(self) -> int:
        """The lowest step of any node's slowest rank in the round (-1: none)."""
        return min((n.min_step for n in self.nodes.values()), default=-1)

    def lag(self, node_id: str) -> int:
        """How many steps the node's fastest rank is behind the round's fastest node."""
        n = self.nodes.get(node_id)
        if n is None or n.max_step < 0:
            return 0
        return max(0, self.fastest() - n.max_step)

    def oldest(self, now: float) -> NodeProgress | None:
        """The node whose least recent rank's progress is the oldest (None: no node reported)."""
        return max(self.nodes.values(), key=lambda n: n.age_s(now), default=None)


@record(frozen=True, slots=True)
class RankScore:
    """One rank's straggler score."""

    rank: int  # global rank
    node: str
    local_rank: int
    compute_ms: float
    score: float  # the job's median compute time / this rank's (1.0: the median)
    flagged: bool  # score < the job's straggler_threshold


def straggler_scores(progress: JobProgress, threshold: float) -> list[RankScore]:
    """Every rank with a known compute time, scored against the job's median, by global rank;
    [] when fewer than two ranks are known. O(world size log world size)."""
    known = [
        (n.rank_offset + lr, nid, lr, ms)
        for nid, n in progress.nodes.items()
        for lr, ms in enumerate(n.compute_ms)
        if ms > 0
    ]
    if len(known) < 2:
        return []
    import statistics  # here: 4 ms to import, and an embedded server (--standalone) seldom scores

    median = statistics.median(ms for _, _, _, ms in known)
    out = []
    for rank, nid, lr, ms in sorted(known):
        score = min(median / ms, SCORE_MAX)  # the quotient of two valid times may overflow
        out.append(RankScore(rank, nid, lr, ms, score, score < threshold))
    return out


def flagged_scores(progress: JobProgress, threshold: float) -> list[RankScore]:
    """The flagged ranks of :func:`straggler_scores` (the same records, in the same order)
    without scoring every rank: what the once-a-second straggler check needs.

    The compute times go into one sorted list of floats (a C sort: about 8 ms for 80,000
    ranks, where scoring each rank as a record takes ten times that); the median is read off
    it, and, since a rank's score falls as its compute time grows, the flagged ones are a tail
    of it, found by bisection with the score's own test. Only the nodes holding a time of that
    tail are looked at rank by rank; with no straggler, none is."""
    ordered = sorted(chain.from_iterable(n.compute_ms for n in progress.nodes.values()))
    first = bisect_right(ordered, 0.0)  # compute times are >= 0; 0: not known
    known = len(ordered) - first
    if known < 2:
        return []
    mid = first + known // 2
    median = ordered[mid] if known % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    progress.median_hint = median

    def flags(ms: float) -> bool:
        return min(median / ms, SCORE_MAX) < threshold

    tail = bisect_left(ordered, True, lo=first, key=flags)
    if tail == len(ordered):
        return []
    least = ordered[tail]
    out = []
    for nid, n in progress.nodes.items():
        if not n.compute_ms or max(n.compute_ms) < least:
            continue
        for lr, ms in enumerate(n.compute_ms):
            if ms >= least and ms > 0:
                score = min(median / ms, SCORE_MAX)
                out.append(RankScore(n.rank_offset + lr, nid, lr, ms, score, score < threshold))
    out.sort(key=lambda s: (s.rank, s.node, s.local_rank, s.compute_ms))
    return out


def may_flag(progress: JobProgress, threshold: float, skip: Collection[str]) -> bool:
    """Whether :func:`flagged_scores` could now flag a rank of a node not in ``skip``; False
    only when it certainly cannot. A bound from a min and a max over the compute times (C
    loops, a fifth of the sort they save at 80,000 ranks), so the once-a-second check of a
    job whose stragglers are all known already (or that has none) sorts nothing.

    The bound: L = the median of the round's last sort (``median_hint``) times
    sqrt(threshold). With no known time below L, the median now is at least L, and a rank is
    flagged (median / time < threshold) only if its time is above L / threshold (less a
    relative 1e-12, for rounding); no such time outside ``skip``: False. A time below L (an
    unknown one, 0, too), no hint yet, or a threshold past SCORE_MAX: True (sort)."""
    hint = progress.median_hint
    if not (hint > 0.0 and 0.0 < threshold <= SCORE_MAX):
        return True
    nodes = progress.nodes
    others = list(chain.from_iterable(n.compute_ms for nid, n in nodes.items() if nid not in skip))
    known = list(chain.from_iterable(nodes[nid].compute_ms for nid in skip if nid in nodes))
    if len(others) + len(known) < 2:
        return False  # fewer than two times, known or not: nobody is scored
    bound = hint * math.sqrt(threshold)
    if not min(min(others, default=bound), min(known, default=bound)) >= bound:
        return True
    return max(others, default=0.0) > bound / threshold * (1.0 - 1e-12)


def flagged_by_node(scores: list[RankScore]) -> dict[str, list[RankScore]]:
    """The flagged ranks of ``straggler_scores``, by node (in rank order)."""
    out: dict[str, list[RankScore]] = {}
    for s in scores:
        if s.flagged:
            out.setdefault(s.node, []).append(s)
    return out


@record(slots=True)
class HangState:
    """The job's latest hang: who reported it first, every hung rank, and the nodes' stacks."""

    round: int
    node: str  # the node whose HangDetected came first, and its address
    addr: str
    ranks: list[int]  # hung global ranks of every HangDetected of the round (HANG_RANKS_KEPT)
    step: int  # the first hung rank's last step, phase and silence
    phase: str
    silent_s: float
    detected_at: float  # the machine's clock
    reason: str  # the text CollectStacks carried
    stacks: dict[str, Stacks] = field(default_factory=dict)  # node -> its Stacks
    nodes_dropped: int = 0  # nodes whose stacks did not fit HANG_NODES_KEPT / HANG_TEXT_KEPT
    text_kept: int = 0  # characters of stacks kept
    # node -> its global ranks in the hang's round: the only ranks its Stacks may name (the
    # round may have restarted before they come). Dropped once the job is over.
    spans: Mapping[str, range] = field(default_factory=dict)
    # What choosing the kept stacks needs (add_stacks), until the job is over: the nodes whose
    # stacks were not kept (nodes_dropped of them), each kept node's ranks' groups, how many
    # kept ranks show each group, and the groups of the texts parsed so far.
    dropped: set[str] = field(default_factory=set, repr=False, compare=False)
    kept_keys: dict[str, tuple[object, ...]] = field(default_factory=dict, repr=False, compare=False)
    key_counts: dict[object, int] = field(default_factory=dict, repr=False, compare=False)
    key_cache: dict[str, object] = field(default_factory=dict, repr=False, compare=False)

    def settle(self) -> None:
        """Keep the report of a job that is over at the cost of one stack text per group of
        alike stacks (every rank of a group then shares its first rank's text, and the report
        merges the same): the finished jobs the server remembers keep their evidence without
        each keeping up to HANG_TEXT_KEPT characters."""
        from protocol.hang_report import merge

        entries = self.entries()
        text_of = {e[0]: e[4] for e in entries}
        shared: dict[int, str] = {}
        for g in merge(entries, hung=self.ranks).groups:
            for rank in g.ranks:
                shared[rank] = text_of[g.ranks[0]]
        for node, msg in list(self.stacks.items()):
            keep = [i for i, rank in enumerate(msg.ranks) if rank in shared]
            self.stacks[node] = Stacks(
                round=msg.round,
                ranks=tuple(msg.ranks[i] for i in keep),
                steps=tuple(msg.steps[i] for i in keep),
                phases=tuple(msg.phases[i] for i in keep),
                silent_s=tuple(msg.silent_s[i] for i in keep),
                stacks=tuple(shared[msg.ranks[i]] for i in keep),
            )
        self.text_kept = sum(len(t) for t in {id(t): t for t in shared.values()}.values())
        self.spans = {}  # no more stacks come
        self.dropped, self.kept_keys, self.key_counts, self.key_cache = set(), {}, {}, {}

    def add_ranks(self, ranks: tuple[int, ...]) -> bool:
        """Name more hung ranks (bounded); True if any was new."""
        new = [r for r in ranks if r not in self.ranks][: max(0, HANG_RANKS_KEPT - len(self.ranks))]
        self.ranks.extend(new)
        return bool(new)

    def add_stacks(self, node_id: str, msg: Stacks) -> bool:
        """Keep a node's stacks (its latest replaces an earlier one); False if they are not kept.

        Past HANG_NODES_KEPT nodes (or HANG_TEXT_KEPT characters), a node's stacks are kept
        only if they bring evidence the kept ones lack: a rank whose stacks group apart from
        every kept rank's (``protocol.hang_report.group_key``: the odd one out a job-wide report
        is for), in place of a kept node whose every rank's group other kept ranks show too
        (never the node that reported the hang first). Every node counts once, kept or not,
        however often it sends (``heard``)."""
        size = sum(map(len, msg.stacks))
        old = self.stacks.get(node_id)
        freed = sum(map(len, old.stacks)) if old is not None else 0
        keys = self._keys(msg)
        if (old is not None or len(self.stacks) < HANG_NODES_KEPT) and (
            self.text_kept - freed + size <= HANG_TEXT_KEPT
        ):
            self._keep(node_id, msg, keys, size - freed)
            return True
        victim = self._evictable(node_id, keys, size - freed) if old is None else None
        if victim is None:
            if old is None:
                self.dropped.add(node_id)  # (a kept node's earlier stacks stay: it is heard)
                self.nodes_dropped = len(self.dropped)
            return False
        self.text_kept -= sum(map(len, self.stacks.pop(victim).stacks))
        self._unkey(victim)
        self.dropped.add(victim)
        self._keep(node_id, msg, keys, size)
        return True

    def heard(self, node_id: str) -> bool:
        """Whether ``node_id`` sent its stacks of this hang (kept or not)."""
        return node_id in self.stacks or node_id in self.dropped

    def _keep(self, node_id: str, msg: Stacks, keys: tuple[object, ...], grown: int) -> None:
        self._unkey(node_id)
        self.stacks[node_id] = msg
        self.text_kept += grown
        self.kept_keys[node_id] = keys
        counts = self.key_counts
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
        self.dropped.discard(node_id)
        self.nodes_dropped = len(self.dropped)

    def _unkey(self, node_id: str) -> None:
        """Take a kept node's ranks' groups out of the counts (before they change or go)."""
        counts = self.key_counts
        for key in self.kept_keys.pop(node_id, ()):
            left = counts[key] - 1
            if left:
                counts[key] = left
            else:
                del counts[key]

    def _evictable(self, node_id: str, keys: tuple[object, ...], size: int) -> str | None:
        """The kept node ``node_id``'s stacks (``keys``, ``size`` characters) may take the
        place of, or None: they must bring a group no kept rank shows (an unknown one, None,
        never counts), and the one they replace must lose none (every one of its groups is
        shown by at least one other kept rank; the most redundant such node goes). O(kept
        ranks), and only for stacks unlike every kept one: in a hang, a few nodes'."""
        counts = self.key_counts
        if not any(key is not None and key not in counts for key in keys):
            return None
        best: str | None = None
        best_spare = 0
        for nid, held in self.kept_keys.items():
            if nid == self.node:
                continue  # the hang's first report: its ranks are the ones named
            own: dict[object, int] = {}
            for key in held:
                own[key] = own.get(key, 0) + 1
            spare = min((counts[key] - n for key, n in own.items()), default=0)
            if spare > best_spare and self.text_kept - sum(map(len, self.stacks[nid].stacks)) + size <= (
                HANG_TEXT_KEPT
            ):
                best, best_spare = nid, spare
        return best

    def _keys(self, msg: Stacks) -> tuple[object, ...]:
        """Each rank's group (``group_key`` of its main thread), None where it is not known:
        the stacks of HANG_KEYS_KEPT different texts are parsed per hang, each once (the
        agents' compacted dumps put the main thread first, so only its part is looked at)."""
        from protocol.hang_report import group_key, parse_stacks

        cache = self.key_cache
        out: list[object] = []
        for text in msg.stacks:
            cut = text.find("\nThread ") if text.startswith("Thread ") else -1
            main = text if cut < 0 else text[:cut]
            key = cache.get(main)
            if key is None and len(cache) < HANG_KEYS_KEPT:
                key = cache[main] = group_key(parse_stacks(main))
            out.append(key)
        return tuple(out)

    def entries(self) -> list[tuple[int, int, str, float, str]]:
        """(rank, step, phase, silent_s, stack text) of every kept rank, by rank: what
        ``protocol.hang_report.merge`` takes."""
        return stack_entries(self.stacks.values())


def stack_entries(stacks: Iterable[Stacks]) -> list[tuple[int, int, str, float, str]]:
    """(rank, step, phase, silent_s, stack text) of every rank of ``stacks``, by rank."""
    out = [
        (rank, step, phase, silent, text)
        for msg in stacks
        for rank, step, phase, silent, text in zip(
            msg.ranks, msg.steps, msg.phases, msg.silent_s, msg.stacks, strict=True
        )
    ]
    out.sort(key=lambda e: e[0])
    return out
