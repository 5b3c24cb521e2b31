"""The agent prints the job's goodput line the server sends as the job ends (issue 47)."""

from __future__ import annotations

from node_agent.machine import events as st
from protocol import JobDone, JobFailed

from .harness import running

LINE = "goodput 97.3 % over 2 h 14 min: 2 failures cost 41 s and 3 steps; start-up 9 s; rendezvous 2 s"


def test_job_done_says_the_goodput_line_then_exits() -> None:
    m = running()
    m.handle(st.WorkersExited(None), 2.0)
    line, ex = m.handle(st.ServerSent(JobDone(summary=LINE)), 3.0)
    assert line == st.Log("info", f"job: {LINE}")
    assert isinstance(ex, st.Exit) and ex.code == st.EXIT_OK


def test_job_failed_says_it_too_and_an_older_servers_silence_adds_nothing() -> None:
    m = running()
    eff = m.handle(st.ServerSent(JobFailed(reason="no restarts left", summary=LINE)), 3.0)
    assert eff[0] == st.Log("info", f"job: {LINE}")
    assert not any(isinstance(e, st.Log) and e.text.startswith("job: ") for e in eff[1:])
    m = running()
    eff = m.handle(st.ServerSent(JobFailed(reason="no restarts left")), 3.0)
    assert not any(isinstance(e, st.Log) and e.text.startswith("job: ") for e in eff)
