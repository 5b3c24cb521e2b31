"""The agent machine's vocabulary: its phases, every event it takes and every effect it asks
for, its settings and its exit codes (:mod:`node_agent.machine.agent` has the rules).

Pure, as the whole ``machine/`` folder is: the I/O layer (``runner.py``, ``progress/``,
``supervisor/``) builds these events from what happened and carries out these effects.
"""

from __future__ import annotations

import enum
import signal

from protocol import MAX_NODES, MAX_TEXT_LEN, Assignment, Failure, Message, Stacks
from protocol.records import record

from ..worker import layout as L

# --- watching the training: what the I/O layer read, and asks of it ----------------------


@record(frozen=True, slots=True, kw_only=True)
class RankSample:
    """One consistent read of a rank's page (torn records are never returned)."""

    step: int  # the last step reported; -1 before the first progress()
    progress_ns: int  # CLOCK_MONOTONIC ns of the last progress() (0: none yet)
    count: int  # progress() calls so far
    phase: str  # the current phase's name ("" outside any phase)
    phase_ns: int  # CLOCK_MONOTONIC ns when the current phase was entered (0: no phase)
    compute_ns: int  # total ns spent in finished "compute" phases
    pid: int  # the writer's pid (0: no worker attached yet)
    stack_signal: int  # the signal that makes the worker dump its stacks (0: cannot)
    attached_ns: int  # CLOCK_MONOTONIC ns when the worker attached (0: not yet)
    # The check record: written once the worker called should_stop() (checks), so it will stop
    # at a commit's step. seen: the last armed stop step it acknowledged (-1: none); seen_at:
    # its step then (below seen: in time; at or past it: late, it will not stop there);
    # stopped: the step should_stop() returned True at (-1: not yet).
    checks: bool = False
    seen: int = L.NO_STEP
    seen_at: int = L.NO_STEP
    stopped: int = L.NO_STEP


@record(frozen=True, slots=True, kw_only=True)
class Hung:
    """A local rank that made no progress past its deadline."""

    local_rank: int
    step: int  # its last step (-1: none reported)
    phase: str  # its phase when found hung ("" none)
    silent_s: float  # seconds since its last progress (or since detection started for it)
    budget_s: float  # the silence it was allowed


@record(frozen=True, slots=True)
class BadPage:
    """A page whose records are whole (their checks hold) but hold a value the layout does not
    allow: a writer's bug. ``why`` names the field and its value (numbers only)."""

    why: str


@record(frozen=True, slots=True)
class ProgressRead:
    """The I/O layer read every local rank's page (None: not attached yet, or torn; BadPage:
    a value the layout does not allow)."""

    samples: tuple[RankSample | BadPage | None, ...]


@record(frozen=True, slots=True)
class PageWarning:
    """A line for the agent's log: a local rank's page was bad (said once per rank and round)."""

    text: str


@record(frozen=True, slots=True)
class StacksDumped:
    """The stacks asked for by ``DumpStacks`` are in (``stacks`` None: none could be read)."""

    stacks: Stacks | None
    report: str  # this node's hang report, as written to ``path``
    path: str  # where it was written ("" if it could not be)


@record(frozen=True, slots=True)
class DumpStacks:
    """Collect every local rank's stacks (bounded in time), hung ranks first; answered by
    :class:`StacksDumped`. ``hung``: our own hang's local ranks (empty: another node's)."""

    round: int
    hung: tuple[Hung, ...]
    reason: str


@record(frozen=True, slots=True)
class WriteStop:
    """Write the stop record of every local rank's page: ``state`` is one of
    ``layout.STOP_NONE`` (with step -1: no stop), ``STOP_ARMED``, ``STOP_GO``."""

    step: int
    state: int


@record(frozen=True, slots=True)
class JobHangReport:
    """Add the server's job-wide hang report (every node's stacks merged; already escaped for
    a terminal) to this node's report file of the round, ``hang_report.txt``: after what the
    node wrote itself, and again should a stack dump still under way write the file anew."""

    text: str


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
# The server ended the job because restarts in a row made no step progress (a crash loop, as
# reported through node_agent.worker): distinct from 1 so a scheduler can tell "do not requeue
# this as is" from an ordinary failure (e.g. a Kubernetes podFailurePolicy rule on exit code 3).
EXIT_CRASH_LOOP = 3
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


class AfterStop(enum.Enum):
    """What STOPPING goes on to once the workers are down."""

    NOTHING = "nothing"  # not stopping
    REJOIN = "rejoin"  # join the next round (a Restart)
    VERDICT = "verdict"  # wait for the server's verdict on our reported failure
    LEAVE = "leave"  # a drain: send the Leave, wait for Left
    EXIT = "exit"  # exit with the decided reason


