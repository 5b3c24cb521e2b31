"""The agent's side of the progress pages (layout: :mod:`node_agent.worker.layout`).

The agent creates each rank's page before starting the worker (:func:`create_page`), reads it
every poll (:class:`Page`, :class:`PageSet`), writes its stop record for a commit (ARMED, GO or
none: :meth:`Page.write_stop`; each rank acknowledges in its check record, read as the
sample's ``checks``, ``seen``, ``seen_at`` and ``stopped``), and reads what the worker's stacks
file gained after a stack signal (:func:`read_stacks_since`).

The agent reads a page with ``pread`` rather than through a mapping: a worker may truncate or
replace its file (it runs the user's code), and a read past the end of a shrunk mapping kills
the reader with SIGBUS; a short ``pread`` is only a bad page. A read costs one system call
(about a microsecond), nothing beside a poll every 50 ms or more. The worker maps its page, so
its writes cost no system call.

A page that is not one (wrong magic, version or size, too short, gone) reads as None, as does
a page no worker attached yet; a record caught halfway through a write (its check word does not
match) is read again, up to :data:`READ_TRIES` times within the call, then reads as None. No
read raises.

A page is written by the user's process (or by a C++ or Rust trainer following
``docs/progress-page.md``), so every value read is checked here, where it enters the agent: a
whole record whose value the layout does not allow (a negative step, a phase slot past 15, a
stop step below -1 in the check record) makes the page *bad* (:class:`BadPage`, from
:meth:`Page.check`; ``read`` gives None), and phase names are cleaned
(:func:`~node_agent.worker.layout.clean_name`). What a sample holds is then within the bounds
of the messages built from it.
"""

from __future__ import annotations

import os

from edge.atomic_write import replace_file

from ..machine.events import BadPage, RankSample
from ..worker import layout as L

__all__ = [
    "BadPage",
    "Page",
    "PageSet",
    "RankSample",
    "create_page",
    "read_page",
    "read_stacks_since",
    "write_stop",
]

READ_TRIES = 3
STACKS_READ_MAX = 1 << 20  # bytes of a stacks file read per call
# The bytes a read needs: header, the four records and the phase names.
_SPAN = L.NAMES_OFFSET + L.NAME_SLOTS * L.NAME_SIZE
_ZERO_RECORD = (0, 0, 0, 0)


def page_bytes() -> bytes:
    """A fresh page: the header with no writer, a stop record asking nothing, everything else
    zero (the check record too: never written)."""
    page = bytearray(L.PAGE_SIZE)
    L.HEADER.pack_into(page, 0, L.MAGIC, L.VERSION, L.PAGE_SIZE, 0, 0, 0)
    L.STOP.pack_into(page, L.STOP_OFFSET, *_stop_record(L.NO_STEP, L.STOP_NONE))
    return bytes(page)


def _stop_record(step: int, state: int) -> tuple[int, int, int, int]:
    return step, state, 0, L.check(step, state, 0)


def create_page(path: str) -> None:
    """Create the page at ``path`` (mode 0600) for a worker about to start.

    An existing file is replaced, not rewritten: the new file is written beside it and renamed
    over it, so a process still mapping the old one never sees it shrink or change.
    """
    replace_file(path, page_bytes(), mode=0o600)


def _sample(data: bytes) -> RankSample | BadPage | None:
    """A sample from a page's first bytes, None (not a page, not attached, torn), or BadPage."""
    if len(data) < _SPAN:
        return None
    magic, version, size, pid, sig, attached_ns = L.HEADER.unpack_from(data, 0)
    if magic != L.MAGIC or version != L.VERSION or size != L.PAGE_SIZE or not pid:
        return None
    step, progress_ns, count, chk = rec = L.PROGRESS.unpack_from(data, L.PROGRESS_OFFSET)
    if rec == _ZERO_RECORD:
        step = L.NO_STEP  # no progress() yet
    elif chk != L.check(step, progress_ns, count):
        return None
    elif step < 0:
        return BadPage(f"step {step} in its progress record (steps are 0 or more)")
    slot, phase_ns, compute_ns, chk = rec = L.PHASE.unpack_from(data, L.PHASE_OFFSET)
    if rec != _ZERO_RECORD and chk != L.check(slot, phase_ns, compute_ns):
        return None
    if slot >= L.NAME_SLOTS:
        return BadPage(f"phase slot {slot} in its phase record (slots are 0 to {L.NAME_SLOTS - 1})")
    name = ""
    if slot:
        off = L.name_offset(slot)
        raw = data[off : off + L.NAME_SIZE - 1].split(b"\0", 1)[0]
        name = L.clean_name(raw.decode("utf-8", "replace"))
    seen, seen_at, stopped, chk = rec = L.CHECK.unpack_from(data, L.CHECK_OFFSET)
    checks = rec != _ZERO_RECORD
    if not checks:
        seen = seen_at = stopped = L.NO_STEP  # should_stop() never called
    elif chk != L.check(seen, seen_at, stopped):
        return None
    elif min(seen, seen_at, stopped) < L.NO_STEP:
        return BadPage(f"steps {seen}, {seen_at}, {stopped} in its check record (each -1 or more)")
    return RankSample(
        step=step,
        progress_ns=progress_ns,
        count=count,
        phase=name,
        phase_ns=phase_ns,
        compute_ns=compute_ns,
        pid=pid,
        stack_signal=sig,
        attached_ns=attached_ns,
        checks=checks,
        seen=seen,
        seen_at=seen_at,
        stopped=stopped,
    )


