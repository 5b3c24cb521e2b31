r"""The console side of the workers' output: what the supervisor writes to the agent's terminal,
how a rank's lines are framed there, and the pty that lets a worker see a terminal on stderr.

How it works.

* Where torchrun hands the worker its own stdout/stderr, so do we: a stream that goes to the
  console unprefixed and to no file reaches the worker as the agent's own file descriptor
  (stdout) or, for stderr, as a pty slave when the agent's stderr is a terminal (the agent reads
  the master, writes every chunk to its stderr at once and keeps the tail for the failure
  report).  ``Console.fileno()`` says whether that is possible: only a genuine file object
  (``io.FileIO``, a buffered writer, a ``TextIOWrapper``) with a working ``fileno()`` qualifies;
  ``io.StringIO``, a test's capture or Jupyter's stream (whose ``fileno()`` names the kernel's
  real terminal, not the notebook) get the bytes through their ``write`` instead.
* Everything that passes through the agent is written at once, never held for its newline, so
  progress bars and prompts show as they are drawn.  ``ConsoleFramer`` is the one place that
  decides how such writes are framed on one console:
  - a prefixed writer (``--tee``) gets its prefix at each line start that has content: after
    ``\n``, and after a ``\r`` that is not part of ``\r\n``, so a progress bar redraws in place,
    prefix included (torchrun's text-mode tail turns each redraw into a line of its own).  An
    empty line gets a prefix too, as in torchrun; a ``\r`` right at a line start gets none;
  - a partial line is written at once; its continuation gets no second prefix;
  - a line begun by one writer is never continued by another when either of them is prefixed:
    the newcomer first ends that line with ``\n``.  So every console line of a prefixed rank
    carries that rank's prefix, and an interrupted partial line resumes, prefixed, on a line
    of its own (the ``\n`` it resumes with is dropped: the break already ended that line).
    Unprefixed writers after unprefixed ones are passed on exactly (torchrun's plain look:
    their bytes are the workers' bytes);
  - when a prefixed writer ends on a partial line, the line is ended (``end``); before a line
    of its own the agent can end whatever partial line a worker left (``break_line``).
* ``LineFilter`` is ``--duplicate-stdout-filters``/``--duplicate-stderr-filters``: the lines of
  a tee'd stream that contain any of the strings, prefixed, written whole to the attempt's
  ``filtered_stdout.log``/``filtered_stderr.log``.  As in torchrun's text-mode reader, ``\r``,
  ``\r\n`` and ``\n`` all end a line and each line is written ending in ``\n``.
"""

from __future__ import annotations

import codecs
import io
import os
import re
from collections.abc import Callable, Iterable
from typing import BinaryIO, TextIO

__all__ = ["FILTER_LINE_MAX", "Console", "ConsoleFramer", "LineFilter", "open_pty"]

# A filtered line is judged whole up to this size; a longer one is judged by its first part and
# the rest of it follows that verdict.
FILTER_LINE_MAX = 64 * 1024

_EOL = re.compile(rb"\r\n?|\n")

# Where the console's cursor is, as far as our own writes tell.
_START = 0  # at a line start
_MID = 1  # after some text of the current line
_CR = 2  # right after a "\r" that ended a chunk: a "\n" may follow and make it "\r\n"


