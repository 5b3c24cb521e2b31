"""Preloaded interpreters (``--preload MODULES``): the agent's side.

For each local rank the agent keeps at most one warm interpreter: the workers' own Python,
started with a cold worker's interpreter flags, session, ``PR_SET_PDEATHSIG`` and environment
(less :data:`ROUND_VARS`, which only a round decides), running :mod:`node_agent.supervisor.warm_boot`,
which imports the modules and waits on a control socket.  On an assignment the supervisor hands
one the worker's argv, environment, cwd and stdio descriptors (:meth:`WarmInterpreter.handoff`)
and it becomes that worker: same pid, so the supervisor's exit, watchdog and stop logic see a
worker like any other.  The warm-up's own output (an import's warnings) goes to two memory files
and is given to the worker's destinations before the worker writes anything
(:meth:`WarmInterpreter.prelude`), as a cold worker would have written it there.

When an interpreter becomes a worker, its replacement starts warming at once, at the
scheduler's idle priority (``SCHED_IDLE``, for every thread of it: it runs only on a core the
workers leave free, so its import does not compete with the new worker's first seconds) and
back at the normal priority (``SCHED_OTHER``, allowed to an unprivileged process) when it is
handed to a worker; one that cannot go back says so and the worker starts cold. So the next
failure finds a warm interpreter ready (issue 44 item 4: with a 2 s delay, a failure 3 s into
training under load found the replacement still importing torch). The first warm-up starts
with the agent, at the normal priority (nothing runs yet to compete with).  The first warm-up
starts with the agent, so in a multi-node job it overlaps the rendezvous.

Whatever goes wrong (an import error, an interpreter that dies or takes longer than
``PRELOAD_TIMEOUT``, a handoff that fails, an entrypoint that is ``--no-python``) the workers
start cold as before, and the agent says why once; a failed preload turns warm-ups off for the
rest of the run.

The supervisor's side of a hand-off is here too: :meth:`WarmPool.become` (take this rank's
interpreter, make it the worker, or say why the worker starts cold) and :func:`hand_off` (the
warm-up's output first, then the worker's descriptors); ``group.py`` only opens the worker's
stdio, as for a cold worker.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, BinaryIO, TypeVar

from ..config import AgentConfig
from ..worker_env import (
    FR_DUMP_VARS,
    FR_PIPE_VARS,
    PAGE_VAR,
    PLACE_VAR,
    SNAPSHOT_VARS,
    NodeAssignment,
    worker_argv,
    worker_env,
)
from . import procutil
from .process import is_open, write_all

if TYPE_CHECKING:
    from .process import Worker
    from .spec import WorkerSpec

T = TypeVar("T")

__all__ = [
    "PRELOAD_TIMEOUT",
    "REFILL_DELAY",
    "ROUND_VARS",
    "WarmHandoffError",
    "WarmInterpreter",
    "WarmPool",
    "hand_off",
    "warm_env",
    "warm_pool",
]

# How long an import may take before the agent gives up on warm-ups (a cold worker, which
# imports the same modules, is not limited).
PRELOAD_TIMEOUT = 600.0
# After a warm interpreter became a worker: when its replacement starts warming.
REFILL_DELAY = 0.0  # at once: the replacement warms at idle priority
# A handoff is a few local messages; a live interpreter answers in milliseconds.
HANDOFF_TIMEOUT = 30.0
# What the agent reads back from a warm interpreter (a message, the prelude of each stream).
MAX_REPLY = 64 * 1024
REAP_TIMEOUT = 10.0
PRELUDE_LIMIT = 256 * 1024
# The script a warm interpreter runs (named, not imported: it imports json, and is the
# interpreter's, not the agent's).
WARM_BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm_boot.py")

# The worker variables only a round (or an attempt) decides: held back from a warm interpreter
# and given with the handoff.  tests/node_agent/test_warm.py checks that every other variable of
# worker_env/training_health_env is the same for any two assignments.
ROUND_VARS: frozenset[str] = frozenset(
    {
        "RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCHELASTIC_ERROR_FILE",
        PAGE_VAR,
        PLACE_VAR,  # the same for every round, but made with the round's first attempt
        *FR_DUMP_VARS,
        *FR_PIPE_VARS,
        *SNAPSHOT_VARS,  # the rank's folder and the round's restore step
    }
)


class WarmHandoffError(Exception):
    """A warm interpreter could not become the worker; the worker starts cold instead."""


def warm_env(cfg: AgentConfig, environ: Mapping[str, str], local_rank: int) -> dict[str, str]:
    """A warm interpreter's environment: the cold worker's of that local rank less ROUND_VARS."""
    placeholder = NodeAssignment(
        run_id=cfg.rdzv_id,
        group_rank=0,
        group_world_size=1,
        rank_offset=0,
        world_size=cfg.nproc_per_node,
        master_addr="127.0.0.1",
        master_port=1,
        restart_count=0,
        max_restarts=cfg.max_restarts,
    )
    env = worker_env(config=cfg, node=placeholder, local_rank=local_rank, error_file="", base_env=environ)
    return {k: v for k, v in env.items() if k not in ROUND_VARS}


def _frame(obj: object) -> bytes:
    import json  # imported only with --preload: a launch without it has no other use for json

    data = json.dumps(obj).encode("utf-8", "surrogatepass")
    return struct.pack(">I", len(data)) + data


async def _read_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> dict[str, object]:
    """One boot -> agent message; a bad one is the interpreter's fault (WarmHandoffError)."""
    buf = bytearray()
    need = 4
    length: int | None = None
    while True:
        while len(buf) < need:
            chunk = await loop.sock_recv(sock, need - len(buf))
            if not chunk:
                raise WarmHandoffError("the interpreter closed its control socket")
            buf += chunk
        if length is None:
            (length,) = struct.unpack(">I", buf[:4])
            if length > MAX_REPLY:
                raise WarmHandoffError(f"the interpreter sent {length} bytes (limit {MAX_REPLY})")
            need = 4 + length
            continue
        import json  # --preload only, as in _frame

        try:
            msg = json.loads(bytes(buf[4:need]).decode("utf-8", "replace"))
        except ValueError as e:
            raise WarmHandoffError(f"the interpreter sent a bad message ({e})") from None
        if not isinstance(msg, dict):
            raise WarmHandoffError("the interpreter sent a bad message (not an object)")
        return msg


