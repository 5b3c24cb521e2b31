"""The progress page: one file per rank, written by the worker, read by its node's agent.

This module is the page's only definition; the worker's writer (``node_agent.worker``), the
agent's reader (``node_agent.progress.pages``) and ``docs/progress-page.md`` (for a trainer written in
C++ or Rust) all follow it. It imports only the standard library's ``struct``, so a worker
pays nothing for it.

The page is a 4096-byte file, mapped shared by both processes. All integers are little-endian.

=======  ====  ==============================================================================
offset   size  field
=======  ====  ==============================================================================
0        8     magic ``b"NAPAGE1\\n"`` (written by the agent when it creates the page)
8        4     u32 layout version (2)
12       4     u32 page size (4096)
16       4     u32 writer pid: 0 until a worker attaches; written last of the header
20       4     u32 stack signal: the signal that makes the worker write the stacks of all its
               threads to ``<page path>.stacks`` without stopping (0: stacks cannot be asked for)
24       8     u64 attached_ns: CLOCK_MONOTONIC when the worker attached
64       32    progress record (worker): i64 step, u64 progress_ns, u64 count, u64 check
96       32    phase record (worker): u64 phase slot (0: no phase), u64 phase_ns (when the
               phase was entered), u64 compute_ns (total time spent in finished "compute"
               phases), u64 check
128      32    stop record (agent): i64 stop_step (-1: none), i64 state (0: none or cancelled,
               1: armed, 2: go), u64 serial (0, reserved), u64 check
160      32    check record (worker): i64 seen (the last armed stop step the worker saw, -1:
               none), i64 at (its step when it first saw ``seen``, -1: none), i64 stopped (the
               step ``should_stop()`` returned True at, -1: never), u64 check; all zero until
               the worker's first ``should_stop()`` call
256      512   phase names: 16 slots of 32 bytes, UTF-8, NUL-padded, at most 31 bytes; slot 0
               is unused (no phase); a name is written before any phase record names its slot
=======  ====  ==============================================================================

A record is written in one store of its 32 bytes and carries ``check``, a mix of its other
three words (:func:`check`). A reader that catches a write halfway sees a check that does
not match and reads again later; it never acts on a torn record. Times are CLOCK_MONOTONIC
nanoseconds (``time.monotonic_ns()``, ``clock_gettime(CLOCK_MONOTONIC)``), which every process
of a host shares.

The stop and check records carry the commit protocol: the agent arms a stop step S (ARMED), each
rank acknowledges in its check record that it saw S and at which step (in time when that step
is below S), and once every rank of the job acknowledged in time the agent writes GO: every rank
then stops at S. A rank at S before GO waits for it (``docs/progress-page.md`` has the rules).
"""

from __future__ import annotations

import struct

MAGIC = b"NAPAGE1\n"
VERSION = 2
PAGE_SIZE = 4096

HEADER = struct.Struct("<8sIIIIQ")  # magic, version, page size, pid, stack signal, attached_ns
PID_OFFSET = 16
SIGNAL_OFFSET = 20
ATTACHED_OFFSET = 24

PROGRESS_OFFSET = 64
PROGRESS = struct.Struct("<qQQQ")  # step, progress_ns, count, check
PHASE_OFFSET = 96
PHASE = struct.Struct("<QQQQ")  # slot, phase_ns, compute_ns, check
STOP_OFFSET = 128
STOP = struct.Struct("<qqQQ")  # stop_step, state, serial, check
STOP_STEP = struct.Struct("<q")  # the stop record's first word alone
STOP_NONE = 0  # no stop step (with stop_step -1): none asked, or the one asked was cancelled
STOP_ARMED = 1  # stop_step is proposed: acknowledge it; a rank that reaches it waits
STOP_GO = 2  # every rank acknowledged in time: stop at stop_step
CHECK_OFFSET = 160
CHECK = struct.Struct("<qqqQ")  # seen, at, stopped, check

NAMES_OFFSET = 256
NAME_SLOTS = 16
NAME_SIZE = 32  # bytes per slot, a NUL included: names are at most 31 bytes of UTF-8
COMPUTE = "compute"  # the phase whose time straggler scores are made of

NO_STEP = -1

_MASK = (1 << 64) - 1
_K1 = 0x9E3779B97F4A7C15
_K2 = 0xC2B2AE3D27D4EB4F
_K3 = 0x165667B19E3779F9
_K4 = 0x27D4EB2F165667C5


def check(a: int, b: int, c: int) -> int:
    """The check word of a record ``(a, b, c)``: (a·K1 + b·K2 + c·K3 + K4) mod 2**64.

    Each word is taken as an unsigned 64-bit integer (a negative step as its two's complement).
    The multipliers are odd, so a record with any one word from an older write never matches,
    and two words changed together match only for differences no real step or time has.
    """
    return (a * _K1 + b * _K2 + c * _K3 + _K4) & _MASK


def clean_name(name: str) -> str:
    """A phase name as a page carries it: each character that is not printable (a control
    character such as a tab, a line or paragraph separator, a format character, a lone
    surrogate) as ``?``, then at most 31 bytes of UTF-8, cut at a character boundary.

    The one rule for names, applied where they enter: by the worker before it writes a name
    and by the agent after it reads one (a page may be written by any program), so no name
    reaches a message, a log line or a table with a control character in it.
    """
    if not name.isprintable():
        name = "".join(c if c.isprintable() else "?" for c in name)
    return name.encode("utf-8")[: NAME_SIZE - 1].decode("utf-8", "ignore")


def name_offset(slot: int) -> int:
    """Where phase-name slot ``slot`` (1..15) starts in the page."""
    if not 1 <= slot < NAME_SLOTS:
        raise ValueError(f"phase slot {slot} not in 1..{NAME_SLOTS - 1}")
    return NAMES_OFFSET + slot * NAME_SIZE
