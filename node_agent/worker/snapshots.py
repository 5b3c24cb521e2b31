"""In-memory snapshots of a rank's state: ``worker.snapshot(step)`` and ``worker.restore()``.

    from node_agent import worker

    r = worker.restore()                    # None: nothing to restore (a fresh job, or torchrun)
    if r is not None:
        state = torch.load(r.path)          # or: with r.open() as f: torch.load(f)
        start = r.step + 1
    for step in range(start, steps):
        train_step()
        if step % 100 == 0:
            with worker.snapshot(step) as f:
                torch.save(state, f)

Under node-agent each rank has a private directory in node-local memory (a tmpfs), named by
``NODE_AGENT_SNAPSHOT_DIR``. ``snapshot(step)`` writes ``<dir>/%020d.snap.part`` and, when the
block ends without an exception, renames it to ``<dir>/%020d.snap``: a ``.snap`` file is
always complete. Then it deletes the older ``.snap`` files of the directory but the newest
:data:`KEEP` by step, the steps named in ``<dir>/.pin`` (written by the agent) and the step just
written. An exception in the block removes the ``.part`` file and propagates; the snapshots
already there stay as they were. Writing more than ``NODE_AGENT_SNAPSHOT_LIMIT`` bytes into one
snapshot raises :class:`SnapshotTooLarge` at the write that crosses it (nothing past the limit
reaches memory) and abandons the snapshot the same way.

``restore()`` gives the snapshot of the step the rendezvous server chose for the whole job
(``NODE_AGENT_RESTORE_STEP``), or None when there is none to restore. When a step is chosen its
file must be there: :class:`SnapshotMissing` otherwise, since a rank that started afresh while
the others resumed would train a different model without any error.

Outside node-agent (``NODE_AGENT_SNAPSHOT_DIR`` unset or not a directory) ``snapshot(step)``
yields a file that counts and discards what is written, and ``restore()`` is None: a script
runs unchanged under torchrun, paying only for the serialisation. The variables are read at
each call (a few microseconds beside a snapshot). A bad step raises at the call, attached or
not, as ``progress()`` does.

Importing this module imports only ``errno`` beside what the worker module has loaded.
"""

from __future__ import annotations

import errno
import io
import os

from . import _MAX_STEP, _as_step

__all__ = [
    "KEEP",
    "Restored",
    "SnapshotCorrupt",
    "SnapshotFile",
    "SnapshotMissing",
    "SnapshotTooLarge",
    "restore",
    "snapshot",
]

DIR_VAR = "NODE_AGENT_SNAPSHOT_DIR"
LIMIT_VAR = "NODE_AGENT_SNAPSHOT_LIMIT"
RESTORE_VAR = "NODE_AGENT_RESTORE_STEP"
# The sha256 its owner announced for the snapshot this rank restores, set where the file came
# from another node (fetched, or a replica a peer pushed): restore() checks the file has it.
DIGEST_VAR = "NODE_AGENT_RESTORE_SHA256"
KEEP = 2  # complete snapshots a rank keeps after writing one (the pinned step aside)
SUFFIX = ".snap"
PART_SUFFIX = ".snap.part"
PIN_NAME = ".pin"
# Present while the rank's snapshots hold state every rank holds alike (``snapshot(step,
# replicated=True)``: data-parallel state): the agent may then restore any rank of a smaller or
# larger world from it (docs/snapshots.md). Removed by a snapshot written without the flag.
REPLICATED_NAME = ".replicated"
MAX_PINS = 4  # steps .pin may name (the agent writes two: the kept one and the one being copied)
DIGITS = 20  # every step below 2**63 in %020d
BUFFER_SIZE = 8 << 20  # few system calls for small records; larger writes go straight through
_NO_LIMIT = 1 << 64  # above any size a file can reach: the limit check never fires


class SnapshotTooLarge(OSError):
    """A snapshot outgrew the bytes node-agent gives one snapshot of this rank.

    An ``OSError`` (errno ``ENOSPC``) because it is the same failure as a full tmpfs: the
    memory for the file ran out. Code that already handles a failed write handles this one."""

    def __init__(self, step: int, limit: int, size: int) -> None:
        super().__init__(
            errno.ENOSPC,
            f"the snapshot of step {step} outgrew this rank's limit of {limit} bytes (a write "
            f"would have ended at byte {size}); the limit ({LIMIT_VAR}) comes from node-agent's "
            "--snapshot-memory: give snapshots more memory or save less",
        )
        self.step, self.limit, self.size = step, limit, size


class SnapshotMissing(RuntimeError):
    """The server chose a step to restore, and this rank has no complete snapshot of it (or
    one whose bytes are not the ones its owner announced: :class:`SnapshotCorrupt`)."""