def _clip(text: object, limit: int = 2000) -> str:
    s = str(text)
    return s if len(s) <= limit else s[: limit - 3] + "..."


class _WarmProtocol(asyncio.SubprocessProtocol):
    def __init__(self, interp: WarmInterpreter) -> None:
        self._interp = interp
        self._transport: asyncio.SubprocessTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # what subprocess_exec makes

    def process_exited(self) -> None:
        assert self._transport is not None
        returncode = self._transport.get_returncode()
        assert returncode is not None
        self._interp._exited(returncode)


class WarmInterpreter:
    """One warm interpreter of one local rank, from spawn to handoff (or its end)."""

    def __init__(self, local_rank: int, argv: Sequence[str], env: Mapping[str, str]) -> None:
        self.local_rank = local_rank
        self.argv = tuple(argv)  # the cold worker's command line it expects to run
        self.env = dict(env)  # what it was started with
        self.cpus: frozenset[int] | None = None  # the --numa-binding it was started with
        self.pid = 0
        self.transport: asyncio.SubprocessTransport | None = None
        self.returncode: int | None = None
        self._sock: socket.socket | None = None
        self._prelude: dict[int, int] = {}  # 1/2 -> the memory file its output went to
        self._on_exit: Callable[[int], None] | None = None
        self._gone: asyncio.Future[None] | None = None  # resolved when it has been reaped
        self.handed_off = False
        # A refill warms at SCHED_IDLE until a worker needs it (promote()): then normal.
        self.promoted = asyncio.Event()

    def promote(self) -> bool:
        """Every thread of it back to the normal policy (from the idle one it warms at); False
        if one could not be (the worker then starts cold)."""
        self.promoted.set()
        if not self.pid:
            return True
        try:
            tids = os.listdir(f"/proc/{self.pid}/task")
        except OSError:
            return True  # gone: take() finds it dead
        for tid in tids:
            try:
                os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
            except ProcessLookupError:
                continue  # a thread that ended meanwhile
            except OSError:
                return False
        return True

    @property
    def alive(self) -> bool:
        return self.returncode is None and self.transport is not None

    def _exited(self, returncode: int) -> None:
        self.returncode = returncode
        if self._gone is not None and not self._gone.done():
            self._gone.set_result(None)
        if self._on_exit is not None:
            self._on_exit(returncode)

    async def spawn(
        self,
        python_flags: Sequence[str],
        preload: Sequence[str],
        cwd: str | None,
        cpus: frozenset[int] | None = None,
        idle: bool = False,
    ) -> None:
        """Start it as a cold worker would start (session, PDEATHSIG, env, the descriptors,
        ``cpus``: its --numa-binding); OSError if it cannot."""
        loop = asyncio.get_running_loop()
        self._gone = loop.create_future()
        self.cpus = cpus or None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            for fd in (1, 2):
                self._prelude[fd] = os.memfd_create(f"warm-{self.local_rank}-{fd}", os.MFD_CLOEXEC)
            config = {
                "fd": theirs.fileno(),
                "preload": list(preload),
                "argv": list(self.argv),
                "ignored": list(procutil.STEP_SIGNALS),  # until it becomes the worker
                "idle": idle,  # warm at SCHED_IDLE, back to SCHED_OTHER at the handoff
            }
            import json  # --preload only, as in _frame

            argv = [self.argv[0], *python_flags, WARM_BOOT, json.dumps(config)]
            keep = (theirs.fileno(),)  # its control socket; stray descriptors go, as a cold worker's
            transport, _ = await loop.subprocess_exec(
                lambda: _WarmProtocol(self),
                *argv,
                stdin=None,  # inherited, as a cold worker's
                stdout=self._prelude[1],
                stderr=self._prelude[2],
                env=self.env,
                cwd=cwd,
                start_new_session=True,
                # It outlives a signal sent to every process of the step while it waits (the
                # job's workers have theirs); warm_boot restores the defaults as it becomes one.
                preexec_fn=procutil.worker_preexec(
                    cpus, procutil.ignore_step_signals(procutil.pdeathsig_preexec()), keep=keep
                ),
                pass_fds=keep,
            )
        except BaseException:
            ours.close()
            self._close_prelude()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours
        self.transport = transport
        self.pid = transport.get_pid()

    async def ready(self) -> None:
        """Wait until its imports are done; WarmHandoffError with the reason if they failed."""
        assert self._sock is not None
        msg = await _read_frame(asyncio.get_running_loop(), self._sock)
        if msg.get("ready") is not True:
            raise WarmHandoffError(_clip(msg.get("error") or "the interpreter is not ready"))

    def prelude(self, fd: int) -> bytes:
        """What it wrote to ``fd`` (1 or 2) while warming, at most PRELUDE_LIMIT bytes."""
        mem = self._prelude.get(fd)
        if mem is None:
            return b""
        size = os.fstat(mem).st_size
        data = os.pread(mem, min(size, PRELUDE_LIMIT), 0)
        if size > PRELUDE_LIMIT:
            data += b"\n[node-agent: %d more bytes of preload output left out]\n" % (size - PRELUDE_LIMIT)
        return data

    def mismatch(
        self, argv: Sequence[str], env: Mapping[str, str], cpus: frozenset[int] | None = None
    ) -> str | None:
        """Why this interpreter cannot become a worker with this argv, env and CPU binding
        (which it had from its start: its imports saw those CPUs), else None."""
        if (cpus or None) != self.cpus:
            return "its CPU binding differs"
        if tuple(argv) != self.argv:
            return f"the command line changed ({list(argv)[:4]}... is not {list(self.argv)[:4]}...)"
        held = {k: v for k, v in env.items() if k not in ROUND_VARS}
        if held != self.env:
            changed = sorted(set(held.items()) ^ set(self.env.items()))
            names = sorted({k for k, _ in changed})
            return f"the environment differs in {', '.join(names[:5])}"
        return None

    async def handoff(
        self,
        *,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str,
        fds: Mapping[int, int],
        on_exit: Callable[[int], None],
    ) -> None:
        """Make it the worker: ``fds`` maps 0/1/2 to our descriptors to put there.  Once this
        returns, ``on_exit`` gets its returncode when it ends.  WarmHandoffError (and the
        interpreter killed) if it cannot."""
        if not self.alive or self._sock is None:
            raise WarmHandoffError(f"it exited ({self.returncode})")
        loop = asyncio.get_running_loop()
        sock = self._sock
        targets = sorted(fds)
        # The step's signals the agent itself ignores now (nohup, a wrapper): a cold worker
        # started now would inherit them ignored, so the warm one keeps them so.
        inherited = [s for s in procutil.STEP_SIGNALS if signal.getsignal(s) == signal.SIG_IGN]
        payload = _frame(
            {"argv": list(argv), "env": dict(env), "cwd": cwd, "targets": targets, "ignored": inherited}
        )
        self._on_exit = on_exit
        try:
            async with asyncio.timeout(HANDOFF_TIMEOUT):
                rights = [
                    (
                        socket.SOL_SOCKET,
                        socket.SCM_RIGHTS,
                        struct.pack(f"{len(targets)}i", *[fds[t] for t in targets]),
                    )
                ]
                sent = 0
                while sent == 0:
                    try:
                        sent = sock.sendmsg([payload], rights)
                    except BlockingIOError:
                        await asyncio.sleep(0.001)
                if sent < len(payload):  # (an empty send would fail once a quick worker closed it)
                    await loop.sock_sendall(sock, payload[sent:])
                reply = await _read_frame(loop, sock)
            if reply.get("ok") is not True:
                raise WarmHandoffError(_clip(reply.get("error") or "refused the handoff"))
        except (OSError, TimeoutError) as e:
            self._on_exit = None
            ended = f"; it had exited ({self.returncode})" if self.returncode is not None else ""
            self.kill()
            raise WarmHandoffError(f"handoff failed ({e or type(e).__name__}{ended})") from None
        except BaseException:  # its error, or we were cancelled: it is in no known state
            self._on_exit = None
            self.kill()
            raise
        self.handed_off = True
        self._close_control()
        self._close_prelude()

    def kill(self) -> None:
        """SIGKILL it (and its process group) unless it became a worker; its exit is reaped by
        the loop."""
        if self.handed_off:
            return
        if self.pid and self.returncode is None:
            procutil.killpg(self.pid, signal.SIGKILL)
        self._close_control()
        self._close_prelude()

    def _close_control(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _close_prelude(self) -> None:
        for fd in self._prelude.values():
            os.close(fd)
        self._prelude.clear()


def _python_flags(argv: Sequence[str]) -> list[str]:
    """The interpreter options of a cold worker's command line (``-u``): what comes between
    the interpreter and its script, ``-m`` or ``-c``."""
    flags = []
    for arg in argv[1:]:
        if arg in ("-m", "-c", "--") or not arg.startswith("-") or arg == "-":
            break
        flags.append(arg)
    return flags


class WarmPool:
    """One warm interpreter per local rank, kept ready (policy: module header)."""

    def __init__(
        self,
        cfg: AgentConfig,
        environ: Mapping[str, str],
        log: Callable[[str], None],
        *,
        preload: Sequence[str] | None = None,
        refill_delay: float = REFILL_DELAY,
        timeout: float = PRELOAD_TIMEOUT,
    ) -> None:
        self._cfg = cfg
        self._environ = dict(environ)
        self._log = log
        self.preload = tuple(cfg.preload if preload is None else preload)
        self._refill_delay = refill_delay
        self._timeout = timeout
        self._slots: dict[int, asyncio.Task[WarmInterpreter | None]] = {}
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._reaping: set[asyncio.Task[None]] = set()
        self.disabled: str | None = None  # why warm-ups are off (said once)
        self._closed = False
        self._cpus: dict[int, frozenset[int]] = {}  # local rank -> its --numa-binding
        self._warming: dict[int, WarmInterpreter] = {}  # the interpreter each slot warms
        self._warmed: set[int] = set()  # ranks whose first warm-up started (refills go idle)

    # --- what the supervisor calls -----------------------------------------------------------

    def start(self, cpus: Mapping[int, frozenset[int]] | None = None) -> None:
        """Warm every local rank (the first warm-up, overlapping the rendezvous); ``cpus``:
        each rank's --numa-binding, which its interpreters start with."""
        self._cpus = dict(cpus or {})
        for local_rank in range(self._cfg.nproc_per_node):
            self.refill(local_rank)

    def refill(self, local_rank: int) -> None:
        """Start warming this rank's interpreter now unless one is ready or warming."""
        timer = self._timers.pop(local_rank, None)
        if timer is not None:
            timer.cancel()
        if self._closed or self.disabled is not None or local_rank in self._slots:
            return
        self._slots[local_rank] = asyncio.get_running_loop().create_task(self._warm(local_rank))

    async def take(
        self,
        local_rank: int,
        argv: Sequence[str],
        env: Mapping[str, str],
        cpus: frozenset[int] | None = None,
    ) -> WarmInterpreter | None:
        """This rank's warm interpreter for a worker with this argv, env and CPU binding,
        waiting for a warm-up under way; None (the reason said once) when the worker must start
        cold."""
        if self._closed or self.disabled is not None:
            return None
        slot = self._slots.get(local_rank)
        if slot is None:
            self.refill(local_rank)
            slot = self._slots.get(local_rank)
            if slot is None:
                return None
        warming = self._warming.get(local_rank)
        if warming is not None and not warming.promote():
            self._turn_off(f"local rank {local_rank}'s warm interpreter could not leave the idle priority")
            await asyncio.shield(slot)
            self.discard(warming)
            return None
        interp = await asyncio.shield(slot)
        if self._slots.get(local_rank) is slot:
            del self._slots[local_rank]
            self._warming.pop(local_rank, None)
        if interp is None:
            return None
        if not interp.alive:
            self._turn_off(f"the warm interpreter of local rank {local_rank} exited ({interp.returncode})")
            return None
        reason = interp.mismatch(argv, env, cpus)
        if reason is not None:
            self.discard(interp)
            self._turn_off(f"local rank {local_rank}'s worker does not match its warm interpreter: {reason}")
            return None
        return interp

    async def become(self, spec: WorkerSpec, start: Callable[[WarmInterpreter], Awaitable[T]]) -> T | None:
        """The worker ``start`` makes of this rank's warm interpreter (``start`` calls
        :func:`hand_off`), or None: it starts cold (said once). A failed hand-off leaves nothing
        behind: that interpreter is killed, and warm-ups are off from then on."""
        interp = await self.take(spec.local_rank, spec.argv, spec.env, spec.cpus)
        if interp is None:
            return None
        try:
            made = await start(interp)
        except (WarmHandoffError, OSError) as e:
            self.failed(interp, e)
            return None
        except BaseException:
            self.discard(interp)
            raise
        self.taken(spec.local_rank)
        return made

    def taken(self, local_rank: int) -> None:
        """A warm interpreter of this rank became its worker: warm the next one (at once, idle)."""
        if self._closed or self.disabled is not None or local_rank in self._timers:
            return
        loop = asyncio.get_running_loop()
        self._timers[local_rank] = loop.call_later(self._refill_delay, self.refill, local_rank)

    def failed(self, interp: WarmInterpreter, error: Exception) -> None:
        """Its handoff failed: the worker starts cold, and so do the next ones."""
        self.discard(interp)
        self._turn_off(f"local rank {interp.local_rank}'s warm interpreter could not take over: {error}")

    def discard(self, interp: WarmInterpreter) -> None:
        interp.kill()
        self._reap_later(interp)

    async def close(self) -> None:
        """Kill every idle warm interpreter and wait for them to be reaped."""
        self._closed = True
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        slots = list(self._slots.values())
        self._slots.clear()
        for slot in slots:
            slot.cancel()
        for slot in slots:
            try:
                interp = await slot
            except (asyncio.CancelledError, Exception):
                continue
            if interp is not None:
                self.discard(interp)
        if self._reaping:
            await asyncio.wait(list(self._reaping), timeout=10.0)

    # --- internals ---------------------------------------------------------------------------

    def _turn_off(self, why: str) -> None:
        if self.disabled is None:
            self.disabled = why
            self._log(f"--preload: {why}; workers start cold from now on")
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    def _reap_later(self, interp: WarmInterpreter) -> None:
        if interp.transport is None or interp.returncode is not None:
            if interp.transport is not None:
                interp.transport.close()
            return

        async def reap() -> None:
            # The loop's child watcher reaps it; we wait for that to be seen, then let go.
            if interp._gone is not None:
                await asyncio.wait([interp._gone], timeout=REAP_TIMEOUT)
            if interp.transport is not None:
                interp.transport.close()

        task = asyncio.get_running_loop().create_task(reap())
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    async def _warm(self, local_rank: int) -> WarmInterpreter | None:
        cfg = self._cfg
        argv = worker_argv(cfg, local_rank)
        interp = WarmInterpreter(local_rank, argv, warm_env(cfg, self._environ, local_rank))
        idle = local_rank in self._warmed  # a refill: idle until a worker needs it
        self._warmed.add(local_rank)
        self._warming[local_rank] = interp
        try:
            await interp.spawn(_python_flags(argv), self.preload, None, self._cpus.get(local_rank), idle)
        except OSError as e:
            self._turn_off(f"cannot start {argv[0]} ({e.strerror or e})")
            return None
        ready = asyncio.ensure_future(interp.ready())
        try:
            if idle:  # its import may take long on a busy node: timed once a worker needs it
                promoted = asyncio.ensure_future(interp.promoted.wait())
                try:
                    await asyncio.wait((ready, promoted), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    promoted.cancel()
            async with asyncio.timeout(self._timeout):
                await ready
        except TimeoutError:
            self.discard(interp)
            self._turn_off(f"importing {','.join(self.preload)} took over {self._timeout:g}s")
            return None
        except WarmHandoffError as e:
            self.discard(interp)
            status = f" (exit {interp.returncode})" if interp.returncode not in (None, 3) else ""
            self._turn_off(f"preloading {','.join(self.preload)} failed{status}: {e}")
            return None
        except BaseException:
            ready.cancel()
            self.discard(interp)
            raise
        return interp


async def hand_off(
    worker: Worker,
    warm: WarmInterpreter,
    stdio: Mapping[int, int],
    direct: Mapping[int, int | BinaryIO],
    log: Callable[[str], None],
) -> asyncio.SubprocessTransport:
    """Make a warm interpreter this worker: its warm-up's output first goes where the
    worker's would (so it comes before the worker's own), then it gets the descriptors a
    cold worker would get, stdin being ours as a cold worker inherits it. ``stdio``: the
    descriptor for each of the worker's fds; ``direct``: those the worker writes itself."""
    spec = worker.spec
    for fd in (1, 2):
        data = warm.prelude(fd)
        if not data:
            continue
        if fd in worker.sinks:
            worker.feed(fd, data)
            continue
        target = direct.get(fd)
        try:
            if isinstance(target, int):
                write_all(target, data)
            elif target is not None:
                target.write(data)
                target.flush()
        except OSError as e:
            log(f"local_rank {spec.local_rank}: cannot write its preload output ({e})")
    fds = dict(stdio)
    if is_open(0):
        fds[0] = 0
    await warm.handoff(
        argv=spec.argv,
        env=spec.env,
        cwd=spec.cwd or os.getcwd(),
        fds=fds,
        on_exit=worker.on_exited,
    )
    assert warm.transport is not None
    worker.warm = True
    return warm.transport


def warm_pool(cfg: AgentConfig, environ: Mapping[str, str], log: Callable[[str], None]) -> WarmPool | None:
    """The run's pool, or None when ``--preload`` is off or cannot apply (said once)."""
    if not cfg.preload:
        return None
    if cfg.no_python and not cfg.run_path:
        log(f"--preload {','.join(cfg.preload)}: the entrypoint is --no-python, so workers start cold")
        return None
    return WarmPool(cfg, environ, log)
