"""Run a command as a person at a terminal would, and look at what the terminal shows.

    with PtyRun(["python", "-m", "node_agent.cli", ...], cols=100, rows=30) as run:
        run.wait_for(b"prompt> ")      # returns as soon as it is on the screen
        run.send(b"yes\\n")             # typed at the keyboard (the pty echoes it)
        result = run.wait()            # exit code and every byte, once the command exited

The command gets a fresh pty as stdin, stdout and stderr and as its controlling terminal, in a
session of its own (so ``run.send(b"\\x03")`` is a Ctrl-C to its foreground process group), sized
``cols`` x ``rows``.  ``pty=False`` runs it over pipes instead (stdin a pipe; stdout and stderr
one pipe, as they share one screen) for the no-terminal case, with the same API.

A thread reads everything the command writes.  Patterns are matched against ``screen``: the
bytes with the terminal's ``\\r\\n`` turned back into ``\\n`` (a bare ``\\r`` is kept).  Every wait
has a deadline; on timeout the command's process group is SIGKILLed and the AssertionError
shows the screen so far.  Leaving the ``with`` block kills the group if it is still running.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .procs import kill_session

__all__ = ["PtyResult", "PtyRun", "run_in_pty"]

# After the command exited: how long descendants that still hold the terminal may keep writing.
EOF_GRACE = 2.0


@dataclass(frozen=True)
class PtyResult:
    code: int  # as Popen.returncode: negative means killed by that signal
    screen: bytes  # all output, "\r\n" turned back into "\n"

    @property
    def text(self) -> str:
        return self.screen.decode(errors="replace")


def _take_terminal() -> None:
    """In the child, after setsid: make its stdin (the pty slave) the controlling terminal."""
    import fcntl
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class PtyRun:
    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        cols: int = 80,
        rows: int = 24,
        pty: bool = True,
    ) -> None:
        self.argv = list(argv)
        self._raw = bytearray()
        self._cond = threading.Condition()
        self._eof = False
        self._input: int | None = None  # where send() writes
        if pty:
            import fcntl
            import struct
            import termios

            master, slave = os.openpty()
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
            try:
                self.p = subprocess.Popen(
                    self.argv,
                    stdin=slave,
                    stdout=slave,
                    stderr=slave,
                    env=dict(env) if env is not None else None,
                    cwd=cwd,
                    start_new_session=True,
                    preexec_fn=_take_terminal,
                )
            except BaseException:
                os.close(master)
                raise
            finally:
                os.close(slave)  # from now on only the command holds it: EIO on master means done
            self._output, self._input = master, master
        else:
            self.p = subprocess.Popen(
                self.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
            )
            assert self.p.stdin is not None and self.p.stdout is not None
            self._output, self._input = self.p.stdout.fileno(), self.p.stdin.fileno()
        self.pid = self.p.pid
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    # --- what the terminal shows ----------------------------------------------------------------

    @property
    def screen(self) -> bytes:
        with self._cond:
            return bytes(self._raw).replace(b"\r\n", b"\n")

    def wait_for(self, pattern: bytes | re.Pattern[bytes], timeout: float = 30.0) -> re.Match[bytes]:
        """Return once ``pattern`` (bytes: literal; a compiled regex: searched) is on the screen."""
        rx = pattern if isinstance(pattern, re.Pattern) else re.compile(re.escape(pattern))
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                m = rx.search(bytes(self._raw).replace(b"\r\n", b"\n"))
                if m:
                    return m
                left = deadline - time.monotonic()
                if left <= 0 or self._eof:
                    break
                self._cond.wait(left)
        why = "the output ended" if self._eof else f"{timeout} s passed"
        self.kill()
        raise AssertionError(f"{pattern!r} not seen before {why}: {self.argv}\nscreen:\n{self._shown()}")

    def send(self, data: bytes) -> None:
        """Type ``data`` at the terminal (or write it to the command's stdin pipe)."""
        assert self._input is not None
        os.write(self._input, data)

    # --- the end ----------------------------------------------------------------------------------

    def wait(self, timeout: float = 60.0) -> PtyResult:
        """Wait for the command to exit and its output to end (``EOF_GRACE`` at most after the exit)."""
        try:
            code = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"{self.argv} did not exit within {timeout} s\nscreen:\n{self._shown()}"
            ) from None
        self._reader.join(EOF_GRACE)
        return PtyResult(code, self.screen)

    def kill(self) -> None:
        """SIGKILL the command's process group (its session) and reap it."""
        kill_session(self.p)

    def close(self) -> None:
        self.kill()
        self._reader.join(EOF_GRACE)
        if self._reader.is_alive():
            return  # a process that left the session holds the output: never close under a read
        if self._input is not None and self._input == self._output:
            os.close(self._output)  # the pty master; pipes close with the Popen's streams
        self._input = None
        for stream in (self.p.stdin, self.p.stdout):
            if stream is not None:
                stream.close()

    def __enter__(self) -> PtyRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self._output, 65536)
            except OSError:  # EIO: no process holds the pty's slave any more; EBADF: closed
                data = b""
            with self._cond:
                if data:
                    self._raw += data
                else:
                    self._eof = True
                self._cond.notify_all()
            if not data:
                return

    def _shown(self) -> str:
        return self.screen.decode(errors="replace")


def run_in_pty(argv: Sequence[str], *, timeout: float = 60.0, **kw: object) -> PtyResult:
    """Run ``argv`` under a fresh pty to the end (options as ``PtyRun``)."""
    with PtyRun(argv, **kw) as run:  # type: ignore[arg-type]
        return run.wait(timeout)
