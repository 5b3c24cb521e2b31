"""Did the workers get this signal already?  The agent's answer, from the watchdog's reports.

Slurm (proctrack/cgroup, proctrack/linuxproc) and systemd (``KillMode=control-group``) send a
job step's signals to every process of the step: the workers have a ``scancel --signal=USR1``
before the agent could forward it, and forwarding it would deliver it twice (a handler that
counts notices or starts a checkpoint per signal does it twice).  A plain ``kill`` of the
agent, a terminal's Ctrl-C, Kubernetes and Slurm's proctrack/pgid reach the agent (or its
process group) only, and there the agent must forward.

No field of a Python signal handler says who sent a signal, and the sender alone would not
tell which processes it reached.  So we ask a process placed exactly like the workers: the
orphan watchdog (``procutil``) is the agent's child in a session of its own, as every worker
is, outlives the signals and writes each one's number on a pipe.  A signal that reached it
reached the workers, from the same sender in the same sweep.  The agent matches each signal it
receives with one such report, waiting up to :data:`WAIT_S` for it (the sender signals the
processes one by one, in any order); none means the workers do not have it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["FRESH_S", "WAIT_S", "SignalWitness"]

# How long the agent waits for the watchdog's report before it forwards a signal itself. A
# sweep over a step's processes takes microseconds; the watchdog's handler runs as soon as it is
# scheduled. A signal nobody else got is forwarded this much later.
WAIT_S = 0.5
# A report no signal of the agent's matched within this long is stale (someone signalled the
# watchdog alone): it must not make a later signal look delivered.
FRESH_S = 2.0


class SignalWitness:
    """Reports of signals received by a process placed like the workers, matched one to one
    with the agent's own signals."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._seen: list[tuple[int, float]] = []  # (signum, when) reports not matched yet
        self._waiting: dict[int, list[asyncio.Future[None]]] = {}
        self._partial = b""

    def feed(self, data: bytes) -> None:
        """Bytes read from the report pipe: one signal number per line."""
        *lines, self._partial = (self._partial + data).split(b"\n")
        self._partial = self._partial[-32:]  # nothing of ours is longer; a stranger's bytes are cut
        for line in lines:
            if line.strip().isdigit():
                self.saw(int(line))

    def saw(self, signum: int) -> None:
        waiters = self._waiting.get(signum)
        while waiters:
            fut = waiters.pop(0)
            if not fut.done():
                fut.set_result(None)
                return
        self._seen.append((signum, self._clock()))
        del self._seen[:-64]  # bounded, whatever is sent

    def _take(self, signum: int) -> bool:
        now = self._clock()
        self._seen = [(s, t) for s, t in self._seen if now - t <= FRESH_S]
        for i, (s, _t) in enumerate(self._seen):
            if s == signum:
                del self._seen[i]
                return True
        return False

    async def delivered(self, signum: int, wait: float = WAIT_S) -> bool:
        """Whether the watchdog saw ``signum`` too (a report already in, or one within ``wait``)."""
        if self._take(signum):
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(signum, []).append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), wait)
        except asyncio.TimeoutError:
            return False
        finally:
            waiters = self._waiting.get(signum, [])
            if fut in waiters:
                waiters.remove(fut)
        return True
