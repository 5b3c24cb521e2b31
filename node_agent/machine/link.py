"""The agent's connection to the rendezvous server, as the machine sees it (pure).

Part of :class:`~node_agent.machine.agent.AgentMachine`, as :class:`~node_agent.machine.training.Training`
is: the machine decides the phase, and this object keeps the connection's side of its state
(whether it is down, whether our ``Resume`` is answered) and what must be said again once the
server hears us (our failure report, that our workers finished or stopped at a commit point).
It returns messages and effects; it never sets the machine's phase or deadline.

A lost connection. With a ``reconnect_timeout`` (every backend but static) every phase rides it
out: the agent reconnects until that window closes, then picks up what it was doing.

- JOINING: joins again.
- STARTING, RUNNING: the workers keep running; ``Resume`` of the round it holds.
- BARRIER: the workers finished; ``Resume(succeeded)``; the barrier's own deadline goes on.
  After a commit: ``Resume`` (not succeeded), then ``WorkersCommitted`` again; losing the
  server for good there exits ``EXIT_RDZV``, not 0 (the job needs this node's next round).
- STOPPING for a restart: the workers are stopped as planned; the node joins the next round
  once they are down *and* it is back (never before: that round must not start while they live).
- STOPPING after our own failure, and VERDICT: ``Resume``, then the failure report again, and
  the server's answer to it is the verdict. A worker failure while the server is unreachable
  is stopped and reported the same way.
- A drain (STOPPING, LEAVING): ``Resume`` (the server keeps our place), then the notice or the
  ``Leave`` as due, and the ``Left`` that picks the exit code.

The server's answer to the Resume decides the rest: ``Resumed`` (it kept our round, or rebuilt
it from its agents after losing its state: nothing restarts), ``Restart`` (the round moved on,
or the server dropped this node while it was away: stop and join again; for a failure we
reported, that is the verdict), ``JobFailed`` or ``JobDone`` (the job ended meanwhile). What
only a node of the round may say (the failure report, the drain's notice) waits for
``Resumed``; a due Leave goes after either answer. A node on its way out for a decided reason
(the job ended, the server refused it, SIGINT) does not reconnect. When the window closes the
workers are stopped and the agent exits 1 (0 at the exit barrier, where its part is done).
"""

from __future__ import annotations

from protocol import (
    Assignment,
    Error,
    JobDone,
    JobFailed,
    Message,
    Restart,
    Resumed,
    WorkersCommitted,
    WorkersFailed,
    WorkersSucceeded,
)
from protocol.records import record

from .events import AfterStop, AgentSettings, Effect, Log, Phase, Reconnect, Send, SendResume


