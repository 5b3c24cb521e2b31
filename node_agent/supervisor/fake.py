"""A worker group without processes, for tests of the runner: the test says when which local
rank exits and with what code (``exit``), and reads what the runner asked (``started``,
``signals``, ``stops``). It stands beside ``group.WorkerGroup`` as ``rdzv/fake.py`` stands
beside the real backends: the runner's logic in milliseconds, where a worker's own behaviour
is not the point (the real group keeps its own tests, and the end-to-end tests run both)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Sequence

from .spec import GroupResult, WorkerExit, WorkerSpec

FIRST_PID = 4_000_000  # above any real pid_max: a fake pid is never a real process


class FakeWorkerGroup:
    def __init__(self) -> None:
        self.started: list[list[WorkerSpec]] = []  # every start's specs, in order
        self.signals: list[int] = []  # what send_signal was asked to pass on
        self.stops: list[tuple[float, int]] = []  # every stop's (grace, signal)
        self._specs: list[WorkerSpec] = []
        self._exits: dict[int, WorkerExit] = {}
        self._pids: dict[int, int] = {}
        self._changed = asyncio.Event()
        self._next_pid = FIRST_PID

    @property
    def pids(self) -> dict[int, int]:
        return dict(self._pids)

    async def start(self, specs: Sequence[WorkerSpec]) -> None:
        self._specs = list(specs)
        self._pids = {s.local_rank: self._next_pid + i for i, s in enumerate(specs)}
        self._next_pid += len(specs)
        self._exits = {}
        self.started.append(list(specs))

    def exit(self, local_rank: int, code: int, message: str = "") -> None:
        """Local rank ``local_rank`` exits with ``code`` (negative: killed by that signal)."""
        spec = next(s for s in self._specs if s.local_rank == local_rank)
        name = signal.Signals(-code).name if code < 0 else ""
        self._exits[local_rank] = WorkerExit(
            local_rank=local_rank,
            rank=spec.rank,
            pid=self._pids[local_rank],
            exitcode=code,
            signal_name=name,
            timestamp=time.time(),
            error_message=message,
            error_record=None,
        )
        self._changed.set()

    def _result(self) -> GroupResult:
        exits = tuple(self._exits[lr] for lr in sorted(self._exits))
        failures = [e for e in exits if e.failed]
        first = min(failures, key=lambda e: (e.timestamp, e.local_rank)) if failures else None
        return GroupResult(state="failed" if failures else "succeeded", exits=exits, first_failure=first)

    async def wait(self) -> GroupResult:
        """Once every worker exited 0, or as soon as one exits non-zero (as the real group)."""
        while True:
            result = self._result()
            if result.first_failure is not None or len(self._exits) == len(self._specs):
                return result
            self._changed.clear()
            await self._changed.wait()

    async def stop(
        self,
        *,
        grace: float,
        sig: int = signal.SIGTERM,
        reap_timeout: float = 10.0,
        keep_watchdog: bool = False,
        park: bool = False,  # fake workers never run under worker.run: nothing to park
    ) -> GroupResult:
        self.stops.append((grace, sig))
        for spec in self._specs:
            if spec.local_rank not in self._exits:
                self.exit(spec.local_rank, -sig)
        return self._result()

    def fresh_line(self) -> None:
        pass

    async def delivered(self, sig: int) -> bool:
        return False  # no scheduler signals the fake workers: the agent passes every one on

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
