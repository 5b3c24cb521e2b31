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

Leaving (``leaving.py`` tells it): a drain (SIGTERM in an elastic job, or the server's
``Drain``) stops the workers, tells the server, sends ``Leave`` once they are down, and the
server's ``Left`` picks the exit code; SIGTERM to an elastic agent whose ranks all call
``worker.should_stop()`` first asks for a commit point (``LeaveAfterCommit``).

Signals (``signals.py`` tells it): a handled one stops the job (SIGTERM in an elastic job
drains, any other stops the workers and exits 1, as torchrun); a second one insists; one to
forward goes on to running workers; a worker killed by a signal we got for it is a stop.

Commit points (issue 20; ``training.py`` has the steps). The server's ``StopAt`` for the round
we run goes into the pages (``WriteStop``: arm, go, cancel); the ``Armed`` answer follows once
every local rank has seen the armed step. Workers that all stopped at the go'd step and exited
0 are no success of the job: the agent says ``WorkersCommitted`` and waits in BARRIER for the
``Restart`` that starts the next round (at most ``join_timeout``, then it exits
``EXIT_RDZV``); a reconnect there says ``WorkersCommitted`` again. ``StopAt`` in any other phase,
or for another round, is ignored.

A lost connection (``link.py`` tells it phase by phase): with a ``reconnect_timeout`` (every
backend but static) every phase rides it out, and the server's answer to our ``Resume``
decides the rest; when the window closes the workers are stopped and the agent exits 1 (0 at
the exit barrier, where its part is done).

Every wait on the server ends by itself: joining at ``join_timeout``, the verdict at
``join_timeout``, the exit barrier at ``exit_barrier_timeout``, leaving at
``LEAVE_ANSWER_TIMEOUT``, and any of them while the connection is down at the reconnect window.

Watching the training (``training.py``): the I/O layer's reads of the ranks' progress pages
come in as ``ProgressRead``; summaries go to the server, and a hang is reported
(``HangDetected``), its stacks collected (``DumpStacks``, answered by ``StacksDumped``) and
then failed as this node's worker failure. The server's ``CollectStacks`` (another node's
hang) asks for the stacks only. ``JobFailed(code="crash_loop")`` exits ``EXIT_CRASH_LOOP``.

Joining (``joining.py`` tells it): ``--health-check`` runs before each round's join as an
effect (``RunHealthCheck``), and its result comes back as an event (``HealthCheckDone``): the
I/O layer never waits on it, so a signal during a long check is handled at once (the check is
killed when the agent exits).

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

import signal

from protocol import (
    Assignment,
    CollectStacks,
    Drain,
    Error,
    Failure,
    GoingAway,
    JobDone,
    JobFailed,
    KeepSnapshot,
    Leave,
    Left,
    Message,
    Restart,
    Resumed,
    Standbys,
    StopAt,
    Waiting,
    Welcome,
    WorkersCommitted,
    WorkersFailed,
    WorkersSucceeded,
)
from protocol.records import record

from ..agent_log import shown
from .assignment import contradiction, doing, node_failure, round_line
from .events import (
    EXIT_CRASH_LOOP,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_RDZV,
    LEAVE_ANSWER_TIMEOUT,
    AfterStop,
    AgentSettings,
    ConnectionLost,
    DumpStacks,
    Effect,
    Event,
    Exit,
    HealthCheckDone,
    Log,
    Phase,
    ProgressRead,
    Reconnected,
    ReconnectFailed,
    SendJoin,
    ServerSent,
    SignalReceived,
    SnapshotsRead,
    StacksDumped,
    StartWorkers,
    StopWorkers,
    Tick,
    UnexpectedEvent,
    WorkersExited,
    WorkersStarted,
    WorkersStartFailed,
    WorkersStopped,
    fit,
)
from .joining import Joining
from .leaving import Leaving, notice
from .link import Link
from .signals import Signals, Then, received
from .snapshots import Snapshots
from .training import Training, job_hang_report