class SnapshotCorrupt(SnapshotMissing):
    """This rank's snapshot of the restore step is not the file its owner made (its sha256
    differs from the one the owner announced): never loaded."""


def _sha256(path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def step_name(step: int) -> str:
    """The file name of the complete snapshot of ``step``."""
    return f"{step:0{DIGITS}d}{SUFFIX}"


def snapshot_step(name: str) -> int | None:
    """The step of a complete snapshot's file name; None for any other name."""
    digits = name[:DIGITS]
    if len(name) == DIGITS + len(SUFFIX) and name.endswith(SUFFIX) and digits.isascii() and digits.isdigit():
        return int(digits)
    return None


class SnapshotFile(io.BufferedIOBase):
    """The write-only binary file ``snapshot(step)`` yields: ``write``, ``tell``, ``seek``,
    ``flush`` (what ``torch.save``, ``pickle.dump`` and ``numpy.save`` use).

    Bytes go to a buffered writer over the ``.part`` file, or nowhere outside node-agent. The
    size check is an add and a compare per write, before the bytes are handed on."""

    def __init__(self, step: int, file: io.BufferedWriter[io.FileIO] | None, limit: int) -> None:
        super().__init__()
        self._step, self._file, self._limit = step, file, limit
        self._pos = 0
        self._put = file.write if file is not None else _discard
        self.too_large: SnapshotTooLarge | None = None  # set at the write that crossed the limit

    def write(self, b: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        # torch.save writes memoryviews; len() of one would count its items, not its bytes.
        n = b.nbytes if isinstance(b, memoryview) else len(b) if type(b) is bytes else memoryview(b).nbytes
        end = self._pos + n
        if end > self._limit:
            return self._over(end)
        self._put(b)
        self._pos = end
        return n

    def _over(self, end: int) -> int:
        # Raised once; later writes are dropped, so that a writer cleaning up after the error
        # (torch.save writes its zip's end record on the way out) does not bury it.
        if self.too_large is None:
            self.too_large = SnapshotTooLarge(self._step, self._limit, end)
            self._put = _discard
            raise self.too_large
        return 0

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos}.get(whence)
        if base is None:  # SEEK_END would need the size of a file that may hold holes
            raise io.UnsupportedOperation("a snapshot seeks from its start or the position only")
        pos = base + offset
        if pos < 0:
            raise ValueError(f"negative seek position {pos}")
        if self._file is not None and self.too_large is None:
            self._file.seek(pos)
        self._pos = pos
        return pos

    def flush(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.flush()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        super().close()

    def _discard_file(self) -> None:
        """Close without writing out the buffer: the file is being thrown away."""
        if self._file is not None:
            self._file.raw.close()  # a buffered writer over a closed raw file closes as a no-op
            self._file.close()
        super().close()


def _discard(b: object) -> int:
    return 0


class _Snapshot:
    """``with snapshot(step) as f:`` writes ``f`` into a ``.part`` file, renamed at a clean end."""

    __slots__ = ("_dir", "_file", "_replicated", "_step")

    def __init__(self, step: int, directory: str | None, replicated: bool = False) -> None:
        self._step, self._dir, self._replicated = step, directory, replicated
        self._file: SnapshotFile | None = None

    def __enter__(self) -> SnapshotFile:
        if self._file is not None:
            raise RuntimeError("a worker.snapshot() block is entered once")
        if self._dir is None:
            self._file = SnapshotFile(self._step, None, _NO_LIMIT)
        else:
            out = io.BufferedWriter(io.FileIO(self._part(), "w"), BUFFER_SIZE)  # closed at exit
            self._file = SnapshotFile(self._step, out, _limit())
        return self._file

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        f = self._file
        assert f is not None, "__exit__ without __enter__"
        if self._dir is None:
            f.close()
            return
        part = self._part()
        if exc_type is None and f.too_large is None:
            try:
                f.close()  # writes out the buffer: the file is complete once this returns
                # The mark first: the agent never sees this file under another file's mark.
                _mark(self._dir, self._replicated)
                os.rename(part, os.path.join(self._dir, step_name(self._step)))
            except BaseException:
                _abandon(f, part)
                raise
            prune(self._dir, self._step)
            return
        _abandon(f, part)
        if f.too_large is not None and exc is not f.too_large:
            # The block caught it, or the serialiser wrapped it in its own error: say what happened.
            raise f.too_large from exc

    def _part(self) -> str:
        assert self._dir is not None
        return os.path.join(self._dir, f"{self._step:0{DIGITS}d}{PART_SUFFIX}")


def _abandon(f: SnapshotFile, part: str) -> None:
    try:
        os.unlink(part)
    except FileNotFoundError:
        pass
    finally:
        f._discard_file()


def _mark(directory: str, replicated: bool) -> None:
    """The directory's mark says whether its snapshots hold state every rank holds alike."""
    mark = os.path.join(directory, REPLICATED_NAME)
    if replicated:
        if not os.path.exists(mark):
            os.close(os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600))
    else:
        try:
            os.unlink(mark)
        except FileNotFoundError:
            pass


def snapshot(step: int, *, replicated: bool = False) -> _Snapshot:
    """A context manager writing this rank's snapshot of ``step``: ``with worker.snapshot(step)
    as f: torch.save(state, f)``. The snapshot exists, complete, once the block ends without an
    exception; an earlier one of the same step is replaced.

    ``replicated=True`` says the state written is what every rank holds alike (plain data
    parallelism: DDP's model and optimizer): after the job shrinks or grows, the server may then
    restore every rank of the new world from one of these files, where snapshots of sharded or
    per-rank state restore at their own world size only."""
    if type(step) is not int or not 0 <= step <= _MAX_STEP:
        step = _as_step(step, "snapshot")
    return _Snapshot(step, _directory(), replicated is True)


class Restored:
    """The snapshot to restore: ``step`` (the job resumes after it) and ``path`` (a file in
    memory: ``torch.load(r.path, mmap=True)`` maps it rather than copying it); ``open()`` gives
    it as a binary file to read."""

    __slots__ = ("path", "step")

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def open(self) -> io.BufferedReader:
        return open(self.path, "rb")

    def __repr__(self) -> str:
        return f"Restored(step={self.step}, path={self.path!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Restored) and (self.step, self.path) == (other.step, other.path)

    def __hash__(self) -> int:
        return hash((self.step, self.path))


def restore() -> Restored | None:
    """This rank's snapshot of the step the job restores from; None when there is none to
    restore (no step chosen, or outside node-agent). Raises :class:`SnapshotMissing` when a
    step is chosen and this rank has no complete snapshot of it."""
    directory = os.environ.get(DIR_VAR)
    value = os.environ.get(RESTORE_VAR, "-1").strip()
    if not directory or value == "-1":
        return None
    if not (value.isascii() and value.isdigit()) or int(value) >> 63:
        raise RuntimeError(f"{RESTORE_VAR}={value!r} is not a step (a decimal integer, or -1 for none)")
    step = int(value)
    path = os.path.join(directory, step_name(step))
    if not os.path.isfile(path):
        why = "the directory is missing" if not os.path.isdir(directory) else "the file is missing"
        raise SnapshotMissing(
            f"the job restores from step {step}, but this rank has no snapshot of it: {path} "
            f"({why}); starting this rank afresh while the others resume would make the ranks "
            "diverge, so it stops instead"
        )
    expected = os.environ.get(DIGEST_VAR, "").strip().lower()
    if expected:
        got = _sha256(path)
        if got != expected:
            raise SnapshotCorrupt(
                f"the job restores from step {step}, but this rank's snapshot of it ({path}) is not "
                f"the file its owner made (sha256 {got}, the owner announced {expected}): not loaded"
            )
    return Restored(step, path)


def prune(directory: str, written: int | None = None) -> list[int]:
    """Delete the complete snapshots of ``directory`` but the newest :data:`KEEP` by step, the
    pinned steps and ``written``; the steps deleted. Other files are never touched."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    steps = sorted((s for s in map(snapshot_step, names) if s is not None), reverse=True)
    keep = set(steps[:KEEP])
    keep.update(_pinned(directory))
    if written is not None:
        keep.add(written)
    deleted = []
    for s in steps[KEEP:]:
        if s in keep:
            continue
        try:
            os.unlink(os.path.join(directory, step_name(s)))
        except FileNotFoundError:  # the agent pruned it first
            continue
        deleted.append(s)
    return deleted


def _pinned(directory: str) -> set[int]:
    """The steps in ``<directory>/.pin`` (decimals separated by white space, at most
    ``MAX_PINS``); none when it is missing or unreadable."""
    try:
        with open(os.path.join(directory, PIN_NAME), "rb") as f:
            words = f.read(MAX_PINS * (DIGITS + 1)).split()
    except OSError:
        return set()
    return {int(w) for w in words[:MAX_PINS] if w.isdigit() and len(w) <= DIGITS}


def _directory() -> str | None:
    """The rank's snapshot directory, or None outside node-agent."""
    directory = os.environ.get(DIR_VAR)
    return directory if directory and os.path.isdir(directory) else None


def _limit() -> int:
    value = os.environ.get(LIMIT_VAR, "").strip()
    return int(value) if value.isascii() and value.isdigit() else _NO_LIMIT
