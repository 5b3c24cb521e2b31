"""GPU health without torch: the built-in ``--health-check gpu`` and the wait, before a
restart's workers start, until the previous workers' GPU memory is released.

Two sources, both readable without CUDA:

* ``nvidia-smi --query-gpu=...`` for each GPU's UUID, PCI bus id, memory used and uncorrected
  volatile ECC count.  It is run as an asyncio subprocess in its own session, so the agent's
  event loop never blocks on it, and a timeout kills its whole process group.  A wedged driver
  can leave nvidia-smi in uninterruptible sleep where even SIGKILL takes no effect; after the
  kill we wait at most :data:`_REAP_WAIT` seconds for it and then give up on it (the event
  loop's child watcher reaps it if it ever wakes), so the wait is truly bounded.
* The kernel log (``/dev/kmsg``) for Xid records the NVIDIA driver wrote after a given moment,
  of the kinds in :data:`FATAL_XIDS`.  Reading it never blocks: the device is opened
  non-blocking and read until ``EAGAIN``.  Where ``kernel.dmesg_restrict`` forbids it, Xids are
  simply not checked (:func:`kmsg_readable` lets the caller say so once).

Why wait for memory: a worker killed by a restart can leave a CUDA context behind for seconds
while the driver tears it down; workers started against it die of out-of-memory.  As NVIDIA's
NVRx launcher does, we poll every :data:`RELEASE_POLL` s until every GPU uses at most
:data:`RELEASE_MIB` MiB, give up after :data:`RELEASE_TIMEOUT` s and say so.  The common case,
memory already free, costs one nvidia-smi call.

GPUs are named by UUID (``GPU-...``); resolving ``CUDA_VISIBLE_DEVICES`` (indices, prefixes,
``MIG-`` UUIDs) to the physical GPUs' UUIDs is the caller's business.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass

from .numa import sysfs_pci_address

__all__ = [
    "FATAL_XIDS",
    "QUERY_TIMEOUT",
    "RELEASE_MIB",
    "RELEASE_POLL",
    "RELEASE_TIMEOUT",
    "GpuQueryError",
    "GpuReading",
    "gpu_problem",
    "kmsg_readable",
    "read_gpus",
    "wait_released",
    "xid_errors",
]

RELEASE_MIB = 512  # MiB a GPU may still use and count as free (NVRx's --ft-gpu-memory-tolerance-mb)
RELEASE_TIMEOUT = 50.0  # seconds to wait for the memory (NVRx's --ft-gpu-memory-reclaim-timeout)
RELEASE_POLL = 2.0  # seconds between two queries while waiting
QUERY_TIMEOUT = 10.0  # seconds one nvidia-smi call may take

# Xids after which the GPU, not the application, needs attention (a reset, a drain, a
# technician), from NVIDIA's Xid catalog.  Application faults (13, 31, 43, 45, ...) are left
# out: a crashed training script causes them and a restart is the cure.
FATAL_XIDS: frozenset[int] = frozenset(
    {
        48,  # double-bit ECC error
        62,  # internal micro-controller halt
        63,  # ECC page retirement / row remapping pending (reset to activate)
        64,  # page retirement / row remapping failed
        74,  # NVLink error
        79,  # GPU has fallen off the bus
        92,  # high single-bit ECC error rate
        94,  # contained ECC error
        95,  # uncontained ECC error
        119,  # GSP RPC timeout
        120,  # GSP error
        140,  # unrecovered ECC error
    }
)

_QUERY_FIELDS = "uuid,pci.bus_id,memory.used,memory.total,ecc.errors.uncorrected.volatile.total"
_MAX_OUTPUT = 256 << 10  # bytes kept of each of nvidia-smi's streams
_MAX_LINES = 1024  # lines parsed from it: far more GPUs than any machine has
_MAX_LINE = 300  # characters of one line quoted in a message
_REAP_WAIT = 1.0  # seconds to wait for a killed nvidia-smi before giving up on it
_KMSG_READ = 16 << 10  # one read; a kmsg record (message and dictionary) is at most 8 KiB
_XID_RECORD = r"NVRM: Xid \((?:PCI:)?([0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})[^)]*\): (\d+)"


@dataclass(frozen=True)
class GpuReading:
    """One GPU as nvidia-smi reported it; a number is None where it said "[N/A]" or the like."""

    uuid: str
    pci_bus_id: str  # sysfs form, "0000:1b:00.0"
    memory_used_mib: int | None
    memory_total_mib: int | None
    ecc_uncorrected: int | None  # None: "[N/A]" (ECC off) or not reported

    def name(self) -> str:
        return f"GPU {self.pci_bus_id} ({self.uuid})"


class GpuQueryError(Exception):
    """nvidia-smi could not be run, did not answer in time, or reported no GPU."""


def kmsg_readable(kmsg: str = "/dev/kmsg") -> bool:
    """Whether the kernel log can be read (``kernel.dmesg_restrict`` forbids it to non-root
    users); :func:`xid_errors` returns [] where it cannot, so the caller may say once that
    Xids are not checked."""
    try:
        os.close(os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
    except OSError:
        return False
    return True


async def read_gpus(smi: str, *, timeout: float = QUERY_TIMEOUT) -> list[GpuReading]:
    """Every GPU nvidia-smi can read.

    A GPU it cannot reach ("GPU is lost") is left out while the others are returned; compare
    the UUIDs with the ones expected.  Raises GpuQueryError when nvidia-smi cannot run, takes
    longer than ``timeout``, or reports no GPU at all."""
    readings, _notes, _code = await _query(smi, timeout)
    return readings


async def _query(smi: str, timeout: float) -> tuple[list[GpuReading], list[str], int]:
    """(the GPUs read, nvidia-smi's other lines, its exit status); see :func:`read_gpus`."""
    argv = [smi, f"--query-gpu={_QUERY_FIELDS}", "--format=csv,noheader,nounits"]
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # a timeout kills it and anything it started
        )
    except OSError as e:
        raise GpuQueryError(f"cannot run {smi}: {e.strerror or e}") from None
    stdout, stderr = proc.stdout, proc.stderr
    if stdout is None or stderr is None:  # cannot happen with PIPE; narrows the types
        raise RuntimeError("nvidia-smi was started without pipes")
    try:
        out, err, code = await asyncio.wait_for(
            asyncio.gather(_read_capped(stdout), _read_capped(stderr), proc.wait()), timeout
        )
    except asyncio.TimeoutError:
        raise GpuQueryError(f"{smi} did not answer within {timeout:g} s (a wedged GPU driver?)") from None
    finally:
        if proc.returncode is None:  # timed out or cancelled: nothing of it outlives the query
            import signal

            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:  # in uninterruptible sleep (a wedged driver) it ignores even SIGKILL: don't wait on it
                await asyncio.wait_for(proc.wait(), _REAP_WAIT)
            except asyncio.TimeoutError:
                pass

    readings: list[GpuReading] = []
    notes: list[str] = []
    for line in out.decode(errors="replace").splitlines()[:_MAX_LINES]:
        reading = _parse_line(line)
        if reading is not None:
            readings.append(reading)
        elif line.strip():
            notes.append(line.strip()[:_MAX_LINE])
    notes += [
        ln.strip()[:_MAX_LINE] for ln in err.decode(errors="replace").splitlines()[:_MAX_LINES] if ln.strip()
    ]
    if readings:
        return readings, notes, code
    detail = f": {' / '.join(notes[-5:])}" if notes else ""
    if code != 0:
        raise GpuQueryError(f"{smi} exited with {code}{detail}")
    raise GpuQueryError(f"{smi} reported no GPU{detail}")