@record
class AgentMachine:
    settings: AgentSettings
    phase: Phase = Phase.JOINING
    assignment: Assignment | None = None
    deadline: float | None = None
    local_failures: tuple[Failure, ...] = ()
    _after_stop: AfterStop = AfterStop.NOTHING
    _exit: Exit | None = None  # decided: the workers stop (if they run), then the agent exits with it
    # Progress summaries and hang verdicts (training.py); None: the agent does not watch them.
    training: Training | None = None

    def __post_init__(self) -> None:
        # Joining a round (joining.py), the connection's side (link.py), the way out of the job
        # (leaving.py) and the signals we get (signals.py): composed helpers, as training is;
        # they return effects, and the machine keeps the phase.
        self.joining = Joining(self.settings)
        self.link = Link(self.settings)
        self.leaving = Leaving(self.settings)
        self.signals = Signals(self.settings)
        self.snapshots = Snapshots()

    def start(self, now: float) -> list[Effect]:
        """The connection is up and the hello exchanged: join the first round."""
        self.deadline = now + self.settings.join_timeout
        return self.joining.join()

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
            return self._on_signal(event.signum, now, event.delivered, event.stale)
        if isinstance(event, HealthCheckDone):
            return self._on_health_check_done(event)
        if isinstance(event, Tick):
            return self._on_tick(now)
        if isinstance(event, ProgressRead):
            return self._on_progress(event, now)
        if isinstance(event, StacksDumped):
            return self._on_stacks_dumped(event, now)
        if isinstance(event, SnapshotsRead):
            return self.snapshots.read(event, self.phase, self.link)
        raise UnexpectedEvent(f"unknown event {event!r} in phase {self.phase.value}")

    # -- server messages -------------------------------------------------------------------

    def _on_server(self, msg: Message, now: float) -> list[Effect]:
        if self.link.answers(msg):
            return self._on_resume_answer(msg, now)
        return self._on_server_now(msg, now)

    def _on_server_now(self, msg: Message, now: float) -> list[Effect]:
        # First what may come in any phase, then what a leaving node no longer acts on.
        if isinstance(msg, Standbys):
            return []  # where to reconnect is the link's to know (rdzv/takeover.py), which keeps it
        if isinstance(msg, Left):
            return self._on_left(msg)
        if isinstance(msg, JobFailed):
            summary = job_summary(msg.summary)
            return [*summary, *job_hang_report(msg.report, restart=False), *self._on_job_failed(msg)]
        if isinstance(msg, JobDone):
            return [*job_summary(msg.summary), *self._on_job_done()]
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
        if isinstance(msg, KeepSnapshot):
            return self.snapshots.keep(msg)
        if self.phase is Phase.LEAVING:
            # Workers down, our Leave out: an assignment or restart that crossed it, a waiting
            # update or a drain request no longer change our course.
            return []
        if isinstance(msg, Waiting):
            return self.joining.waiting(msg)
        if isinstance(msg, Assignment):
            return self._on_assignment(msg)
        if isinstance(msg, Restart):
            return [*self._on_restart(msg, now), *job_hang_report(msg.report, restart=True)]
        if isinstance(msg, Drain):
            if self.leaving.going or self._exit is not None:
                return []  # already on our way out
            why = f"asked to drain by the server: {shown(msg.reason)}" if msg.reason else "asked to drain"
            # Our own SIGTERM's drain, once the commit point it waited for is behind us.
            return self._drain(self.leaving.pending_commit or why, now)
        text = f"{msg.TYPE}, which a server never sends, while this node {doing(self.phase, self.assignment)}"
        return self._protocol_error(text, fatal=False)

    def _on_resume_answer(self, msg: Message, now: float) -> list[Effect]:
        """The server's answer to our Resume, then what waited for it.

        ``Resumed``: we are a node of its round again; say what we have to say (our failure
        report, that our workers finished, that we leave). ``Restart``: the round moved on (or
        it had dropped us): that is the verdict on any failure, and the round stops anyway, so
        only a due Leave still goes. Anything else ends our course as usual."""
        self.link.answered()
        effects = self._on_server_now(msg, now)
        if self.phase is Phase.EXITED or isinstance(msg, JobFailed | JobDone | Error):
            return effects
        resumed = isinstance(msg, Resumed)
        # (Our failure report is never due in RUNNING, where a commit point's ask may be.)
        due = (
            [*self.snapshots.owed(self.phase, self.link), *self.link.owed(self.phase, self.assignment)]
            if resumed
            else []
        )
        due += self.leaving.owed(self.phase, self.assignment, resumed=resumed)
        if self.phase is Phase.LEAVING and self.leaving.leave is not None:
            self.deadline = now + LEAVE_ANSWER_TIMEOUT
        return [*effects, *due]

    def _protocol_error(self, text: str, *, fatal: bool) -> list[Effect]:
        """The server sent what makes no sense in our phase: its mistake, not ours (no traceback).

        Said once as it happens; where we cannot go on, the workers stop and the agent exits 1
        with the same words."""
        note = Log("error", f"protocol error by the rendezvous server: {text}")
        if not fatal:
            return [note]
        self._drop_owed()
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
                f"(it {doing(self.phase, self.assignment)})"
            )
            return self._protocol_error(text, fatal=True)
        problem = contradiction(self.settings, msg)
        if problem is not None:
            return self._protocol_error(problem, fatal=True)
        self.assignment = msg
        self.phase = Phase.STARTING
        self.deadline = None
        self.joining.assigned()
        self.signals.new_attempt()
        if self.training is not None:
            self.training.start(msg)
        return [
            Log("info", round_line(msg, self.settings.nproc)),
            StartWorkers(msg),
        ]

    def _on_job_failed(self, msg: JobFailed) -> list[Effect]:
        where = " while this node waited to join it" if self.phase is Phase.JOINING else ""
        code = EXIT_CRASH_LOOP if msg.code == "crash_loop" else EXIT_FAILED
        what = "job failed (a crash loop)" if code == EXIT_CRASH_LOOP else "job failed"
        exit_ = Exit(code, f"{what}{where}: {shown(msg.reason)}", msg.failure, self.local_failures)
        # The job's failure is the reason to report, not a pending drain's; nothing is left to
        # report or leave.
        self._nothing_to_say()
        return self._stop_then_exit(exit_)

    def _on_job_done(self) -> list[Effect]:
        if self.phase in (Phase.BARRIER, Phase.LEAVING):
            self.leaving.exit_decided()
            return self._exit_now(Exit(EXIT_OK, "all nodes finished", job_done=True))
        if self.phase is Phase.JOINING:
            note, exit_ = self.joining.not_needed()  # a hot spare (or a newcomer) outlived the job
            return [note, *self._exit_now(exit_)]
        if self.phase is Phase.STOPPING and self._after_stop is AfterStop.LEAVE:
            # Drained, and the job finished while our workers stop: a success, nothing to leave.
            self.leaving.settled()
            self._after_stop, self._exit = AfterStop.EXIT, Exit(EXIT_OK, "all nodes finished", job_done=True)
            return []
        if self._exit is not None:
            return []  # on our way out already, for a reason of its own
        # Our workers run (or failed): the server finished the job without us, which it does
        # only after it dropped this node (frozen, or cut off, past the heartbeat timeout).
        what = doing(self.phase, self.assignment)
        self._drop_owed()
        return [
            Log("error", f"the rendezvous server says the job finished while this node {what}; stopping"),
            *self._stop_then_exit(Exit(EXIT_FAILED, f"the job finished without this node (it {what})")),
        ]

    def _on_error(self, msg: Error) -> list[Effect]:
        if not msg.fatal:
            return [Log("warning", f"rendezvous server: {shown(msg.message)} ({shown(msg.code)})")]
        self._nothing_to_say()
        return self._stop_then_exit(Exit(EXIT_RDZV, f"rendezvous server refused us: {shown(msg.message)}"))

    def _on_restart(self, msg: Restart, now: float) -> list[Effect]:
        budget = self.settings.max_restarts
        out = self.leaving.going or self._exit is not None  # on our way out: no rejoin to refuse
        if budget is not None and msg.restart_count > budget and not out:
            text = f"a restart {msg.restart_count}, past this node's budget (--max-restarts {budget})"
            return self._protocol_error(text, fatal=True)
        note = Log("warning", f"re-rendezvous after round {msg.round}: {shown(msg.reason)}")
        self.link.verdict()  # if we reported a failure, this is the verdict
        drained = self._drain_if_asked(now)
        if drained:
            return [note, *drained]  # no rejoin: we were leaving
        if self.phase in (Phase.RUNNING, Phase.STARTING):
            self.phase = Phase.STOPPING
            self._after_stop = AfterStop.REJOIN
            return [note, StopWorkers(signal.SIGTERM, self.settings.shutdown_timeout, park=True)]
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
        failure = node_failure(self.settings, a, now, 127, event.reason)
        self.local_failures = (failure,)
        self._await_verdict(now)
        report = WorkersFailed(
            round=a.round, failure=failure, step=self._max_step(), restore_failed=event.restore_failed
        )
        return [Log("error", f"workers failed to start: {event.reason}"), *self.link.reported(report)]

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
                return self._fail(node_failure(self.settings, self.assignment, now, 0, fit(stop)), (), now)
            self.link.finished()
            self.deadline = now + self.settings.exit_barrier_timeout
            # While the server is unreachable the Resume we send when back says so instead.
            idle = self.training.idle_ms(now) if self.training is not None else 0.0
            effects: list[Effect] = self._send(WorkersSucceeded(round=self.assignment.round, idle_ms=idle))
            if self.assignment.group_world_size > 1:
                effects.insert(0, Log("info", "workers finished; waiting for the other nodes (exit barrier)"))
            effects += self._drain_if_asked(now)  # finished before any commit point
            return effects
        signum = self.signals.killed_by(event.failure)
        if signum:
            drained = self._drain_if_asked(now)  # our drain's commit point is moot now
            if drained:
                return drained
            note, why = self.signals.witness(signum, event.failure)
            return [note, *self._stop_on_signal(why, signum)]
        return self._fail(event.failure, event.local_failures or (event.failure,), now)

    def _on_committed(self, step: int, now: float) -> list[Effect]:
        """Every worker stopped at the commit step and exited 0: not the job's success, a
        planned stop. The server restarts the round (``Restart``: we rejoin); join_timeout
        bounds the wait, as it bounds a round forming (a drain waiting for this commit: its own
        deadline, then it drains)."""
        assert self.assignment is not None
        self.link.committed_at(step)  # (a Resume must not tell the server our work is done)
        wait = now + self.settings.join_timeout
        if self.leaving.pending_commit is not None and self.deadline is not None:
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
        report = WorkersFailed(round=self.assignment.round, failure=failure, step=self._max_step())
        if self.training is not None:
            self.training.stop()
        note: list[Effect] = []
        if self.link.away:
            note = [
                Log(
                    "warning",
                    "a worker failed while the rendezvous server is unreachable; stopping the workers, "
                    "the failure is reported once reconnected",
                )
            ]
        return [
            *note,
            *self.link.reported(report),
            # The survivors wait for the verdict parked: a restart gives them their next place.
            StopWorkers(
                signal.SIGTERM, self.settings.shutdown_timeout, park=self.leaving.pending_commit is None
            ),
            # A drain waited for a commit point: no commit now; leave once the workers are down.
            *self._drain_if_asked(now),
        ]

    # -- training progress and hangs (training.py decides; this routes) -------------------

    def _on_progress(self, event: ProgressRead, now: float) -> list[Effect]:
        t = self.training
        if t is None or self.phase is not Phase.RUNNING:
            return []  # the workers are not (or no longer) running: their silence is no hang
        return t.read(event, now, self.link)

    def _on_stop_at(self, msg: StopAt, now: float) -> list[Effect]:
        """A commit point for the round we run: into the pages (training.py decides what)."""
        a, t = self.assignment, self.training
        if self.phase is not Phase.RUNNING or a is None or t is None or msg.round != a.round:
            return []  # a round we no longer run, or workers on their way down: nothing to stop
        draining = self.leaving.pending_commit is not None
        if msg.state in ("arm", "go") and draining and self.deadline is not None:
            # Our drain waits for this commit as long as the server does: its one deadline,
            # which StopAt says (an older server's: the steps to S at our step times, the
            # lead, the checkpoint budget), and a second for the message's way.
            if msg.deadline_s > 0:
                self.deadline = max(self.deadline, now + msg.deadline_s + 1.0)
            elif msg.state == "arm":
                self.deadline = max(self.deadline, now + t.seconds_to(msg.step) + self.leaving.budget())
        writes, line = t.on_stop(msg)
        return [*([Log("info", line)] if line else []), *writes]

    def _on_stacks_dumped(self, event: StacksDumped, now: float) -> list[Effect]:
        t = self.training
        if t is None:
            return []
        effects: list[Effect] = self._send(event.stacks) if event.stacks is not None else []
        slow = t.moved_on() if self.phase is Phase.RUNNING else ""
        if slow:
            effects.append(Log("warning", slow))
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
        self.deadline = None if self.link.away else now + self.settings.join_timeout

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
        leave = self._send(self.leaving.leave) if self.leaving.leave is not None else []
        return [*leave, *self._exit_now(exit_)]

    # -- the connection --------------------------------------------------------------------

    def _send(self, msg: Message) -> list[Effect]:
        return self.link.send(msg)  # nothing while away or resuming: said once it can be

    def _what_now(self) -> str:
        return self.link.what_now(self.phase, self._after_stop)

    def _nothing_to_say(self) -> None:
        """Our course ended for a reason of its own: no report, no Leave, no Left awaited."""
        self.link.verdict()
        self.leaving.settled()

    def _drop_owed(self) -> None:
        """Nothing of ours is said again: no failure report, no Leave (a Left may still be
        awaited: the exit it picks is decided elsewhere)."""
        self.link.verdict()
        self.leaving.leave_moot()

    def _on_connection_lost(self, event: ConnectionLost, now: float) -> list[Effect]:
        if not self.link.lost():
            return []
        if self._exit is not None:
            # On our way out already (the job ended, the server refused us, SIGINT): finish
            # stopping the workers and exit; the server has nothing left to hear from us.
            return [] if self.phase is Phase.STOPPING else self._exit_now(self._exit)
        if self.settings.reconnect_timeout <= 0:
            return self._gone(f"{event.reason}")
        if self.phase in (Phase.LEAVING, Phase.VERDICT):
            self.deadline = None  # the answer can only come on the next connection
        return self.link.reconnect(event.reason, self._what_now(), now)

    def _on_reconnected(self, now: float) -> list[Effect]:
        """Back on a new connection: pick up what we were doing (link.py's header)."""
        if not self.link.back():
            return []
        self.snapshots.reconnected()
        if self._exit is not None:
            return []
        p = self.phase
        if p is Phase.JOINING:
            return [Log("info", "reconnected; joining again"), *self.joining.join()]
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
        if p is Phase.LEAVING:
            self.deadline = now + LEAVE_ANSWER_TIMEOUT  # bounded, answer and Left alike
        elif p is Phase.VERDICT:
            self.deadline = now + self.settings.join_timeout
        return self.link.resume(p, self.assignment)

    def _on_reconnect_failed(self, event: ReconnectFailed) -> list[Effect]:
        # Still away: nothing can be sent.
        return self._gone(self.link.unreachable(event.reason), unreachable=True)

    def _gone(self, reason: str, *, unreachable: bool = False) -> list[Effect]:
        """The server is gone for good: stop the workers and exit (at the barrier: our part is done)."""
        self._drop_owed()
        drained = self.leaving.gone(reason, unreachable=unreachable)
        if drained is not None:
            return self._stop_then_exit(drained)
        if self.phase is Phase.BARRIER and self.link.committed is None:
            return self._exit_now(
                Exit(EXIT_OK, f"lost the rendezvous server during the exit barrier ({reason})")
            )
        return self._stop_then_exit(
            Exit(EXIT_RDZV, f"lost the connection to the rendezvous server: {reason}")
        )

    # -- signals and leaving ---------------------------------------------------------------

    def _on_signal(
        self, signum: int, now: float, delivered: bool = False, stale: bool = False
    ) -> list[Effect]:
        effects, then = self.signals.receive(
            signum,
            delivered,
            self.phase,
            committing=self.leaving.pending_commit is not None,
            out=self.leaving.going or self._exit is not None,
            stale=stale,
        )
        if then is Then.DRAIN:
            assert self.leaving.pending_commit is not None
            return [*effects, *self._drain_if_asked(now)]
        if then is Then.EXIT:
            why = f"{received(signum)} while leaving"
            return [*effects, *self._exit_now(self._exit or Exit(EXIT_FAILED, why))]
        if then is Then.LEAVE:
            return [*effects, *self._drain_after_commit(received(signum), now)]
        if then is Then.STOP:
            return [*effects, *self._stop_on_signal(received(signum), signum)]
        return effects

    def _stop_on_signal(self, why: str, signum: int) -> list[Effect]:
        """Stop as torchrun does on a signal it handles: workers stopped, no restart, exit 1."""
        exit_ = Exit(EXIT_FAILED, f"{why}: workers stopped", None, self.local_failures)
        leave = self.leaving.quit(why)
        self.link.verdict()
        if self.phase in (Phase.RUNNING, Phase.STARTING, Phase.STOPPING):
            # Workers first; the server hears now that we go, and that we are gone once they are.
            return [*self._stop_then_exit(exit_, self.signals.to_send(signum)), *self._send(notice(leave))]
        return [*self._send(leave), *self._exit_now(exit_)]

    def _drain_after_commit(self, why: str, now: float) -> list[Effect]:
        """A drain that first asks the server to stop the job at a commit point (leaving.py's
        header); where none can be had, today's drain at once."""
        a, t = self.assignment, self.training
        if (
            self.settings.commit_timeout <= 0
            # The workers have the SIGTERM from its sender (Slurm signals every process of the
            # step): they are stopping already, and Slurm's KillWait is no time to wait in.
            or self.signals.delivered
            or t is None
            # Early in the training its ranks may not have called should_stop() yet: the
            # server knows (it waits for every node's summary) and drains us at once if not.
            or not t.may_check(now)
            or self.phase is not Phase.RUNNING
            or a is None
            or self.link.quiet
        ):
            return self._drain(why, now)
        self.deadline = now + self.leaving.budget()
        return self.leaving.ask_commit(why, a.round, now)

    def _drain(self, why: str, now: float) -> list[Effect]:
        """A clean leave (leaving.py): workers stop first, then the Leave; its Left picks the exit code."""
        if self.leaving.pending_commit is not None:
            self.deadline = None  # the commit point's wait is over
        # SIGTERM delivered to the workers by its sender is not sent again (0).
        sig = self.signals.to_send(signal.SIGTERM)
        effects, phase = self.leaving.drain(why, self.phase, self.link.committed, sig, self.link)
        if phase is Phase.LEAVING:
            return [*effects, *self._send_leave(now)]
        self.phase, self._after_stop = phase, AfterStop.LEAVE
        return effects

    def _drain_if_asked(self, now: float) -> list[Effect]:
        """A drain that waits for a commit point goes now (none waits: nothing)."""
        why = self.leaving.pending_commit
        return [] if why is None else self._drain(why, now)

    def _send_leave(self, now: float) -> list[Effect]:
        """Workers down: say we leave, and wait (bounded) for the answer that picks the exit code."""
        self.phase = Phase.LEAVING
        effects, self.deadline = self.leaving.send_leave(self.link, now)
        return effects

    def _on_left(self, msg: Left) -> list[Effect]:
        exit_ = self.leaving.left(msg, self.signals.signalled is not None)
        if exit_ is None:
            if self.leaving.going:
                return []  # a Leave whose exit code was decided without the answer (fixed-size SIGTERM)
            return self._protocol_error("a 'left' answer, but this node did not leave", fatal=False)
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
            return [*self._send(Leave(reason="join timeout")), *self._exit_now(self.joining.timed_out())]
        if self.leaving.pending_commit is not None and self.phase in (Phase.RUNNING, Phase.BARRIER):
            return [self.leaving.no_drain(now), *self._drain_if_asked(now)]
        if self.phase is Phase.BARRIER and self.link.committed is not None:
            return [
                *self._send(Leave(reason="no next round after a commit point")),
                *self._exit_now(
                    Exit(
                        EXIT_RDZV,
                        f"workers stopped at step {self.link.committed} (a commit point), but the rendezvous "
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
            self.link.verdict()
            return self._exit_now(
                Exit(
                    EXIT_FAILED,
                    f"the rendezvous server did not answer the report of this node's worker failure"
                    f"{held} within {self.settings.join_timeout:g} s (join_timeout): no verdict, "
                    "so this node gives up; its workers are stopped",
                )
            )
        if self.phase is Phase.LEAVING:
            unanswered = self.leaving.unanswered()
            return self._exit_now(self._exit or unanswered)
        return []

    def _on_health_check_done(self, event: HealthCheckDone) -> list[Effect]:
        if not self.joining.checking:
            return []  # we moved on meanwhile (a signal, the job's end, a timeout)
        failed = self.joining.check_done(event)
        if failed is not None:
            return [*self._send(Leave(reason="health check failed")), *self._stop_then_exit(failed)]
        if self.phase is not Phase.JOINING or self.link.away:
            return []  # not joining any more, or the join goes once reconnected
        return [SendJoin()]

    def _rejoin(self, now: float) -> list[Effect]:
        self.phase = Phase.JOINING
        self.assignment = None
        self.link.new_round()
        self.joining.new_round()  # each round's join is checked again
        self.deadline = now + self.settings.join_timeout
        return [] if self.link.away else self.joining.join()  # while away: once reconnected

    def _stop_then_exit(self, exit_: Exit, signum: int = signal.SIGTERM) -> list[Effect]:
        self.leaving.exit_decided()
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


def job_summary(summary: str) -> list[Effect]:
    """The job's goodput in one line, as the server said it as the job ended (issue 47:
    ``JobDone``/``JobFailed.summary``); nothing from an older server."""
    return [Log("info", f"job: {shown(summary)}")] if summary else []
