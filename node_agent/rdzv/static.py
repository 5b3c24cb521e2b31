"""``--rdzv-backend static``: no rendezvous service; the command line gives every rank.

This stands in for the server connection and answers the agent's machine locally, so the
agent runs exactly the same code path as with a server. As in torchrun's static backend:
group rank = --node-rank, the master is --master-addr:--master-port (worker rank 0 hosts
torch's TCPStore there), node counts are fixed, every node runs the same --nproc-per-node, and
a failure restarts only this node's workers, counted by this node. Every node is one fixed
group rank, so the job never goes on without one: a ``Leave`` is answered ``Left`` with
``job_continues=False`` (the agent then exits non-zero, as torchrun does on a signal).
"""

from __future__ import annotations

import asyncio
import socket

from protocol import (
    Assignment,
    JobDone,
    JobFailed,
    Join,
    Leave,
    Left,
    Message,
    Restart,
    WorkersFailed,
    WorkersSucceeded,
)

from ..config import AgentConfig


class StaticBackend:
    """One link for the whole run: there is nothing to reconnect to."""

    reconnects = False
    shares_joins = False

    def __init__(self, config: AgentConfig) -> None:
        self.config = config

    async def connect(self, deadline: float) -> StaticConnection:
        return StaticConnection(self.config)

    async def close(self, *, linger: bool) -> None:
        return None


class StaticConnection:
    """Answers the agent's messages as a server would, from the command line alone."""

    challenge = ""  # nothing to prove a token to

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.restart_count = 0
        self.round = 0
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.local_ip = config.local_addr or socket.gethostname()

    def send(self, msg: Message) -> None:
        cfg = self.config
        if isinstance(msg, Join):
            self._inbox.put_nowait(
                Assignment(
                    job_id=cfg.rdzv_id,
                    round=self.round,
                    group_rank=cfg.node_rank,
                    group_world_size=cfg.max_nodes,
                    rank_offset=cfg.node_rank * cfg.nproc_per_node,
                    world_size=cfg.max_nodes * cfg.nproc_per_node,
                    master_addr=cfg.rdzv_host,
                    master_port=cfg.rdzv_port,
                    restart_count=self.restart_count,
                    max_restarts=cfg.max_restarts,
                )
            )
        elif isinstance(msg, WorkersFailed):
            from protocol.failure_text import describe_failure

            cause = describe_failure(msg.failure, node=False)
            if self.restart_count < cfg.max_restarts:
                self.restart_count += 1
                self._inbox.put_nowait(
                    Restart(
                        round=self.round, reason=f"worker failure: {cause}", restart_count=self.restart_count
                    )
                )
                self.round += 1
            else:
                self._inbox.put_nowait(
                    JobFailed(
                        reason=f"{cause} (--max-restarts {cfg.max_restarts} used up)", failure=msg.failure
                    )
                )
        elif isinstance(msg, WorkersSucceeded):
            self._inbox.put_nowait(JobDone())
        elif isinstance(msg, Leave):
            why = f"the static rendezvous has no place for group rank {cfg.node_rank} without this node"
            self._inbox.put_nowait(Left(job_continues=False, reason=why))

    async def receive(self) -> Message:
        return await self._inbox.get()

    async def close(self) -> None:
        return None
