"""Collecting the local ranks' stacks after a hang, bounded in time (I/O).

For each rank, in parallel:

1. ``py-spy dump --pid P`` when ``py-spy`` is on PATH (it reads any CPython process from
   outside, armed or not, if ptrace is allowed: same user and ``kernel.yama.ptrace_scope`` 0
   or 1 with the agent the parent, or CAP_SYS_PTRACE). Bounded; killed and reaped past its time.
2. Else, or if py-spy failed, the stack signal, only to a rank whose page says it armed one
   (``node_agent.worker`` arms faulthandler on ``SIGRTMIN + 4`` when first used): the worker
   appends every thread's stack to ``<page>.stacks`` and carries on; we read what the file
   gained once it stopped growing for :data:`SETTLE_S`. Only real-time signals are sent: a
   page is written by the user's process, and no other signal may reach a worker from here.
3. Else a line saying why there are no stacks.

Each result says which produced it. Nothing here waits without a bound, every child is
reaped, and nothing raises for a rank's sake: a rank's failure is its text.

Also here: :func:`poke_flight_recorder` (asks torch's NCCL flight recorder of every rank to
dump, through the FIFOs torch opens when ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` is set) and
:func:`write_report` and :func:`append_report`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import stat
import time
from collections.abc import Sequence

from edge.atomic_write import replace_file
from protocol.records import record

from .pages import read_stacks_since

__all__ = ["RankStacks", "Target", "append_report", "collect", "poke_flight_recorder", "write_report"]

PY_SPY = "py-spy"
SETTLE_S = 0.1  # a stacks file unchanged this long is complete
POLL_S = 0.01
MAX_STACKS_BYTES = 1 << 20  # read per rank
PY_SPY_SHARE = 0.5  # of the time, when the signal can follow a failed py-spy
NO_STACKS = "no stacks: the rank did not import node_agent.worker and py-spy is not installed/allowed"


@record(frozen=True, slots=True, kw_only=True)
class Target:
    """A local rank to collect from."""

    local_rank: int
    rank: int  # global
    pid: int  # the worker's pid (0: not running)
    stack_signal: int  # from its page (0: not armed); sent only to ``pid``
    page_path: str  # the stacks file is ``<page_path>.stacks``


@record(frozen=True, slots=True, kw_only=True)
class RankStacks:
    local_rank: int
    rank: int
    text: str  # the dump (faulthandler's or py-spy's format), or why there is none
    source: str  # "py-spy", "signal" or "none"
    seconds: float  # how long collecting it took


async def collect(
    targets: Sequence[Target], *, timeout: float = 5.0, py_spy: str | None = PY_SPY
) -> list[RankStacks]:
    """Every target's stacks, in the targets' order, within ``timeout`` seconds in all.

    ``py_spy``: the command to try first (looked up on PATH; None: never).
    """
    exe = shutil.which(py_spy) if py_spy else None
    deadline = time.monotonic() + timeout
    return list(await asyncio.gather(*(_one(t, exe, deadline, timeout) for t in targets)))


async def _one(t: Target, exe: str | None, deadline: float, timeout: float) -> RankStacks:
    start = time.monotonic()

    def done(text: str, source: str) -> RankStacks:
        return RankStacks(
            local_rank=t.local_rank, rank=t.rank, text=text, source=source, seconds=time.monotonic() - start
        )

    if t.pid <= 0:
        return done("no stacks: the worker is not running", "none")
    armed = _armed(t.stack_signal)
    why = ""
    if exe is not None:
        # Leave the signal time of its own should py-spy fail or stall.
        until = start + timeout * PY_SPY_SHARE if armed else deadline
        text, why = await _py_spy(exe, t.pid, min(until, deadline))
        if text:
            return done(text, "py-spy")
    if armed:
        text, sig_why = await _signal(t, deadline)
        if text:
            return done(text, "signal")
        why = f"{why}; {sig_why}" if why else sig_why
    elif t.stack_signal:
        why = f"{why}; " if why else ""
        why += f"its page names signal {t.stack_signal}, not a real-time signal: not sent"
    return done(f"{NO_STACKS} ({why})" if why else NO_STACKS, "none")


def _armed(sig: int) -> bool:
    return signal.SIGRTMIN <= sig <= signal.SIGRTMAX


async def _py_spy(exe: str, pid: int, until: float) -> tuple[str, str]:
    """(the dump, "") or ("", why not)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            exe,
            "dump",
            "--pid",
            str(pid),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as e:
        return "", f"py-spy did not start: {e}"
    try:
        assert proc.stdout is not None and proc.stderr is not None
        out, err = await asyncio.wait_for(
            asyncio.gather(_read(proc.stdout, MAX_STACKS_BYTES), _read(proc.stderr, 4096)),
            max(0.0, until - time.monotonic()),
        )
        rc = await asyncio.wait_for(proc.wait(), max(0.0, until - time.monotonic()))
    except asyncio.TimeoutError:
        return "", "py-spy did not answer in time"
    finally:
        await _reap(proc)
    text = out.decode("utf-8", "replace")
    if rc != 0 or "Thread " not in text:
        first = (err.decode("utf-8", "replace").strip().splitlines() or [f"exit code {rc}"])[0]
        return "", f"py-spy failed: {first[:200]}"
    return text, ""


