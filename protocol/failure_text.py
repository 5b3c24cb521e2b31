"""The one sentence that says which worker failed and how.

Everything that shows a :class:`~protocol.messages.Failure` to a person (the server's job
history, its status API and CLI, a restart's reason, the agent's report) words it here, so a
reader sees the same words everywhere and nothing has to match another copy's wording. Pure:
a ``Failure`` in, a string out.
"""

from __future__ import annotations

from protocol.messages import Failure

# Failure.signal of a rank the agent found hung (it made no progress past its deadline), and
# then stopped: no signal or exit code of its own says what went wrong.
HUNG = "hang"


def how_it_failed(f: Failure) -> str:
    """``signal SIGKILL``, ``exit code 1``, or ``a hang (no progress past its deadline)``."""
    if f.signal == HUNG:
        return "a hang (no progress past its deadline)"
    if f.signal:
        # A signal with no name is given as "signal 38" already: not "signal signal 38".
        return f.signal if f.signal.startswith("signal ") else f"signal {f.signal}"
    return f"exit code {f.exitcode}"


def describe_failure(f: Failure, *, node: bool = True) -> str:
    """``rank 3 (local rank 1) on node n2 (10.0.0.2) failed with exit code 1``.

    ``node=False`` leaves out the node, for a view of one node's own workers (the static
    backend, where every node is told its own failures).
    """
    where = f" on node {f.node_id} ({f.addr})" if node else ""
    return f"rank {f.rank} (local rank {f.local_rank}){where} failed with {how_it_failed(f)}"
