"""What a node agent does, as a pure state machine.

The asyncio layer (``runner.py``) owns the server connection, the worker processes, signals
and timers. It turns what happens into events, calls :meth:`AgentMachine.handle` with the time
of its monotonic clock, and carries out the effects: send a message, start or stop the workers,
forward a signal, exit. The machine decides everything else, so races such as "the server says
restart while our own workers are failing" are plain synchronous tests.

Phases, in the order of one successful run::

    JOINING --assignment--> STARTING --started--> RUNNING --all exited 0--> BARRIER --job_done--> EXITED

Restarts loop back to JOINING: a ``Restart`` from the server (another node failed, a node came
or went) stops the workers (STOPPING) and re-joins. Our own worker failure is reported to the
server, the workers are stopped, and the server's verdict (``Restart`` or ``JobFailed``) decides
what follows (VERDICT). The server counts the restart budget; the agent never does.

Leaving. A drain (SIGTERM in an elastic job, or the server's ``Drain``) stops the workers with
SIGTERM and sends ``Leave``; the server answers ``Left(job_continues)``. The exit code follows
that answer: 0 only when the job goes on without this node, else 1 as torchrun exits on a
signal. Workers stopped and no answer yet, the agent waits in LEAVING (at most
``LEAVE_ANSWER_TIMEOUT``); no answer (the connection closed first, or an older server that never
sends one) counts as "does not go on": a scheduler is told of a failure rather than a success
that may not be one. SIGTERM in a fixed-size job exits 1 whatever the answer, as torchrun does.

The job ending while this node waits to join (a hot spare beyond --nnodes, or a newcomer that
was not yet in a round): ``JobDone`` exits ``EXIT_NOT_NEEDED`` (0) and ``JobFailed`` exits 1
with the job's reason.
"""

from __future__ import annotations

import enum
import signal

from protocol import (
    Assignment,
    Drain,
    Error,
    Failure,
    GoingAway,
    JobDone,
    JobFailed,
    Leave,
    Left,
    Message,
    Restart,
    Resumed,
    Waiting,
    WorkersFailed,
    WorkersSucceeded,
)
from protocol.records import record

EXIT_OK = 0
EXIT_FAILED = 1  # workers failed, the job failed, or we were told to stop (as torchrun)
EXIT_RDZV = 1  # the rendezvous could not be completed
# The job finished (every node of it succeeded) while this node waited to join, as a hot spare
# or a late newcomer: it was not needed. 0, because the job this node was started for
# succeeded and there is nothing left to do: Slurm marks a step FAILED and Kubernetes counts a
# pod failure (towards the Job's backoffLimit, or failing a JobSet) for any non-zero exit, and
# an unneeded spare must not turn a successful run into a failed one. The agent says so in a
# warning, which is where a second run that joined the first by mistake shows up.
EXIT_NOT_NEEDED = 0
# After a drain's Leave, how long to wait for the server's Left once the workers are down. The
# server answers in the same step that handles the Leave, so silence this long means no answer.
LEAVE_ANSWER_TIMEOUT = 10.0

TERMINATING_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})


class Phase(enum.Enum):
    JOINING = "joining"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    VERDICT = "awaiting verdict"
    BARRIER = "exit barrier"
    LEAVING = "leaving"  # drained, workers down: waiting for the server's Left to pick the exit code
    EXITED = "exited"


# --- events -------------------------------------------------------------------------------


@record(frozen=True, slots=True)
class ServerSent:
    msg: Message


@record(frozen=True, slots=True)
class WorkersStarted:
    pids: tuple[int, ...]


@record(frozen=True, slots=True)
class WorkersStartFailed:
    reason: str


@record(frozen=True, slots=True)
class WorkersExited:
    """All workers exited 0 (failure=None), or the first one failed (the others may still run)."""

    failure: Failure | None
    local_failures: tuple[Failure, ...] = ()


@record(frozen=True, slots=True)
class WorkersStopped:
    local_failures: tuple[Failure, ...] = ()


@record(frozen=True, slots=True)
class ConnectionLost:
    reason: str


@record(frozen=True, slots=True)
class SignalReceived:
    signum: int


@record(frozen=True, slots=True)
class Reconnected:
    """A new connection to the server is up (hello exchanged)."""


