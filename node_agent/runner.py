"""The agent's asyncio layer: wires the rendezvous, the workers, signals and time to the machine.

One queue of events feeds :class:`~node_agent.machine.agent.AgentMachine`; each of its effects is
carried out here. Background work (reading the rendezvous, heartbeats, waiting for workers,
stopping them) runs in tasks owned by one ``TaskGroup``, so nothing outlives the agent.

Which rendezvous the agent talks to is not this module's business: it gets a
:class:`~node_agent.rdzv.RendezvousBackend` (from :func:`~node_agent.rdzv.open_backend`, or one
a test gives it) and only ever connects, sends, receives and closes. What runs beside the
workers (the event log, snapshots, the GPUs, the watch on the training, the workers' store) is
not its business either: each is a :class:`~node_agent.parts.RoundPart`, walked in order at
each step of a round (``parts.py``); this module only makes them. What each worker gets,
what the agent sends and the failures it reports are plain functions (:mod:`node_agent.worker_env`,
:mod:`node_agent.outbound`, :mod:`node_agent.machine.settings`);
this module only carries them out. :meth:`Agent.run` returns an :class:`AgentOutcome`: the exit
code and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import field, replace
from typing import TYPE_CHECKING, Any, TextIO

from protocol import Assignment, Failure, Heartbeat, Join, Message, Resume
from protocol.auth import proof as auth_proof
from protocol.errors import ProtocolError
from protocol.records import record

from . import step_notices
from .agent_log import AgentLog, shown
from .config import AgentConfig
from .health_check import health_check
from .logs import RunLogs
from .machine import events as st
from .machine.agent import AgentMachine
from .machine.settings import machine_settings, training
from .outbound import failure_of, failures_of, join_message
from .parts import RoundPart, RoundStart, StartFailed, StartWait, with_part
from .progress.poll import RoundWatch
from .rdzv import NotARendezvousServer, RendezvousError, open_backend
from .report import failure_summary
from .runtime_dir import RuntimeDir
from .store.host import hosts_round, start_store
from .supervisor.group import WorkerGroup
from .supervisor.spec import GroupResult, WorkerGroupLike, WorkerSpawnError
from .supervisor.warm import warm_pool
from .torch_events import EventLog
from .worker_env import omp_threads_notice, worker_specs

if TYPE_CHECKING:
    from .gpu.node import GpuNode
    from .rdzv import RendezvousBackend, RendezvousLink


@record(frozen=True, slots=True)
class AgentOutcome:
    """How a run ended: the process's exit code and why."""

    code: int
    reason: str  # the agent's last line, without the failure summary
    failure: Failure | None = None  # the job's root cause, when a worker failed (maybe elsewhere)
    local_failures: tuple[Failure, ...] = ()  # this node's failed workers, first first
    # {local rank: global rank} of the last workers this node started; empty if none were
    ranks: Mapping[int, int] = field(default_factory=dict)
    job_done: bool = False  # every node of the job finished (exit 0 for the job, not a leave)


def make_node_id() -> str:
    """This run's node id: host, pid and a random tail (a restarted agent is a new node)."""
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(2).hex()}"


