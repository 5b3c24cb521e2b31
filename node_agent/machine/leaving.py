"""Leaving the job: the drain, SIGTERM's wait for a commit point, the Leave and the Left (pure).

Part of :class:`~node_agent.machine.agent.AgentMachine`, as :class:`~node_agent.machine.training.Training`
is: this object keeps what a node on its way out has decided (why it leaves, the Leave it owes
the server, whether its exit code waits for the server's ``Left``) and returns the effects and
the phase it asks for (STOPPING: the workers stop first; LEAVING: the Leave is out), which the
machine applies; it never sets the machine's phase or deadline itself.

Leaving. A drain (SIGTERM in an elastic job, or the server's ``Drain``) stops the workers with
SIGTERM and tells the server at once (``Leave(workers_stopping=True)``): it restarts the other
nodes' round but keeps this node's place, not ready, so the next round cannot start while these
workers live (one may be writing the checkpoint the next round loads). Once they have exited
(``shutdown_timeout``, then SIGKILL) the agent sends ``Leave``; the server answers
``Left(job_continues)``, and the exit code follows: 0 only when the job goes on without this
node, else 1 as torchrun exits on a signal. The agent waits for the answer in LEAVING (at most
``LEAVE_ANSWER_TIMEOUT`` once the Leave is out); none counts as "does not go on": a scheduler is
told of a failure rather than a success that may not be one. SIGTERM in a fixed-size job exits 1
whatever the answer, as torchrun does; its Leave, too, waits for the workers.

SIGTERM to an elastic agent whose ranks all call ``worker.should_stop()`` (and with
``commit_timeout`` > 0) first asks for a commit point: ``LeaveAfterCommit``, the workers run on
to the step the server picks, and the server's ``Drain`` (once they committed, or at once when
it cannot commit) starts the drain above, from the exit barrier straight to the ``Leave``. It
drains by itself when no ``Drain`` comes within ``commit_timeout`` + ``COMMIT_LEAD`` (from
the armed step on: the server's own deadline for it, the steps to it at our step times
added), on a second signal, on a ``Restart`` (it leaves rather than rejoin) and on a worker
failure (reported first).
"""

from __future__ import annotations

from protocol import COMMIT_LEAD, Assignment, Leave, LeaveAfterCommit, Left
from protocol.records import record

from ..agent_log import shown
from .events import (
    EXIT_FAILED,
    EXIT_OK,
    LEAVE_ANSWER_TIMEOUT,
    AgentSettings,
    Effect,
    Exit,
    Log,
    Phase,
    Send,
    StopWorkers,
    fit,
)
from .link import Link

WORKERS = (Phase.RUNNING, Phase.STARTING, Phase.STOPPING)  # the phases with workers alive


