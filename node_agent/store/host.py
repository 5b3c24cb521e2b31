"""The agent-hosted TCPStore: workers' ``init_process_group`` never waits in torch's connect retry.

Under torchrun the agent of node rank 0 hosts the workers' TCPStore; here, without it, worker
rank 0 would host it and every other rank that connects before it listens is refused and sleeps
in torch's retry (0.3-0.9 s). So the agent listens on MASTER_PORT itself, from its start (which
also keeps the port from being taken between the Join and the workers' start), with a large
backlog: a worker that connects early waits in the kernel's queue, not in a retry. A store
process, the workers' own interpreter running :mod:`node_agent.store.boot`, checks at once that
it has a usable torch, imports it when this node first hosts a round (at once with ``--preload
torch``), and serves torch's own TCPStore on that socket, a fresh one per round. Only group rank
0's node pays for the import: the workers, importing torch too, connect about when it is done.

Every node of a round must agree on who hosts: this node says in its Join whether it can
(``hosts_store``: listening, and its store process has a usable torch or is importing one) and
the server tells every node (``Assignment.agent_store``: the group-rank-0 node's answer); the
workers' environment follows (``TORCHELASTIC_USE_AGENT_STORE``). When the workers' interpreter
has no usable torch (none, or older than 2.8), or the store process dies, this node stops
offering: it closes the socket, says why once, and its next Join says ``hosts_store=False``
(worker rank 0 hosts the store, as before). An assignment that still counts on the store then
fails that round's start on this node (the job restarts without it).

The static backend has no server to agree through: it keeps today's behaviour (no store here).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import importlib.util
import os
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from protocol import Assignment

from ..parts import RoundPart, RoundStart, StartFailed
from ..rdzv import BACKENDS
from ..supervisor import procutil
from ..worker_env import SECRETS

if TYPE_CHECKING:
    from ..agent_log import AgentLog
    from ..config import AgentConfig

__all__ = ["StoreHost", "StoreUnavailable", "hosts_round", "listen_socket"]

# The kernel caps it at net.core.somaxconn; every rank of a large job may connect at once.
BACKLOG = 65535
# A warm store process answers `fresh` in about a millisecond; this only bounds a wedged one.
FRESH_TIMEOUT = 10.0
# ``drop`` while torch still imports waits behind the import (a cold torch import on a busy node).
IMPORT_TIMEOUT = 120.0
_MAX_LINE = 4096
# Not pathlib: it imports urllib.parse and ipaddress (3 ms), which a launch needs nowhere else.
_BOOT_SOURCE = os.path.join(os.path.dirname(__file__), "boot.py")
# TCPStore serves a socket it is given (master_listen_fd, libuv) from 2.8. store/boot.py, run
# by the workers' Python, keeps its own copy: it must import nothing of node_agent.
MIN_TORCH = (2, 8)


class StoreUnavailable(StartFailed):
    """This node's agent cannot serve the store a round counts on (say why): the round's
    workers do not start."""


class Phase(enum.Enum):
    STARTING = "starting"  # looking for torch
    IMPORTING = "importing"  # torch found and usable; imported when first needed
    READY = "ready"  # torch imported; serves a store when asked
    OFF = "off"  # no usable torch, or the process died: today's behaviour from now on


def torch_version_here(python: str, env: Mapping[str, str]) -> str | None:
    """torch's version, when the workers' interpreter is this one (same executable and module
    path settings) and finds a torch >= 2.8 without importing it; None: ask the store process."""
    try:
        same = os.path.realpath(python) == os.path.realpath(sys.executable)
    except OSError:
        return None
    if not same or any(env.get(k) != os.environ.get(k) for k in ("PYTHONPATH", "PYTHONHOME")):
        return None
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        with open(os.path.join(next(iter(spec.submodule_search_locations)), "version.py")) as f:
            text = f.read()
    except (OSError, StopIteration):
        return None
    for line in text.splitlines():
        name, _, value = line.partition("=")
        if name.strip() == "__version__":
            version = value.strip().strip("'\"")
            head = version.split("+")[0].split(".")[:2]
            try:
                return version if tuple(int(x) for x in head) >= MIN_TORCH else None
            except ValueError:
                return None
    return None


def _boot_source() -> str:
    with open(_BOOT_SOURCE) as f:
        return f.read()


def hosts_round(a: Assignment) -> bool:
    """Whether this node's agent serves the store of round ``a`` (it is the group-rank-0 node)."""
    return a.agent_store and a.group_rank == 0


