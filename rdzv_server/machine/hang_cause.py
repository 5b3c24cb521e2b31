"""The job-wide cause of a hang: the rank every node's stacks point at (pure).

An agent sees only its own ranks pass their budget. When a rank of another node stopped
outside any collective, the ranks of the node that reports first all wait in one, and its
report can only name them. The server holds every node's stacks (``HangState``); merged by
``protocol.hang_report``, the odd one out is the rank the others wait for. :func:`job_cause`
makes that rank the hang's failure, with the merged report as its message, so the job's root
cause, the restart's reason and every agent's failure banner name it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from protocol import Failure
from protocol.failure_text import HUNG
from protocol.messages import clip_text

from .progress import HangState

if TYPE_CHECKING:
    from protocol.hang_report import HangReport
# protocol.hang_report (1.5 ms of record classes and patterns) is imported only when a hang is
# reported: a job that never hangs (an agent's embedded server's, most often) never pays for it.

# The most a hang's verdict waits for the other nodes' stacks after the hung node's failure:
# every agent collects its ranks' within 5 s of the server's CollectStacks
# (node_agent.progress.poll.STACKS_TIMEOUT), which went out before that failure; 1 s for the wire.
HANG_VERDICT_WAIT_S = 6.0
TITLE = "job-wide hang report (every node's stacks, merged by the rendezvous server)"
SOURCE = "node-agent"  # who collected each rank's stacks (py-spy or the signal: Stacks does not say)


def job_report(hang: HangState) -> HangReport:
    """Every kept node's stacks merged, each rank named with its node."""
    from protocol.hang_report import Entry, merge

    entries = [
        Entry(rank=rank, step=step, phase=phase, silent_s=silent, text=text, source=SOURCE, node=node)
        for node, msg in hang.stacks.items()
        for rank, step, phase, silent, text in zip(
            msg.ranks, msg.steps, msg.phases, msg.silent_s, msg.stacks, strict=True
        )
    ]
    return merge(entries, hung=hang.ranks)


def all_stacks_in(hang: HangState, nodes: int) -> bool:
    """Whether each of the round's ``nodes`` nodes sent its stacks (or was past the caps)."""
    return len(hang.stacks) + hang.nodes_dropped >= nodes


def job_cause(
    hang: HangState | None,
    failure: Failure,
    spans: Mapping[str, range],
    addrs: Mapping[str, str],
    message_len: int,
) -> tuple[Failure, str] | None:
    """A hang's ``failure`` as every node's stacks tell it, and the report's whole text; None
    when there is nothing to tell it from (not a hang, or no stacks: ``hang`` is the round's).

    The failure names the first suspect when the report has an odd one out (the rank is
    placed by the round's assignment, ``spans``: node -> its global ranks, never by what a
    node sent); otherwise the reported ranks stand. Its message is the report, cut to
    ``message_len``: the odd ones out and their frames come first."""
    if failure.signal != HUNG or hang is None or not hang.stacks:
        return None
    from protocol.hang_report import render

    report = job_report(hang)
    text = render(report)
    message = clip_text(f"{TITLE}:\n{text}", message_len)
    if not any(g.odd for g in report.groups) or not report.suspects:
        return replace(failure, message=message), text
    rank = report.suspects[0].rank
    if rank == failure.rank:
        return replace(failure, message=message), text
    for node, span in spans.items():
        if rank in span and node in addrs:
            first = span.start
            named = replace(
                failure,
                node_id=node,
                addr=addrs[node],
                rank=rank,
                local_rank=rank - first,
                pid=0,  # the suspect's pid is its node's to know
                error_file="",
                message=message,
            )
            return named, text
    return replace(failure, message=message), text