@record(frozen=True, slots=True)
class ReconnectFailed:
    reason: str


@record(frozen=True, slots=True)
class HealthCheckFailed:
    reason: str


@record(frozen=True, slots=True)
class Tick:
    pass


Event = (
    ServerSent
    | WorkersStarted
    | WorkersStartFailed
    | WorkersExited
    | WorkersStopped
    | ConnectionLost
    | SignalReceived
    | HealthCheckFailed
    | Reconnected
    | ReconnectFailed
    | Tick
)


# --- effects ------------------------------------------------------------------------------


@record(frozen=True, slots=True)
class SendJoin:
    """Join the next round (the I/O layer fills in a fresh free master port)."""


@record(frozen=True, slots=True)
class Send:
    msg: Message


@record(frozen=True, slots=True)
class Reconnect:
    """Connect to the server again, trying until ``deadline``; workers keep running."""

    deadline: float


@record(frozen=True, slots=True)
class SendResume:
    """Tell the new connection which round we hold (the I/O layer adds our join)."""

    assignment: Assignment
    succeeded: bool


@record(frozen=True, slots=True)
class StartWorkers:
    assignment: Assignment


@record(frozen=True, slots=True)
class StopWorkers:
    signum: int
    grace: float


@record(frozen=True, slots=True)
class ForwardSignal:
    signum: int


@record(frozen=True, slots=True)
class Exit:
    code: int
    reason: str
    failure: Failure | None = None  # the job's root cause, when there is one
    local_failures: tuple[Failure, ...] = ()


@record(frozen=True, slots=True)
class Log:
    level: str
    text: str


Effect = SendJoin | Send | Reconnect | SendResume | StartWorkers | StopWorkers | ForwardSignal | Exit | Log


class UnexpectedEvent(Exception):
    """A local bug: the I/O layer delivered an event the machine cannot be in a state for."""


@record(frozen=True, kw_only=True)
class AgentSettings:
    node_id: str
    addr: str  # the address this node reports (MASTER_ADDR when it has group rank 0)
    join_timeout: float
    exit_barrier_timeout: float
    shutdown_timeout: float  # grace between SIGTERM and SIGKILL for workers
    elastic: bool = False  # SIGTERM in an elastic job is a clean leave (drain), not a failure
    reconnect_timeout: float = 0.0  # keep workers running this long while reconnecting
    forward_signals: frozenset[int] = frozenset({signal.SIGUSR1, signal.SIGUSR2})
    handled_signals: frozenset[int] = TERMINATING_SIGNALS
    nproc: int = 1  # this node's workers, for the round line's rank range


