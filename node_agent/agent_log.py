"""The agent's own lines: ``[node-agent] …`` on stderr (or JSON objects for log shippers).

Every line the agent prints goes through here: the runner's and the machine's lines, the
command line's warnings and the lines of a rendezvous server the agent hosts (both through
``logging``, which :func:`install` routes here). ``LOGLEVEL`` sets the threshold as torchrun
applies it to its own lines; unset, the agent shows its INFO lines (rounds, workers started).
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["AgentLog", "install", "shown"]

_RANK = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
DEFAULT_LEVEL = "INFO"


class AgentLog:
    """Callable: ``log(text, level="info")`` writes one line if ``level`` passes the threshold."""

    def __init__(self, stream: TextIO, fmt: str = "text", node: str = "", level: str | None = None) -> None:
        self.stream = stream
        self.fmt = fmt
        self.node = node
        self.job = ""
        self.threshold = _threshold(level)
        self.level_given = level is not None  # LOGLEVEL was set
        self.before_line: Callable[[], None] | None = None  # ends a worker's partial console line

    def enabled(self, level: str) -> bool:
        return _RANK.get(level, 20) >= self.threshold

    def __call__(self, text: str, level: str = "info") -> None:
        if not self.enabled(level):
            return
        if self.fmt == "json":
            rec = {"ts": time.time(), "level": level, "job": self.job, "node": self.node, "msg": text}
            import json  # only for --log-format json: 2 ms of every launch otherwise

            line = json.dumps(rec)
        else:
            # Every line carries the prefix, those of a multi-line text (a failure report) too.
            head = "[node-agent] " if level == "info" else f"[node-agent] {level.upper()}: "
            line = "\n".join(head + part for part in text.split("\n"))
        if self.before_line is not None:
            self.before_line()
        try:
            # One write of the whole line, newline included: print() writes the text and the
            # newline apart, and with PYTHONUNBUFFERED (a write-through stderr) a worker's line
            # sharing the console can land between them ("...{0: 7752}rank 0 running").
            self.stream.write(line + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stderr must not take the agent down
            pass


# What a peer's text may not carry onto our terminal as is: C0 and C1 controls (newline, CR,
# ESC of an ANSI sequence, the C1 CSI), DEL and the Unicode line separators. In a multi-line
# text (a worker's traceback) newlines and tabs stay, each line then gets our prefix.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_CONTROL_BUT_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")
SHOWN_LEN = 2000  # a one-line text from a peer, as shown: enough for any reason a server builds


def shown(text: str, *, limit: int | None = SHOWN_LEN, multiline: bool = False) -> str:
    """A text from a peer (the rendezvous server, another node), fit for our terminal.

    Control characters are written as Python escapes (``\\n``, ``\\x1b``), so the text can
    neither forge a ``[node-agent]`` line nor drive the terminal; a one-line text longer than
    ``limit`` (None: no limit) is cut, saying how much was left out."""
    text = (_CONTROL_BUT_LINES if multiline else _CONTROL).sub(lambda m: repr(m.group())[1:-1], text)
    if not multiline and limit is not None and len(text) > limit:
        text = f"{text[:limit]}... ({len(text) - limit:,} more characters)"
    return text


def _threshold(level: str | None) -> int:
    name = (level or DEFAULT_LEVEL).upper()
    if name == "NOTSET":
        return 0
    return _RANK.get(name.lower(), 20)


class _Forward(logging.Handler):
    """``logging`` records (argument warnings, an embedded server) as the agent's own lines."""

    def __init__(self, log: AgentLog) -> None:
        super().__init__(level=logging.NOTSET)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # a bad format in a third-party message must not crash the agent
            text = str(record.msg)
        level = "debug" if record.levelno < 20 else "info" if record.levelno < 30 else "warning"
        if record.levelno >= 40:
            level = "error"
        self.log(text, level)


def install(log: AgentLog) -> None:
    """Route the ``node_agent``, ``rdzv_server`` and ``protocol`` loggers to ``log`` (once).

    A rendezvous server the agent hosts narrates every join, round and failure of the job; the
    agent says the same in its own words, so those lines show only when LOGLEVEL asks."""
    handler = _Forward(log)
    for name in ("node_agent", "rdzv_server", "protocol"):
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, _Forward)]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        quiet = name == "rdzv_server" and not log.level_given
        logger.setLevel(logging.CRITICAL if quiet else max(1, log.threshold))
        logger.propagate = False


def for_cli(environ_level: str | None, fmt: str = "text") -> AgentLog:
    """The command's log before its config is read: LOGLEVEL as given (a bad value is reported
    by the config; until then INFO)."""
    level = environ_level.strip().upper() if environ_level else None
    if level == "WARN":
        level = "WARNING"
    if level is not None and level.lower() not in _RANK and level != "NOTSET":
        level = None
    return AgentLog(sys.stderr, fmt, level=level)
