"""Joining a round, as the machine sees it (pure): the health check before the join, the
server's waiting updates, and how a wait to join ends without a round.

Part of :class:`~node_agent.machine.agent.AgentMachine`, as :class:`~node_agent.machine.link.Link`
and :class:`~node_agent.machine.leaving.Leaving` are: this object keeps whether our
``--health-check`` runs or passed for the round we join, and the last waiting update we said;
it returns effects and exits, and never sets the machine's phase or deadline.

``--health-check`` runs before each round's join as an effect (``RunHealthCheck``), and its
result comes back as an event (``HealthCheckDone``): the I/O layer never waits on it, so a
signal during a long check is handled at once (the check is killed when the agent exits). A
reconnect while joining joins again without running it again.

The job ending while this node waits to join (a hot spare beyond --nnodes, or a newcomer that
was not yet in a round): ``JobDone`` exits ``EXIT_NOT_NEEDED`` (0). No round within
``join_timeout`` exits ``EXIT_RDZV``.
"""

from __future__ import annotations

from protocol import Waiting
from protocol.records import record

from ..agent_log import shown
from .assignment import node_range
from .events import (
    EXIT_FAILED,
    EXIT_NOT_NEEDED,
    EXIT_RDZV,
    AgentSettings,
    Effect,
    Exit,
    HealthCheckDone,
    Log,
    RunHealthCheck,
    SendJoin,
)


@record
class Joining:
    settings: AgentSettings
    last_waiting: tuple[int, int, str, bool] | None = None  # joined, round, reason, spare
    checking: bool = False  # our --health-check runs; the join waits for it
    checked: bool = False  # it passed for the round we are joining (a reconnect does not rerun it)

    def join(self) -> list[Effect]:
        """Join, after the health check when there is one (once per round: see ``checked``).

        The join deadline runs meanwhile, as it did when the check ran inline: a check longer
        than ``join_timeout`` times the join out."""
        if not self.settings.health_check or self.checked:
            return [SendJoin()]
        if self.checking:
            return []  # its result sends the join
        self.checking = True
        return [RunHealthCheck()]

    def check_done(self, event: HealthCheckDone) -> Exit | None:
        """Our health check finished (it was ``checking``): the exit when it failed; None: it
        passed, and the join may go."""
        self.checking = False
        if not event.ok:
            return Exit(EXIT_FAILED, f"health check failed, not joining: {event.detail}")
        self.checked = True
        return None

    def new_round(self) -> None:
        """We join a new round: its join is checked again."""
        self.checked = False

    def assigned(self) -> None:
        """Our place in a round came: the waiting is over (a next one is said again)."""
        self.last_waiting = None

    def waiting(self, msg: Waiting) -> list[Effect]:
        """The server's waiting update: said once per change."""
        key = (msg.joined, msg.round, msg.reason, msg.spare)
        if key == self.last_waiting:
            return []
        self.last_waiting = key
        what = f"waiting for nodes: {msg.joined} of {node_range(msg.min_nodes, msg.max_nodes)} joined"
        return [Log("info", f"{what} ({shown(msg.reason)})" if msg.reason else what)]

    def timed_out(self) -> Exit:
        """No round within join_timeout."""
        joined = f" ({self.last_waiting[0]} joined)" if self.last_waiting else ""
        return Exit(
            EXIT_RDZV,
            f"timed out after {self.settings.join_timeout:g} s waiting for the rendezvous to "
            f"complete{joined} (join_timeout)",
        )

    def not_needed(self) -> tuple[Log, Exit]:
        """The job finished while this node waited to join it: a hot spare (or a newcomer not
        yet in a round) outlived the job (see EXIT_NOT_NEEDED). The line, and the exit."""
        spare = self.last_waiting is not None and self.last_waiting[3]
        how = "it waited as a spare" if spare else "it had no place in a round yet"
        note = Log(
            "warning",
            f"the job this node waited to join finished without it ({how}; every node of the job succeeded)",
        )
        return note, Exit(EXIT_NOT_NEEDED, f"nothing left to do: exit code {EXIT_NOT_NEEDED}")