@record
class AgentMachine:
    settings: AgentSettings
    phase: Phase = Phase.JOINING
    assignment: Assignment | None = None
    deadline: float | None = None
    local_failures: tuple[Failure, ...] = ()
    _after_stop: str = ""  # "rejoin" | "verdict" | "exit"
    _exit: Exit | None = None
    _last_waiting: tuple[int, int, str] | None = None
    _signalled: int | None = None
    _leaving: bool = False  # we told the server we leave; its closing the connection is expected
    _awaiting_left: bool = False  # a drain's exit code waits for the server's Left
    _drain_why: str = ""
    away: bool = False  # the connection broke and we are reconnecting

    def start(self, now: float) -> list[Effect]:
        """The connection is up and the hello exchanged: join the first round."""
        self.deadline = now + self.settings.join_timeout
        return [SendJoin()]

    def next_deadline(self) -> float | None:
        return self.deadline

    def handle(self, event: Event, now: float) -> list[Effect]:
        if self.phase is Phase.EXITED:
            return []
        if isinstance(event, ServerSent):
            return self._on_server(event.msg, now)
        if isinstance(event, WorkersStarted):
            return self._on_started()
        if isinstance(event, WorkersStartFailed):
            return self._on_start_failed(event, now)
        if isinstance(event, WorkersExited):
            return self._on_exited(event, now)
        if isinstance(event, WorkersStopped):
            return self._on_stopped(event, now)
        if isinstance(event, ConnectionLost):
            return self._on_connection_lost(event, now)
        if isinstance(event, Reconnected):
            return self._on_reconnected()
        if isinstance(event, ReconnectFailed):
            return self._on_reconnect_failed(event)
        if isinstance(event, SignalReceived):
            return self._on_signal(event.signum, now)
        if isinstance(event, HealthCheckFailed):
            exit_ = Exit(EXIT_FAILED, f"health check failed, not joining: {event.reason}")
            return [Send(Leave(reason="health check failed")), *self._stop_then_exit(exit_)]
        if isinstance(event, Tick):
            return self._on_tick(now)
        raise UnexpectedEvent(f"unknown event {event!r} in phase {self.phase.value}")

    # -- server messages -------------------------------------------------------------------

    def _on_server(self, msg: Message, now: float) -> list[Effect]:
        if isinstance(msg, Left):
            return self._on_left(msg)
        if self.phase is Phase.LEAVING:
            return self._while_leaving(msg)
        if isinstance(msg, Waiting):
            return self._on_waiting(msg)
        if isinstance(msg, Assignment):
            if self.phase is not Phase.JOINING:
                raise UnexpectedEvent(f"assignment for round {msg.round} in phase {self.phase.value}")
            self.assignment = msg
            self.phase = Phase.STARTING
            self.deadline = None
            self._last_waiting = None
            return [
                Log(
                    "info",
                    f"round {msg.round}: group rank {msg.group_rank} of {msg.group_world_size}, "
                    f"{_ranks(msg.rank_offset, self.settings.nproc)}, world size {msg.world_size}, "
                    f"master {msg.master_addr}:{msg.master_port}, restart {msg.restart_count}",
                ),
                StartWorkers(msg),
            ]
        if isinstance(msg, Restart):
            return self._on_restart(msg, now)
        if isinstance(msg, JobFailed):
            where = " while this node waited to join it" if self.phase is Phase.JOINING else ""
            exit_ = Exit(EXIT_FAILED, f"job failed{where}: {msg.reason}", msg.failure, self.local_failures)
            if self._awaiting_left:
                # The job's failure is the reason to report, not the pending drain's.
                self._awaiting_left, self._exit = False, None
            return self._stop_then_exit(exit_)
        if isinstance(msg, JobDone):
            if self.phase is Phase.BARRIER:
                return self._exit_now(Exit(EXIT_OK, "all nodes finished"))
            if self.phase is Phase.JOINING:
                # A hot spare (or a newcomer not yet in a round) outlived the job: see EXIT_NOT_NEEDED.
                spare = self._last_waiting is not None and "spare" in self._last_waiting[2]
                how = "it waited as a spare" if spare else "it had no place in a round yet"
                note = Log(
                    "warning",
                    f"the job this node waited to join finished without it ({how}; every node of "
                    "the job succeeded)",
                )
                exit_ = Exit(EXIT_NOT_NEEDED, f"nothing left to do: exit code {EXIT_NOT_NEEDED}")
                return [note, *self._exit_now(exit_)]
            if self._awaiting_left and self.phase is Phase.STOPPING:
                self._awaiting_left = False
                self._exit = Exit(EXIT_OK, "all nodes finished")
                return []
            raise UnexpectedEvent(f"job_done in phase {self.phase.value}")
        if isinstance(msg, Resumed):
            how = "rebuilt by the server from its agents" if msg.rebuilt else "the server kept it"
            return [Log("info", f"resumed round {msg.round} ({how}); workers were not restarted")]
        if isinstance(msg, Drain):
            if self._leaving:
                return []  # already on our way out
            why = f"asked to drain by the server: {msg.reason}" if msg.reason else "asked to drain"
            return self._drain(why, now)
        if isinstance(msg, GoingAway):
            # The server closes the connection next; we reconnect as after any lost connection.
            why = f" ({msg.reason})" if msg.reason else ""
            keep = "workers keep running; " if self.phase in (Phase.STARTING, Phase.RUNNING) else ""
            return [Log("warning", f"the rendezvous server is going away{why}; {keep}will reconnect")]
        if isinstance(msg, Error) and not msg.fatal:
            return [Log("warning", f"rendezvous server: {msg.message} ({msg.code})")]
        if isinstance(msg, Error):
            return self._stop_then_exit(Exit(EXIT_RDZV, f"rendezvous server refused us: {msg.message}"))
        raise UnexpectedEvent(f"{msg.TYPE} from the server in phase {self.phase.value}")

    def _on_waiting(self, msg: Waiting) -> list[Effect]:
        key = (msg.joined, msg.round, msg.reason)
        if key == self._last_waiting:
            return []
        self._last_waiting = key
        what = f"waiting for nodes: {msg.joined} of {_range(msg.min_nodes, msg.max_nodes)} joined"
        return [Log("info", f"{what} ({msg.reason})" if msg.reason else what)]

    def _on_restart(self, msg: Restart, now: float) -> list[Effect]:
        note = Log("warning", f"re-rendezvous after round {msg.round}: {msg.reason}")
        if self.phase in (Phase.RUNNING, Phase.STARTING):
            self.phase = Phase.STOPPING
            self._after_stop = "rejoin"
            return [note, StopWorkers(signal.SIGTERM, self.settings.shutdown_timeout)]
        if self.phase is Phase.STOPPING:
            if self._after_stop == "verdict":
                self._after_stop = "rejoin"
            return [note]
        if self.phase in (Phase.VERDICT, Phase.BARRIER):
            return [note, *self._rejoin(now)]
        return [note]  # JOINING: the round we are joining was reshaped; our join stands

    # -- workers ---------------------------------------------------------------------------

    def _on_started(self) -> list[Effect]:
        if self.phase is Phase.STARTING:
            self.phase = Phase.RUNNING
        return []

    def _on_start_failed(self, event: WorkersStartFailed, now: float) -> list[Effect]:
        if self.phase is not Phase.STARTING or self.assignment is None:
            return []
        a = self.assignment
        failure = Failure(
            node_id=self.settings.node_id,
            addr=self.settings.addr,
            rank=a.rank_offset,
            local_rank=0,
            exitcode=127,
            signal="",
            timestamp=now,
            message=event.reason,
        )
        self.local_failures = (failure,)
        self.phase = Phase.VERDICT
        return [
            Log("error", f"workers failed to start: {event.reason}"),
            Send(WorkersFailed(round=a.round, failure=failure)),
        ]

    def _on_exited(self, event: WorkersExited, now: float) -> list[Effect]:
        if self.phase is not Phase.RUNNING or self.assignment is None:
            return []  # we are already stopping them for another reason
        if event.failure is None:
            self.phase = Phase.BARRIER
            self.deadline = now + self.settings.exit_barrier_timeout
            effects: list[Effect] = [Send(WorkersSucceeded(round=self.assignment.round))]
            if self.assignment.group_world_size > 1:
                effects.insert(0, Log("info", "workers finished; waiting for the other nodes (exit barrier)"))
            return effects
        self.local_failures = event.local_failures or (event.failure,)
        if self.away:
            # Nobody to report to: stop and fail; the server will see this node gone.
            why = "a worker failed while the rendezvous server was unreachable"
            return self._stop_then_exit(Exit(EXIT_FAILED, why, event.failure, self.local_failures))
        self.phase = Phase.STOPPING
        self._after_stop = "verdict"
        return [
            Send(WorkersFailed(round=self.assignment.round, failure=event.failure)),
            StopWorkers(signal.SIGTERM, self.settings.shutdown_timeout),
        ]

    def _on_stopped(self, event: WorkersStopped, now: float) -> list[Effect]:
        if self.phase is not Phase.STOPPING:
            return []
        if event.local_failures and not self.local_failures:
            self.local_failures = event.local_failures
        after, self._after_stop = self._after_stop, ""
        if after == "rejoin":
            return self._rejoin(now)
        if after == "verdict":
            self.phase = Phase.VERDICT
            return []
        if self._awaiting_left:
            return self._wait_for_left(now)
        exit_ = self._exit or Exit(EXIT_FAILED, "stopped")
        return self._exit_now(exit_)

    # -- the rest --------------------------------------------------------------------------

    def _on_connection_lost(self, event: ConnectionLost, now: float) -> list[Effect]:
        if self._awaiting_left:
            # Closed before the answer (or by an older server, which sends none): assume the job
            # does not go on without us.
            self._awaiting_left = False
            self._exit = Exit(
                EXIT_FAILED,
                f"drained: {self._drain_why}; the connection to the rendezvous server closed "
                f"({event.reason}) before it said whether the job goes on without this node",
            )
        if self._leaving:
            return (
                []
                if self.phase is Phase.STOPPING
                else self._exit_now(self._exit or Exit(EXIT_FAILED, "left"))
            )
        resumable = (Phase.JOINING, Phase.STARTING, Phase.RUNNING, Phase.BARRIER)
        if self.settings.reconnect_timeout > 0 and self.phase in resumable and self._exit is None:
            self.away = True
            keep = "workers keep running; " if self.phase in (Phase.STARTING, Phase.RUNNING) else ""
            return [
                Log(
                    "warning",
                    f"lost the connection to the rendezvous server ({event.reason}); {keep}"
                    f"reconnecting for up to {self.settings.reconnect_timeout:g} s",
                ),
                Reconnect(deadline=now + self.settings.reconnect_timeout),
            ]
        return self._gone(event.reason)

    def _on_reconnected(self) -> list[Effect]:
        if not self.away or self._leaving:
            self.away = False
            return []
        self.away = False
        if self.phase is Phase.JOINING:
            return [Log("info", "reconnected; joining again"), SendJoin()]
        if self.assignment is not None and self.phase in (Phase.STARTING, Phase.RUNNING, Phase.BARRIER):
            done = self.phase is Phase.BARRIER
            return [Log("info", "reconnected; resuming our round"), SendResume(self.assignment, done)]
        return []

    def _on_reconnect_failed(self, event: ReconnectFailed) -> list[Effect]:
        self.away = False
        return self._gone(
            f"{event.reason} (could not reconnect within {self.settings.reconnect_timeout:g} s)"
        )

    def _gone(self, reason: str) -> list[Effect]:
        if self.phase is Phase.BARRIER:
            return self._exit_now(
                Exit(EXIT_OK, f"lost the rendezvous server during the exit barrier ({reason})")
            )
        return self._stop_then_exit(
            Exit(EXIT_RDZV, f"lost the connection to the rendezvous server: {reason}")
        )

    def _on_signal(self, signum: int, now: float) -> list[Effect]:
        if signum in self.settings.forward_signals and self.phase in (Phase.RUNNING, Phase.STARTING):
            return [ForwardSignal(signum)]
        if signum not in self.settings.handled_signals:
            return []
        name = signal.Signals(signum).name
        if self._signalled is not None:
            # A second signal while we stop: the user insists.
            if self.phase is Phase.LEAVING:
                return self._exit_now(self._exit or Exit(EXIT_FAILED, f"received {name} while leaving"))
            return [ForwardSignal(signal.SIGKILL)] if self.phase is Phase.STOPPING else []
        self._signalled = signum
        if self.settings.elastic and signum == signal.SIGTERM:
            return self._drain(f"received {name}", now)
        exit_ = Exit(EXIT_FAILED, f"received {name}: workers stopped", None, self.local_failures)
        self._leaving = True
        return [*self._stop_then_exit(exit_, signum), Send(Leave(reason=f"agent received {name}"))]

    def _drain(self, why: str, now: float) -> list[Effect]:
        """A clean leave: workers get SIGTERM first (to checkpoint); the server's Left picks the code."""
        self._leaving = True
        note = Log("warning", f"{why}: draining (workers get SIGTERM, then this node leaves the job)")
        leave = Send(Leave(reason=f"drain: {why}"))
        if self._exit is not None:
            # Already exiting for another reason (the job failed, the server refused us): keep it.
            return [note, *self._stop_then_exit(self._exit), leave]
        if self.away:
            # Nobody can say whether the job goes on without us: assume it does not.
            why_not = (
                f"drained: {why}; the rendezvous server was unreachable, so nobody confirmed that "
                "the job goes on without this node"
            )
            return [note, *self._stop_then_exit(Exit(EXIT_FAILED, why_not))]
        self._drain_why = why
        self._awaiting_left = True
        pending = Exit(
            EXIT_FAILED,
            f"drained: {why}; the rendezvous server did not answer whether the job goes on without "
            f"this node (no answer within {LEAVE_ANSWER_TIMEOUT:g} s)",
        )
        if self.phase in (Phase.RUNNING, Phase.STARTING, Phase.STOPPING):
            return [note, *self._stop_then_exit(pending), leave]
        self._exit = pending
        return [note, leave, *self._wait_for_left(now)]

    def _wait_for_left(self, now: float) -> list[Effect]:
        """No workers to stop: wait for the server's answer to our Leave, within a bound."""
        self.phase = Phase.LEAVING
        self.deadline = now + LEAVE_ANSWER_TIMEOUT
        return []

    def _on_left(self, msg: Left) -> list[Effect]:
        if not self._awaiting_left:
            return []  # a Leave whose exit code was decided without the answer (fixed-size SIGTERM)
        self._awaiting_left = False
        why = self._drain_why
        if msg.job_continues:
            exit_ = Exit(
                EXIT_OK, f"drained: {why}; left the job, which goes on without this node ({msg.reason})"
            )
        else:
            exit_ = Exit(
                EXIT_FAILED,
                f"drained: {why}; left the job, which does not go on without this node ({msg.reason})",
            )
        self._exit = exit_
        if self.phase is Phase.LEAVING:
            return self._exit_now(exit_)
        return []  # workers still stopping: _on_stopped exits with it

    def _while_leaving(self, msg: Message) -> list[Effect]:
        """Workers down, waiting for Left: what else the server says no longer changes our course."""
        if isinstance(msg, JobDone):
            self._awaiting_left = False
            return self._exit_now(Exit(EXIT_OK, "all nodes finished"))
        if isinstance(msg, JobFailed):
            self._awaiting_left = False
            return self._exit_now(
                Exit(EXIT_FAILED, f"job failed: {msg.reason}", msg.failure, self.local_failures)
            )
        if isinstance(msg, Error) and msg.fatal:
            return self._exit_now(Exit(EXIT_RDZV, f"rendezvous server refused us: {msg.message}"))
        return []  # an assignment or restart that crossed our Leave, a waiting update, ...

    def _on_tick(self, now: float) -> list[Effect]:
        if self.deadline is None or now < self.deadline:
            return []
        self.deadline = None
        if self.phase is Phase.JOINING:
            joined = f" ({self._last_waiting[0]} joined)" if self._last_waiting else ""
            return [
                Send(Leave(reason="join timeout")),
                *self._exit_now(
                    Exit(
                        EXIT_RDZV,
                        f"timed out after {self.settings.join_timeout:g} s waiting for the rendezvous to "
                        f"complete{joined} (join_timeout)",
                    )
                ),
            ]
        if self.phase is Phase.BARRIER:
            return self._exit_now(
                Exit(EXIT_OK, f"exit barrier timed out after {self.settings.exit_barrier_timeout:g} s")
            )
        if self.phase is Phase.LEAVING:
            self._awaiting_left = False
            return self._exit_now(self._exit or Exit(EXIT_FAILED, "left without an answer from the server"))
        return []

    def _rejoin(self, now: float) -> list[Effect]:
        self.phase = Phase.JOINING
        self.assignment = None
        self.deadline = now + self.settings.join_timeout
        return [SendJoin()]

    def _stop_then_exit(self, exit_: Exit, signum: int = signal.SIGTERM) -> list[Effect]:
        if self.phase in (Phase.RUNNING, Phase.STARTING):
            self.phase = Phase.STOPPING
            self._after_stop = "exit"
            self._exit = exit_
            return [StopWorkers(signum, self.settings.shutdown_timeout)]
        if self.phase is Phase.STOPPING:
            self._after_stop = "exit"
            # The first reason to exit is the one a person needs (a refusal, not the
            # connection closing right after it).
            self._exit = self._exit or exit_
            return []
        return self._exit_now(exit_)

    def _exit_now(self, exit_: Exit) -> list[Effect]:
        self.phase = Phase.EXITED
        self.deadline = None
        if not exit_.local_failures and self.local_failures:
            exit_ = Exit(exit_.code, exit_.reason, exit_.failure, self.local_failures)
        return [exit_]


def _ranks(first: int, count: int) -> str:
    return f"rank {first}" if count == 1 else f"ranks {first}-{first + count - 1}"


def _range(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}:{hi}"
