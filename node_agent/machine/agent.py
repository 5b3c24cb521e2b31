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
what follows (VERDICT, at most ``join_timeout``). The server counts the restart budget; the
agent checks its word: an assignment for another job, past this node's ``--max-restarts``,
outside its ``--nnodes`` or with ranks its world does not hold (and a restart past the budget)
is the server's protocol error, and the agent stops its workers and exits 1.

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

Commit points (issue 20; ``training.py`` has the steps). The server's ``StopAt`` for the round
we run goes into the pages (``WriteStop``: arm, go, cancel); the ``Armed`` answer follows once
every local rank has seen the armed step. Workers that all stopped at the go'd step and exited
0 are no success of the job: the agent says ``WorkersCommitted`` and waits in BARRIER for the
``Restart`` that starts the next round (at most ``join_timeout``, then it exits
``EXIT_RDZV``); a reconnect there says ``WorkersCommitted`` again. ``StopAt`` in any other phase,
or for another round, is ignored.

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

Every wait on the server ends by itself: joining at ``join_timeout``, the verdict at
``join_timeout``, the exit barrier at ``exit_barrier_timeout``, leaving at
``LEAVE_ANSWER_TIMEOUT``, and any of them while the connection is down at the reconnect window.

Watching the training (``training.py``): the I/O layer's reads of the ranks' progress pages
come in as ``ProgressRead``; summaries go to the server, and a hang is reported
(``HangDetected``), its stacks collected (``DumpStacks``, answered by ``StacksDumped``) and
then failed as this node's worker failure. The server's ``CollectStacks`` (another node's
hang) asks for the stacks only. ``JobFailed(code="crash_loop")`` exits ``EXIT_CRASH_LOOP``.

``--health-check`` runs before each round's join as an effect (``RunHealthCheck``), and its
result comes back as an event (``HealthCheckDone``): the I/O layer never waits on it, so a
signal during a long check is handled at once (the check is killed when the agent exits).

