"""A worker starts with stdin, stdout and stderr only, as torchrun's does: not the descriptors
the launcher inherited from whatever started it (a scheduler's pipes), nor copies the event loop
made of the worker's stdio (uvloop implements no close_fds)."""

from __future__ import annotations

import os
import subprocess
import sys

from .procs import ROOT, WORKERS, agent_cmd

SCRIPT = str(WORKERS / "list_fds.py")


def fds_seen(launcher: list[str]) -> list[str]:
    """Start ``launcher`` holding an extra inheritable descriptor; the lines its workers print."""
    r, w = os.pipe()
    try:
        p = subprocess.run(
            [*launcher, "--standalone", "--nproc-per-node", "2", SCRIPT],
            pass_fds=(r, w), capture_output=True, text=True, timeout=120, cwd=ROOT,
        )  # fmt: skip
    finally:
        os.close(r)
        os.close(w)
    assert p.returncode == 0, p.stderr
    return sorted(line for line in p.stdout.splitlines() if line.startswith("FDS"))


def test_workers_inherit_only_stdio_like_torchruns() -> None:
    ours = fds_seen(agent_cmd())
    theirs = fds_seen([sys.executable, "-m", "torch.distributed.run"])
    assert ours == theirs == ["FDS 0,1,2", "FDS 0,1,2"]
