"""When a rank is hung, and the node's progress summary (pure: the clock is a parameter).

The agent reads its ranks' progress pages (:mod:`node_agent.progress.pages`) every
:meth:`NodeWatch.poll_interval_s` and hands the samples to :meth:`NodeWatch.observe` with the
time of the read (CLOCK_MONOTONIC ns, the pages' clock). The watch answers with the ranks that
passed their deadline, once per silence, and keeps what :meth:`NodeWatch.summary` sends the
server (``protocol.Progress``).

Deadlines (``--hang-timeout``, ``--hang-conf``; :class:`HangPolicy`):

* Nothing is hung before some rank of the node reported progress: a job that never calls
  ``worker.progress`` is never watched, and neither is a rank that never touched its page (a
  script may report from rank 0 only). Detection starts for the other attached ranks then.
* ``auto``: until a rank has made ``warmup`` step intervals, its deadline is its last progress
  (or the moment detection started for it) plus ``first_step``; afterwards, its last progress
  plus max(``floor``, ``factor`` x the largest step interval it has shown).
* ``SECONDS``: last progress (or the start of detection) plus that many seconds.
* ``off``: never hung; pages and summaries still work.
* In a phase with its own budget (``checkpoint``, ``setup``, ``eval``, ``phase.NAME``) the
  deadline is at least the phase's start plus that budget: a long checkpoint is not a hang.

A step interval is measured between two reads whose progress count differs: (progress_ns
delta) / (count delta), so a poll that saw ten fast steps counts their mean once.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal

from protocol.messages import MAX_TIMEOUT
from protocol.records import record

from ..worker.layout import clean_name
from .events import Hung, RankSample

__all__ = ["HangPolicy", "Hung", "NodeWatch"]

Mode = Literal["auto", "fixed", "off"]
WINDOW = 32  # step intervals and compute samples kept per rank
POLL_MAX_S = 1.0
POLL_MIN_S = 0.05
_NS = 1_000_000_000
# The keys of --hang-conf beside phase.<name>, with their defaults.
_DEFAULTS: dict[str, float] = {"first_step": 1800.0, "floor": 120.0, "factor": 5.0, "warmup": 5}
_CHECKPOINT_S = 1800.0
_FIRST_STEP_PHASES = ("setup", "eval")  # phases whose budget follows first_step unless set
_PHASE_PREFIX = "phase."
_NAME_BYTES = 31  # a page's phase names are at most 31 bytes of UTF-8


@record(frozen=True, slots=True, kw_only=True)
class HangPolicy:
    """How long a rank may make no progress (see the module's docstring)."""

    mode: Mode = "auto"
    timeout: float = 0.0  # seconds, for mode "fixed"
    first_step: float = _DEFAULTS["first_step"]
    floor: float = _DEFAULTS["floor"]
    factor: float = _DEFAULTS["factor"]
    warmup: int = int(_DEFAULTS["warmup"])
    # Phase name -> seconds, sorted by name (a tuple: the record stays hashable).
    phases: tuple[tuple[str, float], ...] = (
        ("checkpoint", _CHECKPOINT_S),
        ("eval", _DEFAULTS["first_step"]),
        ("setup", _DEFAULTS["first_step"]),
    )

    @classmethod
    def parse(cls, timeout: str, conf: str = "") -> HangPolicy:
        """The policy of ``--hang-timeout TIMEOUT --hang-conf CONF``; ValueError names the
        bad value (``TIMEOUT``: auto, off or seconds; ``CONF``: ``key=value,...``)."""
        t = timeout.strip().lower()
        mode: Mode
        if t in ("auto", "off"):
            mode, seconds = ("auto" if t == "auto" else "off"), 0.0
        else:
            mode, seconds = "fixed", _seconds("--hang-timeout", timeout, "auto, off or seconds")
        values: dict[str, float] = dict(_DEFAULTS)
        phases: dict[str, float] = {}
        seen: set[str] = set()
        for item in conf.split(","):
            item = item.strip()
            if not item:
                continue
            key, eq, raw = item.partition("=")
            key = key.strip()
            if not eq:
                raise ValueError(f"--hang-conf: {item!r} is not key=value")
            if key in seen:
                raise ValueError(f"--hang-conf: {key} is given twice")
            seen.add(key)
            if key.startswith(_PHASE_PREFIX):
                name = key[len(_PHASE_PREFIX) :]
                if not name or len(name.encode("utf-8")) > _NAME_BYTES or not name.isprintable():
                    raise ValueError(
                        f"--hang-conf: {key}: a phase name is 1 to {_NAME_BYTES} bytes of printable text"
                    )
                phases[name] = _seconds(f"--hang-conf {key}", raw, "seconds")
            elif key == "checkpoint":
                phases["checkpoint"] = _seconds(f"--hang-conf {key}", raw, "seconds")
            elif key == "warmup":
                values[key] = _count(f"--hang-conf {key}", raw)
            elif key == "factor":
                values[key] = _seconds(f"--hang-conf {key}", raw, "a number >= 1")
                if values[key] < 1:
                    raise ValueError(f"--hang-conf factor: must be >= 1, got {raw.strip()!r}")
            elif key in values:
                values[key] = _seconds(f"--hang-conf {key}", raw, "seconds")
            else:
                known = ", ".join([*_DEFAULTS, "checkpoint", "phase.NAME"])
                raise ValueError(f"--hang-conf: unknown key {key!r} (known: {known})")
        if {"checkpoint", "phase.checkpoint"} <= seen:
            raise ValueError("--hang-conf: checkpoint is given twice (checkpoint and phase.checkpoint)")
        merged = {"checkpoint": _CHECKPOINT_S, **{p: values["first_step"] for p in _FIRST_STEP_PHASES}}
        merged.update(phases)
        return cls(
            mode=mode,
            timeout=seconds,
            first_step=values["first_step"],
            floor=values["floor"],
            factor=values["factor"],
            warmup=int(values["warmup"]),
            phases=tuple(sorted(merged.items())),
        )

    def phase_budget(self, name: str) -> float | None:
        """The budget of phase ``name`` in seconds (None: the phase has none of its own)."""
        for phase, seconds in self.phases:
            if phase == name:
                return seconds
        return None

    def poll_interval_s(self) -> float:
        """How often to read the pages: min(1 s, the shortest budget / 10), at least 50 ms."""
        if self.mode == "fixed":
            shortest = self.timeout
        elif self.mode == "auto":
            shortest = min(self.first_step, self.floor)
        else:
            return POLL_MAX_S
        return max(POLL_MIN_S, min(POLL_MAX_S, shortest / 10))

    def describe(self) -> str:
        """One line for the agent's start-up log."""
        if self.mode == "off":
            return "hang detection off"
        if self.mode == "fixed":
            base = f"hang timeout {self.timeout:g} s"
        else:
            base = (
                f"hang timeout auto (first step {self.first_step:g} s, then max({self.floor:g} s, "
                f"{self.factor:g} x the longest step) after {self.warmup} steps)"
            )
        phases = ", ".join(f"{name} {s:g} s" for name, s in self.phases)
        return f"{base}; phase budgets: {phases}"


def _seconds(what: str, raw: str, expected: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError(f"{what}: expected {expected}, got {raw.strip()!r}") from None
    if not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT:
        raise ValueError(f"{what}: expected {expected} in (0, {MAX_TIMEOUT:g}], got {raw.strip()!r}")
    return value


def _count(what: str, raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"{what}: expected a whole number of steps, got {raw.strip()!r}") from None
    if not 1 <= value <= 1_000_000:
        raise ValueError(f"{what}: expected 1..1000000 steps, got {raw.strip()!r}")
    return value


class _Rank:
    """What the watch remembers of one local rank this round."""

    __slots__ = (
        "attached",
        "compute",
        "compute_ns",
        "count",
        "from_ns",
        "intervals",
        "last_ns",
        "max_interval_ns",
        "measured",
        "phase",
        "phase_ns",
        "reported",
        "resumed_ns",
        "since_ns",
        "step",
    )

    def __init__(self) -> None:
        self.attached = False
        self.count = 0  # progress() calls seen
        self.step = -1
        self.last_ns = 0  # its last progress (or, before any, when detection started for it)
        self.from_ns = 0  # when detection started for it (0: not yet)
        self.phase = ""
        self.phase_ns = 0
        self.compute_ns = 0
        self.intervals: deque[float] = deque(maxlen=WINDOW)  # ns per step
        self.compute: deque[float] = deque(maxlen=WINDOW)  # compute ns per step
        self.max_interval_ns = 0.0
        self.measured = 0  # step intervals measured (for the warm-up)
        self.reported = False
        # Last seen inside a phase with a budget of its own (0: never): the step budget counts
        # from there, not from the progress before it, and no interval spans it.
        self.resumed_ns = 0
        # No progress of this rank is older than this: the read before the one that first saw
        # it attached (the first read of the round when none came before).
        self.since_ns = 0


class NodeWatch:
    """One round's watch over the node's ``nproc`` local ranks; :meth:`reset` for a new round."""

    def __init__(self, policy: HangPolicy, nproc: int) -> None:
        if nproc < 1:
            raise ValueError(f"nproc must be >= 1, got {nproc}")
        self.policy = policy
        self.nproc = nproc
        self.reset()

    def reset(self) -> None:
        """Forget everything: new workers with new pages."""
        self._ranks = [_Rank() for _ in range(self.nproc)]
        self._active_ns = 0  # when some rank first reported progress (0: none has)
        self._read_ns = 0  # the previous read (0: none yet)
        self._changed = False

    def forget(self, local_rank: int) -> None:
        """Rank ``local_rank`` no longer counts as reporting (its page went bad): as if it never
        touched its page, until :meth:`reset`."""
        self._ranks[local_rank] = _Rank()
        self._changed = True

    # --- hangs ---------------------------------------------------------------------------------

    def observe(self, samples: Sequence[RankSample | None], now_ns: int) -> list[Hung]:
        """Take one read of every local rank's page (index = local rank; None: unreadable or
        not attached) at ``now_ns``; the ranks newly past their deadline."""
        # A short list leaves the missing ranks as they were (as None would).
        for rank, sample in zip(self._ranks, samples, strict=False):
            if sample is not None:
                self._update(rank, sample, now_ns)
        self._read_ns = now_ns
        if not self._active_ns and any(r.count for r in self._ranks):
            self._active_ns = now_ns
        if self._active_ns:
            for r in self._ranks:
                if r.attached and not r.from_ns:
                    r.from_ns = now_ns
                    if not r.count:
                        r.last_ns = now_ns
        hung = []
        for local_rank, r in enumerate(self._ranks):
            deadline = self._deadline(r)
            if deadline is None or r.reported or now_ns < deadline:
                continue
            r.reported = True
            hung.append(
                Hung(
                    local_rank=local_rank,
                    step=r.step,
                    phase=r.phase,
                    silent_s=max(0, now_ns - r.last_ns) / _NS,
                    budget_s=(deadline - r.last_ns) / _NS,
                )
            )
        return hung

    def _update(self, r: _Rank, s: RankSample, now_ns: int) -> None:
        if not s.pid:
            return
        if not r.attached:
            r.attached, r.since_ns = True, min(self._read_ns or now_ns, now_ns)
        phase = _plain(s.phase)
        if phase != r.phase:
            r.phase = phase
            self._changed = True
        r.phase_ns = min(s.phase_ns, now_ns) if s.phase else 0
        if phase and self.policy.phase_budget(phase) is not None:
            r.resumed_ns = now_ns
        if s.count == r.count or s.count < r.count:
            return  # no progress (a smaller count is a writer's bug: ignored)
        # The writer's clock is trusted only within what we saw: never in our future, never
        # before its previous progress, nor before it could have reported at all.
        at = min(max(s.progress_ns, r.last_ns, r.since_ns), now_ns)
        if r.count:  # an interval needs the previous progress's time
            steps = s.count - r.count
            interval = (at - max(r.last_ns, min(r.resumed_ns, at))) / steps
            r.intervals.append(interval)
            r.max_interval_ns = max(r.max_interval_ns, interval)
            r.measured += steps
            if s.compute_ns > r.compute_ns:
                r.compute.append((s.compute_ns - r.compute_ns) / steps)
        r.compute_ns = s.compute_ns
        r.count, r.step, r.last_ns = s.count, s.step, at
        r.reported = False
        self._changed = True

    def _deadline(self, r: _Rank) -> int | None:
        """When rank ``r`` is hung (None: not watched)."""
        p = self.policy
        if p.mode == "off" or not r.from_ns:
            return None
        if p.mode == "fixed":
            budget = p.timeout
        elif r.measured < p.warmup or not r.intervals:
            budget = p.first_step
        else:
            budget = max(p.floor, p.factor * r.max_interval_ns / _NS)
        own = p.phase_budget(r.phase) if r.phase else None
        if own is not None:  # inside such a phase: its own budget from its start
            return max(r.last_ns + int(budget * _NS), r.phase_ns + int(own * _NS))
        # Out of it again: the step's budget counts from when it was last seen inside.
        return max(r.last_ns, r.resumed_ns) + int(budget * _NS)

    def deadline_ns(self) -> int | None:
        """The earliest deadline of a rank not already reported (None: nothing to wait for)."""
        deadlines = [d for r in self._ranks if not r.reported and (d := self._deadline(r)) is not None]
        return min(deadlines, default=None)

    def poll_interval_s(self) -> float:
        """How often to read the pages (see :meth:`HangPolicy.poll_interval_s`)."""
        return self.policy.poll_interval_s()

    # --- the summary ---------------------------------------------------------------------------

    def changed(self) -> bool:
        """Whether a step moved or a phase changed since the last :meth:`summary`."""
        return self._changed

    def max_step(self) -> int:
        """The highest step any rank reported this round (-1: none)."""
        return max((r.step for r in self._ranks), default=-1)

    def idle_ms(self, now_ns: int) -> float:
        """How long ago the most recent step of any rank was (ms; 0: no step reported)."""
        last = max((r.last_ns for r in self._ranks if r.attached and r.step >= 0), default=0)
        return _ms(max(0, now_ns - last)) if last else 0.0

    def _pooled_intervals(self) -> list[float]:
        """Every attached rank's recent step intervals (ns), sorted: the node's distribution."""
        return sorted(i for r in self._ranks if r.attached for i in r.intervals)

    def seconds_to(self, step: int) -> float:
        """How long the slowest rank takes to reach ``step`` at this node's p90 step interval
        (0 with no interval measured, or a rank there already)."""
        pooled = self._pooled_intervals()
        steps = [r.step for r in self._ranks if r.attached]
        if not pooled or not steps:
            return 0.0
        return max(0, step - min(steps)) * _percentile(pooled, 0.9) / _NS

    def summary(self, now_ns: int) -> dict[str, Any]:
        """The fields of ``protocol.Progress`` beside ``round``; clears :meth:`changed`."""
        self._changed = False
        seen = [r for r in self._ranks if r.attached]
        steps = [r.step for r in seen] or [-1]
        pooled = self._pooled_intervals()
        oldest = min(seen, key=lambda r: r.last_ns if r.last_ns else now_ns, default=None)
        age_ms = phase = None
        if oldest is not None and oldest.last_ns:
            age_ms = max(0, now_ns - oldest.last_ns) / 1e6
        if oldest is not None:
            phase = oldest.phase
        return {
            "min_step": min(steps),
            "max_step": max(steps),
            "step_p50_ms": _ms(_percentile(pooled, 0.5)),
            "step_p90_ms": _ms(_percentile(pooled, 0.9)),
            "phase": phase or "",
            "age_ms": _ms(age_ms or 0.0, ns=False),
            "compute_ms": tuple(_ms(_median(r.compute)) for r in self._ranks),
        }


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile of already sorted values (0 for none)."""
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]


def _median(values: deque[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _ms(value: float, *, ns: bool = True) -> float:
    """Milliseconds (from ns unless ``ns`` is False), rounded and within Progress's bounds."""
    ms = value / 1e6 if ns else value
    return round(min(max(ms, 0.0), MAX_TIMEOUT * 1000), 3)


def _plain(name: str) -> str:
    """A phase name as Progress takes it (the reader cleaned it already; a sample made by other
    means gets the same rule)."""
    return clean_name(name)