class ConsoleFramer:
    """One console's framing of the writes of many writers (policy: module header).

    Pure: ``write``/``end``/``break_line`` return the bytes to put on the console.  A writer is
    any hashable object that identifies one worker stream (the supervisor passes its sink).
    """

    def __init__(self) -> None:
        self._owner: object | None = None  # who wrote last
        self._owner_prefixed = False
        self._state = _START
        # Writers whose partial line someone else ended: the line end they resume with is dropped.
        self._interrupted: set[object] = set()

    @property
    def at_line_start(self) -> bool:
        return self._state == _START

    def write(self, writer: object, data: bytes, prefix: bytes = b"") -> bytes:
        if not data:
            return b""
        out = bytearray()
        if self._state != _START and self._owner is not writer and (prefix or self._owner_prefixed):
            out += self.break_line()  # the other writer's partial line stays its own
        pos = 0
        if writer in self._interrupted:
            self._interrupted.discard(writer)
            pos = 2 if data.startswith(b"\r\n") else 1 if data.startswith(b"\n") else 0
        self._owner = writer
        self._owner_prefixed = bool(prefix)
        if not prefix:
            out += data[pos:]
            if pos < len(data):
                self._state = _START if data.endswith(b"\n") else _MID
            return bytes(out)
        state = self._state
        if state == _CR:  # our own "\r" ended the last chunk
            if data.startswith(b"\n"):
                out += b"\n"
                pos = 1
            state = _START
        for m in _EOL.finditer(data, pos):
            bare_cr = m.group() == b"\r"
            empty = state == _START and m.start() == pos
            if empty and bare_cr:  # "\r" at a line start moves nothing: no prefix for it
                out += b"\r"
                pos = m.end()
                continue
            if state == _START:
                out += prefix  # an empty line gets one too, as in torchrun
            out += data[pos : m.end()]
            pos = m.end()
            state = _CR if bare_cr and pos == len(data) else _START
        if pos < len(data):
            if state == _START:
                out += prefix
            out += data[pos:]
            state = _MID
        self._state = state
        return bytes(out)

    def end(self, writer: object) -> bytes:
        """``writer`` has no more output: end a partial prefixed line it left."""
        self._interrupted.discard(writer)
        if self._owner is writer and self._owner_prefixed and self._state != _START:
            self._state = _START
            return b"\n"
        return b""

    def break_line(self) -> bytes:
        """End the current line, whoever left it partial: before another writer's line, or
        before a line the agent writes itself."""
        if self._state == _START:
            return b""
        if self._owner is not None:
            self._interrupted.add(self._owner)
        self._owner, self._owner_prefixed, self._state = None, False, _START
        return b"\n"


class LineFilter:
    """The lines containing any of ``needles``, each prefixed and ending in ``\\n``."""

    def __init__(self, needles: Iterable[str], prefix: bytes = b"", max_line: int = FILTER_LINE_MAX) -> None:
        self._needles = tuple(n.encode() for n in needles if n)
        self._prefix = prefix
        self._max = max_line
        self._pending = bytearray()
        self._verdict: bool | None = None  # decided early for a line longer than max_line
        self._after_cr = False  # the last chunk ended with "\r": a leading "\n" completes it

    def feed(self, data: bytes) -> bytes:
        out = bytearray()
        pos = 0
        if self._after_cr and data.startswith(b"\n"):
            pos = 1
        self._after_cr = False
        for m in _EOL.finditer(data, pos):
            self._pending += data[pos : m.start()]
            out += self._line_end()
            pos = m.end()
            self._after_cr = pos == len(data) and m.group() == b"\r"
        self._pending += data[pos:]
        if len(self._pending) >= self._max:
            out += self._overlong()
        return bytes(out)

    def finish(self) -> bytes:
        if self._pending or self._verdict:
            return self._line_end()
        return b""

    def _matches(self, text: bytes | bytearray) -> bool:
        return any(n in text for n in self._needles)

    def _overlong(self) -> bytes:
        if self._verdict is None:
            self._verdict = self._matches(self._pending)
            out = self._prefix + bytes(self._pending) if self._verdict else b""
        else:
            out = bytes(self._pending) if self._verdict else b""
        self._pending.clear()
        return out

    def _line_end(self) -> bytes:
        line = bytes(self._pending)
        self._pending.clear()
        verdict, self._verdict = self._verdict, None
        if verdict is None:
            return self._prefix + line + b"\n" if self._matches(line) else b""
        return line + b"\n" if verdict else b""