@record
class Leaving:
    settings: AgentSettings
    going: bool = False  # on our way out of the job by a Leave (a drain, or SIGTERM/SIGINT)
    leave: Leave | None = None  # the Leave to send once the workers are down (again after a reconnect)
    awaiting_left: bool = False  # a drain's exit code waits for the server's Left
    drain_why: str = ""
    # A SIGTERM drain waiting for a commit point (our LeaveAfterCommit is out): its reason,
    # and when we asked (its give-up line says how long we waited).
    commit_leave: str | None = None
    commit_asked_at: float = 0.0

    @property
    def pending_commit(self) -> str | None:
        """The reason of a drain waiting for a commit point (None: none waits)."""
        return self.commit_leave

    def exit_decided(self) -> None:
        """The exit code is decided without the server's ``Left`` (none is awaited any more)."""
        self.awaiting_left = False

    def leave_moot(self) -> None:
        """The Leave is owed no more (the server dropped us, or the job ended)."""
        self.leave = None

    def settled(self) -> None:
        """Nothing to say on the way out, nothing to await: no Leave, no Left."""
        self.awaiting_left = False
        self.leave = None

    def quit(self, why: str) -> Leave:
        """A signal stops this node without a drain: the Leave it owes the server."""
        self.going = True
        self.leave = Leave(reason=fit(f"agent {why}"))
        return self.leave

    def ask_commit(self, why: str, round_: int, now: float) -> list[Effect]:
        """A drain that first asks the server to stop the job at a commit point; the machine's
        deadline is ``now`` + :meth:`budget`."""
        self.commit_leave, self.commit_asked_at = why, now
        return [
            Log(
                "warning",
                f"{why}: asking the job to stop at a commit point first; the workers keep running, "
                f"and this node drains within {self.budget():g} s (a second signal drains at once)",
            ),
            Send(leave_after_commit(round_, why)),
        ]

    def budget(self) -> float:
        """How long a drain waits for the server's Drain past the committing ranks' steps: the
        checkpoint budget and the lead, as the server's own commit deadline."""
        return self.settings.commit_timeout + COMMIT_LEAD

    def no_drain(self, now: float) -> Log:
        """No Drain came for our commit point in time: the line before we drain by ourselves."""
        waited = now - self.commit_asked_at  # the budget, or longer once a step was armed
        return Log(
            "warning",
            f"no drain from the rendezvous server within {waited:g} s of asking for a commit point",
        )

    def drain(
        self, why: str, phase: Phase, committed: int | None, sig: int, link: Link
    ) -> tuple[list[Effect], Phase]:
        """A clean leave: workers get SIGTERM (``sig``; 0: they have it) first (to checkpoint),
        the server restarts the others' round at once, and our Leave follows once the workers
        have exited, so no next round starts while they live. The server's Left picks the exit
        code. The phase asked for: STOPPING (then the Leave), or LEAVING (no workers: send it)."""
        self.commit_leave = None
        self.going = True
        self.drain_why = why
        self.awaiting_left = True
        self.leave = Leave(reason=fit(f"drain: {why}"))
        if phase in WORKERS:
            how = "workers get SIGTERM, then this node leaves the job"
        elif committed is not None:
            how = f"its workers stopped at the commit point, step {committed}; this node leaves the job"
        else:
            how = "this node leaves the job"
        note = Log("warning", f"{why}: draining ({how})")
        if phase in WORKERS:
            stop: list[Effect] = []
            if phase is not Phase.STOPPING:
                stop = [StopWorkers(sig, self.settings.shutdown_timeout)]
            return [note, *stop, *link.send(notice(self.leave))], Phase.STOPPING
        return [note], Phase.LEAVING  # no workers: JOINING, VERDICT, BARRIER

    def send_leave(self, link: Link, now: float) -> tuple[list[Effect], float | None]:
        """Workers down: say we leave, and wait (bounded) for the answer that picks the exit
        code. Its effects and the machine's deadline (LEAVING)."""
        if link.away or self.leave is None:
            return [], None  # sent once reconnected; the reconnect window bounds the wait
        deadline = now + LEAVE_ANSWER_TIMEOUT  # the answer to a Resume still out, too
        if link.resuming:
            return [], deadline  # sent with the answer to our Resume (which restarts this wait)
        return [Send(self.leave)], deadline

    def owed(self, phase: Phase, a: Assignment | None, *, resumed: bool) -> list[Effect]:
        """What a node on its way out says again once the server answered our Resume: after
        ``Resumed`` (a node of its round again) our commit point's ask and the drain's notice;
        after either answer a due Leave."""
        due: list[Effect] = []
        if resumed:
            if phase is Phase.RUNNING and a is not None and self.commit_leave is not None:
                # The server may have lost it with its state: asking twice is harmless.
                due.append(Send(leave_after_commit(a.round, self.commit_leave)))
            if phase is Phase.STOPPING and self.going and self.leave is not None:
                due.append(Send(notice(self.leave)))
        if phase is Phase.LEAVING and self.leave is not None:
            due.append(Send(self.leave))
        return due

    def left(self, msg: Left, signalled: bool) -> Exit | None:
        """The server's answer to our Leave: the exit it picks (None: we awaited none)."""
        if not self.awaiting_left:
            return None
        self.awaiting_left = False
        self.leave = None
        why = self.drain_why
        if msg.job_continues and signalled and self.settings.signals_end_job:
            return Exit(
                EXIT_FAILED,
                f"drained: {why}; left the job ({shown(msg.reason)}), but under Slurm a signal "
                "ends the whole job (scancel, pre-emption, time limit): exit 1, as torchrun",
            )
        if msg.job_continues:
            return Exit(
                EXIT_OK,
                f"drained: {why}; left the job, which goes on without this node ({shown(msg.reason)})",
            )
        return Exit(
            EXIT_FAILED,
            f"drained: {why}; left the job, which does not go on without this node ({shown(msg.reason)})",
        )

    def unanswered(self) -> Exit:
        """No Left within LEAVE_ANSWER_TIMEOUT: "does not go on"."""
        self.awaiting_left = False
        return Exit(
            EXIT_FAILED,
            f"drained: {self.drain_why}; the rendezvous server did not answer whether the job "
            f"goes on without this node (no answer within {LEAVE_ANSWER_TIMEOUT:g} s)",
        )

    def gone(self, reason: str, *, unreachable: bool) -> Exit | None:
        """The server is gone for good while a drain awaits its Left: the exit (None: none awaited)."""
        if not self.awaiting_left:
            return None
        why = self.drain_why
        if unreachable:
            text = (
                f"drained: {why}; the rendezvous server was unreachable ({reason}), so nobody "
                "confirmed that the job goes on without this node"
            )
        else:
            text = (
                f"drained: {why}; the connection to the rendezvous server closed ({reason}) before "
                "it said whether the job goes on without this node"
            )
        return Exit(EXIT_FAILED, text)


def notice(leave: Leave) -> Leave:
    """The drain's notice: we leave once our workers are down (they are stopping now)."""
    return Leave(reason=leave.reason, workers_stopping=True)


def leave_after_commit(round_: int, why: str) -> LeaveAfterCommit:
    return LeaveAfterCommit(round=round_, reason=fit(f"drain: {why}"))
