"""The asyncio layer of the rendezvous server: sockets and timers around the pure machine.

One TCP port carries both protocols. The first bytes of a connection decide: our magic means
an agent speaking framed msgpack (handled here, as an ``asyncio.Protocol``: no stream or task
per connection, which keeps 10,000 agents cheap); an HTTP request line means a person or a
monitoring system, and the connection's bytes are relayed to aiohttp's server protocol.
aiohttp is imported only when HTTP is enabled, so an agent's embedded server starts fast.
With an ``ssl.SSLContext`` the port speaks only TLS, and the same routing runs on the
decrypted bytes once the handshake is done (see ``protocol/tls.py``).

What a stranger can make the server hold, and for how long, is bounded:

- Caps on open connections, in all and per address, fit under the process's file
  descriptor limit (``admission.py``: the ``Gate``, which also holds the listening sockets).
  Every connection holds its place from the accept (after its TLS handshake, which
  ``hello_timeout`` bounds) until it closes, HTTP ones too. A connection over a cap is told
  "server busy" in its own protocol (an ``Error`` frame, or a 503), not just closed.
- Each stage has a deadline: the hello (and a TLS handshake) within ``hello_timeout``, the
  join within ``auth_timeout`` after it, each HTTP request head within ``hello_timeout`` of
  the accept and then ``http_idle_timeout`` of the previous one. The hello and join deadlines
  are the machine's (``machine/state.py``, "Handshake deadlines"), delivered as its ``Tick``; this
  layer times only what the machine never sees: the TLS handshake, a socket whose first bytes
  have not yet said what it speaks, HTTP connections, and one over the caps being refused.
- Each stage has a frame limit (``protocol.frame_limits``): 2 KiB before the hello, the
  largest legal Join or Resume until joined, the largest legal client message after.
- Each connection decodes at most ``FRAMES_PER_TURN`` frames (``BYTES_PER_TURN`` bytes) in
  one turn of the event loop, then pauses reading until the next; one that sends faster than
  ``FRAME_RATE`` frames a second (past a burst), or keeps sending messages that change nothing,
  is closed with an Error saying so.
- A stall of the server itself (a long turn of the loop, a SIGSTOP) is measured by a
  watchdog timer and credited to every agent (``Rendezvous.credit_stall``) before the
  heartbeat sweep can run, so it never counts as the agents' silence.

Faults. The machine contains a fault of its rules itself (``machine/faults.py``); this layer makes
sure no fault can leave the server without its timer, which every deadline of every job
(heartbeats, settle windows, commits, handshakes) hangs on. The timer is re-armed after every
event whatever happens (``dispatch``, ``_on_timer``), but a training summary or stacks that
told nobody anything and derived no fact, which can have moved no deadline; an exception that
still escapes the machine is logged with its traceback and, with a state log, the machine is
snapshotted as it is, since the event's record cannot say what the event did; the watchdog
re-arms a timer found missing while a deadline is pending; and a deadline that a Tick at its
time left due (a bug) is retried every ``STUCK_RETRY`` s, not in a busy loop.

A full disk. A write of the state log that fails for want of room (ENOSPC, EDQUOT) does not
stop the server: it goes read-only (``journal.py``, "A full disk"), as etcd does on its NOSPACE
alarm. The effects of the events whose records failed stay held (nobody was told anything of
them), and so are the effects of every event handled while read-only. Running jobs are served
from memory: heartbeats, training progress and the status API need no write. What would add to
the log from outside is turned away with the non-fatal ``server_busy`` Error: a new agent
connection at once (an agent takes that answer to its hello as "busy" and tries again with
backoff until its join or reconnect deadline), a connection not yet joined at its next message,
an operator's drain with 503. A member's own change (a failure report, a rejoin, a commit) is
handled, and its answer held: the member is told once, with the same non-fatal Error (an agent
logs it as a warning and waits), and answered when the log is written again. Every ``RETRY``
s (backing off to ``RETRY_MAX``) the service tries ``StateLog.recover``, a snapshot of the
machine as it is; once it is written the held effects are carried out in order. Entering and
leaving are each logged once. Any other write error still stops the server (``on_fatal``).

Everything the machine decides comes back as effects; this module only carries them out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from protocol import (
    MAX_FRAME_SIZE,
    Error,
    Progress,
    SnapshotsHeld,
    Stacks,
    encode,
)
from protocol.auth import TokenTable

from .admission import Gate
from .connection import HTTP_IDLE_TIMEOUT, WRITE_BUFFER_LIMIT, Connection
from .machine.state import (
    AUTH_TIMEOUT,
    HELLO_TIMEOUT,
    SERVER_BUSY,
    Close,
    Connected,
    ConnPhase,
    Disconnected,
    DrainRequested,
    Effect,
    Event,
    Log,
    NotFound,
    Received,
    Rendezvous,
    Send,
    ShuttingDown,
    Tick,
)

if TYPE_CHECKING:
    from aiohttp import web

    from .http_app import Access
    from .journal import LogHealth, StateLog
    from .machine.standbys import TakeOver

logger = logging.getLogger("rdzv_server")

# The watchdog: how often it looks, and the lateness that counts as a stall of the server.
WATCHDOG_INTERVAL = 0.25
STALL_MIN = 0.2
STUCK_RETRY = 1.0  # a deadline a Tick left due is delivered again after this long, not at once
_monotonic = time.monotonic
_NEVER = -float("inf")
# Messages that change only the machine's volatile views unless they derive a fact (see
# journal.py, which does not log them then either).
_VOLATILE = (Progress, Stacks, SnapshotsHeld)
# Read-only (a full state disk): how soon the service tries to write the log again, backing off
# to RETRY_MAX; and the most effects it holds meanwhile (far more than running jobs produce in
# hours: past it, memory would grow without end, and the server stops as for any failed write).
RETRY = 1.0
RETRY_MAX = 5.0
MAX_HELD_EFFECTS = 1_000_000


class RendezvousService:
    """Serves the rendezvous protocol (and optionally HTTP) on one TCP port."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        http: bool = False,
        http_on_demand: bool = False,
        max_frame_size: int = MAX_FRAME_SIZE,
        tokens: TokenTable | None = None,
        max_connections: int | None = None,
        max_per_address: int | None = None,
        hello_timeout: float = HELLO_TIMEOUT,
        auth_timeout: float = AUTH_TIMEOUT,
        write_buffer_limit: int = WRITE_BUFFER_LIMIT,
        tls: ssl.SSLContext | None = None,
        listeners: int = 1,
        raise_fd_limit: bool | None = None,
        http_idle_timeout: float = HTTP_IDLE_TIMEOUT,
        http_access: Access | None = None,
        state_log: StateLog | None = None,
        on_fatal: Callable[[str], None] | None = None,
        host_node: str | None = None,
        standby_term: int = 0,
        taken_over: TakeOver | None = None,
    ) -> None:
        """``max_connections``/``max_per_address``: None fits them under the open-files limit
        (``admission.py``), which ``start`` first raises to the hard limit when
        ``raise_fd_limit`` (default: with ``http``, i.e. a standalone server; an agent's
        embedded server keeps its limit, which its workers inherit). ``listeners``: sockets
        sharing the port (SO_REUSEPORT), for an accept queue a join storm of thousands fits
        in; embedded servers keep 1. ``host_node``/``standby_term``: the node of the agent
        hosting us and the take-overs so far (``machine/standbys.py``); each round then names
        its job's standbys. ``taken_over``: we host as the standby that took over, and what it
        knows was lost. ``http_on_demand`` (an agent's server): HTTP is set up at its first
        request, so the agent imports aiohttp only when someone asks for the status."""
        # The port, the caps on its connections and what each may send (admission.py).
        self.gate = Gate(
            max_connections=max_connections,
            max_per_address=max_per_address,
            max_frame_size=max_frame_size,
            tls=tls,
            listeners=listeners,
            raise_fd_limit=http if raise_fd_limit is None else raise_fd_limit,
            hello_timeout=hello_timeout,
        )
        self.hello_timeout = hello_timeout
        self.auth_timeout = auth_timeout
        self.http_idle_timeout = http_idle_timeout
        self.write_buffer_limit = write_buffer_limit
        # The watchdog (see the module docstring): when it is due, and the stalls so far.
        self._watchdog: asyncio.TimerHandle | None = None
        self._watch_due = 0.0
        self.stall_total = 0.0  # seconds the server stood still: credited to every agent
        self.machine = Rendezvous(
            tokens,
            hello_timeout=hello_timeout,
            auth_timeout=auth_timeout,
            host_node=host_node,
            standby_term=standby_term,
            taken_over=taken_over,
        )
        self.tokens = tokens
        self.clock = clock
        self.http_enabled = http
        self.http_on_demand = http_on_demand and not http
        self._http_starting: asyncio.Task[None] | None = None
        self._http_waiting: list[Connection] = []  # HTTP clients until it is set up (on demand)
        self.http_access = http_access  # the HTTP API's read token and Host names
        self.http_factory: Callable[[], asyncio.Protocol] | None = None
        self._http_runner: web.AppRunner | None = None
        self._conns: dict[int, Connection] = {}
        self._next_id = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._ticked_at = -float("inf")  # the machine's clock at a Tick, until the next event
        self._stuck_at: float | None = None  # a deadline already said to be left due
        self._closed = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._change_waiters: list[asyncio.Future[None]] = []  # woken after each machine step
        # Called when the state log cannot be written: the server stops serving.
        self.on_fatal: Callable[[str], None] | None = on_fatal
        self._durable_init(state_log)

    def _durable_init(self, state_log: StateLog | None) -> None:
        # With a state log, the effects of the events handled in one turn of the loop wait
        # until their records are fsync'd together (journal.py, "Order").
        self.state_log = state_log
        self._pending: list[Effect] = []
        self._flush_soon = False
        self._inflight: asyncio.Future[None] | None = None  # the fsync of the batch being committed
        self._snapshot_due = False  # an event escaped the machine: snapshot it as it is
        self._gone = False  # told the agents we are going away: the machine takes no more events
        # Read-only (the state log's disk is full): the next try to write it, the delay after
        # that, the connections told their answers are held, the connections refused.
        self._retry: asyncio.TimerHandle | None = None
        self._retry_delay = RETRY
        self._told_held: set[int] = set()
        self._held_notice = b""
        self._refused_read_only = 0
        if state_log is not None:
            restored = state_log.machine
            given = (self.hello_timeout, self.auth_timeout)
            if (restored.hello_timeout, restored.auth_timeout) != given:
                # StateLog.open built it: the timeouts must be given there too, never patched here.
                raise ValueError(
                    f"the state log's machine has hello/auth timeouts {restored.hello_timeout:g}/"
                    f"{restored.auth_timeout:g} s, the service {given[0]:g}/{given[1]:g} s: "
                    "pass the same ones to StateLog.open"
                )
            self.machine = restored
            self.clock = state_log.clock
            # Restored members hold the old process's connection ids (AWAY): never reuse one.
            self._next_id = max(self.machine.conns, default=0)

    def arm_timer(self) -> None:
        """Deliver the restored machine's next deadline (its resume window) even if nobody calls."""
        self._schedule()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, host: str | None, port: int, *, sock: socket.socket | None = None) -> int:
        """Listen on host:port (port 0 picks a free one), or serve on ``sock`` (bound already);
        returns the bound port."""
        self.gate.raise_limit()
        if self.http_enabled:
            await self._set_up_http()
        bound = await self.gate.listen(host, port, self._make_connection, sock=sock)
        self._watch_due = _monotonic() + WATCHDOG_INTERVAL
        self._watchdog = asyncio.get_running_loop().call_later(WATCHDOG_INTERVAL, self._watch)
        return bound

    @property
    def port(self) -> int:
        return self.gate.port

    async def close(self) -> None:
        """Stop listening, close every connection and the HTTP side."""
        self.gate.close()
        for c in list(self._conns.values()):
            c.close()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        await self.gate.wait_closed()
        if self._http_starting is not None:
            self._http_starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._http_starting
            self._http_starting = None
        if self._http_runner is not None:
            await self._http_runner.cleanup()
            self._http_runner = None
        self._closed.set()

    def http_later(self, conn: Connection) -> bool:
        """An HTTP client of a server that sets up HTTP on demand: set it up (once) and hand
        ``conn`` over when it is ready (its reading paused meanwhile). False: no HTTP here."""
        if not self.http_on_demand:
            return False
        self._http_waiting.append(conn)
        if self._http_starting is None:
            self._http_starting = asyncio.get_running_loop().create_task(self._start_http())
        return True

    async def _set_up_http(self) -> None:
        from .http_app import make_http_runner

        runner = await make_http_runner(self)
        self._http_runner = runner
        self.http_factory = runner.server

    async def _start_http(self) -> None:
        try:
            await self._set_up_http()
        except Exception as exc:  # aiohttp missing or broken: the rendezvous goes on without
            logger.warning("cannot serve HTTP here (%s): closing its clients", exc)
            self.http_on_demand = False
        factory = self.http_factory
        waiting, self._http_waiting = self._http_waiting, []
        for c in waiting:
            if factory is None:
                c.close()
            else:
                c.http_ready(factory)

    # -- connections -----------------------------------------------------------------------

    def _make_connection(self) -> Connection:
        self._next_id += 1
        return Connection(self, self._next_id)

    def agent_connected(self, conn: Connection) -> None:
        """A connection spoke our protocol (its hello deadline is the machine's from now on)."""
        if self.read_only:
            # Read-only: a new agent would add to a log that cannot be written. Told so before
            # the machine sees it (nothing to hold); it tries again until its deadline.
            self._refused_read_only += 1
            conn.write(self._busy_frame())
            conn.close()  # after the Error is written; its frames go nowhere (not in the machine)
            return
        self._conns[conn.conn_id] = conn
        self._idle.clear()
        challenge = os.urandom(16).hex() if self.tokens is not None else ""
        self.dispatch(Connected(conn.conn_id, conn.peer, challenge, since=conn.accepted, local=conn.local))

    def agent_disconnected(self, conn: Connection, reason: str) -> None:
        if self._conns.pop(conn.conn_id, None) is not None:
            self.dispatch(Disconnected(conn.conn_id, reason))
        if not self._conns:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Until no agent is connected."""
        await self._idle.wait()

    def job_nodes(self, job_id: str) -> set[str]:
        """The node ids in job ``job_id`` (members and spares); empty when there is no such job."""
        job = self.machine.jobs.get(job_id)
        return set() if job is None else {*job.members, *job.spares}

    async def wait_job_gone(self, job_id: str) -> None:
        """Until the machine forgets job ``job_id`` (its last node left): an agent that hosts
        the rendezvous waits for its own job's peers, not for other jobs it happens to serve."""
        while job_id in self.machine.jobs:
            waiter = asyncio.get_running_loop().create_future()
            self._change_waiters.append(waiter)
            await waiter

    # -- operations ------------------------------------------------------------------------

    def drain(self, job_id: str, node_id: str, reason: str = "") -> None:
        """Ask one node to leave its job cleanly; KeyError names what does not exist."""
        now = self.clock()
        event = DrainRequested(job_id, node_id, reason)
        effects = self.machine.handle(event, now)
        missing = next((e for e in effects if isinstance(e, NotFound)), None)
        if missing is not None:
            raise KeyError(missing.text)
        if self.state_log is not None:
            self.state_log.record(event, effects, now)
        self._carry_out(effects)
        self._schedule()
        self._wake_waiters()

    async def go_away(self, reason: str, grace: float = 5.0) -> None:
        """SIGTERM's policy: stop taking connections and joins, flush, tell the agents, close.

        Agents keep their workers and reconnect (to the next server process on this port);
        with a state dir that server resumes their rounds. The state log ends in a snapshot,
        so a newer server (an upgrade) starts from the state this one had, not from a replay
        of its inputs under its own rules. Each step is logged once.
        """
        self.gate.close()
        logger.info("draining (%s): no new connections or joins", reason)
        now = self.clock()
        event = ShuttingDown(reason)
        effects = self.machine.handle(event, now)
        told = sum(1 for e in effects if isinstance(e, Send))
        if self.state_log is not None:
            self.state_log.record(event, effects, now)
            await self._commit_all()
            if not self.state_log.read_only:  # (read-only, _commit_all tried once more)
                try:
                    # The next server on this dir (an upgrade, say) then loads the state as it
                    # is, rather than replaying inputs under rules that may have changed since.
                    self.state_log.compact()
                except OSError as exc:
                    logger.warning("no snapshot at shutdown (%s); the next server replays the log", exc)
                logger.info(
                    "state log flushed: record %d in %s (%d fsyncs by this process, %.2f s)",
                    self.state_log.seq,
                    self.state_log.dir,
                    self.state_log.syncs,
                    self.state_log.sync_seconds,
                )
        self._gone = True  # what follows (connections closing) is not a change of job state
        self._apply(effects)
        logger.info("told %d agent connection(s) the server is going away; closing them", told)
        for c in list(self._conns.values()):
            c.close()  # after the buffered GoingAway is written
        if self._conns:
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except asyncio.TimeoutError:
                logger.warning("%d agent connection(s) still open after %g s", len(self._conns), grace)

    # -- the machine -----------------------------------------------------------------------

    def heartbeat(self, conn_id: int) -> bool:
        """A heartbeat frame, alone in its read: just note the agent is alive."""
        return not self._gone and self.machine.heartbeat(conn_id, self.clock())

    def dispatch(self, event: Connected | Received | Disconnected | Tick) -> bool:
        """Hand the machine an event; False when it was not handed (we are going away, or
        the machine already closed the connection)."""
        if self._gone:
            return False
        if isinstance(event, Received) and self.state_log is not None:
            conn = self.machine.conns.get(event.conn)
            if conn is None:
                return False  # the machine closed it; the Close waits for the batch's fsync
            if self.state_log.read_only and conn.phase in (ConnPhase.HELLO, ConnPhase.READY):
                self._refuse_unjoined(event.conn)  # (it came before the log went read-only)
                return False
        now = self.clock()
        quiet = False
        try:
            try:
                effects = self.machine.handle(event, now)
            except Exception:
                self._escaped(event)
                return True
            # A deadline due at a Tick's time must be gone after it (see _schedule).
            self._ticked_at = now if type(event) is Tick else _NEVER
            if self.state_log is not None:
                self.state_log.record(event, effects, now)
            if effects or self.state_log is not None:
                self._carry_out(effects)
            # A training summary (or stacks) that told nobody anything and derived no fact: it
            # changed only the machine's volatile views, never a deadline (deadlines are state
            # the state log replays, and the log keeps no such event), so the timer stays as
            # it is. Every agent sends one a second: this is most of what the server handles.
            quiet = (
                not effects
                and self.machine.facts is None
                and type(event) is Received
                and type(event.msg) in _VOLATILE
            )
        finally:
            if not quiet:
                self._schedule()  # whatever happened: every deadline hangs on this timer
            if self._change_waiters:
                self._wake_waiters()
        return True

    def _escaped(self, event: Event) -> None:
        """The machine raised (it contains its rules' faults, so this is a bug in that, or the
        caller's). Its state may have changed without a record saying how: with a state log,
        snapshot it as it is, so a restart starts from what the server serves."""
        logger.exception("internal error: the machine raised handling %s; going on", type(event).__name__)
        if self.state_log is not None:
            self._snapshot_due = True
            if not self._flush_soon:
                self._flush_soon = True
                asyncio.get_running_loop().call_soon(self._flush)

    def _wake_waiters(self) -> None:
        """After each machine step: whoever waits for a change (wait_job_gone) looks again."""
        if self._change_waiters:
            waiters, self._change_waiters = self._change_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def _carry_out(self, effects: list[Effect]) -> None:
        """Now, or with a state log once the batch's records are durable (read-only: once the
        log is written again)."""
        if self.state_log is None:
            self._apply(effects)
            return
        self._pending.extend(effects)
        if self.state_log.read_only:
            self._tell_held(effects)
            if len(self._pending) > MAX_HELD_EFFECTS:
                self._stop(
                    f"cannot write the state log ({self.state_log.read_only}) and {len(self._pending)} "
                    "effects wait for it"
                )
            return
        if not self._flush_soon and (self._pending or self.state_log.pending):
            self._flush_soon = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Commit the batch: write its records, fsync them (in a thread), then carry out its
        effects in order. One batch is committed at a time; the next gathers meanwhile."""
        self._flush_soon = False
        log = self.state_log
        if log is None or self._inflight is not None or self._gone or log.read_only:
            return  # the fsync in flight flushes again when it is done (read-only: _retry_log)
        try:
            if self._snapshot_due:
                self._snapshot_due = False
                log.compact()  # the records buffered and the state, durable (fsync'd) before...
                urgent = False  # ...the effects are carried out
            else:
                urgent = log.write()
        except OSError as exc:
            self._log_failed(exc)
            return
        effects, self._pending = self._pending, []
        if not urgent:
            self._apply(effects)
            return
        fut = asyncio.get_running_loop().run_in_executor(None, log.fsync_written)
        self._inflight = fut
        fut.add_done_callback(lambda f: self._committed(f, effects))

    def _committed(self, fut: asyncio.Future[None], effects: list[Effect]) -> None:
        self._inflight = None
        error = None if fut.cancelled() else fut.exception()
        if fut.cancelled() or error is not None:
            self._pending[:0] = effects  # not carried out: held (read-only) or dropped (stopping)
            self._log_failed(error if isinstance(error, OSError) else OSError(str(error or "cancelled")))
            return
        self._apply(effects)
        assert self.state_log is not None
        try:
            self.state_log.maybe_compact()
        except OSError as exc:
            self._log_failed(exc)
            return
        if self._pending or self.state_log.pending or self._snapshot_due:
            self._flush()

    async def _commit_all(self) -> None:
        """Until every record so far is durable and its effects carried out (for shutdown)."""
        while self._inflight is not None:
            await asyncio.wait({self._inflight})
            await asyncio.sleep(0)  # let its done-callback carry out its batch
        log = self.state_log
        if log is None or self._gone:
            return
        if not log.read_only:
            try:
                log.sync()
            except OSError as exc:
                self._log_failed(exc)  # read-only (then tried once more below), or stopping
            else:
                effects, self._pending = self._pending, []
                self._apply(effects)
                return
        if not self._gone and log.read_only:
            self._retry_log()  # one last try
            if log.read_only:
                logger.warning(
                    "state log: still cannot write it (%s): the %d change(s) of state held in memory since "
                    "%s were never acknowledged to an agent and are not kept; the next server on %s starts "
                    "from the state the log had then",
                    log.read_only,
                    log.held,
                    _when(log.read_only_since),
                    log.dir,
                )
                self._pending.clear()

    def _log_failed(self, exc: OSError) -> None:
        """A write of the state log failed: read-only for want of room, else stop."""
        log = self.state_log
        assert log is not None
        was = log.read_only
        if not log.enter_read_only(exc):
            # Nothing may be acknowledged that is not durable: stop serving.
            self._stop(f"cannot write the state log in {log.dir}: {exc.strerror or exc}")
            return
        if not was:
            logger.error(
                "cannot write the state log (%s): read-only until there is room: running jobs are "
                "served from memory, new agents are refused (server_busy), changes of state wait "
                "(held in memory, nothing acknowledged); trying again every %g-%g s",
                log.read_only,
                RETRY,
                RETRY_MAX,
            )
            self._tell_held(self._pending)
        self._schedule_retry()

    def _stop(self, why: str) -> None:
        logger.error("%s; stopping", why)
        self._pending.clear()
        self._gone = True
        if self.on_fatal is not None:
            self.on_fatal(why)

    # -- read-only (a full state disk) -----------------------------------------------------

    @property
    def read_only(self) -> str:
        """Why the state log is not written ("" while it is, or without one)."""
        return self.state_log.read_only if self.state_log is not None else ""

    def state_log_health(self) -> LogHealth | None:
        """For ``/healthz`` and ``/metrics``; None without a state log."""
        log = self.state_log
        return None if log is None else log.health(self._refused_read_only if log.read_only else 0)

    def _busy_frame(self) -> bytes:
        text = (
            f"the rendezvous server cannot write its state log ({self.read_only}): it takes no new "
            "agents until there is room again; try again later"
        )
        return encode(Error(code=SERVER_BUSY, message=text, fatal=False))

    def _refuse_unjoined(self, conn_id: int) -> None:
        """Read-only: a connection that has not joined says something; tell it to come back
        later and close it (its close is an event like any other, held)."""
        c = self._conns.get(conn_id)
        if c is None:
            return
        self._refused_read_only += 1
        c.write(self._busy_frame())
        c.close()

    def _tell_held(self, effects: list[Effect]) -> None:
        """Read-only: tell each agent a message to it waits, once (until the log is written)."""
        for eff in effects:
            if isinstance(eff, Send) and eff.conn not in self._told_held:
                c = self._conns.get(eff.conn)
                if c is not None:
                    self._told_held.add(eff.conn)
                    if not self._held_notice:
                        text = (
                            f"the rendezvous server cannot write its state log ({self.read_only}): what "
                            "it has to tell this node waits until there is room again; running workers go on"
                        )
                        self._held_notice = encode(Error(code=SERVER_BUSY, message=text, fatal=False))
                    c.write(self._held_notice)

    def _schedule_retry(self) -> None:
        if self._retry is None and not self._gone:
            self._retry = asyncio.get_running_loop().call_later(self._retry_delay, self._retry_log)
            self._retry_delay = min(self._retry_delay * 2, RETRY_MAX)

    def _retry_log(self) -> None:
        """Read-only: try to write the log again (a snapshot of the machine as it is); once it
        is written, carry out every effect held, in order."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        log = self.state_log
        if log is None or self._gone or not log.read_only:
            return
        if self._inflight is not None:  # (never while read-only: nothing is written)
            self._schedule_retry()
            return
        why, since = log.read_only, log.read_only_since
        try:
            held = log.recover()
        except OSError as exc:
            if log.enter_read_only(exc):
                self._schedule_retry()
            else:
                self._stop(f"cannot write the state log in {log.dir}: {exc.strerror or exc}")
            return
        effects, self._pending = self._pending, []
        logger.info(
            "state log written again in %s (a snapshot holding the %d change(s) of state held since %s, "
            "when it failed: %s); read-only mode is over: new agents are accepted, %d refused meanwhile, "
            "and %d held effect(s) are carried out now",
            log.dir,
            held,
            _when(since),
            why,
            self._refused_read_only,
            len(effects),
        )
        self._snapshot_due = False  # (the snapshot just written is of the machine as it is)
        self._retry_delay = RETRY
        self._told_held.clear()
        self._held_notice = b""
        self._refused_read_only = 0
        self._apply(effects)
        if log.pending:
            self._flush()

    def _apply(self, effects: list[Effect]) -> None:
        # A broadcast (Restart, JobFailed) is one message object sent to every member: encode
        # it once, not once per node.
        last_msg, frame = None, b""
        for eff in effects:
            if isinstance(eff, Send):
                c = self._conns.get(eff.conn)
                if c is not None:
                    if eff.msg is not last_msg:
                        last_msg, frame = eff.msg, encode(eff.msg)
                    c.write(frame)
            elif isinstance(eff, Close):
                c = self._conns.pop(eff.conn, None)
                if c is not None:
                    c.close()
                if not self._conns:
                    self._idle.set()
            elif isinstance(eff, Log):
                logger.log(_LEVELS.get(eff.level, logging.INFO), "%s", eff.text)

    def _schedule(self) -> None:
        """Arm the one timer for the machine's next deadline (none: no timer)."""
        if self._gone:
            return  # the machine takes no more events: its deadlines do not matter
        at = self.machine.next_deadline()
        if at == self._timer_at and (at is None) == (self._timer is None):
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = at
        if at is not None:
            delay = max(0.0, at - self.clock())
            if at <= self._ticked_at:
                # A Tick at or after it left it due: a bug of the machine's, which must not
                # become a busy loop. Said once per such deadline.
                if self._stuck_at != at:
                    self._stuck_at = at
                    logger.error(
                        "internal error: a deadline (%.3f) is still due after a tick; "
                        "delivering it again every %g s",
                        at,
                        STUCK_RETRY,
                    )
                delay = max(delay, STUCK_RETRY)
            self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        try:
            self._check_stall()  # before the sweep: a stall of ours is no agent's silence
            self.dispatch(Tick())
        finally:
            self._schedule()

    def _watch(self) -> None:
        try:
            self._check_stall()
            self._check_timer()
        finally:  # nothing above may stop the watchdog
            self._watch_due = _monotonic() + WATCHDOG_INTERVAL
            self._watchdog = asyncio.get_running_loop().call_later(WATCHDOG_INTERVAL, self._watch)

    def _check_timer(self) -> None:
        """A deadline pending and no timer armed for it: no heartbeat sweep, settle window,
        commit or handshake deadline of any job would fire. Say so and arm it."""
        if self._gone or self._timer is not None or self.machine.next_deadline() is None:
            return
        logger.error("internal error: no timer was armed for the machine's next deadline; arming it")
        self._schedule()

    def _check_stall(self) -> None:
        """Credit the agents with the time the server itself did not run: the watchdog fires
        every WATCHDOG_INTERVAL, so its lateness is how long the loop (or the process) stood
        still."""
        if self._watchdog is None:
            return  # not started (a restored machine's timer armed before start)
        now = _monotonic()
        late = now - self._watch_due
        if late < STALL_MIN:
            return
        self._watch_due = now  # counted once, whichever of the watchdog and the sweep saw it
        self.stall_total += late
        self.machine.credit_stall(late)
        if late >= 1.0:
            logger.warning(
                "the server did not run for %.1f s (a stalled event loop, or a stopped process); "
                "agents are not held to their heartbeats for that time",
                late,
            )


_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _when(wall: float | None) -> str:
    return "?" if wall is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall))