async def _read_capped(stream: asyncio.StreamReader) -> bytes:
    """All of a stream, keeping the first _MAX_OUTPUT bytes: the rest is read and dropped so
    that the writer never blocks on a full pipe."""
    kept = bytearray()
    while chunk := await stream.read(64 << 10):
        if len(kept) < _MAX_OUTPUT:
            kept += chunk[: _MAX_OUTPUT - len(kept)]
    return bytes(kept)


def _parse_line(line: str) -> GpuReading | None:
    """One CSV line of our query, or None if it is something else (an error message)."""
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != 5 or not fields[0].startswith(("GPU-", "MIG-")):
        return None
    bus = sysfs_pci_address(fields[1])
    if bus is None:
        return None
    return GpuReading(
        uuid=fields[0],
        pci_bus_id=bus,
        memory_used_mib=_number(fields[2]),
        memory_total_mib=_number(fields[3]),
        ecc_uncorrected=_number(fields[4]),
    )


def _number(text: str) -> int | None:
    """ "30000" or "30000 MiB" -> 30000; "[N/A]", "[Not Supported]", "[Unknown Error]" -> None."""
    value = text.removesuffix("MiB").strip()
    return int(value) if value.isdigit() else None


def xid_errors(
    since_us: int, *, kmsg: str = "/dev/kmsg", max_bytes: int = 4 << 20
) -> list[tuple[str, int, str]]:
    """The fatal Xids (:data:`FATAL_XIDS`) the NVIDIA driver logged after ``since_us``.

    ``since_us`` is a kernel-log timestamp: microseconds of CLOCK_MONOTONIC, which is what
    ``int(time.monotonic() * 1e6)`` gives on Linux.  Returns (PCI address "0000:1b:00", Xid,
    the log message), oldest first.  At most ``max_bytes`` of the log are read: on a plain file
    its last ``max_bytes``; on /dev/kmsg, which can only be read from its oldest record, the
    oldest.  [] when the log cannot be read (``kernel.dmesg_restrict``: see
    :func:`kmsg_readable`)."""
    import re
    import stat

    try:
        fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    found: list[tuple[str, int, str]] = []
    pattern = re.compile(_XID_RECORD)

    def record(line: bytes) -> None:
        # "PRI,SEQ,TS_US,FLAGS[,...];MESSAGE"; lines starting with a space are a record's dictionary
        if b"Xid" not in line or line[:1].isspace():
            return
        header, sep, body = line.partition(b";")
        fields = header.split(b",")
        if not sep or len(fields) < 3:
            return
        try:
            ts = int(fields[2])
        except ValueError:
            return
        if ts <= since_us:
            return
        message = body.decode(errors="replace").strip()
        match = pattern.search(message)
        if match and int(match.group(2)) in FATAL_XIDS:
            domain, _, bus = match.group(1).partition(":")
            pci = f"{int(domain, 16):04x}:{bus.lower()}"  # as the bus ids of read_gpus, less ".0"
            found.append((pci, int(match.group(2)), message[:_MAX_LINE]))

    try:
        partial = b""
        if stat.S_ISREG(os.fstat(fd).st_mode):
            size = os.fstat(fd).st_size
            if size > max_bytes:  # keep the newest records; the first line read may be cut
                os.lseek(fd, size - max_bytes, os.SEEK_SET)
                partial = b"\0"  # marks the cut line, dropped below
        total = 0
        overruns = 0
        while total < max_bytes:
            try:
                chunk = os.read(fd, _KMSG_READ)  # /dev/kmsg: one record per read
            except BlockingIOError:  # EAGAIN: every record read
                break
            except BrokenPipeError:  # EPIPE: records were overwritten meanwhile; read on
                overruns += 1
                if overruns > 1000:
                    break
                continue
            except OSError:
                break
            if not chunk:  # end of a plain file
                break
            total += len(chunk)
            lines = (partial + chunk).split(b"\n")
            partial = lines.pop()
            if len(partial) > _KMSG_READ:  # no record is this long: drop it, keep the copies small
                partial = b"\0"
            for line in lines:
                if line.startswith(b"\0"):
                    continue
                record(line)
        if partial and not partial.startswith(b"\0"):
            record(partial)
    finally:
        os.close(fd)
    return found


