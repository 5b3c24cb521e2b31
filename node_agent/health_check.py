"""``--health-check CMD``: the command run before each rendezvous (``gpu`` is gpu/health.py's)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

HEALTH_CHECK_TIMEOUT = 60.0


async def health_check(cmd: str, timeout: float = HEALTH_CHECK_TIMEOUT) -> str | None:
    """Run --health-check (before each rendezvous): None if it passed, else what went wrong.

    Cancelled (the agent exits meanwhile), it kills the check's whole process group first."""
    proc = await asyncio.create_subprocess_shell(
        cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        return f"{cmd!r} did not finish within {timeout:g} s"
    finally:
        if proc.returncode is None:  # timed out or cancelled: nothing of the check outlives it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.shield(proc.wait())
    if proc.returncode == 0:
        return None
    tail = out.decode(errors="replace").strip().splitlines()[-5:]
    detail = f": {' / '.join(tail)}" if tail else ""
    return f"{cmd!r} exited with {proc.returncode}{detail}"