@record
class Link:
    settings: AgentSettings
    away: bool = False  # the connection broke: nothing can be sent until Reconnected
    # Our Resume is out on a new connection and not yet answered: until the answer says whether
    # the server holds us in its round, what only a node of the round may say waits.
    resuming: bool = False
    # Our workers' failure, reported and not yet decided on by the server: sent again after a
    # reconnect (or first then, when it happened while the server was unreachable).
    report: WorkersFailed | None = None
    succeeded: bool = False  # every worker of the round we hold exited 0 (said again in a Resume)
    # The commit step every worker of the round we hold stopped at (BARRIER, waiting for the
    # server's Restart; said again after a reconnect's Resumed); None: not committed.
    committed: int | None = None

    @property
    def quiet(self) -> bool:
        """Nothing can be said now: the connection is down, or our Resume is unanswered."""
        return self.away or self.resuming

    def send(self, msg: Message) -> list[Effect]:
        """Send now, or nothing while the connection is down or our Resume is unanswered (what
        must be said then is kept in our state and said once it can be: the report, the Leave,
        the notice, that our workers finished)."""
        return [] if self.away or self.resuming else [Send(msg)]

    def new_round(self) -> None:
        """We join a new round: nothing of the last one is said again."""
        self.succeeded = False
        self.committed = None
        self.report = None

    def reported(self, msg: WorkersFailed) -> list[Effect]:
        """Our workers' failure: said now (or once we can), and again after a reconnect until
        the server decides on it (:meth:`verdict`)."""
        self.report = msg
        return self.send(msg)

    def verdict(self) -> None:
        """The server decided on our failure report (its ``Restart``), or there is none to make
        any more (our course ended otherwise): it is not said again."""
        self.report = None

    def finished(self) -> None:
        """Every worker of our round exited 0: a Resume says so."""
        self.succeeded = True

    def committed_at(self, step: int) -> None:
        """Every worker of our round stopped at the commit ``step``: said again after a
        reconnect's ``Resumed``; a Resume must not tell the server our work is done."""
        self.committed = step
        self.succeeded = False

    def lost(self) -> bool:
        """The connection broke; False when it was down already (nothing new)."""
        if self.away:
            return False
        self.away = True
        self.resuming = False
        return True

    def reconnect(self, reason: str, what_now: str, now: float) -> list[Effect]:
        """Ride a lost connection out: reconnect until the window closes."""
        window = self.settings.reconnect_timeout
        return [
            Log(
                "warning",
                f"lost the connection to the rendezvous server ({reason}); {what_now}"
                f"reconnecting for up to {window:g} s",
            ),
            Reconnect(deadline=now + window),
        ]

    def unreachable(self, reason: str) -> str:
        """Why the server is gone for good once the reconnect window closed."""
        return f"{reason} (could not reconnect within {self.settings.reconnect_timeout:g} s)"

    def back(self) -> bool:
        """Back on a new connection; False when it was not down (nothing new)."""
        if not self.away:
            return False
        self.away = False
        return True

    def resume(self, phase: Phase, a: Assignment) -> list[Effect]:
        """Take our round back first; the server's answer tells what else to say (:meth:`owed`)."""
        self.resuming = True
        what = {
            Phase.STOPPING: "resuming our round while our workers stop",
            Phase.VERDICT: "resuming our round to report our workers' failure again",
            Phase.LEAVING: "resuming our round to leave it",
        }.get(phase, "resuming our round")
        return [Log("info", f"reconnected; {what}"), SendResume(a, self.succeeded)]

    def answered(self) -> None:
        """The server answered our Resume: what waited for the answer can be said."""
        self.resuming = False

    def answers(self, msg: Message) -> bool:
        """Whether ``msg`` is the server's answer to our Resume (a non-fatal ``Error`` is not:
        a draining server closes next, and we come back)."""
        return (
            self.resuming
            and isinstance(msg, Resumed | Restart | JobFailed | JobDone | Error)
            and not (isinstance(msg, Error) and not msg.fatal)
        )

    def owed(self, phase: Phase, a: Assignment | None) -> list[Effect]:
        """``Resumed``: we are a node of its round again; what we have to say of it (that our
        workers finished or committed, our failure report)."""
        due: list[Effect] = []
        if phase is Phase.BARRIER and a is not None and self.committed is not None:
            due.append(Send(WorkersCommitted(round=a.round, step=self.committed)))
        elif phase is Phase.BARRIER and a is not None:
            due.append(Send(WorkersSucceeded(round=a.round)))  # they may have finished since
        if self.report is not None:
            due.append(Send(self.report))
        return due

    def what_now(self, phase: Phase, after: AfterStop) -> str:
        """What becomes of the workers while we reconnect, for the lost-connection lines."""
        p = phase
        if p in (Phase.STARTING, Phase.RUNNING):
            return "workers keep running; "
        if p is Phase.STOPPING and after is AfterStop.REJOIN:
            return (
                "workers are being stopped; this node joins the next round once they are down and it "
                "is back; "
            )
        if p is Phase.STOPPING and after is AfterStop.VERDICT:
            return "workers are being stopped; their failure is reported once this node is back; "
        if p is Phase.STOPPING and after is AfterStop.LEAVE:
            return (
                "workers are being stopped for the drain; this node leaves once they are down and it is "
                "back; "
            )
        if p is Phase.STOPPING:
            return "workers are being stopped; "
        if p is Phase.VERDICT:
            return "workers stopped; their failure is reported again once this node is back; "
        if p is Phase.BARRIER and self.committed is not None:
            return f"workers stopped at step {self.committed} (a commit point); "
        if p is Phase.BARRIER:
            return "workers finished; "
        if p is Phase.LEAVING:
            return "workers stopped; this node asks to leave again once it is back; "
        return ""