def _select(readings: Sequence[GpuReading], uuids: Sequence[str]) -> tuple[list[GpuReading], list[str]]:
    """(the readings of these UUIDs, the UUIDs nvidia-smi did not report); no UUIDs: all GPUs."""
    if not uuids:
        return list(readings), []
    by_uuid = {r.uuid: r for r in readings}
    return [by_uuid[u] for u in uuids if u in by_uuid], [u for u in uuids if u not in by_uuid]


async def _wait_memory(
    uuids: Sequence[str],
    *,
    smi: str,
    threshold_mib: int,
    timeout: float,
    poll: float,
    query_timeout: float,
    first: Sequence[GpuReading] | None = None,
) -> str | None:
    """None once every GPU uses <= threshold_mib, else why not (no advice appended).

    ``first``: a reading already made, used as the first check."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    readings = first
    while True:
        if readings is None:
            try:
                readings = await read_gpus(smi, timeout=query_timeout)
            except GpuQueryError as e:
                return f"cannot check that the GPUs' memory is released: {e}"
        chosen, missing = _select(readings, uuids)
        if missing:
            unread = ", ".join(missing)
            return f"cannot check that the GPUs' memory is released: nvidia-smi did not report {unread}"
        held = [r for r in chosen if r.memory_used_mib is not None and r.memory_used_mib > threshold_mib]
        if not held:
            return None
        remaining = deadline - loop.time()
        if remaining <= 0:
            return (
                ", ".join(f"{r.name()} still holds {r.memory_used_mib} MiB" for r in held)
                + f" after {timeout:g} s"
            )
        await asyncio.sleep(min(poll, remaining))
        readings = None


async def wait_released(
    uuids: Sequence[str],
    *,
    smi: str,
    threshold_mib: int = RELEASE_MIB,
    timeout: float = RELEASE_TIMEOUT,
    poll: float = RELEASE_POLL,
    query_timeout: float = QUERY_TIMEOUT,
) -> str | None:
    """Wait until every listed GPU (by UUID; none listed: every GPU) uses <= threshold_mib.

    None once they do (the first check is immediate); else, after ``timeout``, or at once when
    nvidia-smi fails or does not report a listed GPU, one line saying why, for the log: the
    workers are started anyway."""
    problem = await _wait_memory(
        uuids, smi=smi, threshold_mib=threshold_mib, timeout=timeout, poll=poll, query_timeout=query_timeout
    )
    return None if problem is None else f"{problem}; starting the workers anyway"


async def gpu_problem(
    uuids: Sequence[str],
    *,
    smi: str,
    kmsg: str = "/dev/kmsg",
    since_us: int = 0,
    release_mib: int = RELEASE_MIB,
    release_timeout: float = RELEASE_TIMEOUT,
    poll: float = RELEASE_POLL,
    timeout: float = QUERY_TIMEOUT,
) -> str | None:
    """The built-in ``--health-check gpu``: None when healthy, else one line naming the GPU(s).

    Healthy: every listed GPU (by UUID; none listed: every GPU, and nvidia-smi must succeed)
    answers nvidia-smi, has no uncorrected volatile ECC error, has no fatal Xid on its PCI bus
    logged after ``since_us`` (see :func:`xid_errors`), and uses at most ``release_mib`` MiB --
    waited for up to ``release_timeout`` s, as a restart's previous workers may still be
    letting go of it."""
    try:
        readings, notes, code = await _query(smi, timeout)
    except GpuQueryError as e:
        return str(e)
    chosen, missing = _select(readings, uuids)
    problems: list[str] = []
    detail = f" ({' / '.join(notes[-3:])})" if notes else ""
    if missing:
        problems.append(f"GPU {', '.join(missing)} did not answer nvidia-smi{detail}")
    elif not uuids and code != 0:
        problems.append(f"{smi} exited with {code}{detail}")
    problems += [
        f"{r.name()} has {r.ecc_uncorrected} uncorrected ECC error{'s' if r.ecc_uncorrected != 1 else ''}"
        for r in chosen
        if r.ecc_uncorrected
    ]
    by_bus = {r.pci_bus_id.rpartition(".")[0]: r for r in chosen}  # the log names "0000:1b:00"
    seen: set[tuple[str, int]] = set()
    for pci, xid, message in xid_errors(since_us, kmsg=kmsg):
        if pci in by_bus and (pci, xid) not in seen:
            seen.add((pci, xid))
            problems.append(f"{by_bus[pci].name()}: {message}")
    if problems:
        return "; ".join(problems)
    return await _wait_memory(
        uuids,
        smi=smi,
        threshold_mib=release_mib,
        timeout=release_timeout,
        poll=poll,
        query_timeout=timeout,
        first=readings,
    )
