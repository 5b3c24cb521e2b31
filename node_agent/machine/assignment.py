"""The round this node holds, in plain functions (pure): the server's assignment checked
against what this node was started with, said in words, and a failure of this node's workers
in it that no one rank owns.

The server counts restarts and sizes the world; the agent does not trust it to: a buggy or
hostile one could run this node for another job, restart it for ever past its
``--max-restarts``, or give it ranks that do not exist (:func:`contradiction`).
"""

from __future__ import annotations

from protocol import Assignment, Failure

from ..agent_log import shown
from .events import AgentSettings, Phase


def contradiction(s: AgentSettings, a: Assignment) -> str | None:
    """How an assignment contradicts what this node was started with, or None."""
    if s.job_id and a.job_id != s.job_id:
        return f"an assignment for job {shown(a.job_id)!r}, but this node runs job {s.job_id!r}"
    if s.max_restarts is not None:
        if a.max_restarts != s.max_restarts:
            return (
                f"an assignment that says --max-restarts {a.max_restarts}, but this node has "
                f"--max-restarts {s.max_restarts}"
            )
        if a.restart_count > s.max_restarts:
            return (
                f"an assignment for restart {a.restart_count}, past this node's budget "
                f"(--max-restarts {s.max_restarts})"
            )
    if not s.min_nodes <= a.group_world_size <= s.max_nodes:
        return (
            f"an assignment for a round of {a.group_world_size} nodes, but this node has "
            f"--nnodes {node_range(s.min_nodes, s.max_nodes)}"
        )
    if a.rank_offset + s.nproc > a.world_size or a.world_size < a.group_world_size:
        return (
            f"an assignment whose ranks do not fit its world: {ranks(a.rank_offset, s.nproc)} "
            f"of this node's {s.nproc} worker(s) in a world size {a.world_size} of "
            f"{a.group_world_size} nodes"
        )
    return None


def round_line(a: Assignment, nproc: int) -> str:
    """The line that says which round this node starts its workers for, and their place in it."""
    return (
        f"round {a.round}: group rank {a.group_rank} of {a.group_world_size}, "
        f"{ranks(a.rank_offset, nproc)}, world size {a.world_size}, "
        f"master {shown(a.master_addr)}:{a.master_port}, restart {a.restart_count}"
    )


def doing(phase: Phase, a: Assignment | None) -> str:
    """Our phase (and the round we hold) in words, for protocol-error messages."""
    held = f" round {a.round}" if a is not None else ""
    return {
        Phase.JOINING: "was joining",
        Phase.STARTING: f"was starting its workers of{held}",
        Phase.RUNNING: f"was running{held}",
        Phase.STOPPING: "was stopping its workers",
        Phase.VERDICT: "was waiting for the verdict on its workers' failure",
        Phase.BARRIER: "was waiting at the exit barrier",
        Phase.LEAVING: "was leaving",
        Phase.EXITED: "had exited",
    }[phase]


def node_failure(s: AgentSettings, a: Assignment, now: float, exitcode: int, message: str) -> Failure:
    """A failure of this node's workers in round ``a`` that no one rank owns (they did not
    start; they stopped short of a commit point), on its first rank."""
    return Failure(
        node_id=s.node_id,
        addr=s.addr,
        rank=a.rank_offset,
        local_rank=0,
        exitcode=exitcode,
        signal="",
        timestamp=now + s.wall_offset,
        message=message,
    )


def ranks(first: int, count: int) -> str:
    return f"rank {first}" if count == 1 else f"ranks {first}-{first + count - 1}"


def node_range(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}:{hi}"