class Page:
    """One rank's page, opened once: :meth:`read` every poll, :meth:`write_stop` when asked.

    Opening never raises: a page that cannot be opened reads as None (and cannot be stopped).
    """

    __slots__ = ("_fd", "path")

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            self._fd = -1

    def read(self) -> RankSample | None:
        """The page's current sample; None when not attached, not a page, bad or torn thrice."""
        sample = self.check()
        return sample if isinstance(sample, RankSample) else None

    def check(self) -> RankSample | BadPage | None:
        """As :meth:`read`, but a bad page says why (:class:`BadPage`)."""
        if self._fd < 0:
            return None
        for _ in range(READ_TRIES):
            try:
                data = os.pread(self._fd, _SPAN, 0)
            except OSError:
                return None
            sample = _sample(data)
            if sample is not None or not _torn(data):
                return sample
        return None

    def write_stop(self, step: int, state: int) -> bool:
        """Write the stop record: ``(S, STOP_ARMED)`` proposes stop step S, ``(S, STOP_GO)``
        confirms it, ``(-1, STOP_NONE)`` asks nothing (a cancel). One ``pwrite`` of the whole
        record. False when the page could not be written; ValueError for a record that is not
        one of those (nothing is written)."""
        _check_stop(step, state)
        if self._fd < 0:
            return False
        data = L.STOP.pack(*_stop_record(step, state))
        try:
            return os.pwrite(self._fd, data, L.STOP_OFFSET) == len(data)
        except OSError:
            return False

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Page:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_stop(step: int, state: int) -> None:
    if type(step) is not int or not L.NO_STEP <= step < 1 << 63:
        raise ValueError(f"stop step {step!r} not an int in -1..2**63-1")
    if type(state) is not int or state not in (L.STOP_NONE, L.STOP_ARMED, L.STOP_GO):
        raise ValueError(f"stop state {state!r} not STOP_NONE, STOP_ARMED or STOP_GO")
    if (step == L.NO_STEP) != (state == L.STOP_NONE):
        raise ValueError(f"stop step {step} with state {state}: step -1 goes with STOP_NONE only")


def _torn(data: bytes) -> bool:
    """Whether a page that read as None might read otherwise a moment later (a record's check
    failed while the header is a writer's): worth another read."""
    if len(data) < _SPAN:
        return False
    magic, version, size, pid, _sig, _at = L.HEADER.unpack_from(data, 0)
    return magic == L.MAGIC and version == L.VERSION and size == L.PAGE_SIZE and pid != 0


class PageSet:
    """The pages of one round's local ranks, opened once and read together."""

    __slots__ = ("pages",)

    def __init__(self, paths: list[str] | tuple[str, ...]) -> None:
        self.pages = tuple(Page(p) for p in paths)

    def read(self) -> tuple[RankSample | None, ...]:
        return tuple(p.read() for p in self.pages)

    def check(self) -> tuple[RankSample | BadPage | None, ...]:
        return tuple(p.check() for p in self.pages)

    def write_stop(self, step: int, state: int) -> None:
        """Write the stop record of every page (see :meth:`Page.write_stop`); a page that cannot
        be written is skipped (its rank never acknowledges, which the caller sees)."""
        _check_stop(step, state)
        for p in self.pages:
            p.write_stop(step, state)

    def close(self) -> None:
        for p in self.pages:
            p.close()

    def __enter__(self) -> PageSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_page(path: str) -> RankSample | None:
    """One read of the page at ``path`` (opens and closes it; a poll loop keeps a :class:`Page`)."""
    with Page(path) as page:
        return page.read()


def write_stop(path: str, step: int, state: int) -> bool:
    """Write the stop record of the page at ``path`` (see :meth:`Page.write_stop`)."""
    _check_stop(step, state)
    with Page(path) as page:
        return page.write_stop(step, state)


def read_stacks_since(path: str, offset: int, limit: int = STACKS_READ_MAX) -> tuple[str, int]:
    """What the stacks file ``path`` gained past ``offset``: (text, the offset to pass next).

    At most ``limit`` bytes are read (the rest waits for the next call). A file shorter than
    ``offset`` was replaced: it is read from its start. A missing file gained nothing.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return "", offset
    try:
        size = os.fstat(fd).st_size
        if size < offset:
            offset = 0
        data = os.pread(fd, max(0, min(limit, size - offset)), offset)
    except OSError:
        return "", offset
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace"), offset + len(data)
