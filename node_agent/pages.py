"""The agent's side of the progress pages (layout: :mod:`node_agent.worker.layout`)."""

from __future__ import annotations

from protocol.records import record


@record(frozen=True, slots=True, kw_only=True)
class RankSample:
    """One consistent read of a rank's page (torn records are never returned)."""

    step: int  # the last step reported; -1 before the first progress()
    progress_ns: int  # CLOCK_MONOTONIC ns of the last progress() (0: none yet)
    count: int  # progress() calls so far
    phase: str  # the current phase's name ("" outside any phase)
    phase_ns: int  # CLOCK_MONOTONIC ns when the current phase was entered (0: no phase)
    compute_ns: int  # total ns spent in finished "compute" phases
    pid: int  # the writer's pid (0: no worker attached yet)
    stack_signal: int  # the signal that makes the worker dump its stacks (0: cannot)
    attached_ns: int  # CLOCK_MONOTONIC ns when the worker attached (0: not yet)