class Console:
    """Bytes to a console stream: a binary stream, or a text stream's buffer (or the text itself).

    Every write is flushed at once.  Writes are synchronous: a console that stops reading
    stalls the agent, as it would stall torchrun's own writes.
    """

    def __init__(self, stream: TextIO | BinaryIO, name: str, log: Callable[[str], None]) -> None:
        self.name = name
        self._stream = stream
        self._log = log
        self._broken = False
        self._framer = ConsoleFramer()
        self._text: TextIO | None = None
        self._binary: BinaryIO | None = None
        self._decoders: dict[int, codecs.IncrementalDecoder] = {}  # per writer, text-only consoles
        buffer = getattr(stream, "buffer", None)
        if buffer is not None:
            self._text = stream  # type: ignore[assignment]  # a stream with a .buffer is a text one
            self._binary = buffer
        elif isinstance(stream, io.TextIOBase):
            self._text = stream
        else:
            self._binary = stream  # type: ignore[assignment]  # neither text kind: taken as binary

    def fileno(self) -> int | None:
        """The descriptor a worker may write itself, or None (see the module header)."""
        if self._broken or not isinstance(
            self._stream, (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom, io.FileIO)
        ):
            return None
        try:
            fd = self._stream.fileno()
            os.fstat(fd)
        except (OSError, ValueError):  # io.UnsupportedOperation, a closed stream or descriptor
            return None
        return fd

    def flush(self) -> None:
        """Our own pending output goes out before a worker writes the descriptor itself."""
        for stream in (self._text, self._binary):
            if stream is not None:
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass

    def same_file(self, other: Console) -> bool:
        """Both write to one file or terminal (their descriptors say so)."""
        mine, theirs = self.fileno(), other.fileno()
        if mine is None or theirs is None:
            return False
        try:
            return os.path.samestat(os.fstat(mine), os.fstat(theirs))
        except OSError:
            return False

    def write(self, writer: object, data: bytes, prefix: bytes = b"") -> None:
        self._put(writer, self._framer.write(writer, data, prefix), final=False)

    def break_line(self) -> None:
        """End a partial line a worker left here (through us), so that the next line is ours."""
        data = self._framer.break_line()
        if not data or self._broken:
            return
        if self._binary is None:
            self._put_text(data.decode())
            return
        try:
            self._binary.write(data)
            self._binary.flush()
        except (OSError, ValueError) as e:
            self._fail(e)

    def end(self, writer: object) -> None:
        self._put(writer, self._framer.end(writer), final=True)

    def _put(self, writer: object, data: bytes, *, final: bool) -> None:
        if self._broken:
            return
        if self._binary is None:
            # A character cut between two reads is decoded once both halves are here.
            decoder = self._decoders.pop(id(writer), None) if final else self._decoders.get(id(writer))
            if decoder is None:
                if not data:
                    return
                decoder = codecs.getincrementaldecoder("utf-8")("replace")
                if not final:
                    self._decoders[id(writer)] = decoder
            self._put_text(decoder.decode(data, final=final))
            return
        if not data:
            return
        try:
            if self._text is not None:
                self._text.flush()  # the agent's own pending text goes first
            self._binary.write(data)
            self._binary.flush()
        except (OSError, ValueError) as e:  # EPIPE, a closed stream: keep the files going
            self._fail(e)

    def _put_text(self, text: str) -> None:
        if self._broken or not text or self._text is None:
            return
        try:
            self._text.write(text)
            self._text.flush()
        except (OSError, ValueError) as e:
            self._fail(e)

    def _fail(self, e: Exception) -> None:
        self._broken = True
        self._log(f"console {self.name} is unusable ({e}); workers' console output is dropped")


def open_pty(like_fd: int) -> tuple[int, int]:
    """A pty pair ``(master, slave)`` for a worker's stderr, sized like the terminal ``like_fd``.

    Output post-processing (OPOST) is off, so the bytes the worker writes are the bytes we read
    (no ``\\n`` -> ``\\r\\n``).  The master is non-blocking, for the event loop's reader.  Both
    are close-on-exec; the caller hands the slave to exactly one worker and closes its own copy.
    The size is copied once: a later resize of the agent's terminal reaches the worker's stdout
    (the terminal itself) but not this pty.
    """
    import fcntl  # deferred: only an agent on a terminal pays for them
    import termios

    master, slave = os.openpty()
    try:
        attrs = termios.tcgetattr(slave)
        attrs[1] &= ~termios.OPOST
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        try:
            size = fcntl.ioctl(like_fd, termios.TIOCGWINSZ, bytes(8))
            fcntl.ioctl(slave, termios.TIOCSWINSZ, size)
        except OSError:  # a terminal without a size: tqdm falls back to its default width
            pass
        os.set_blocking(master, False)
    except BaseException:
        os.close(master)
        os.close(slave)
        raise
    return master, slave
