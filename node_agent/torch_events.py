"""``--event-log-handler console``: torchrun's agent and worker events as JSON lines on stderr.

torchrun records an event at each step of its agent (``torch.distributed.elastic.events``):
the rendezvous, the rank assignment, each worker's start and end, and the agent's end. With the
``console`` handler each is one JSON object per line on stderr, which some clusters scrape. We
write the same names and fields; ``null`` and ``dynamic_rendezvous`` discard them (as torchrun's
handlers of those names do), and then nothing here costs anything.
"""

from __future__ import annotations

import socket
import sys
from typing import Any, TextIO

__all__ = ["EventLog"]


class EventLog:
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
