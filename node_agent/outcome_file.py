"""``--outcome-dir DIR``: how the job ended, as this agent saw it, for a batch script to read.

An elastic job goes on when one of its nodes is lost, but a scheduler sees each node's agent:
Slurm's srun returns the highest exit code of its tasks, the lost node's 137, and the batch
script (``set -e``) ends the job FAILED although the training finished. So each agent that
lives to see the end writes one file, ``DIR/<host>-<pid>``, holding one line:

- ``succeeded``: every node of the job finished (the agent exits 0: the job is done);
- ``left``: this node left a job that goes on (a drain, a scale-down: exit 0);
- ``failed <exit code>``: anything else (the job failed, the rendezvous was lost, a signal).

An agent that was killed writes nothing. ``deploy/slurm/train.sbatch`` ends COMPLETED when
srun failed only because agents were killed: some agent says ``succeeded`` and none
``failed``. Written whole (beside, then renamed): a reader sees a file complete or none.
"""

from __future__ import annotations

import os
import socket

__all__ = ["outcome_text", "write_outcome"]


def outcome_text(code: int, job_done: bool) -> str:
    if code == 0:
        return "succeeded" if job_done else "left"
    return f"failed {code}"


def write_outcome(folder: str, code: int, job_done: bool) -> str:
    """This agent's line in ``folder`` (made if missing); "" or why it could not be written."""
    name = f"{socket.gethostname()}-{os.getpid()}"
    tmp = os.path.join(folder, f".{name}.part")
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, f"{outcome_text(code, job_done)}\n".encode())
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(folder, name))
    except OSError as exc:
        return f"could not write the job's outcome to {folder}: {exc}"
    return ""