The server's messages. Every message has an outcome in every phase. One that makes no sense in
ours (an assignment we did not join for, the job "done" while our workers run) is the server's
mistake: a protocol error, logged, and where the agent cannot go on it stops its workers and
exits 1 with that message. ``UnexpectedEvent`` is kept for our own bugs (an unknown event).
Its texts are shown escaped (``agent_log.shown``), so they cannot forge our lines or drive the
terminal, and what we send built from them (a drain's Leave) is cut to fit its field.

The job ending while this node waits to join (a hot spare beyond --nnodes, or a newcomer that
was not yet in a round): ``JobDone`` exits ``EXIT_NOT_NEEDED`` (0) and ``JobFailed`` exits 1
with the job's reason.
"""

from __future__ import annotations

import enum
import signal

from protocol import (
    COMMIT_LEAD,
    MAX_TEXT_LEN,
    Armed,
    Assignment,
    CollectStacks,
    Drain,
    Error,
    Failure,
    GoingAway,
    JobDone,
    JobFailed,
    Leave,
    LeaveAfterCommit,
    Left,
    Message,
    Restart,
    Resumed,
    StopAt,
    Waiting,
    Welcome,
    WorkersCommitted,
    WorkersFailed,
    WorkersSucceeded,
)
from protocol.records import record

from ..agent_log import shown
from .events import (
    EXIT_CRASH_LOOP,
    EXIT_FAILED,
    EXIT_NOT_NEEDED,
    EXIT_OK,
    EXIT_RDZV,
    LEAVE_ANSWER_TIMEOUT,
    AgentSettings,
    ConnectionLost,
    DumpStacks,
    Effect,
    Event,
    Exit,
    ForwardSignal,
    HealthCheckDone,
    Log,
    PageWarning,
    Phase,
    ProgressRead,
    Reconnect,
    Reconnected,
    ReconnectFailed,
    RunHealthCheck,
    Send,
    SendJoin,
    SendResume,
    ServerSent,
    SignalReceived,
    StacksDumped,
    StartWorkers,
    StopWorkers,
    Tick,
    UnexpectedEvent,
    WorkersExited,
    WorkersStarted,
    WorkersStartFailed,
    WorkersStopped,
)
from .training import Training, job_hang_report


class AfterStop(enum.Enum):
    """What STOPPING goes on to once the workers are down."""

    NOTHING = "nothing"  # not stopping
    REJOIN = "rejoin"  # join the next round (a Restart)
    VERDICT = "verdict"  # wait for the server's verdict on our reported failure
    LEAVE = "leave"  # a drain: send the Leave, wait for Left
    EXIT = "exit"  # exit with the decided reason


@record
class AgentMachine:
    settings: AgentSettings
    phase: Phase = Phase.JOINING
    assignment: Assignment | None = None
    deadline: float | None = None
    local_failures: tuple[Failure, ...] = ()
    _after_stop: AfterStop = AfterStop.NOTHING
    _exit: Exit | None = None  # decided: the workers stop (if they run), then the agent exits with it
    _last_waiting: tuple[int, int, str, bool] | None = None  # joined, round, reason, spare
    _signalled: int | None = None
    _delivered: bool = False  # the workers got _signalled from its sender: stops send no signal
    # Signals passed on to (or delivered with) this attempt's workers: a worker they kill is
    # no failure to restart for, but a stop, as if the agent had been sent a handled signal.
    _passed_on: frozenset[int] = frozenset()
    _leaving: bool = False  # on our way out of the job by a Leave (a drain, or SIGTERM/SIGINT)
    _leave: Leave | None = None  # the Leave to send once the workers are down (again after a reconnect)
    _awaiting_left: bool = False  # a drain's exit code waits for the server's Left
    _drain_why: str = ""
    # Our workers' failure, reported and not yet decided on by the server: sent again after a
    # reconnect (or first then, when it happened while the server was unreachable).
    _report: WorkersFailed | None = None
    _succeeded: bool = False  # every worker of the round we hold exited 0 (said again in a Resume)
    # The commit step every worker of the round we hold stopped at (BARRIER, waiting for the
    # server's Restart; said again after a reconnect's Resumed); None: not committed.
    _committed: int | None = None
    # A SIGTERM drain waiting for a commit point (our LeaveAfterCommit is out): its reason,
    # and when we asked (its give-up line says how long we waited).
    _commit_leave: str | None = None
    _commit_asked_at: float = 0.0
    away: bool = False  # the connection broke: nothing can be sent until Reconnected
    # Our Resume is out on a new connection and not yet answered: until the answer says whether
    # the server holds us in its round, what only a node of the round may say waits.
    _resuming: bool = False
    _checking: bool = False  # our --health-check runs; the join waits for it
    _checked: bool = False  # it passed for the round we are joining (a reconnect does not rerun it)
    # Progress summaries and hang verdicts (training.py); None: the agent does not watch them.
    training: Training | None = None

    def start(self, now: float) -> list[Effect]:
        """The connection is up and the hello exchanged: join the first round."""
        self.deadline = now + self.settings.join_timeout
        return self._join()

    def _join(self) -> list[Effect]:
        """Join, after the health check when there is one (once per round: see ``_checked``).

        The join deadline runs meanwhile, as it did when the check ran inline: a check longer
        than ``join_timeout`` times the join out."""
        if not self.settings.health_check or self._checked:
            return [SendJoin()]
        if self._checking:
            return []  # its result sends the join
        self._checking = True
        return [RunHealthCheck()]

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
            return self._on_reconnected(now)
        if isinstance(event, ReconnectFailed):
            return self._on_reconnect_failed(event)
        if isinstance(event, SignalReceived):
            return self._on_signal(event.signum, now, event.delivered)
        if isinstance(event, HealthCheckDone):
            return self._on_health_check_done(event)
        if isinstance(event, Tick):
            return self._on_tick(now)
        if isinstance(event, ProgressRead):
            return self._on_progress(event, now)
        if isinstance(event, StacksDumped):
            return self._on_stacks_dumped(event, now)
        raise UnexpectedEvent(f"unknown event {event!r} in phase {self.phase.value}")

    # -- server messages -------------------------------------------------------------------

    def _on_server(self, msg: Message, now: float) -> list[Effect]:
        if self._resuming and isinstance(msg, Resumed | Restart | JobFailed | JobDone | Error):
            return self._on_resume_answer(msg, now)
        return self._on_server_now(msg, now)

    def _on_server_now(self, msg: Message, now: float) -> list[Effect]:
        # First what may come in any phase, then what a leaving node no longer acts on.
        if isinstance(msg, Left):
            return self._on_left(msg)
        if isinstance(msg, JobFailed):
            return [*self._job_hang_report(msg.report, restart=False), *self._on_job_failed(msg)]
        if isinstance(msg, JobDone):
            return self._on_job_done()
        if isinstance(msg, Error):
            return self._on_error(msg)
        if isinstance(msg, GoingAway):
            # The server closes the connection next; we reconnect as after any lost connection.
            why = f" ({shown(msg.reason)})" if msg.reason else ""
            return [
                Log("warning", f"the rendezvous server is going away{why}; {self._what_now()}will reconnect")
            ]
        if isinstance(msg, Resumed):
            if self.settings.job_id and msg.job_id != self.settings.job_id:
                mine = self.settings.job_id
                text = f"took this node back into job {shown(msg.job_id)!r}, but it runs job {mine!r}"
                return self._protocol_error(text, fatal=True)
            how = "rebuilt by the server from its agents" if msg.rebuilt else "the server kept it"
            if self.phase in (Phase.STARTING, Phase.RUNNING, Phase.BARRIER):
                return [Log("info", f"resumed round {msg.round} ({how}); workers were not restarted")]
            return [Log("info", f"the server took this node back into round {msg.round} ({how})")]
        if isinstance(msg, Welcome):
            return self._protocol_error("a second welcome on an open connection; ignored", fatal=False)
        if isinstance(msg, CollectStacks):
            dump = self.training.on_collect(msg.round, msg.reason) if self.training is not None else None
            if dump is None or self.phase is not Phase.RUNNING:
                return []  # not running that round (any more), or collecting already
            return [Log("warning", f"the server asks for our ranks' stacks: {shown(msg.reason)}"), dump]
        if isinstance(msg, StopAt):
            return self._on_stop_at(msg, now)
        if self.phase is Phase.LEAVING:
            # Workers down, our Leave out: an assignment or restart that crossed it, a waiting
            # update or a drain request no longer change our course.
            return []
        if isinstance(msg, Waiting):
            return self._on_waiting(msg)
        if isinstance(msg, Assignment):
            return self._on_assignment(msg)
        if isinstance(msg, Restart):
            return [*self._on_restart(msg, now), *self._job_hang_report(msg.report, restart=True)]
        if isinstance(msg, Drain):
            if self._leaving or self._exit is not None:
                return []  # already on our way out
            why = f"asked to drain by the server: {shown(msg.reason)}" if msg.reason else "asked to drain"
            # Our own SIGTERM's drain, once the commit point it waited for is behind us.
            return self._drain(self._commit_leave or why, now)
        return self._protocol_error(
            f"{msg.TYPE}, which a server never sends, while this node {self._doing()}", fatal=False
        )

    def _on_resume_answer(self, msg: Message, now: float) -> list[Effect]:
        """The server's answer to our Resume, then what waited for it.

        ``Resumed``: we are a node of its round again; say what we have to say (our failure
        report, that our workers finished, that we leave). ``Restart``: the round moved on (or
        it had dropped us): that is the verdict on any failure, and the round stops anyway, so
        only a due Leave still goes. Anything else ends our course as usual."""
        if isinstance(msg, Error) and not msg.fatal:
            return self._on_server_now(msg, now)  # a draining server: it closes, we come back
        self._resuming = False
        effects = self._on_server_now(msg, now)
        if self.phase is Phase.EXITED or isinstance(msg, JobFailed | JobDone | Error):
            return effects
        due: list[Effect] = []
        if isinstance(msg, Resumed):
            a = self.assignment
            if self.phase is Phase.BARRIER and a is not None and self._committed is not None:
                due.append(Send(WorkersCommitted(round=a.round, step=self._committed)))
            elif self.phase is Phase.BARRIER and a is not None:
                due.append(Send(WorkersSucceeded(round=a.round)))  # they may have finished since
            if self.phase is Phase.RUNNING and a is not None and self._commit_leave is not None:
                # The server may have lost it with its state: asking twice is harmless.
                due.append(Send(self._leave_after_commit(a.round, self._commit_leave)))
            if self._report is not None:
                due.append(Send(self._report))
            if self.phase is Phase.STOPPING and self._leaving and self._leave is not None:
                due.append(Send(self._notice(self._leave)))
        if self.phase is Phase.LEAVING and self._leave is not None:
            due.append(Send(self._leave))
            self.deadline = now + LEAVE_ANSWER_TIMEOUT
        return [*effects, *due]

    def _protocol_error(self, text: str, *, fatal: bool) -> list[Effect]:
        """The server sent what makes no sense in our phase: its mistake, not ours (no traceback).

        Said once as it happens; where we cannot go on, the workers stop and the agent exits 1
        with the same words."""
        note = Log("error", f"protocol error by the rendezvous server: {text}")
        if not fatal:
            return [note]
        self._report, self._leave = None, None
        return [
            note,
            *self._stop_then_exit(Exit(EXIT_RDZV, f"the rendezvous server broke the protocol: {text}")),
        ]

    def _on_assignment(self, msg: Assignment) -> list[Effect]:
        if self.phase is not Phase.JOINING:
            if msg == self.assignment:
                return self._protocol_error(
                    f"the assignment for round {msg.round} again; ignored", fatal=False
                )
            # We did not join for it: the server counts ranks of ours that will never run.
            text = (
                f"an assignment for round {msg.round}, but this node did not join for one "
                f"(it {self._doing()})"
            )
            return self._protocol_error(text, fatal=True)
        problem = self._contradiction(msg)
        if problem is not None:
            return self._protocol_error(problem, fatal=True)
        self.assignment = msg
        self.phase = Phase.STARTING
        self.deadline = None
        self._last_waiting = None
        self._passed_on = frozenset()  # a new attempt's workers have received nothing yet
        if self.training is not None:
            self.training.start(msg)
        return [
            Log(
                "info",
                f"round {msg.round}: group rank {msg.group_rank} of {msg.group_world_size}, "
                f"{_ranks(msg.rank_offset, self.settings.nproc)}, world size {msg.world_size}, "
                f"master {shown(msg.master_addr)}:{msg.master_port}, restart {msg.restart_count}",
            ),
            StartWorkers(msg),
        ]

    def _contradiction(self, a: Assignment) -> str | None:
        """How an assignment contradicts what this node was started with, or None.

        The server counts restarts and sizes the world; the agent does not trust it to: a
        buggy or hostile one could run this node for another job, restart it for ever past
        its --max-restarts, or give it ranks that do not exist."""
        s = self.settings
        if s.job_id and a.job_id != s.job_id:
            return f"an assignment for job {shown(a.job_id)!r}, but this node runs job {s.job_id!r}"
        if s.max_restarts is not None:
            if a.max_restarts != s.max_restarts:
                return (
                    f"an assignment that says --max-restarts {a.max_restarts}, but this node has "
                    f"--max-restarts {s.max_restarts}"
                )
            if a.restart_count > s.max_restarts:
                return (
                    f"an assignment for restart {a.restart_count}, past this node's budget "
                    f"(--max-restarts {s.max_restarts})"
                )
        if not s.min_nodes <= a.group_world_size <= s.max_nodes:
            return (
                f"an assignment for a round of {a.group_world_size} nodes, but this node has "
                f"--nnodes {_range(s.min_nodes, s.max_nodes)}"
            )
        if a.rank_offset + s.nproc > a.world_size or a.world_size < a.group_world_size:
            return (
                f"an assignment whose ranks do not fit its world: {_ranks(a.rank_offset, s.nproc)} "
                f"of this node's {s.nproc} worker(s) in a world size {a.world_size} of "
                f"{a.group_world_size} nodes"
            )
        return None

    def _on_job_failed(self, msg: JobFailed) -> list[Effect]:
        where = " while this node waited to join it" if self.phase is Phase.JOINING else ""
        code = EXIT_CRASH_LOOP if msg.code == "crash_loop" else EXIT_FAILED
        what = "job failed (a crash loop)" if code == EXIT_CRASH_LOOP else "job failed"
        exit_ = Exit(code, f"{what}{where}: {shown(msg.reason)}", msg.failure, self.local_failures)
        # The job's failure is the reason to report, not a pending drain's; nothing is left to
        # report or leave.
        self._awaiting_left, self._report, self._leave = False, None, None
        return self._stop_then_exit(exit_)

    def _on_job_done(self) -> list[Effect]:
        if self.phase in (Phase.BARRIER, Phase.LEAVING):
            self._awaiting_left = False
            return self._exit_now(Exit(EXIT_OK, "all nodes finished", job_done=True))
        if self.phase is Phase.JOINING:
            # A hot spare (or a newcomer not yet in a round) outlived the job: see EXIT_NOT_NEEDED.
            spare = self._last_waiting is not None and self._last_waiting[3]
            how = "it waited as a spare" if spare else "it had no place in a round yet"
            note = Log(
                "warning",
                f"the job this node waited to join finished without it ({how}; every node of "
                "the job succeeded)",
            )
            return [
                note,
                *self._exit_now(Exit(EXIT_NOT_NEEDED, f"nothing left to do: exit code {EXIT_NOT_NEEDED}")),
            ]
        if self.phase is Phase.STOPPING and self._after_stop is AfterStop.LEAVE:
            # Drained, and the job finished while our workers stop: a success, nothing to leave.
            self._awaiting_left, self._leave = False, None
            self._after_stop, self._exit = AfterStop.EXIT, Exit(EXIT_OK, "all nodes finished", job_done=True)
            return []
        if self._exit is not None:
            return []  # on our way out already, for a reason of its own
        # Our workers run (or failed): the server finished the job without us, which it does
        # only after it dropped this node (frozen, or cut off, past the heartbeat timeout).
        doing = self._doing()
        self._report, self._leave = None, None
        return [
            Log("error", f"the rendezvous server says the job finished while this node {doing}; stopping"),
            *self._stop_then_exit(Exit(EXIT_FAILED, f"the job finished without this node (it {doing})")),
        ]

    def _on_error(self, msg: Error) -> list[Effect]:
        if not msg.fatal:
            return [Log("warning", f"rendezvous server: {shown(msg.message)} ({shown(msg.code)})")]
        self._awaiting_left, self._report, self._leave = False, None, None
        return self._stop_then_exit(Exit(EXIT_RDZV, f"rendezvous server refused us: {shown(msg.message)}"))

    def _on_waiting(self, msg: Waiting) -> list[Effect]:
        key = (msg.joined, msg.round, msg.reason, msg.spare)
        if key == self._last_waiting:
            return []
        self._last_waiting = key
        what = f"waiting for nodes: {msg.joined} of {_range(msg.min_nodes, msg.max_nodes)} joined"
        return [Log("info", f"{what} ({shown(msg.reason)})" if msg.reason else what)]

    def _on_restart(self, msg: Restart, now: float) -> list[Effect]:
        budget = self.settings.max_restarts
        if budget is not None and msg.restart_count > budget and not self._leaving and self._exit is None:
            text = f"a restart {msg.restart_count}, past this node's budget (--max-restarts {budget})"
            return self._protocol_error(text, fatal=True)
        note = Log("warning", f"re-rendezvous after round {msg.round}: {shown(msg.reason)}")
        self._report = None  # if we reported a failure, this is the verdict
        if self._commit_leave is not None:
            return [note, *self._drain(self._commit_leave, now)]  # no rejoin: we were leaving
        if self.phase in (Phase.RUNNING, Phase.STARTING):
            self.phase = Phase.STOPPING
            self._after_stop = AfterStop.REJOIN
            return [note, StopWorkers(signal.SIGTERM, self.settings.shutdown_timeout)]
        if self.phase is Phase.STOPPING:
            if self._after_stop is AfterStop.VERDICT:
                self._after_stop = AfterStop.REJOIN
            return [note]  # already stopping: to rejoin, to leave, or to exit
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
            timestamp=now + self.settings.wall_offset,
            message=event.reason,
        )
        self.local_failures = (failure,)
        self._await_verdict(now)
        self._report = WorkersFailed(round=a.round, failure=failure, step=self._max_step())
        return [Log("error", f"workers failed to start: {event.reason}"), *self._send(self._report)]

    def _on_exited(self, event: WorkersExited, now: float) -> list[Effect]:
        if self.phase is not Phase.RUNNING or self.assignment is None:
            return []  # we are already stopping them for another reason
        if event.failure is None:
            self.phase = Phase.BARRIER
            stop = self.training.commit_stop() if self.training is not None else None
            if isinstance(stop, int):
                return self._on_committed(stop, now)
            if isinstance(stop, str):
                self.phase = Phase.RUNNING  # (no success) a failure of this node's workers
                return self._fail(self._commit_failure(stop, now), (), now)
            self._succeeded = True
            self.deadline = now + self.settings.exit_barrier_timeout
            # While the server is unreachable the Resume we send when back says so instead.
            effects: list[Effect] = self._send(WorkersSucceeded(round=self.assignment.round))
            if self.assignment.group_world_size > 1:
                effects.insert(0, Log("info", "workers finished; waiting for the other nodes (exit barrier)"))
            if self._commit_leave is not None:
                effects += self._drain(self._commit_leave, now)  # finished before any commit point
            return effects
        signum = self._killed_by_a_signal_we_got(event.failure)
        if signum:
            name = signal.Signals(signum).name
            if self._commit_leave is not None:  # our drain's commit point is moot now
                return self._drain(self._commit_leave, now)
            self._signalled, self._delivered = signum, True
            who = f"local rank {event.failure.local_rank}"
            return [
                Log(
                    "warning",
                    f"{who} was killed by {name}, a signal sent to this node's workers: the job "
                    "stops as for a signal this agent handles, without a restart",
                ),
                *self._stop_on_signal(f"{who} was killed by {name}", signum),
            ]
        return self._fail(event.failure, event.local_failures or (event.failure,), now)

    def _commit_failure(self, why: str, now: float) -> Failure:
        a = self.assignment
        assert a is not None
        return Failure(
            node_id=self.settings.node_id,
            addr=self.settings.addr,
            rank=a.rank_offset,
            local_rank=0,
            exitcode=0,
            signal="",
            timestamp=now + self.settings.wall_offset,
            message=_fit(why),
        )

    def _on_committed(self, step: int, now: float) -> list[Effect]:
        """Every worker stopped at the commit step and exited 0: not the job's success, a
        planned stop. The server restarts the round (``Restart``: we rejoin); join_timeout
        bounds the wait, as it bounds a round forming (a drain waiting for this commit: its own
        deadline, then it drains)."""
        assert self.assignment is not None
        self._committed = step
        self._succeeded = False  # a Resume must not tell the server our work is done
        wait = now + self.settings.join_timeout
        if self._commit_leave is not None and self.deadline is not None:
            wait = min(wait, self.deadline)
        self.deadline = wait
        return [
            Log("info", f"workers stopped at step {step} (a commit point); waiting for the next round"),
            *self._send(WorkersCommitted(round=self.assignment.round, step=step)),
        ]

    def _max_step(self) -> int:
        return self.training.max_step() if self.training is not None else -1

    def _fail(self, failure: Failure, local_failures: tuple[Failure, ...], now: float) -> list[Effect]:
        """Our workers failed (or hung) in RUNNING: report it, stop them, await the verdict."""
        assert self.assignment is not None
        self.local_failures = local_failures
        self.phase = Phase.STOPPING
        self._after_stop = AfterStop.VERDICT
        self._report = WorkersFailed(round=self.assignment.round, failure=failure, step=self._max_step())
        if self.training is not None:
            self.training.stop()
        note: list[Effect] = []
        if self.away:
            note = [
                Log(
                    "warning",
                    "a worker failed while the rendezvous server is unreachable; stopping the workers, "
                    "the failure is reported once reconnected",
                )
            ]
        effects = [
            *note,
            *self._send(self._report),
            StopWorkers(signal.SIGTERM, self.settings.shutdown_timeout),
        ]
        if self._commit_leave is not None:
            # A drain waited for a commit point: no commit now; leave once the workers are down.
            effects += self._drain(self._commit_leave, now)
        return effects

    # -- training progress and hangs (training.py decides; this routes) -------------------

    def _on_progress(self, event: ProgressRead, now: float) -> list[Effect]:
        t = self.training
        if t is None or self.phase is not Phase.RUNNING:
            return []  # the workers are not (or no longer) running: their silence is no hang
        out, line = t.on_read(event, now)
        effects: list[Effect] = [Log("error", line)] if line else []
        for item in out:
            if isinstance(item, PageWarning):
                effects.append(Log("warning", item.text))
                continue
            if isinstance(item, Armed) and (self.away or self._resuming):
                t.arming = item.step  # not said yet: said on a read once we are back
                continue
            effects.extend([item] if isinstance(item, DumpStacks) else self._send(item))
        return effects

    @staticmethod
    def _job_hang_report(report: str, *, restart: bool) -> list[Effect]:
        """A hang ended the round, and the server sent the job's report (every node's stacks
        merged; an older server sends none): filed beside ours, and said on a restart."""
        if not report:
            return []
        filed, line = job_hang_report(report, restart=restart)
        return [*([Log("warning", line)] if line else []), filed]

    def _on_stop_at(self, msg: StopAt, now: float) -> list[Effect]:
        """A commit point for the round we run: into the pages (training.py decides what)."""
        a, t = self.assignment, self.training
        if self.phase is not Phase.RUNNING or a is None or t is None or msg.round != a.round:
            return []  # a round we no longer run, or workers on their way down: nothing to stop
        if msg.state in ("arm", "go") and self._commit_leave is not None and self.deadline is not None:
            # Our drain waits for this commit as long as the server does: its one deadline,
            # which StopAt says (an older server's: the steps to S at our step times, the
            # lead, the checkpoint budget), and a second for the message's way.
            if msg.deadline_s > 0:
                self.deadline = max(self.deadline, now + msg.deadline_s + 1.0)
            elif msg.state == "arm":
                self.deadline = max(self.deadline, now + t.seconds_to(msg.step) + self._commit_budget())
        writes, line = t.on_stop(msg)
        return [*([Log("info", line)] if line else []), *writes]

    def _on_stacks_dumped(self, event: StacksDumped, now: float) -> list[Effect]:
        t = self.training
        if t is None:
            return []
        effects: list[Effect] = self._send(event.stacks) if event.stacks is not None else []
        then = t.on_dumped()
        if not then or self.phase is not Phase.RUNNING or self.assignment is None:
            return effects  # another node's hang, or the round moved on while we collected
        if isinstance(then, DumpStacks):
            return [*effects, then]
        failure = t.failure(now, event.report, event.path)
        return [*effects, Log("error", event.report), *self._fail(failure, (failure,), now)]

    def _await_verdict(self, now: float) -> None:
        """Workers down after our failure: the server's verdict decides (Restart or JobFailed).

        It answers a report in the step that handles it, but after a restart it may first
        rebuild the round from every node's Resume: join_timeout, the longest we would wait for
        a round to form, bounds the wait (while the connection is down the reconnect window
        does, and the wait starts again once back)."""
        self.phase = Phase.VERDICT
        self.deadline = None if self.away else now + self.settings.join_timeout

    def _on_stopped(self, event: WorkersStopped, now: float) -> list[Effect]:
        if self.phase is not Phase.STOPPING:
            return []
        if event.local_failures and not self.local_failures:
            self.local_failures = event.local_failures
        after, self._after_stop = self._after_stop, AfterStop.NOTHING
        if after is AfterStop.REJOIN:
            return self._rejoin(now)
        if after is AfterStop.VERDICT:
            self._await_verdict(now)
            return []
        if after is AfterStop.LEAVE:
            return self._send_leave(now)
        exit_ = self._exit or Exit(EXIT_FAILED, "stopped")
        # A SIGTERM/SIGINT in a fixed-size job: the server hears we left once the workers are down.
        leave = self._send(self._leave) if self._leave is not None else []
        return [*leave, *self._exit_now(exit_)]

    # -- the connection --------------------------------------------------------------------

    def _send(self, msg: Message) -> list[Effect]:
        """Send now, or nothing while the connection is down or our Resume is unanswered (what
        must be said then is kept in our state and said once it can be: the report, the Leave,
        the notice, that our workers finished)."""
        return [] if self.away or self._resuming else [Send(msg)]

    def _what_now(self) -> str:
        """What becomes of the workers while we reconnect, for the lost-connection lines."""
        p, after = self.phase, self._after_stop
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
        if p is Phase.BARRIER and self._committed is not None:
            return f"workers stopped at step {self._committed} (a commit point); "
        if p is Phase.BARRIER:
            return "workers finished; "
        if p is Phase.LEAVING:
            return "workers stopped; this node asks to leave again once it is back; "
        return ""

    def _doing(self) -> str:
        """Our phase in words, for protocol-error messages."""
        a = self.assignment
        held = f" round {a.round}" if a is not None else ""
        return {
            Phase.JOINING: "was joining",
            Phase.STARTING: f"was starting its workers of{held}",
            Phase.RUNNING: f"was running{held}",
            Phase.STOPPING: "was stopping its workers",
            Phase.VERDICT: "was waiting for the verdict on its workers' failure",
            Phase.BARRIER: "was waiting at the exit barrier",
            Phase.LEAVING: "was leaving",
            Phase.EXITED: "had exited",
        }[self.phase]

    def _on_connection_lost(self, event: ConnectionLost, now: float) -> list[Effect]:
        if self.away:
            return []
        self.away = True
        self._resuming = False
        if self._exit is not None:
            # On our way out already (the job ended, the server refused us, SIGINT): finish
            # stopping the workers and exit; the server has nothing left to hear from us.
            return [] if self.phase is Phase.STOPPING else self._exit_now(self._exit)
        if self.settings.reconnect_timeout <= 0:
            return self._gone(f"{event.reason}")
        if self.phase in (Phase.LEAVING, Phase.VERDICT):
            self.deadline = None  # the answer can only come on the next connection
        return [
            Log(
                "warning",
                f"lost the connection to the rendezvous server ({event.reason}); {self._what_now()}"
                f"reconnecting for up to {self.settings.reconnect_timeout:g} s",
            ),
            Reconnect(deadline=now + self.settings.reconnect_timeout),
        ]

    def _on_reconnected(self, now: float) -> list[Effect]:
        """Back on a new connection: pick up what we were doing (module header, "A lost connection")."""
        if not self.away:
            return []
        self.away = False
        if self._exit is not None:
            return []
        p = self.phase
        if p is Phase.JOINING:
            return [Log("info", "reconnected; joining again"), *self._join()]
        if p is Phase.STOPPING and self._after_stop is AfterStop.REJOIN:
            # Not before the workers are down: the next round must not start while they live.
            return [Log("info", "reconnected; this node joins the next round once its workers are down")]
        if self.assignment is None:
            if p is Phase.LEAVING:
                # Drained between rounds: no round to take back, but the new connection must
                # say which node it is before it leaves, or the server cannot tell whether the
                # job goes on without us (and keeps our place waiting for us to come back).
                return [Log("info", "reconnected; leaving the job again"), SendJoin(), *self._send_leave(now)]
            return []
        # Take our round back first; the server's answer tells what else to say (_on_resume_answer).
        self._resuming = True
        if p is Phase.LEAVING:
            self.deadline = now + LEAVE_ANSWER_TIMEOUT  # bounded, answer and Left alike
        elif p is Phase.VERDICT:
            self.deadline = now + self.settings.join_timeout
        what = {
            Phase.STOPPING: "resuming our round while our workers stop",
            Phase.VERDICT: "resuming our round to report our workers' failure again",
            Phase.LEAVING: "resuming our round to leave it",
        }.get(p, "resuming our round")
        return [Log("info", f"reconnected; {what}"), SendResume(self.assignment, self._succeeded)]

    def _on_reconnect_failed(self, event: ReconnectFailed) -> list[Effect]:
        # Still away: nothing can be sent.
        return self._gone(
            f"{event.reason} (could not reconnect within {self.settings.reconnect_timeout:g} s)",
            unreachable=True,
        )

    def _gone(self, reason: str, *, unreachable: bool = False) -> list[Effect]:
        """The server is gone for good: stop the workers and exit (at the barrier: our part is done)."""
        self._report, self._leave = None, None
        if self._awaiting_left:
            why = self._drain_why
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
            return self._stop_then_exit(Exit(EXIT_FAILED, text))
        if self.phase is Phase.BARRIER and self._committed is None:
            return self._exit_now(
                Exit(EXIT_OK, f"lost the rendezvous server during the exit barrier ({reason})")
            )
        return self._stop_then_exit(
            Exit(EXIT_RDZV, f"lost the connection to the rendezvous server: {reason}")
        )

    # -- signals and leaving ---------------------------------------------------------------

    def _on_signal(self, signum: int, now: float, delivered: bool = False) -> list[Effect]:
        if signum not in self.settings.handled_signals:
            if signum in self.settings.forward_signals and self.phase in (Phase.RUNNING, Phase.STARTING):
                return self._pass_on(signum, delivered)
            return []
        name = signal.Signals(signum).name
        if self._commit_leave is not None:
            # A second signal while a drain waits for a commit point: the user insists.
            why = self._commit_leave
            return [
                Log("warning", f"received {name} again; not waiting for a commit point"),
                *self._drain(why, now),
            ]
        if self._signalled is not None:
            # A second signal while we stop: the user insists.
            if self.phase is Phase.LEAVING:
                return self._exit_now(self._exit or Exit(EXIT_FAILED, f"received {name} while leaving"))
            return [ForwardSignal(signal.SIGKILL)] if self.phase is Phase.STOPPING else []
        self._signalled, self._delivered = signum, delivered
        if self._leaving or self._exit is not None:
            # Already on our way out (a drain the server asked for, the job's end): a second
            # signal insists.
            return [Log("info", f"received {name}; already stopping")]
        if self.settings.elastic and signum == signal.SIGTERM:
            return self._drain_after_commit(f"received {name}", now)
        return self._stop_on_signal(f"received {name}", signum)

    def _pass_on(self, signum: int, delivered: bool) -> list[Effect]:
        self._passed_on |= {signum}
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

    def _stop_on_signal(self, why: str, signum: int) -> list[Effect]:
        """Stop as torchrun does on a signal it handles: workers stopped, no restart, exit 1."""
        exit_ = Exit(EXIT_FAILED, f"{why}: workers stopped", None, self.local_failures)
        self._leaving = True
        self._leave = Leave(reason=_fit(f"agent {why}"))
        self._report = None
        if self.phase in (Phase.RUNNING, Phase.STARTING, Phase.STOPPING):
            # Workers first; the server hears now that we go, and that we are gone once they are.
            sig = 0 if self._delivered and self._signalled == signum else signum
            return [*self._stop_then_exit(exit_, sig), *self._send(self._notice(self._leave))]
        leave = self._send(self._leave)
        return [*leave, *self._exit_now(exit_)]

    def _killed_by_a_signal_we_got(self, failure: Failure) -> int:
        """The signal (0: none) behind a worker's death when it is one this agent received for
        its workers: passed on, or delivered with its own (a scheduler signals every process)."""
        signum = -failure.exitcode
        if signum <= 0:
            return 0
        return signum if signum in self._passed_on or signum == self._signalled else 0

    @staticmethod
    def _notice(leave: Leave) -> Leave:
        return Leave(reason=leave.reason, workers_stopping=True)

    def _drain_after_commit(self, why: str, now: float) -> list[Effect]:
        """A drain that first asks the server to stop the job at a commit point (module header,
        "Commit points"); where none can be had, today's drain at once."""
        a, t = self.assignment, self.training
        if (
            self.settings.commit_timeout <= 0
            # The workers have the SIGTERM from its sender (Slurm signals every process of the
            # step): they are stopping already, and Slurm's KillWait is no time to wait in.
            or self._delivered
            or t is None
            # Early in the training its ranks may not have called should_stop() yet: the
            # server knows (it waits for every node's summary) and drains us at once if not.
            or not t.may_check(now)
            or self.phase is not Phase.RUNNING
            or a is None
            or self.away
            or self._resuming
        ):
            return self._drain(why, now)
        self._commit_leave, self._commit_asked_at = why, now
        budget = self._commit_budget()
        self.deadline = now + budget
        return [
            Log(
                "warning",
                f"{why}: asking the job to stop at a commit point first; the workers keep running, "
                f"and this node drains within {budget:g} s (a second signal drains at once)",
            ),
            Send(self._leave_after_commit(a.round, why)),
        ]

    def _commit_budget(self) -> float:
        """How long a drain waits for the server's Drain past the committing ranks' steps: the
        checkpoint budget and the lead, as the server's own commit deadline."""
        return self.settings.commit_timeout + COMMIT_LEAD

    @staticmethod
    def _leave_after_commit(round_: int, why: str) -> LeaveAfterCommit:
        return LeaveAfterCommit(round=round_, reason=_fit(f"drain: {why}"))

    def _drain(self, why: str, now: float) -> list[Effect]:
        """A clean leave: workers get SIGTERM first (to checkpoint), the server restarts the
        others' round at once, and our Leave follows once the workers have exited, so no next
        round starts while they live. The server's Left picks the exit code."""
        if self._commit_leave is not None:
            self._commit_leave = None
            self.deadline = None  # the commit point's wait is over
        self._leaving = True
        self._drain_why = why
        self._awaiting_left = True
        self._leave = Leave(reason=_fit(f"drain: {why}"))
        if self.phase in (Phase.RUNNING, Phase.STARTING, Phase.STOPPING):
            how = "workers get SIGTERM, then this node leaves the job"
        elif self._committed is not None:
            how = f"its workers stopped at the commit point, step {self._committed}; this node leaves the job"
        else:
            how = "this node leaves the job"
        note = Log("warning", f"{why}: draining ({how})")
        if self.phase in (Phase.RUNNING, Phase.STARTING, Phase.STOPPING):
            stop: list[Effect] = []
            if self.phase is not Phase.STOPPING:
                self.phase = Phase.STOPPING
                # SIGTERM delivered to the workers by its sender is not sent again (0).
                sig = 0 if self._delivered and self._signalled == signal.SIGTERM else signal.SIGTERM
                stop = [StopWorkers(sig, self.settings.shutdown_timeout)]
            self._after_stop = AfterStop.LEAVE
            return [note, *stop, *self._send(self._notice(self._leave))]
        return [note, *self._send_leave(now)]  # no workers: JOINING, VERDICT, BARRIER

    def _send_leave(self, now: float) -> list[Effect]:
        """Workers down: say we leave, and wait (bounded) for the answer that picks the exit code."""
        self.phase = Phase.LEAVING
        if self.away or self._leave is None:
            self.deadline = None  # sent once reconnected; the reconnect window bounds the wait
            return []
        self.deadline = now + LEAVE_ANSWER_TIMEOUT  # the answer to a Resume still out, too
        if self._resuming:
            return []  # sent with the answer to our Resume (which restarts this wait)
        return [Send(self._leave)]

    def _on_left(self, msg: Left) -> list[Effect]:
        if not self._awaiting_left:
            if self._leaving:
                return []  # a Leave whose exit code was decided without the answer (fixed-size SIGTERM)
            return self._protocol_error("a 'left' answer, but this node did not leave", fatal=False)
        self._awaiting_left = False
        self._leave = None
        why = self._drain_why
        if msg.job_continues and self._signalled is not None and self.settings.signals_end_job:
            exit_ = Exit(
                EXIT_FAILED,
                f"drained: {why}; left the job ({shown(msg.reason)}), but under Slurm a signal "
                "ends the whole job (scancel, pre-emption, time limit): exit 1, as torchrun",
            )
        elif msg.job_continues:
            exit_ = Exit(
                EXIT_OK,
                f"drained: {why}; left the job, which goes on without this node ({shown(msg.reason)})",
            )
        else:
            exit_ = Exit(
                EXIT_FAILED,
                f"drained: {why}; left the job, which does not go on without this node ({shown(msg.reason)})",
            )
        if self.phase is Phase.LEAVING:
            return self._exit_now(exit_)
        # An older server (or the static backend) answers our notice as the Leave itself: exit
        # with its answer once the workers are down.
        return self._stop_then_exit(exit_)

    def _on_tick(self, now: float) -> list[Effect]:
        if self.deadline is None or now < self.deadline:
            return []
        self.deadline = None
        if self.phase is Phase.JOINING:
            joined = f" ({self._last_waiting[0]} joined)" if self._last_waiting else ""
            return [
                *self._send(Leave(reason="join timeout")),
                *self._exit_now(
                    Exit(
                        EXIT_RDZV,
                        f"timed out after {self.settings.join_timeout:g} s waiting for the rendezvous to "
                        f"complete{joined} (join_timeout)",
                    )
                ),
            ]
        if self._commit_leave is not None and self.phase in (Phase.RUNNING, Phase.BARRIER):
            why = self._commit_leave
            waited = now - self._commit_asked_at  # the budget, or longer once a step was armed
            note = Log(
                "warning",
                f"no drain from the rendezvous server within {waited:g} s of asking for a commit point",
            )
            return [note, *self._drain(why, now)]
        if self.phase is Phase.BARRIER and self._committed is not None:
            return [
                *self._send(Leave(reason="no next round after a commit point")),
                *self._exit_now(
                    Exit(
                        EXIT_RDZV,
                        f"workers stopped at step {self._committed} (a commit point), but the rendezvous "
                        f"server did not start the next round within {self.settings.join_timeout:g} s "
                        "(join_timeout)",
                    )
                ),
            ]
        if self.phase is Phase.BARRIER:
            return self._exit_now(
                Exit(EXIT_OK, f"exit barrier timed out after {self.settings.exit_barrier_timeout:g} s")
            )
        if self.phase is Phase.VERDICT:
            a = self.assignment
            held = f" of round {a.round}" if a is not None else ""
            self._report = None
            return self._exit_now(
                Exit(
                    EXIT_FAILED,
                    f"the rendezvous server did not answer the report of this node's worker failure"
                    f"{held} within {self.settings.join_timeout:g} s (join_timeout): no verdict, "
                    "so this node gives up; its workers are stopped",
                )
            )
        if self.phase is Phase.LEAVING:
            self._awaiting_left = False
            return self._exit_now(
                self._exit
                or Exit(
                    EXIT_FAILED,
                    f"drained: {self._drain_why}; the rendezvous server did not answer whether the job "
                    f"goes on without this node (no answer within {LEAVE_ANSWER_TIMEOUT:g} s)",
                )
            )
        return []

    def _on_health_check_done(self, event: HealthCheckDone) -> list[Effect]:
        if not self._checking:
            return []  # we moved on meanwhile (a signal, the job's end, a timeout)
        self._checking = False
        if not event.ok:
            exit_ = Exit(EXIT_FAILED, f"health check failed, not joining: {event.detail}")
            return [*self._send(Leave(reason="health check failed")), *self._stop_then_exit(exit_)]
        self._checked = True
        if self.phase is not Phase.JOINING or self.away:
            return []  # not joining any more, or the join goes once reconnected
        return [SendJoin()]

    def _rejoin(self, now: float) -> list[Effect]:
        self.phase = Phase.JOINING
        self.assignment = None
        self._succeeded = False
        self._committed = None
        self._report = None
        self._checked = False  # each round's join is checked again
        self.deadline = now + self.settings.join_timeout
        return [] if self.away else self._join()  # while away: once reconnected

    def _stop_then_exit(self, exit_: Exit, signum: int = signal.SIGTERM) -> list[Effect]:
        self._awaiting_left = False
        if self.phase in (Phase.RUNNING, Phase.STARTING):
            self.phase = Phase.STOPPING
            self._after_stop = AfterStop.EXIT
            self._exit = exit_
            return [StopWorkers(signum, self.settings.shutdown_timeout)]
        if self.phase is Phase.STOPPING:
            self._after_stop = AfterStop.EXIT
            # The first reason to exit is the one a person needs (a refusal, not the
            # connection closing right after it).
            self._exit = self._exit or exit_
            return []
        return self._exit_now(exit_)

    def _exit_now(self, exit_: Exit) -> list[Effect]:
        self.phase = Phase.EXITED
        self.deadline = None
        if not exit_.local_failures and self.local_failures:
            exit_ = Exit(exit_.code, exit_.reason, exit_.failure, self.local_failures, exit_.job_done)
        return [exit_]


def _fit(text: str) -> str:
    """A text we send, cut to its field: what we build from a server's text must never fail
    validation (an exception there would take the agent down, and SIGKILL its workers)."""
    return text if len(text) <= MAX_TEXT_LEN else text[: MAX_TEXT_LEN - 3] + "..."


def _ranks(first: int, count: int) -> str:
    return f"rank {first}" if count == 1 else f"ranks {first}-{first + count - 1}"


def _range(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}:{hi}"