async def _read(stream: asyncio.StreamReader, limit: int) -> bytes:
    """Up to ``limit`` bytes, to the end of the stream."""
    chunks: list[bytes] = []
    left = limit
    while left > 0 and (chunk := await stream.read(min(left, 65536))):
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """Kill ``proc`` if it still runs and wait for it: SIGKILL cannot be ignored, so the wait is
    short; bounded all the same (a process in the kernel's D state, NFS)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.shield(asyncio.wait_for(proc.wait(), 5.0))


async def _signal(t: Target, deadline: float) -> tuple[str, str]:
    """Ask the rank for its stacks with its signal; (the text it wrote, "") or ("", why not)."""
    path = f"{t.page_path}.stacks"
    try:
        offset = os.stat(path).st_size
    except FileNotFoundError:
        offset = 0
    except OSError as e:
        return "", f"cannot read {path}: {e.strerror}"
    try:
        os.kill(t.pid, t.stack_signal)
    except ProcessLookupError:
        return "", "the worker is gone"
    except OSError as e:
        return "", f"cannot signal pid {t.pid}: {e.strerror}"
    size, changed = offset, time.monotonic()
    while True:
        now = time.monotonic()
        if now >= deadline:
            break
        try:
            new = os.stat(path).st_size
        except OSError:
            new = size
        if new != size:
            size, changed = new, now
        elif size > offset and now - changed >= SETTLE_S:
            break
        await asyncio.sleep(POLL_S)
    if size <= offset:
        return "", f"the rank did not answer its stack signal ({t.stack_signal}) in time"
    text, _ = read_stacks_since(path, offset, MAX_STACKS_BYTES)
    return text, ""


def poke_flight_recorder(stem: str, ranks: Sequence[int]) -> list[int]:
    """Ask torch's flight recorder of each rank to dump: one byte into ``<stem><rank>.pipe``
    where that FIFO exists and someone reads it. The ranks poked."""
    poked = []
    for rank in ranks:
        path = f"{stem}{rank}.pipe"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:  # ENOENT: no such pipe; ENXIO: nobody reads it (no NCCL group yet)
            continue
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):  # never write into a regular file
                os.write(fd, b"1")
                poked.append(rank)
        except OSError:  # EAGAIN (full) or EPIPE (the reader left): it is asked already or gone
            pass
        finally:
            os.close(fd)
    return poked


def write_report(path: str, text: str) -> bool:
    """Write ``text`` to ``path`` (replaced whole, never half-written); False if it could not."""
    try:
        replace_file(path, text, mode=0o644)
    except OSError:
        return False
    return True


def append_report(path: str, text: str) -> bool:
    """Add ``text`` at the end of ``path`` (created if missing, never through a symlink);
    False if it could not be written."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError:
        return False
    try:
        view = memoryview(text.encode("utf-8", "replace"))
        while view:
            view = view[os.write(fd, view) :]
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
