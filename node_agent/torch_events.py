"""``--event-log-handler console``: torchrun's agent and worker events as JSON lines on stderr.

torchrun records an event at each step of its agent (``torch.distributed.elastic.events``):
the rendezvous, the rank assignment, each worker's start and end, and the agent's end. With the
``console`` handler each is one JSON object per line on stderr, which some clusters scrape. We
write the same names and fields; ``null`` and ``dynamic_rendezvous`` discard them (as torchrun's
handlers of those names do), and then nothing here costs anything.

One of the agent's parts (``parts.py``): a round's start, its workers' start and their exit
are recorded as the agent walks its parts; the agent's end by the agent itself.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, TextIO

from .parts import RoundPart, RoundStart

if TYPE_CHECKING:
    from protocol import Assignment

    from .machine.events import Exit
    from .supervisor.spec import GroupResult, WorkerExit

__all__ = ["EventLog"]


class EventLog(RoundPart):
    name = "events"

    def __init__(
        self,
        handler: str,
        *,
        run_id: str,
        role: str,
        backend: str,
        entrypoint: str,
        stream: TextIO | None = None,
    ) -> None:
        self.enabled = handler == "console"
        self._stream = stream
        self._base = {"run_id": run_id, "role": role, "rdzv_backend": backend}
        self._entrypoint = entrypoint
        self._hostname = socket.gethostname() if self.enabled else ""
        self.restarts = 0
        self._round: Assignment | None = None  # the round whose workers' exit is recorded

    # -- the agent's part (parts.py) --------------------------------------------------------

    async def before_start(self, r: RoundStart) -> dict[int, dict[str, str]]:
        self._round = r.assignment
        self.round_started(r.assignment, r.rendezvous_ms)
        return {}

    def started(self, a: Assignment, pids: Mapping[int, int]) -> None:
        self.workers_started(a, pids)

    def after_exit(self, result: GroupResult, *, stopped: bool) -> None:
        """Workers that exited by themselves (torchrun records no exit for a stop)."""
        if not stopped and self._round is not None:
            self.workers_exited(self._round, result.exits)

    # -- the agent's steps, as torchrun records them -----------------------------------------

    def round_started(self, a: Assignment, rendezvous_ms: float) -> None:
        """A round was assigned: torchrun's RENDEZVOUS (timed from the join) and its rank
        assignment."""
        if not self.enabled:
            return
        self.restarts = a.restart_count
        self.agent("RENDEZVOUS", group_world_size=a.group_world_size, duration_ms=rendezvous_ms)
        self.agent("ASSIGN_WORKER_RANKS", group_world_size=a.group_world_size, duration_ms=0.0)

    def workers_started(self, a: Assignment, pids: Mapping[int, int]) -> None:
        if self.enabled:
            for local_rank, pid in pids.items():
                self._worker_event("START", a, local_rank, pid)

    def workers_exited(self, a: Assignment, exits: Iterable[WorkerExit]) -> None:
        if self.enabled:
            for w in exits:
                state = "FAILED" if w.failed else "SUCCEEDED"
                raw_error = w.error_message or None if w.failed else None
                self._worker_event(state, a, w.local_rank, w.pid, w.exitcode, raw_error)

    def run_ended(self, a: Assignment | None, exit_: Exit, *, ok: bool) -> None:
        """The agent's end. As torchrun's: its own run succeeded when it saw the job to its
        end, whatever the workers did; it failed on a rendezvous error or a signal."""
        if not self.enabled:
            return
        ran = ok or exit_.failure is not None or bool(exit_.local_failures)
        self.agent(
            "SUCCEEDED" if ran else "FAILED",
            group_rank=None if a is None else a.group_rank,
            group_world_size=None if a is None else a.group_world_size,
            raw_error=None if ran else exit_.reason,
        )

    def _worker_event(
        self,
        state: str,
        a: Assignment,
        local_rank: int,
        pid: int,
        exit_code: int | None = None,
        raw_error: str | None = None,
    ) -> None:
        self.worker(
            state,
            pid=pid,
            rank=a.rank_offset + local_rank,
            local_rank=local_rank,
            group_rank=a.group_rank,
            group_world_size=a.group_world_size,
            role_world_size=a.world_size,
            exit_code=exit_code,
            raw_error=raw_error,
        )

    # -- one event ---------------------------------------------------------------------------

    def agent(
        self,
        state: str,
        *,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        duration_ms: float | None = None,
        raw_error: str | None = None,
    ) -> None:
        if not self.enabled:
            return
        extra = {"group_world_size": group_world_size, "entry_point": self._entrypoint}
        self._emit("AGENT", state, None, group_rank, None, extra, duration_ms, raw_error)

    def worker(
        self,
        state: str,
        *,
        rank: int,
        local_rank: int,
        group_rank: int,
        group_world_size: int,
        role_world_size: int,
        pid: int,
        exit_code: int | None = None,
        raw_error: str | None = None,
    ) -> None:
        if not self.enabled:
            return
        extra = {
            "group_world_size": group_world_size,
            "entry_point": self._entrypoint,
            "local_rank": [local_rank],
            "role_rank": [rank],
            "role_world_size": [role_world_size],
            "exit_code": [exit_code],
            "worker_pid": [pid],
        }
        self._emit("WORKER", state, rank, group_rank, str(pid), extra, None, raw_error)

    def _emit(
        self,
        source: str,
        state: str,
        rank: int | None,
        group_rank: int | None,
        worker_id: str | None,
        extra: dict[str, Any],
        duration_ms: float | None,
        raw_error: str | None,
    ) -> None:
        import json  # only with the console handler

        metadata = {
            "run_id": self._base["run_id"],
            "global_rank": rank,
            "group_rank": group_rank,
            "worker_id": worker_id,
            "role": self._base["role"],
            "hostname": self._hostname,
            "state": state,
            "total_run_time": 0,
            "rdzv_backend": self._base["rdzv_backend"],
            "raw_error": raw_error,
            "metadata": json.dumps(extra),
            "agent_restarts": self.restarts,
            "duration_ms": duration_ms,
        }
        event = {"name": f"torchelastic.worker.status.{state}", "source": source, "timestamp": 0}
        event["metadata"] = metadata
        stream = self._stream or sys.stderr
        try:
            stream.write(json.dumps(event) + "\n")
            stream.flush()
        except (OSError, ValueError):
            self.enabled = False  # a broken stderr: events stop, the job goes on