def fit(text: str) -> str:
    """A text we send, cut to its field: what we build from a server's text must never fail
    validation (an exception there would take the agent down, and SIGKILL its workers)."""
    return text if len(text) <= MAX_TEXT_LEN else text[: MAX_TEXT_LEN - 3] + "..."


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
    # The round's restore step, when what failed was getting a local rank's snapshot of it
    # (every holder failed): the server then restores from another step (-1: not that).
    restore_failed: int = -1


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
    # The workers have it already, from its sender (a scheduler that signals every process of
    # the job step: Slurm, systemd): never sent to them again (signal_witness.py).
    delivered: bool = False
    # It came while no workers of this node ran (before the first start, between rounds, or
    # before the agent handled signals at all: step_notices.py), or they were restarted since:
    # the workers that run now never had it from its sender, and one of forward_signals is
    # not passed on to them either (a worker just started has no handler yet: a notice would
    # kill it).
    stale: bool = False


@record(frozen=True, slots=True)
class Reconnected:
    """A new connection to the server is up (hello exchanged)."""


@record(frozen=True, slots=True)
class ReconnectFailed:
    reason: str


@record(frozen=True, slots=True)
class HealthCheckDone:
    """The ``--health-check`` command finished: passed, or ``detail`` says what went wrong."""

    ok: bool
    detail: str = ""


@record(frozen=True, slots=True)
class Tick:
    pass


@record(frozen=True, slots=True)
class SnapshotsRead:
    """The I/O layer's read of this node's holdings: (global rank, step) pairs, newest first,
    of a job of ``world_size`` ranks."""

    world_size: int
    pairs: tuple[tuple[int, int], ...]
    digests: tuple[str, ...] = ()  # per pair, the sha256 this node knows ("": not known)
    replicated: bool = False  # its own ranks' snapshots hold state every rank holds alike


@record(frozen=True, slots=True)
class KeepSteps:
    """Keep ``step``'s snapshots from pruning (every rank has it on two nodes; -1: none yet)
    and ``replicate``'s, which the node copies to its ring peer now (-1: none)."""

    step: int
    replicate: int = -1


Event = (
    ServerSent
    | WorkersStarted
    | WorkersStartFailed
    | WorkersExited
    | WorkersStopped
    | ConnectionLost
    | SignalReceived
    | HealthCheckDone
    | Reconnected
    | ReconnectFailed
    | Tick
    | ProgressRead
    | StacksDumped
    | SnapshotsRead
)


# --- effects ------------------------------------------------------------------------------


@record(frozen=True, slots=True)
class SendJoin:
    """Join the next round (the I/O layer fills in a fresh free master port)."""


@record(frozen=True, slots=True)
class RunHealthCheck:
    """Run ``--health-check`` before joining; its result comes back as :class:`HealthCheckDone`.

    The I/O layer runs it in the background (a check may take a minute), so a signal meanwhile
    is handled at once; the check's process is killed when the agent exits."""


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
    """Send ``signum`` (0: none, the workers have the signal already from its sender), wait up to
    ``grace`` for them to exit, then SIGKILL what is left. ``park``: the job goes on in a next
    round; workers that run under ``worker.run`` leave their attempt and wait for their next
    place instead (``supervisor/parking.py``), and the next ``StartWorkers`` gives it them."""

    signum: int
    grace: float
    park: bool = False


@record(frozen=True, slots=True)
class ForwardSignal:
    signum: int


@record(frozen=True, slots=True)
class Exit:
    code: int
    reason: str
    failure: Failure | None = None  # the job's root cause, when there is one
    local_failures: tuple[Failure, ...] = ()
    job_done: bool = False  # every node of the job finished: the job succeeded


@record(frozen=True, slots=True)
class Log:
    level: str
    text: str


Effect = (
    SendJoin
    | RunHealthCheck
    | Send
    | Reconnect
    | SendResume
    | StartWorkers
    | StopWorkers
    | ForwardSignal
    | Exit
    | Log
    | DumpStacks
    | WriteStop
    | JobHangReport
    | KeepSteps
)


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
    # A signal of handled_signals stops the job (torchrun's --signals-to-handle, which wins
    # where a signal is in both); one of forward_signals that is not is passed on to the workers.
    forward_signals: frozenset[int] = frozenset({signal.SIGUSR1, signal.SIGUSR2})
    handled_signals: frozenset[int] = TERMINATING_SIGNALS
    # Slurm cancels, pre-empts and times out a job as a whole: a drain on a signal never
    # exits 0 there, even when the rendezvous says the job goes on (the others are going too).
    signals_end_job: bool = False
    nproc: int = 1  # this node's workers, for the round line's rank range
    # What this node was started with, checked against every assignment: a server's word
    # never runs this node for another job, past its --max-restarts, or outside its --nnodes.
    # The defaults check nothing (a test's machine that does not care).
    job_id: str = ""
    max_restarts: int | None = None
    min_nodes: int = 1
    max_nodes: int = MAX_NODES
    health_check: bool = False  # run --health-check (RunHealthCheck) before each round's join
    # The checkpoint budget of a commit point (--rdzv-conf commit_timeout): a SIGTERM drain
    # first asks the server for one, and waits this long (plus COMMIT_LEAD) for its Drain.
    # 0: never ask (the drain stops the workers at once).
    commit_timeout: float = 0.0
    # The wall clock minus the machine's clock: a Failure's timestamp is wall time (the banner
    # and torchrun's error file show it as a date), the machine's ``now`` is monotonic.
    wall_offset: float = 0.0
