"""Report a worker's training progress to node-agent: ``from node_agent import worker``.

    for step in range(start, steps):
        with worker.phase("compute"):
            loss = train_step(batch)
        worker.progress(step)          # this rank finished `step`
        if worker.should_stop():       # the job changes size: every rank stops at this step
            save(step)                 # e.g. torch.distributed.checkpoint, resumed from step + 1
            return                     # exit 0: a commit, not a failure

    with worker.phase("checkpoint"):   # a long checkpoint is not a hang
        save(...)

Under node-agent each rank has a progress page (a 4096-byte file, :mod:`.layout`) whose path
is in ``NODE_AGENT_PROGRESS_PAGE``; this module maps it on its first call and writes into it,
and the agent polls the pages to tell a hang from a slow step. Outside node-agent (the variable
unset, the file missing or not a page) every call is a no-op, for good.

Costs and guarantees:

* ``progress(step)`` is one ``clock_gettime`` and one store of a 32-byte record: well under a
  microsecond, no system call, no lock, no I/O; it never blocks whatever the agent does.
* Nothing here raises into the training loop except a bad argument, at the call, attached or
  not (so a script fails the same under torchrun): ``progress`` takes a non-negative integer
  below 2**63 (``TypeError`` for a bool, a float or anything without ``__index__``;
  ``ValueError`` for a negative or too large one; numpy or 0-dim torch integers are taken);
  ``phase`` takes a non-empty ``str`` without NUL.
* On attaching, ``faulthandler`` is armed on ``SIGRTMIN + 4``: that signal makes the process
  append the stacks of all its threads to ``<page>.stacks`` and carry on, so the agent can show
  where a hung rank is without killing it.
* Importing this module imports only ``mmap``, ``struct`` and ``faulthandler`` beside what every
  interpreter has loaded (no agent code, no asyncio, not even ``signal``'s enums), so a worker
  pays nothing for it.
* A forked child (a DataLoader worker) detaches: its calls are no-ops and never write the
  parent's page. Only the first process to attach a page writes it: a process started with the
  same environment later (``spawn``) finds the page taken and stays a no-op.

Phases nest: leaving one restores the phase around it. Time inside "compute" (forward,
backward, optimizer step: the work whose speed straggler scores compare) is added to the
page's ``compute_ns`` when the outermost "compute" phase is left. A page has 15 name slots:
slot 1 is "compute" (named on attaching), the next 13 distinct names get one each, and every
later name, like "other" itself, is reported as "other" (slot 15). Names are cut to 31 bytes of
UTF-8 at a character boundary, and a character that is not printable (a tab, a newline, any
control character) is written as "?" (two names equal once so cleaned share a slot). Phases are
per process: use them from the training thread.

``snapshot(step)`` and ``restore()`` keep a rank's state in node-local memory across a restart
(:mod:`.snapshots`, ``docs/snapshots.md``); they are imported at their first use.

``should_stop()`` lets a planned change of the job (a node joins, drains or is replaced) cost
no work: instead of being killed wherever it is, every rank stops at the same step S, saves a
checkpoint and returns, and the next round resumes from S. Call it every step, right after
``progress(step)``, on every rank, from the training thread. It is False outside node-agent and
while no stop is asked (one read of the page, no system call: about as cheap as ``progress``).
The server picks S ahead of every rank; the agent writes it into the pages as *armed*, and
each rank acknowledges it at its next call with the step it is at. If every rank saw S before
reaching it, the agent confirms S (*go*) and every rank gets True at S and at every later
call. A rank that reaches S before the confirmation waits inside ``should_stop()`` (re-reading
the page every millisecond) until it comes, usually within a few agent polls, or until S is
called off or moved (then False). A rank that was already at or past S when it first saw it
never stops at S; the server then picks a later step. A job where some rank never calls
``should_stop()`` is restarted as before.
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import time

try:  # the C module: ``signal`` would import enum and more for nothing
    from _signal import (  # type: ignore[import-not-found, unused-ignore]
        SIG_DFL,
        SIG_IGN,
        SIGRTMIN,
        getsignal,
    )
    from _signal import signal as _set_signal  # type: ignore[import-not-found, unused-ignore]
except ImportError:  # not CPython
    from signal import SIG_DFL, SIG_IGN, SIGRTMIN, getsignal
    from signal import signal as _set_signal

from . import layout as _layout

TYPE_CHECKING = False  # typing's would import typing; type checkers know the name
if TYPE_CHECKING:
    from .inplace import Interrupted, run
    from .snapshots import Restored, SnapshotCorrupt, SnapshotMissing, SnapshotTooLarge, restore, snapshot

__all__ = [
    "Interrupted",
    "Restored",
    "SnapshotCorrupt",
    "SnapshotMissing",
    "SnapshotTooLarge",
    "attached",
    "phase",
    "progress",
    "restore",
    "run",
    "should_stop",
    "snapshot",
]
# Snapshots (.snapshots) and restarts in place (.inplace) are imported at their first use: a
# script that takes none pays nothing.
_SNAPSHOT_NAMES = frozenset(
    {"Restored", "SnapshotCorrupt", "SnapshotMissing", "SnapshotTooLarge", "restore", "snapshot"}
)
_INPLACE_NAMES = frozenset({"Interrupted", "run"})

PAGE_VAR = "NODE_AGENT_PROGRESS_PAGE"
# A real-time signal nobody else uses: it asks for the stacks of all threads. Its default
# action kills, so the agent sends it only to a pid whose page says it is armed, and an armed
# process ignores it once faulthandler lets it go (see _ignored_when_let_go).
STACK_SIGNAL = int(SIGRTMIN) + 4
OTHER = "other"  # the name of the last slot, shared by every name past the first 14
_MAX_STEP = (1 << 63) - 1

# Module globals keep the hot path to a few fast global loads (no attribute lookups).
_on: bool | None = None  # None: not tried yet; True: attached; False: a no-op for good
_buf: mmap.mmap | bytearray = bytearray(_layout.PAGE_SIZE)  # a scratch page until attached
_pack = _layout.PROGRESS.pack_into
_pack_phase = _layout.PHASE.pack_into
_unpack_stop = _layout.STOP.unpack_from
_unpack_stop_step = _layout.STOP_STEP.unpack_from
_pack_check = _layout.CHECK.pack_into
_sleep = time.sleep
_now = time.monotonic_ns
_P = _layout.PROGRESS_OFFSET
_PH = _layout.PHASE_OFFSET
_ST = _layout.STOP_OFFSET
_CK = _layout.CHECK_OFFSET
_K1, _K2, _K3, _K4, _M = _layout._K1, _layout._K2, _layout._K3, _layout._K4, _layout._MASK
_count = 0
_step = _layout.NO_STEP
_pid = 0
_stacks_fd = -1
_ignoring = False  # the stack signal ignored by us (_ignored_when_let_go), not by the user

# The commit protocol (see should_stop). The hot path compares the stop record's first word
# with _fast: (-1,) while this rank knows no stop step, None (every call takes the slow path)
# before the first call, while a stop step is known and once stopped. A stop step of -1 is
# "nothing asked" whatever the other words: read from a record halfway written, it means the
# write had not reached it, the same as reading just before the write, and False is right then
# (a step armed meanwhile is acknowledged at the next call).
_NONE_STOP = (_layout.NO_STEP,)
_fast: tuple[int] | None = None
_checked = False  # the first should_stop() call wrote the check record
_seen = _layout.NO_STEP  # the armed stop step last acknowledged (-1: none)
_seen_at = _layout.NO_STEP  # this rank's step when it acknowledged _seen
_late = False  # _seen was first seen at a step >= _seen: this rank never stops at it
_stopped = _layout.NO_STEP  # the step should_stop() returned True at
_TORN_TRIES = 100  # immediate re-reads of a torn stop record (a write takes nanoseconds)
_WAIT_S = 0.001  # the re-read interval of a rank waiting at its stop step for GO

# Phases: the current slot and when it was entered, the enclosing ones, compute time.
_slots: dict[str, int] = {}  # name as given -> slot
_slot = 0
_since = 0
_outer: list[tuple[int, int]] = []
_OTHER_SLOT = _layout.NAME_SLOTS - 1
_COMPUTE_SLOT = 1  # "compute" is named when the page is attached: its time must always count
_compute_depth = 0
_compute_from = 0
_compute_ns = 0


def progress(step: int) -> None:
    """This rank finished ``step`` (a non-negative int): one store into the page, no I/O."""
    global _count, _step
    if type(step) is not int or step < 0 or step > _MAX_STEP:
        step = _as_step(step)
    if _on:
        c = _count = _count + 1
        t = _now()
        _pack(_buf, _P, step, t, c, (step * _K1 + t * _K2 + c * _K3 + _K4) & _M)
        _step = step
    elif _on is None:
        _attach()
        if _on:
            progress(step)


def _as_step(step: object, caller: str = "progress") -> int:
    """The slow path: an int subclass or an integer-like object, or the argument's error
    naming ``worker.<caller>()``."""
    if isinstance(step, bool) or not hasattr(type(step), "__index__"):
        raise TypeError(f"worker.{caller}() takes an int step, not {type(step).__name__}")
    value = type(step).__index__(step)  # type: ignore[attr-defined]
    if not 0 <= value <= _MAX_STEP:
        raise ValueError(f"worker.{caller}() takes a step in 0..2**63-1, not {value}")
    return int(value)


class _Phase:
    """``with phase(name):`` (one instance per name, reused: it holds no per-use state)."""

    __slots__ = ("_slot", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._slot = 0  # interned on first enter while attached

    def __enter__(self) -> _Phase:
        global _slot, _since, _compute_depth, _compute_from
        if not _on:
            if _on is None:
                _attach()
            if not _on:
                return self
        slot = self._slot or _intern(self)
        t = _now()
        _outer.append((_slot, _since))
        _slot, _since = slot, t
        if slot == _COMPUTE_SLOT:
            if not _compute_depth:
                _compute_from = t
            _compute_depth += 1
        _pack_phase(_buf, _PH, slot, t, _compute_ns, (slot * _K1 + t * _K2 + _compute_ns * _K3 + _K4) & _M)
        return self

    def __exit__(self, *exc: object) -> None:
        global _slot, _since, _compute_depth, _compute_ns
        if not _on or not _outer:
            return
        if _slot == _COMPUTE_SLOT:
            _compute_depth -= 1
            if not _compute_depth:
                _compute_ns += _now() - _compute_from
        _slot, _since = _outer.pop()
        slot, since, total = _slot, _since, _compute_ns
        _pack_phase(_buf, _PH, slot, since, total, (slot * _K1 + since * _K2 + total * _K3 + _K4) & _M)


_phases: dict[str, _Phase] = {}


def phase(name: str) -> _Phase:
    """A context manager: the rank is in phase ``name`` ("compute", "checkpoint", "eval",
    "setup" or any other) until the block ends; phases nest."""
    p = _phases.get(name)
    if p is None:
        if type(name) is not str:
            raise TypeError(f"worker.phase() takes a str name, not {type(name).__name__}")
        if not name or "\0" in name:
            raise ValueError(f"worker.phase() takes a non-empty name without NUL, not {name!r}")
        if len(_phases) >= 1024:  # a program making up names: keep the cache bounded
            _phases.clear()
        p = _phases[name] = _Phase(name)
    return p


def should_stop() -> bool:
    """Whether this rank stops now: call it every step, right after ``progress(step)``.

    False outside node-agent, and whenever no stop is asked: then it is one read of the page,
    no system call. True on every rank of the job at the same step S, the one the server chose
    for a commit; it stays True after that. A rank that reaches S before every rank has
    acknowledged S waits here (a few ms, rarely more than the agents' round trip) until the
    stop is confirmed (True) or called off (False). Called only every few steps, it is True at
    the first call at or past S: call it at the same steps on every rank, so that all stop at
    one step (the README's "commit points" has the rule).
    """
    if _on:
        if _unpack_stop_step(_buf, _ST) == _fast:
            return False
        return _decide()
    if _on is None:
        _attach()
        if _on:
            return _decide()
    return False


def _read_stop() -> tuple[int, int] | None:
    """The stop record as (stop step, state), (-1, STOP_NONE) for none; None while it reads
    torn (or holds a state this layout does not know)."""
    for _ in range(_TORN_TRIES):
        step, state, serial, chk = _unpack_stop(_buf, _ST)
        if chk != (step * _K1 + state * _K2 + serial * _K3 + _K4) & _M:
            continue
        if state == _layout.STOP_NONE or step < 0:
            return _layout.NO_STEP, _layout.STOP_NONE
        if state == _layout.STOP_ARMED or state == _layout.STOP_GO:
            return step, state
        return None
    return None


def _write_check(seen: int, at: int, stopped: int) -> None:
    _pack_check(_buf, _CK, seen, at, stopped, (seen * _K1 + at * _K2 + stopped * _K3 + _K4) & _M)


def _decide() -> bool:
    """should_stop() off the hot path: the first call, a stop step known, a torn record."""
    global _fast, _checked, _seen, _seen_at, _late, _stopped
    if _stopped >= 0:
        return True
    if not _checked:  # the first call: tell the agent this rank consults the page
        _write_check(_layout.NO_STEP, _layout.NO_STEP, _layout.NO_STEP)
        _checked, _fast = True, _NONE_STOP
    step = _step
    while True:
        rec = _read_stop()
        if rec is None:
            # Unreadable: never taken for "no stop" where that could be wrong, i.e. at or past
            # a step acknowledged in time (the record may say GO). Before it, False is safe.
            if _seen >= 0 and not _late and step >= _seen:
                _sleep(_WAIT_S)
                continue
            return False
        stop, state = rec
        if state == _layout.STOP_NONE:
            if _seen >= 0:  # called off: forget S, so that S armed again is acknowledged again
                _seen = _seen_at = _layout.NO_STEP
                _late, _fast = False, _NONE_STOP
                _write_check(_layout.NO_STEP, _layout.NO_STEP, _layout.NO_STEP)
            return False
        if stop != _seen:  # a new stop step: acknowledge it, with the step this rank is at
            _seen, _seen_at, _late, _fast = stop, step, step >= stop, None
            _write_check(stop, step, _layout.NO_STEP)
            return False  # in time: the step is below it; late: this rank never stops at it
        if _late or step < stop:
            return False
        if state == _layout.STOP_GO:
            _stopped = step
            _write_check(stop, _seen_at, step)
            return True
        _sleep(_WAIT_S)  # at the armed step: wait for GO, a cancel or another step


def attached() -> bool:
    """Whether this process reports to node-agent (attaches on first use)."""
    if _on is None:
        _attach()
    return bool(_on)


class _PhaseStack:
    """The phases a callback entered, for hooks that come as separate begin and end calls (the
    Lightning and Hugging Face integrations): a phase left by name leaves those inside it."""

    __slots__ = ("entered",)

    def __init__(self) -> None:
        self.entered: list[_Phase] = []

    def push(self, name: str) -> None:
        p = phase(name)
        p.__enter__()
        self.entered.append(p)

    def leave(self, name: str) -> None:
        """Leave phase ``name`` (and any inside it); nothing if it was not entered."""
        if any(p.name == name for p in self.entered):
            while self.entered:
                p = self.entered.pop()
                p.__exit__(None, None, None)
                if p.name == name:
                    return

    def clear(self) -> None:
        while self.entered:
            self.entered.pop().__exit__(None, None, None)

    def __contains__(self, name: str) -> bool:
        return any(p.name == name for p in self.entered)


def page_name(name: str) -> str:
    """``name`` as a page stores it (:func:`.layout.clean_name`): a character that is not
    printable as "?", at most 31 bytes of UTF-8, cut at a character boundary."""
    return _layout.clean_name(name)


def _intern(p: _Phase) -> int:
    """The slot of ``p``'s name, writing the name into the page the first time (before any
    phase record names the slot, as the layout requires)."""
    stored = page_name(p.name)
    slot = _slots.get(stored)
    if slot is None:
        free = 1 + sum(1 for s in _slots.values() if s != _OTHER_SLOT)
        if stored == OTHER or free >= _OTHER_SLOT:
            stored = OTHER
            slot = _slots.get(OTHER)
        if slot is None:
            slot = _OTHER_SLOT if stored == OTHER else free
            _write_name(slot, stored)
            _slots[stored] = slot
    p._slot = slot
    return slot


def _write_name(slot: int, name: str) -> None:
    off = _layout.name_offset(slot)
    _buf[off : off + _layout.NAME_SIZE] = name.encode("utf-8", "surrogatepass").ljust(
        _layout.NAME_SIZE, b"\0"
    )


def _attach() -> None:
    """Map the page named by the environment, once; any problem leaves the module a no-op."""
    global _on, _buf, _pid, _stacks_fd
    _on = False
    path = os.environ.get(PAGE_VAR)
    if not path:
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return
    try:
        # A page shorter than its size would make writes past its end fault (SIGBUS).
        if os.fstat(fd).st_size != _layout.PAGE_SIZE:
            return
        buf = mmap.mmap(fd, _layout.PAGE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError):
        return
    finally:
        os.close(fd)
    magic, version, size, pid, _sig, _at = _layout.HEADER.unpack_from(buf, 0)
    if (magic, version, size) != (_layout.MAGIC, _layout.VERSION, _layout.PAGE_SIZE) or pid:
        buf.close()  # not a page, or another process reports through it already
        return
    sig = 0
    try:
        _stacks_fd = os.open(path + ".stacks", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        _ignored_when_let_go()
        faulthandler.register(STACK_SIGNAL, file=_stacks_fd, all_threads=True, chain=False)
        sig = int(STACK_SIGNAL)
    except (OSError, ValueError, RuntimeError):  # no stacks on demand; progress still works
        if _stacks_fd >= 0:
            os.close(_stacks_fd)
            _stacks_fd = -1
    _buf, _pid = buf, os.getpid()
    _write_name(_COMPUTE_SLOT, _layout.COMPUTE)
    _slots[_layout.COMPUTE] = _COMPUTE_SLOT
    _layout.HEADER.pack_into(buf, 0, magic, version, size, 0, sig, _now())
    buf[_layout.PID_OFFSET : _layout.PID_OFFSET + 4] = _pid.to_bytes(4, "little")  # last: armed
    _on = True


def _ignored_when_let_go() -> None:
    """The stack signal ignored, before faulthandler takes it: faulthandler puts back the
    disposition it found whenever it lets the signal go, and the default one kills.

    It lets it go in the interpreter's finalization, after the last Python code ran and before
    the process is gone (with torch loaded, its libraries' teardown makes that a window of
    many milliseconds), and in a forked child (``_detach_in_child``). The page says "armed" to
    the end, and the agent may have read it just before: its stack request then found no
    handler and killed a rank that was exiting 0 (issue 48, item 1: ``exitcode -38``, a
    finished job failed). Ignored instead, a request at any moment of an armed process's life
    is harmless. Only a signal still at its default is changed (a handler of the user's is
    theirs), and only from the main thread, the one place Python lets us set it (elsewhere the
    window stays as it was)."""
    global _ignoring
    try:
        if getsignal(STACK_SIGNAL) == SIG_DFL:
            _set_signal(STACK_SIGNAL, SIG_IGN)
            _ignoring = True
    except (ValueError, OSError):  # not the main thread (ValueError), or no such signal
        pass


def _detach_in_child() -> None:
    """After fork, in the child: never write the parent's page, never answer its signal."""
    global _on, _buf
    if _on:
        _on, _buf = False, bytearray(_layout.PAGE_SIZE)
        _outer.clear()
        try:
            faulthandler.unregister(STACK_SIGNAL)
        except (ValueError, RuntimeError):
            pass
    elif _on is None:
        _on = False  # the parent never attached: a child must not take its page either


def _reset() -> None:
    """Forget the page, as a fresh process would (tests attach and detach in one process)."""
    global _on, _buf, _count, _step, _pid, _stacks_fd, _slot, _since
    global _compute_depth, _compute_from, _compute_ns
    global _fast, _checked, _seen, _seen_at, _late, _stopped, _ignoring
    if _on:
        faulthandler.unregister(STACK_SIGNAL)
        if isinstance(_buf, mmap.mmap):
            _buf.close()
    if _ignoring:
        _ignoring = False
        try:
            _set_signal(STACK_SIGNAL, SIG_DFL)
        except (ValueError, OSError):
            pass
    if _stacks_fd >= 0:
        os.close(_stacks_fd)
    _on, _buf = None, bytearray(_layout.PAGE_SIZE)
    _count, _step, _pid, _stacks_fd = 0, _layout.NO_STEP, 0, -1
    _slot = _since = _compute_depth = _compute_from = _compute_ns = 0
    _fast, _checked, _late = None, False, False
    _seen = _seen_at = _stopped = _layout.NO_STEP
    _slots.clear()
    _outer.clear()
    for p in _phases.values():
        p._slot = 0


def _stopped_at_commit() -> bool:
    """``should_stop()`` said True in this round: the attempt ended at a commit point."""
    return _stopped >= 0


def _rebind() -> None:
    """A process restarting in place (:mod:`.inplace`) takes the next round's page: the last
    one let go, everything it counted forgotten, the stack signal still ignored while no
    handler holds it (a request between the two is harmless), then the new page attached."""
    global _ignoring
    keep = _ignoring
    _ignoring = False  # _reset must not put the default (killing) disposition back
    _reset()
    _ignoring = keep
    _attach()


def __getattr__(name: str) -> object:
    if name in _INPLACE_NAMES:
        from . import inplace

        for n in _INPLACE_NAMES:
            globals()[n] = getattr(inplace, n)
        return globals()[name]
    if name in _SNAPSHOT_NAMES:
        from . import snapshots

        for n in _SNAPSHOT_NAMES:  # bound here: later uses are plain global lookups
            globals()[n] = getattr(snapshots, n)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


os.register_at_fork(after_in_child=_detach_in_child)
