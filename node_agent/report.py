"""The failure summary a person reads when a job fails, in torchrun's layout.

torchrun prints a ``ChildFailedError`` block: the entrypoint, this node's failures, and the
root cause (the first failure by time). Ours names the root cause of the whole job, which the
server knows, so every node prints the same first failure, not only its own. That failure comes
from the server (and another node): its texts are shown escaped (``agent_log.shown``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from protocol import Failure

from .agent_log import shown

WIDTH = 60


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d_%H:%M:%S", time.localtime(ts))


def _how(f: Failure) -> str:
    pid = f" (pid: {f.pid})" if f.pid else ""
    if f.signal:
        return f"{f.exitcode}{pid} (killed by {shown(f.signal)})"
    return f"{f.exitcode}{pid}"


def _block(index: int, f: Failure) -> list[str]:
    lines = [
        f"[{index}]:",
        f"  time      : {_when(f.timestamp)}",
        f"  host      : {shown(f.addr)} (node {shown(f.node_id)})",
        f"  rank      : {f.rank} (local_rank: {f.local_rank})",
        f"  exitcode  : {_how(f)}",
        f"  error_file: {shown(f.error_file, limit=None) or '<N/A>'}",
    ]
    if f.message:
        msg = shown(f.message.rstrip(), multiline=True).split("\n")
        lines.append(f"  error     : {msg[0]}")
        lines.extend(f"              {line}" for line in msg[1:])
    return lines


def failure_summary(entrypoint: str, root: Failure | None, local: Sequence[Failure]) -> str:
    """The text block printed by every agent of a failed job."""
    bar, thin = "=" * WIDTH, "-" * WIDTH
    lines = [bar, f"{entrypoint} FAILED", thin, "Failures:"]
    others = [f for f in local if root is None or f != root]
    if others:
        for i, f in enumerate(others, start=1):
            lines.extend(_block(i, f))
    else:
        lines.append("  <NO_OTHER_FAILURES>")
    lines += [thin, "Root Cause (first observed failure):"]
    if root is not None:
        lines.extend(_block(0, root))
    elif local:
        lines.extend(_block(0, min(local, key=lambda f: f.timestamp)))
    else:
        lines.append("  <unknown: no worker failure was reported>")
    lines.append(bar)
    return "\n".join(lines)
