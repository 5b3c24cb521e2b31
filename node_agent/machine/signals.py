"""The signals this agent receives, and what they ask of it (pure).

Part of :class:`~node_agent.machine.agent.AgentMachine`, as :class:`~node_agent.machine.link.Link`
and :class:`~node_agent.machine.leaving.Leaving` are: this object keeps which signal stopped the
agent, whether the workers have it from its sender, and which signals were passed on to this
attempt's workers; it returns effects and what follows (:class:`Then`), which the machine
carries out; it never sets the machine's phase or deadline.

A signal of ``handled_signals`` stops the job (torchrun's ``--signals-to-handle``): SIGTERM in
an elastic job drains (``leaving.py``), any other stops the workers and exits 1, as torchrun
does. A second one insists: a drain waiting for a commit point drains at once, a stop sends
SIGKILL, a node waiting for its ``Left`` exits. One of ``forward_signals`` that is not handled
is passed on to running workers, unless they have it from its sender already (a scheduler that
signals every process of the job step: ``signal_witness.py``); one that came while no workers
ran, or before the running ones were started, is said and not passed on.

A worker killed by a signal this agent received for its workers (passed on, or delivered with
its own) is no failure to restart for, but a stop, as if the agent had been sent a handled
signal.
"""

from __future__ import annotations

import enum
import signal

from protocol import Failure
from protocol.records import record

from .events import AgentSettings, Effect, ForwardSignal, Log, Phase


class Then(enum.Enum):
    """What a signal asks of the machine, past the effects :meth:`Signals.receive` returns."""

    NOTHING = "nothing"  # its effects say it all
    DRAIN = "drain"  # a second signal while a drain waits for a commit point: drain at once
    EXIT = "exit"  # a second signal while the Leave awaits its answer: exit at once
    LEAVE = "leave"  # SIGTERM in an elastic job: drain, after a commit point where one can be had
    STOP = "stop"  # stop as torchrun does: workers stopped, no restart, exit 1


@record
class Signals:
    settings: AgentSettings
    signalled: int | None = None  # the handled signal that stopped us (or killed a worker of ours)
    delivered: bool = False  # the workers got ``signalled`` from its sender: stops send no signal
    # Signals passed on to (or delivered with) this attempt's workers: a worker they kill is
    # no failure to restart for, but a stop, as if the agent had been sent a handled signal.
    passed_on: frozenset[int] = frozenset()

    def receive(
        self, signum: int, delivered: bool, phase: Phase, *, committing: bool, out: bool, stale: bool = False
    ) -> tuple[list[Effect], Then]:
        """A signal came (``delivered``: the workers have it too; ``stale``: it came while no
        workers ran, or before the ones running now started). ``committing``: a drain waits
        for a commit point; ``out``: we are on our way out already (a drain, the job's end)."""
        if signum not in self.settings.handled_signals:
            if signum not in self.settings.forward_signals:
                return [], Then.NOTHING
            if phase in (Phase.RUNNING, Phase.STARTING) and not stale:
                return self._pass_on(signum, delivered), Then.NOTHING
            return [_not_passed_on(signum)], Then.NOTHING
        name = signal.Signals(signum).name
        if committing:
            # A second signal while a drain waits for a commit point: the user insists.
            return [Log("warning", f"received {name} again; not waiting for a commit point")], Then.DRAIN
        if self.signalled is not None:
            # A second signal while we stop: the user insists.
            if phase is Phase.LEAVING:
                return [], Then.EXIT
            return ([ForwardSignal(signal.SIGKILL)] if phase is Phase.STOPPING else []), Then.NOTHING
        self.signalled, self.delivered = signum, delivered
        if out:
            # Already on our way out (a drain the server asked for, the job's end): a second
            # signal insists.
            return [Log("info", f"received {name}; already stopping")], Then.NOTHING
        if self.settings.elastic and signum == signal.SIGTERM:
            return [], Then.LEAVE
        return [], Then.STOP

    def _pass_on(self, signum: int, delivered: bool) -> list[Effect]:
        self.passed_on |= {signum}
        if delivered:
            name = signal.Signals(signum).name
            return [
                Log(
                    "info",
                    f"received {name}; the workers have it too, from its sender (it signals every "
                    "process of the job step), so it is not forwarded again",
                )
            ]
        return [ForwardSignal(signum)]

    def new_attempt(self) -> None:
        """A new attempt's workers start: they have received nothing yet."""
        self.passed_on = frozenset()

    def to_send(self, signum: int) -> int:
        """The signal a stop for ``signum`` sends the workers: 0 where they have it from its
        sender already (it is not sent again)."""
        return 0 if self.delivered and self.signalled == signum else signum

    def killed_by(self, failure: Failure) -> int:
        """The signal (0: none) behind a worker's death when it is one this agent received for
        its workers: passed on, or delivered with its own (a scheduler signals every process)."""
        signum = -failure.exitcode
        if signum <= 0:
            return 0
        return signum if signum in self.passed_on or signum == self.signalled else 0

    def witness(self, signum: int, failure: Failure) -> tuple[Log, str]:
        """A worker died of ``signum``, one we got for them (:meth:`killed_by`): the job stops
        as for a handled signal the workers have already. The line that says so, and why we stop."""
        self.signalled, self.delivered = signum, True
        name = signal.Signals(signum).name
        who = f"local rank {failure.local_rank}"
        note = Log(
            "warning",
            f"{who} was killed by {name}, a signal sent to this node's workers: the job "
            "stops as for a signal this agent handles, without a restart",
        )
        return note, f"{who} was killed by {name}"


def _not_passed_on(signum: int) -> Log:
    """A notice that came while none of this node's workers ran: the workers that start later
    never had it from its sender (it signalled the processes there were), and one passed on
    at their start would kill them before their handler is in."""
    return Log(
        "info",
        f"received {signal.Signals(signum).name} while no workers of this node ran (not started "
        "yet, between rounds, stopping or done): not passed on to workers started after it",
    )


def received(signum: int) -> str:
    """Why we stop, for a handled signal."""
    return f"received {signal.Signals(signum).name}"