def listen_socket(attempts: int = 5) -> socket.socket:
    """A socket listening on a free port, dual-stack where the machine has IPv6.

    The port comes from :func:`node_agent.worker_env.free_port` (below the ephemeral range, where
    nothing but an explicit bind takes a port); another process may bind it in between, hence
    the retries.
    """
    from ..worker_env import free_port

    last: OSError | None = None
    for _ in range(attempts):
        port = free_port()
        for family in (socket.AF_INET6, socket.AF_INET) if socket.has_ipv6 else (socket.AF_INET,):
            try:
                s = socket.socket(family, socket.SOCK_STREAM)
            except OSError as exc:  # no IPv6 in this kernel
                last = exc
                continue
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                s.bind(("::" if family == socket.AF_INET6 else "", port))
                s.listen(BACKLOG)
            except OSError as exc:
                s.close()
                last = exc
                continue
            return s
    raise OSError(f"no port to listen on for the workers' store: {last}")


class StoreHost(RoundPart):
    """This node's store process and the socket it serves on; see the module's header.

    ``on_lost(reason)`` is called once when the store stops being available after
    :meth:`start` (the runner stops a round that counted on it).

    One of the agent's parts (``parts.py``): its Join offers the store (:meth:`join_fields`),
    the first Join waits for the verdict (:meth:`connected`), each Join drops the last
    round's store (:meth:`before_join`), each start serves the round's (:meth:`before_start`).
    """

    name = "store"

    def __init__(
        self,
        python: str,
        environ: Mapping[str, str],
        *,
        log: Callable[[str, str], None],
        on_lost: Callable[[str], None] | None = None,
        listener: socket.socket | None = None,
    ) -> None:
        self.python = python
        self.env = {k: v for k, v in environ.items() if k not in SECRETS}
        self.log = log
        self.on_lost = on_lost
        self.phase = Phase.STARTING
        self.why_off = ""
        self.torch_version = ""
        self._listener = listener if listener is not None else listen_socket()
        self.port: int = self._listener.getsockname()[1]
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._waiters: dict[str, asyncio.Future[str]] = {}
        self._tag = 0
        self._closing = False
        self._verdict = asyncio.Event()  # torch found, or the store is off
        self._served = False  # a round's store was asked for and not dropped since

    @property
    def hosting(self) -> bool:
        """What this node's Join says (``hosts_store``): it can serve a round's store."""
        return self.phase is not Phase.OFF

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    async def start(self, *, eager: bool = False) -> None:
        """Start the store process; returns at once. It imports torch when this node first hosts
        a round, or at once (in the background) with ``eager``. When the workers' interpreter is
        the agent's own, the verdict (a usable torch) is known at once, so the first Join does
        not wait for the process to start."""
        quick = torch_version_here(self.python, self.env)
        if quick is not None:
            self.phase, self.torch_version = Phase.IMPORTING, quick
            self._verdict.set()
        fd = self._listener.fileno()
        try:
            self._proc = await asyncio.create_subprocess_exec(
                self.python, "-u", "-c", _boot_source(), str(fd), str(self.port),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
                env=self.env,
                pass_fds=(fd,),
                # Killed with the agent, however the agent dies (stdin's EOF is the clean way).
                # Outlives a signal sent to every process of the step (procutil.STEP_SIGNALS).
                preexec_fn=procutil.ignore_step_signals(procutil.pdeathsig_preexec()),
                start_new_session=True,
                limit=_MAX_LINE,
            )  # fmt: skip
        except OSError as exc:
            self._off(f"cannot start {self.python} ({exc.strerror or exc})", lost=False)
            return
        self._reader = asyncio.create_task(self._read(self._proc))
        if eager and self._proc.stdin is not None:
            self._proc.stdin.write(b"import\n")

    async def verdict(self, timeout: float = 10.0) -> bool:
        """Wait (bounded) until the store process found a usable torch or gave up, so that the
        first Join does not offer a store that cannot be. True: this node can host."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._verdict.wait(), timeout)
        return self.hosting

    async def for_round(self, a: Assignment) -> None:
        """Before round ``a``'s workers start: serve its store if this node hosts it; give the
        port up if this node is group rank 0 and the round did not ask for our store (an older
        server), so that worker rank 0 can bind it. Raises :class:`StoreUnavailable`."""
        if hosts_round(a):
            await self.serve_round(a)
        elif a.group_rank == 0 and a.master_port == self.port and self.phase is not Phase.OFF:
            await self.give_up("the rendezvous did not ask for it (a server older than the agent?)")

    async def give_up(self, why: str) -> None:
        """Offer no store from now on: the process stopped, the socket closed, said once."""
        self._closing = True
        await self._stop_process()
        self._off(why, lost=False)

    async def serve_round(self, a: Assignment) -> None:
        """A fresh, empty store for round ``a``, which this node hosts (:func:`hosts_round`).

        Returns once it is served, or at once while torch is still importing: the workers'
        connections wait in the backlog until it is. Raises :class:`StoreUnavailable`.
        """
        if self.phase is Phase.OFF or self._proc is None or self._proc.stdin is None:
            raise StoreUnavailable(f"this node's agent cannot host the workers' store: {self.why_off}")
        if a.master_port != self.port:
            raise StoreUnavailable(f"the round's MASTER_PORT {a.master_port} is not ours ({self.port})")
        self._served = True
        if self.phase is not Phase.READY:
            # Answered after the import; a failure then is reported through on_lost.
            self._command("fresh")
            return
        answer = await self._ask("fresh", FRESH_TIMEOUT)
        if answer != "serving":
            raise StoreUnavailable(answer)

    async def end_round(self) -> None:
        """The round this node served is over (called before the next Join): drop its store, so
        that no connection made for the next round can reach it. Another node's workers start
        as soon as the next round forms, before this node serves its new store; a connection the
        old store accepted would be closed under them at ``fresh`` ("Failed to recv, got 0
        bytes"). With no store served, connections wait in the backlog. Never raises: a store
        process that does not answer is given up (the Join then offers no store)."""
        if not self._served or self.phase is Phase.OFF or self._proc is None or self._proc.stdin is None:
            return
        self._served = False
        # While torch imports, a queued ``fresh`` is answered first: wait for the import too.
        bound = FRESH_TIMEOUT if self.phase is Phase.READY else IMPORT_TIMEOUT
        try:
            answer = await self._ask("drop", bound)
        except StoreUnavailable as exc:
            answer = str(exc)
        if answer != "dropped":
            await self.give_up(f"the last round's store could not be dropped: {answer}")

    # -- the agent's part (parts.py) --------------------------------------------------------

    def join_fields(self) -> dict[str, int]:
        """The Join offers this node's store while it can host one (``hosts_store``)."""
        return {"store_port": self.port} if self.hosting else {}

    async def connected(self) -> None:
        await self.verdict()  # overlapped the connect; the first Join must not offer in vain

    async def before_join(self) -> None:
        await self.end_round()  # no next-round connection may reach its store

    async def before_start(self, r: RoundStart) -> dict[int, dict[str, str]]:
        await self.for_round(r.assignment)
        return {}

    async def close(self, *, succeeded: bool = False) -> None:
        """Stop the store process and close the socket (the agent is exiting)."""
        self._closing = True
        await self._stop_process()
        self._listener.close()

    # -- internals -----------------------------------------------------------------------

    def _command(self, word: str) -> asyncio.Future[str]:
        """Send ``<word> <tag>``; the future gets the answer's word (or why there is none)."""
        assert self._proc is not None and self._proc.stdin is not None
        self._tag += 1
        tag = str(self._tag)
        waiter: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiters[tag] = waiter
        try:
            self._proc.stdin.write(f"{word} {tag}\n".encode())
        except (ConnectionError, OSError) as exc:
            self._waiters.pop(tag, None)
            raise StoreUnavailable(f"the store process is gone ({exc})") from None
        return waiter

    async def _ask(self, word: str, timeout: float) -> str:
        """``<word> <tag>`` and its answer, bounded; raises StoreUnavailable only for a gone pipe."""
        waiter = self._command(word)
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except asyncio.TimeoutError:
            return f"the store process did not answer within {timeout:g} s"

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        why = ""
        try:
            while True:
                try:
                    raw = await proc.stdout.readline()
                except ValueError:  # a line over the limit: not our store/boot.py
                    why = "the store process said something unexpected"
                    break
                if not raw:
                    break
                why = self._on_line(raw.decode(errors="replace").strip())
                if why:
                    break
        finally:
            if not self._closing and self.phase is not Phase.OFF:
                # Gone before the socket is given up: its copy of it must not outlive ours.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                code = await proc.wait()
                self._off(why or f"the store process exited (code {code})", lost=True)

    def _on_line(self, line: str) -> str:
        """Act on one line of the store process; a reason to stop offering, or ""."""
        word, _, rest = line.partition(" ")
        if word == "found":
            self.phase, self.torch_version = Phase.IMPORTING, rest
            self._verdict.set()
        elif word == "ready":
            self.phase = Phase.READY
        elif word == "unusable":
            return rest or "no usable torch"
        elif word in ("serving", "dropped", "error"):
            tag, _, detail = rest.partition(" ")
            waiter = self._waiters.pop(tag, None)
            answer = word if word != "error" else f"the store could not be served: {detail}"
            if waiter is not None and not waiter.done():
                waiter.set_result(answer)
            if word == "error" and waiter is None and self.on_lost is not None:
                self.on_lost(answer)
        else:
            return f"the store process said something unexpected: {line[:200]!r}"
        return ""

    def _off(self, why: str, *, lost: bool) -> None:
        """From now on this node offers no store (said once); close the socket so that worker
        rank 0 can host the store on a port of its own."""
        if self.phase is Phase.OFF:
            return
        self.phase, self.why_off = Phase.OFF, why
        self._verdict.set()
        self._listener.close()
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_result(why)
        self._waiters.clear()
        self.log(f"agent-hosted TCPStore off: {why}; worker rank 0 hosts the store (as torchrun's "
                 "TORCHELASTIC_USE_AGENT_STORE=False)", "warning")  # fmt: skip
        if lost and self.on_lost is not None:
            self.on_lost(why)

    async def _stop_process(self) -> None:
        proc = self._proc
        if proc is not None and proc.returncode is None:
            if proc.stdin is not None:
                with contextlib.suppress(ConnectionError, OSError):
                    proc.stdin.close()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: nothing of it lingers
            await proc.wait()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None


async def start_store(
    cfg: AgentConfig, environ: Mapping[str, str], log: AgentLog, on_lost: Callable[[str], None]
) -> StoreHost | None:
    """The workers' TCPStore host, started before the first Join; None with the static backend
    (no server to agree through), --no-python (no interpreter of ours), or no core to spare
    beside the workers (CPU affinity: cores <= --nproc-per-node)."""
    traits = BACKENDS.get(cfg.rdzv_backend)
    if (traits is not None and not traits.agent_store) or cfg.no_python:
        return None
    cores = len(os.sched_getaffinity(0))
    if cores <= cfg.nproc_per_node:
        # The store process imports torch while the workers do: with no core to spare it
        # would slow every worker's start by more than the retry it saves.
        log(
            f"worker rank 0 hosts the TCPStore: no core to spare for a store process "
            f"({cores} core(s) for {cfg.nproc_per_node} worker(s))",
            "debug",
        )
        return None
    try:
        store = StoreHost(cfg.python_exec, environ, log=log, on_lost=on_lost)
    except OSError as exc:
        log(f"agent-hosted TCPStore off: {exc}; worker rank 0 hosts the store", "warning")
        return None
    await store.start(eager="torch" in cfg.preload)  # --preload torch: the first round's too
    return store