class Agent:
    """One node's agent for one run: ``await Agent(config).run()``.

    ``backend``: the rendezvous to use; by default the one ``--rdzv-backend`` names.
    ``group``: the workers; by default real processes (``supervisor/group.py``).
    """

    def __init__(
        self,
        config: AgentConfig,
        *,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        backend: RendezvousBackend | None = None,
        group: WorkerGroupLike | None = None,
    ) -> None:
        self.config = config
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr
        self.log = AgentLog(self.stderr, config.log_format, level=config.log_level)
        self.node_id = make_node_id()
        # Sent in every Join (and the Join of a Resume) so that, after a server restart, only
        # this process can take its node's place back: the job's token proves the job, not the
        # node. Picked once per run (os.urandom is what secrets.token_hex uses, without its
        # imports); never logged, never in a worker's environment.
        self.node_secret = os.urandom(16).hex()
        self.log.node = self.node_id
        self.log.job = config.rdzv_id
        self.events: asyncio.Queue[st.Event] = asyncio.Queue()
        self.clock: Callable[[], float] = time.monotonic
        # --preload: warm interpreters that become the workers (warm.py); None: always cold.
        self.warm = warm_pool(config, os.environ, self.log)
        # Pages and pipes, node-local and private (runtime_dir.py); removed when the run ends,
        # by the orphan watchdog if the agent is killed, else by the node's next agent.
        self.runtime = RuntimeDir(log=self.log)  # it says so if the folder has to be made again
        self.group: WorkerGroupLike = group or WorkerGroup(
            stdout=self.stdout,
            stderr=self.stderr,
            log=self.log,
            warm=self.warm,
            remove_on_death=self.runtime.path,
        )
        # A worker's partial line (a progress bar) is ended before the agent's own line.
        self.log.before_line = self.group.fresh_line
        self.logs = RunLogs(config.log_dir, config.rdzv_id, self.runtime)
        self.backend = backend
        self.conn: RendezvousLink | None = None
        self.addr = ""
        self._tasks: asyncio.TaskGroup | None = None
        self._wait_task: asyncio.Task[None] | None = None
        self._exit: st.Exit | None = None
        self._bg: set[asyncio.Task[None]] = set()
        self._signal_tasks: set[asyncio.Task[None]] = set()  # signals being classified
        self._starts = 0  # worker groups started: a signal that came before one never reached it
        self.events_log = EventLog(
            config.event_log_handler,
            run_id=config.rdzv_id,
            role=config.role,
            backend=config.rdzv_backend,
            # torchrun names the program it starts: the interpreter, or the --no-python command
            entrypoint=os.path.basename(config.training_script if config.no_python else config.python_exec),
            stream=self.stderr,
        )
        self._joined_at = 0.0  # when the last join was sent (the rendezvous event's duration)
        self._sent = 0  # messages sent on the link (a heartbeat is due only after a silent tick)
        self._phase = "starting"
        self._assignment: Assignment | None = None
        self._ranks: dict[int, int] = {}
        # Watching the training (progress/poll.py): this round's pages, their poll, a stack dump.
        self.watch = RoundWatch(
            self._spawn, self.events.put_nowait, self.log, pids=lambda: self.group.pids, node=self.node_id
        )
        # What runs beside the workers (parts.py), in ORDER; each added as it is made: the
        # workers' TCPStore (store/host.py) before the first Join, in-memory snapshots
        # (snapshots/node.py) once connected, the GPUs (gpu/node.py) when first needed.
        self.parts: tuple[RoundPart, ...] = (self.events_log, self.watch)
        self._gpu: GpuNode | None = None  # --numa-binding's CPUs, the visible GPUs, the GPU check
        self._start_task: asyncio.Task[None] | None = None  # a start waiting (for the GPUs)
        self._started_us = int(time.monotonic() * 1e6)  # Xids the GPU check counts come after this

    # -- the whole run ---------------------------------------------------------------------

    async def run(self) -> AgentOutcome:
        try:
            return await self._run_bound()
        finally:
            self.runtime.close()

    async def _run_bound(self) -> AgentOutcome:
        if self.config.numa_binding is not None:
            from .gpu.binding import GpuSetupError  # GPU nodes only (1.5 ms to import)

            try:
                self._gpu_node().bind()
            except GpuSetupError as exc:
                return self._gave_up(str(exc))
        if self.warm is None:
            return await self._run()
        # The first warm-up overlaps the rendezvous; each interpreter starts on its rank's CPUs,
        # so what its imports size by the CPUs they see (OpenMP's threads) is a cold worker's.
        self.warm.start(self._cpus())
        try:
            return await self._run()
        finally:
            await self.warm.close()

    async def _run(self) -> AgentOutcome:
        if self.backend is None:
            try:
                self.backend = await open_backend(
                    self.config, node_id=self.node_id, log=self.log, clock=self.clock
                )
            except RendezvousError as exc:
                return self._gave_up(str(exc))
        backend = self.backend
        health = None
        if self.config.health_check_port is not None:
            from .liveness import start_liveness  # only with TORCHELASTIC_HEALTH_CHECK_PORT (json, HTTP)

            health = await start_liveness(self.config.health_check_port, lambda: self._phase, self.log)
        store = await start_store(self.config, os.environ, self.log, self._store_lost)
        if store is not None:
            self.parts = with_part(self.parts, store)
        outcome = None
        try:
            outcome = await self._run_connected(backend)
            return outcome
        finally:
            try:
                await backend.close(linger=outcome is not None)
            finally:
                if health is not None:
                    await health.close()
                # The job finished: its persisted snapshots are no fallback any more.
                succeeded = self._exit is not None and self._exit.job_done
                for part in reversed(self.parts):
                    await part.close(succeeded=succeeded)

    def _gpu_node(self) -> GpuNode:
        if self._gpu is None:
            from .gpu.node import GpuNode  # GPU work only: a launch without it never imports it

            self._gpu = GpuNode(self.config, os.environ, self.log, self.clock, self._started_us, self._spawn)
            self.parts = with_part(self.parts, self._gpu)
        return self._gpu

    def _cpus(self) -> dict[int, frozenset[int]]:
        """--numa-binding's CPUs per local rank (none without it)."""
        return self._gpu.cpus if self._gpu is not None else {}

    def _store_lost(self, why: str) -> None:
        a = self._assignment
        if a is not None and hosts_round(a) and self._phase == "running":
            self.log(f"this round's workers lost their TCPStore ({why}): stopping them", "error")
            self.group.send_signal(signal.SIGKILL)

    async def _run_connected(self, backend: RendezvousBackend) -> AgentOutcome:
        cfg = self.config
        try:
            self.conn = conn = await backend.connect(self.clock() + cfg.rdzv_conf.join_timeout)
        except RendezvousError as exc:
            return self._gave_up(str(exc))
        for part in self.parts:
            await part.connected()  # the store's verdict: the first Join must not offer in vain
        self.addr = cfg.local_addr or conn.local_ip
        if cfg.snapshot_memory != 0 and backend.snapshots:
            from .snapshots.node import start_snapshots  # light: see its header

            snaps = await start_snapshots(cfg, self.runtime.path, self.addr, self.log, self.events.put_nowait)
            if snaps is not None:
                self.parts = with_part(self.parts, snaps)
        machine = AgentMachine(
            settings=machine_settings(
                cfg,
                node_id=self.node_id,
                addr=self.addr,
                reconnects=backend.reconnects,
                environ=os.environ,
                wall_offset=time.time() - time.monotonic(),  # the machine's clock is monotonic
            ),
            training=training(
                cfg, node_id=self.node_id, addr=self.addr, wall_offset=time.time() - time.monotonic()
            ),
        )
        self.watch.follow(machine.training)
        notice = omp_threads_notice(cfg, os.environ)
        if notice:
            self.log(notice, "warning")
        loop = asyncio.get_running_loop()
        # The node-agent command holds the step's notices from its first instruction
        # (step_notices.py): they come to the machine through the hold, never through a
        # handler of the loop's, which its removal would leave at the signal's default action.
        held = step_notices.held_signals()
        watched = {signal.Signals[s] for s in cfg.signals_to_handle} | {signal.SIGUSR1, signal.SIGUSR2}
        watched = {sig for sig in watched if sig not in held}
        for sig in watched:
            loop.add_signal_handler(sig, self._on_signal, int(sig))
        if held:

            def on_notice(signum: int) -> None:  # in a signal handler: only schedules
                loop.call_soon_threadsafe(self._on_signal, signum)

            step_notices.deliver_to(on_notice)
        try:
            async with asyncio.TaskGroup() as tasks:
                self._tasks = tasks
                self._spawn(self._read_server())
                self._spawn(self._heartbeat())
                try:
                    await self._drive(machine)
                finally:
                    for t in list(self._bg):
                        t.cancel()
        finally:
            if held:
                step_notices.hold_again()
            for sig in watched:
                loop.remove_signal_handler(sig)
            # Whatever happened, no worker outlives the agent.
            await self.group.stop(grace=0.0, sig=signal.SIGKILL)
            await self.conn.close()
        return self._finish()

    async def _drive(self, machine: AgentMachine) -> None:
        await self._apply(machine.start(self.clock()))
        while self._exit is None:
            deadline = machine.next_deadline()
            timeout = None if deadline is None else max(0.0, deadline - self.clock())
            try:
                event = await asyncio.wait_for(self.events.get(), timeout)
            except asyncio.TimeoutError:
                event = st.Tick()
            try:
                await self._apply(machine.handle(event, self.clock()))
            except Exception as exc:  # last resort, on purpose: a bug of ours must not SIGKILL the workers
                await self._internal_error(event, exc)

    async def _internal_error(self, event: st.Event, exc: Exception) -> None:
        """A bug of ours (nothing a peer sends may get here): said loudly, with its traceback,
        and the workers stopped as on any failure, SIGTERM first, never a SIGKILL out of the blue."""
        import traceback

        what = f"{type(event).__name__}" + (
            f" ({event.msg.TYPE})" if isinstance(event, st.ServerSent) else ""
        )
        self.log(
            f"internal error while handling {what}: {exc!r} (a bug in node-agent; please report it)\n"
            + "".join(traceback.format_exception(exc)).rstrip(),
            "error",
        )
        self._exit = st.Exit(st.EXIT_FAILED, f"internal error: {exc!r}")
        await self.group.stop(grace=self.config.shutdown_timeout, sig=signal.SIGTERM)

    def _on_signal(self, signum: int) -> None:
        """A signal for the machine, once we know whether the workers have it already from its
        sender (signal_witness.py); with no watchdog to ask, at once."""

        starts = self._starts
        running = self._phase == "running"  # else no workers of ours ran when it came

        async def classify() -> None:
            delivered = await self.group.delivered(signum)
            # Workers started while we asked (a restart meanwhile) came after the signal: its
            # sender never reached them.
            restarted = self._starts != starts
            delivered = delivered and not restarted
            self.events.put_nowait(
                st.SignalReceived(signum, delivered=delivered, stale=restarted or not running)
            )

        task = asyncio.get_running_loop().create_task(classify())
        self._signal_tasks.add(task)
        task.add_done_callback(self._signal_tasks.discard)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """A background task owned by the run's task group, cancelled when the run ends."""
        assert self._tasks is not None
        task = self._tasks.create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
        return task

    # -- effects ---------------------------------------------------------------------------

    async def _apply(self, effects: list[st.Effect]) -> None:
        for eff in effects:
            if isinstance(eff, st.Send):
                self._send(eff.msg)
            elif isinstance(eff, st.SendJoin):
                for part in reversed(self.parts):
                    await part.before_join()  # the last round's store dropped, a new replica key
                self._joined_at = self.clock()
                self._phase = "rendezvous"
                self._send(self._join())
            elif isinstance(eff, st.RunHealthCheck):
                self._phase = "rendezvous"
                self._spawn(self._health_check())
            elif isinstance(eff, st.SendResume):
                # The restore digests mattered before the workers started; a Resume never echoes them.
                held = eff.assignment._copy_with(restore_digests=())
                self._send(Resume(join=self._join(), assignment=held, succeeded=eff.succeeded))
            elif isinstance(eff, st.Reconnect):
                self._spawn(self._reconnect(eff.deadline))
            elif isinstance(eff, st.StartWorkers):
                await self._start_workers(eff.assignment)
            elif isinstance(eff, st.StopWorkers):
                self._stop_workers(eff.signum, eff.grace, park=eff.park)
            elif isinstance(eff, st.ForwardSignal):
                self.group.send_signal(eff.signum)
            elif isinstance(eff, st.Log):
                self.log(eff.text, eff.level)
            elif isinstance(eff, st.Exit):
                self._exit = eff
            else:  # a part's own: the stacks, the pages' stop records, the snapshots to keep
                any(part.carry_out(eff) for part in self.parts)

    def _send(self, msg: Message) -> None:
        assert self.conn is not None
        self.conn.send(msg)
        self._sent += 1

    def _join(self) -> Join:
        # Not where every agent of the job reads our Join (etcd): a secret there is none.
        shared = self.backend is not None and self.backend.shares_joins
        fields: dict[str, Any] = {}
        for part in self.parts:
            fields.update(part.join_fields())  # the store's port, where replicas go
        if self.backend is not None:
            fields["standby_port"] = self.backend.standby_port
        return join_message(
            self.config, node_id=self.node_id, addr=self.addr, proof=self._proof(),
            node_secret="" if shared else self.node_secret, **fields,
        )  # fmt: skip

    def _proof(self) -> str:
        token = self.config.token
        challenge = self.conn.challenge if self.conn is not None else ""
        if not token or not challenge:
            return ""
        return auth_proof(token, challenge, self.config.rdzv_id, self.node_id)

    async def _start_workers(self, a: Assignment) -> None:
        rendezvous_ms = (self.clock() - self._joined_at) * 1000  # not counting a GPU wait below
        waits = [w for part in self.parts if (w := part.start_wait()) is not None]
        if waits:
            # The last workers' GPU memory is not free yet: start once it is (or the wait gave
            # up). The machine meanwhile handles signals and stops as in any start.
            self._start_task = self._spawn(self._start_after(waits, a, rendezvous_ms))
            return
        await self._launch(a, rendezvous_ms)

    async def _start_after(self, waits: list[StartWait], a: Assignment, rendezvous_ms: float) -> None:
        tasks = [w.task for w in waits]
        _, pending = await asyncio.wait(tasks, timeout=1.0)  # the usual case: one quick query
        for w in waits:
            if w.task in pending:
                self.log(f"round {a.round}: {w.why}")
        if pending:
            await asyncio.wait(pending)
        await self._launch(a, rendezvous_ms)

    async def _launch(self, a: Assignment, rendezvous_ms: float) -> None:
        self._assignment = a
        attempt = self.logs.new_attempt()
        specs = worker_specs(self.config, a, os.environ, attempt, self._cpus())
        ready = RoundStart(a, attempt, self.config.nproc_per_node, rendezvous_ms)
        try:
            env: dict[int, dict[str, str]] = {}
            for part in self.parts:  # a failed restore starts nothing (a worker would diverge)
                for rank, more in (await part.before_start(ready)).items():
                    env.setdefault(rank, {}).update(more)
            specs = [replace(s, env={**s.env, **env[s.rank]}) if s.rank in env else s for s in specs]
            self._ranks = {spec.local_rank: spec.rank for spec in specs}
            self._starts += 1
            await self.group.start(specs)
        except (WorkerSpawnError, StartFailed) as exc:
            restore_failed = exc.restore_failed if isinstance(exc, StartFailed) else -1
            self.events.put_nowait(st.WorkersStartFailed(str(exc), restore_failed=restore_failed))
            return
        self._phase = "running"
        self.events.put_nowait(st.WorkersStarted(tuple(self.group.pids.values())))
        self._wait_task = self._spawn(self._wait_workers())
        for part in self.parts:
            part.started(a, self.group.pids)  # the event log's START events, the pages' poll

    async def _wait_workers(self) -> None:
        result = await self.group.wait()
        failures = failures_of(result, self.node_id, self.addr)
        cause = result.first_failure
        first = None if cause is None else failure_of(cause, self.node_id, self.addr)
        # The steps reported since the last poll (the failure report carries the highest), the
        # snapshots the workers left: the machine has them before the exit.
        self._after_exit(result, stopped=False)
        self.events.put_nowait(st.WorkersExited(first, failures))

    def _stop_workers(self, signum: int, grace: float, *, park: bool = False) -> None:
        if self._start_task is not None:
            self._start_task.cancel()  # a start still waiting for the GPUs: it never happens
            self._start_task = None
        if self._wait_task is not None:
            self._wait_task.cancel()
            self._wait_task = None
        # Stacks being collected (bounded): a rank signalled now could die halfway.
        waits = [t for part in self.parts if (t := part.stopping()) is not None]

        async def stop() -> None:
            if waits:
                await asyncio.wait(waits)
            # The watchdog stays for the next attempt's workers; the run's last stop ends it.
            result = await self.group.stop(grace=grace, sig=signum, keep_watchdog=True, park=park)
            if result.exits and self.config.gpu_release_timeout > 0:
                self._gpu_node()  # made now if not yet: the next start waits for their GPU memory
            self._after_exit(result, stopped=True)
            self.events.put_nowait(st.WorkersStopped())

        self._spawn(stop())

    def _after_exit(self, result: GroupResult, *, stopped: bool) -> None:
        for part in reversed(self.parts):
            read = part.after_exit(result, stopped=stopped)
            if read is not None:
                self.events.put_nowait(read)

    # -- background tasks ------------------------------------------------------------------

    async def _health_check(self) -> None:
        """The check runs beside the machine: a signal meanwhile is handled at once, and the
        run's end cancels this task, which kills the check's processes."""
        assert self.config.health_check is not None
        if self.config.health_check == "gpu":
            problem = await self._gpu_node().check()
        else:
            problem = await health_check(self.config.health_check)
        self.events.put_nowait(st.HealthCheckDone(ok=problem is None, detail=problem or ""))

    async def _reconnect(self, deadline: float) -> None:
        while True:
            try:
                assert self.backend is not None
                conn = await self.backend.connect(deadline)
                break
            except NotARendezvousServer as exc:
                # A server that is still starting may drop a connection during the hello:
                # keep trying until the window closes.
                if self.clock() + 0.2 >= deadline:
                    self.events.put_nowait(st.ReconnectFailed(str(exc)))
                    return
                await asyncio.sleep(0.2)
            except RendezvousError as exc:
                self.events.put_nowait(st.ReconnectFailed(str(exc)))
                return
        old, self.conn = self.conn, conn
        if old is not None:
            await old.close()
        assert self._tasks is not None
        self._spawn(self._read_server())
        self.events.put_nowait(st.Reconnected())

    async def _read_server(self) -> None:
        assert self.conn is not None
        try:
            while True:
                msg = await self.conn.receive()
                self.events.put_nowait(st.ServerSent(msg))
        except (ConnectionError, OSError) as exc:
            self.events.put_nowait(st.ConnectionLost(str(exc) or type(exc).__name__))
        except ProtocolError as exc:  # a frame we cannot decode: the server's fault, not a crash
            self.events.put_nowait(st.ConnectionLost(f"bad message from the server: {shown(str(exc))}"))
        except Exception as exc:  # last resort, on purpose: a bug of ours in the link must not
            # end the run with a SIGKILL of the workers; said with its traceback, the link is lost
            import traceback

            tb = "".join(traceback.format_exception(exc)).rstrip()
            self.log(f"internal error reading the rendezvous: {exc!r} (a bug in node-agent)\n{tb}", "error")
            self.events.put_nowait(st.ConnectionLost(f"internal error reading the rendezvous: {exc!r}"))

    async def _heartbeat(self) -> None:
        conf = self.config.rdzv_conf
        interval = conf.heartbeat_interval
        # Any message is a sign of life to the server (its machine's last_seen): a tick that
        # finds the link carried something since the last tick sends no heartbeat, so the
        # training's summaries, one an interval, replace most of them (half the frames a
        # training node sends). The silence is then at most two intervals: only where that is
        # well inside heartbeat_timeout (the default's five).
        may_skip = conf.heartbeat_timeout >= 3 * interval
        beat = Heartbeat()
        counted = self._sent
        while True:
            await asyncio.sleep(interval)
            if may_skip and self._sent != counted:
                counted = self._sent
                continue
            # A link's send does not raise once the link is lost (its reader reports the loss);
            # a transport error on the write is the same loss.
            with contextlib.suppress(ConnectionError, OSError):
                self._send(beat)
            counted = self._sent

    # -- the end ---------------------------------------------------------------------------

    def _finish(self) -> AgentOutcome:
        exit_ = self._exit
        assert exit_ is not None
        self._phase = "exited"
        self.events_log.run_ended(self._assignment, exit_, ok=exit_.code == st.EXIT_OK)
        outcome = AgentOutcome(
            exit_.code, exit_.reason, exit_.failure, exit_.local_failures, dict(self._ranks), exit_.job_done
        )
        if exit_.code == st.EXIT_OK:
            self.log(f"done: {exit_.reason}" if exit_.job_done else exit_.reason)
            return outcome
        if exit_.failure is not None or exit_.local_failures:
            self.log(
                failure_summary(self.config.entrypoint_name, exit_.failure, exit_.local_failures), "error"
            )
        self.log(exit_.reason, "error")
        return outcome

    def _gave_up(self, reason: str) -> AgentOutcome:
        """The rendezvous could not be set up or reached: no run, so no summary and no event."""
        self.log(reason, "error")
        return AgentOutcome(st.EXIT_RDZV, reason)


def run_agent(config: AgentConfig, **kwargs: Any) -> tuple[Agent, AgentOutcome]:
    """The ``node-agent`` command's run: its ``logging`` lines (an embedded server's) are its
    own. The outcome whole (code, reason, root cause), for the launcher's error file."""
    from edge.loop import run_loop

    from .agent_log import install

    agent = Agent(config, **kwargs)
    install(agent.log)
    return agent, run_loop(agent.run())
