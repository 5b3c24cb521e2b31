"""The agent's own lines: the prefix on every line, LOGLEVEL's threshold, logging routed in."""

from __future__ import annotations

import io
import json
import logging

import pytest

from node_agent.agent_log import AgentLog, install


def lines(level: str | None, fmt: str = "text") -> tuple[AgentLog, io.StringIO]:
    out = io.StringIO()
    return AgentLog(out, fmt, level=level), out


class Writes(io.StringIO):
    """A stream that keeps each write apart."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, s: str) -> int:
        self.calls.append(s)
        return super().write(s)


def test_each_line_is_one_write_newline_included() -> None:
    """A console shared with the workers (PYTHONUNBUFFERED: every write goes out as it is) must
    get each agent line whole, so no worker line lands inside it."""
    out = Writes()
    log = AgentLog(out, "text", level=None)
    log("started 1 worker(s)")
    log("first\nsecond", "error")
    assert out.calls == [
        "[node-agent] started 1 worker(s)\n",
        "[node-agent] ERROR: first\n[node-agent] ERROR: second\n",
    ]


def test_every_line_of_a_report_carries_the_prefix() -> None:
    log, out = lines(None)
    log("first\nsecond", "error")
    log("round 0")
    assert out.getvalue().splitlines() == [
        "[node-agent] ERROR: first",
        "[node-agent] ERROR: second",
        "[node-agent] round 0",
    ]


@pytest.mark.parametrize(
    ("level", "shown"),
    [
        (None, ["info", "warning", "error"]),  # unset: the agent's INFO lines show
        ("WARNING", ["warning", "error"]),
        ("ERROR", ["error"]),
        ("DEBUG", ["debug", "info", "warning", "error"]),
    ],
)
def test_loglevel_sets_the_threshold(level: str | None, shown: list[str]) -> None:
    log, out = lines(level, "json")
    for name in ("debug", "info", "warning", "error"):
        log(name, name)
    assert [json.loads(line)["level"] for line in out.getvalue().splitlines()] == shown


def test_logging_lines_become_agent_lines_and_an_embedded_server_is_quiet_unless_asked() -> None:
    log, out = lines(None)
    install(log)
    try:
        logging.getLogger("node_agent.cli").warning("--master-addr: ignored")
        logging.getLogger("rdzv_server").warning("job x: node lost")
        assert out.getvalue().splitlines() == ["[node-agent] WARNING: --master-addr: ignored"]
        loud, loud_out = lines("INFO")
        install(loud)
        logging.getLogger("rdzv_server").info("job x: round 0 complete")
        assert loud_out.getvalue().splitlines() == ["[node-agent] job x: round 0 complete"]
    finally:
        for name in ("node_agent", "rdzv_server", "protocol"):
            logger = logging.getLogger(name)
            logger.handlers.clear()
            logger.propagate = True
            logger.setLevel(logging.NOTSET)


def test_a_closed_stream_does_not_raise() -> None:
    out = io.StringIO()
    log = AgentLog(out)
    out.close()
    log("still fine", "error")


def test_a_peers_text_is_shown_escaped_and_bounded() -> None:
    from node_agent.agent_log import SHOWN_LEN, shown

    assert shown("plain text, ünïcode") == "plain text, ünïcode"
    forged = "a\n[node-agent] ERROR: forged\x1b[2J\r\x9b\u2028\x00\t"
    assert shown(forged) == "a\\n[node-agent] ERROR: forged\\x1b[2J\\r\\x9b\\u2028\\x00\\t"
    # a worker's traceback keeps its lines and tabs; the rest is escaped all the same
    assert shown("l1\n\tl2\x1b[0m\r", multiline=True) == "l1\n\tl2\\x1b[0m\\r"
    long = shown("x" * 70000)
    assert long.startswith("x" * SHOWN_LEN) and long.endswith("... (68,000 more characters)")
    assert shown("x" * 70000, limit=None) == "x" * 70000


def test_the_failure_report_shows_a_servers_failure_escaped() -> None:
    from node_agent.report import failure_summary
    from protocol import Failure

    f = Failure(
        node_id="n2",
        addr="10.0.0.2",
        rank=1,
        local_rank=0,
        exitcode=1,
        timestamp=0.0,
        message="Error: boom\n\x1b[31mred\r!",
        error_file="/tmp/e\n[node-agent] forged",
    )
    text = failure_summary("train.py", f, ())
    assert "\x1b" not in text and "\r" not in text
    assert "error_file: /tmp/e\\n[node-agent] forged" in text
    assert "error     : Error: boom\n              \\x1b[31mred\\r!" in text
