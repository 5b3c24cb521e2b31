"""``--rdzv-backend static``: no rendezvous service; the command line gives every rank.

This stands in for the server connection and answers the agent's machine locally, so the
agent runs exactly the same code path as with a server. As in torchrun's static backend:
group rank = --node-rank, the master is --master-addr:--master-port (worker rank 0 hosts
torch's TCPStore there), node counts are fixed, and a failure restarts only this node's
workers, counted by this node. Every node is one fixed group rank, so the job never goes on
without one: a ``Leave`` is answered ``Left`` with ``job_continues=False`` (the agent then
exits non-zero, as torchrun does on a signal).

Nodes may give different ``--nproc-per-node``. Before the first round the nodes tell each other
their sizes, as torchrun's agents do through its TCPStore (``_assign_worker_ranks``): node rank
0's agent listens on the master port for a moment (it closes before its workers start, so
worker rank 0 can then bind the port for torch's store), every other node connects, sends its
size and gets everyone's back once all are in. Global ranks follow node-rank order
(:func:`static_ranks`). The sizes cannot change in a static job, so restarts reuse them. A node
that has not got every size by the rendezvous timeout (``--rdzv-conf timeout=S``, else
``join_timeout``) exits non-zero naming what it waited for; a node whose line disagrees with
node rank 0's (``--nnodes``, ``--rdzv-id``, a node rank out of range, a size out of bounds) is
refused with both values named. ``TORCH_ELASTIC_WORKER_IDENTICAL=1`` skips the exchange, as in
torchrun: every node is then assumed to run this node's ``--nproc-per-node``.

Anyone who reaches the master port can connect, and a static job has no shared secret (no
token: torchrun's TCPStore trusts its port the same way), so node rank 0 bounds what strangers
cost and never lets one silently change the job: connections that have not said who they are
are capped (64 at once, 8 from one address, the oldest closed for a newer one; a node so closed
connects again) and get 3 s to say it; a node rank's slot goes to the first consistent hello
for it, and a second agent claiming a slot whose holder is still connected fails the exchange
on every node, naming both addresses and both sizes (two agents given one ``--node-rank``, or
a stranger: the job does not start rather than run with a size nobody can vouch for).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from protocol import (
    MAX_NPROC,
    Assignment,
    JobDone,
    JobFailed,
    Join,
    Leave,
    Left,
    Message,
    Restart,
    WorkersFailed,
    WorkersSucceeded,
)

from ..agent_log import shown
from ..config import AgentConfig
from . import RendezvousError

__all__ = ["StaticBackend", "StaticConnection", "static_ranks"]

# What node rank 0's agent says first on every connection to its exchange: a client that reads
# anything else has reached something other than a node-agent (a TCPStore, another service).
GREETING = b"node-agent static sizes 1\n"
_MAX_LINE = 4096  # one JSON line each way; the sizes of MAX_NODES nodes fit easily
# Anyone can connect to the master port: what strangers' connections may hold on node rank 0.
_HELLO_TIMEOUT = 3.0  # a connection must say who it is within this (a node says it at once)
_MAX_WAITING = 64  # connections at once that have not said who they are (the oldest is closed)
_MAX_WAITING_PER_HOST = 8  # of them from one address (that address's oldest is closed)
_CLAIM_GRACE = 1.0  # a second claim of a node rank waits this long for its holder to be gone
_GREETING_TIMEOUT = 5.0  # how long a node waits for node rank 0's greeting on one connection
_RETRY_S = 0.25  # between connection attempts to node rank 0
_GOODBYE_TIMEOUT = 5.0  # node rank 0 waits this long for a node to close after its answer

Log = Callable[..., None]


def static_ranks(sizes: Sequence[int], node_rank: int) -> tuple[int, int]:
    """``(rank_offset, world_size)`` of node ``node_rank`` when node ``i`` runs ``sizes[i]``
    workers: torchrun's rule (``_assign_worker_ranks``, one role): nodes in node-rank order,
    each node's global ranks right after those of the nodes before it."""
    if not 0 <= node_rank < len(sizes):
        raise ValueError(f"node rank {node_rank} not in 0..{len(sizes) - 1}")
    if any(n < 1 for n in sizes):
        raise ValueError(f"every node runs at least one worker: {list(sizes)}")
    return sum(sizes[:node_rank]), sum(sizes)


class StaticBackend:
    """One link for the whole run: there is nothing to reconnect to."""

    reconnects = False
    snapshots = False
    standby_port = 0  # never hosts as a standby (issue 45: server.py's links only)
    shares_joins = False

    def __init__(
        self,
        config: AgentConfig,
        *,
        log: Log | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._log: Log = log or (lambda *a, **k: None)
        self._clock = clock

    async def connect(self, deadline: float) -> StaticConnection:
        cfg = self.config
        timeout = cfg.rdzv_conf.extra.get("timeout")  # torchrun's static rendezvous timeout
        if timeout is not None:
            deadline = self._clock() + float(timeout)
        if cfg.max_nodes == 1:
            sizes = [cfg.nproc_per_node]
        elif os.environ.get("TORCH_ELASTIC_WORKER_IDENTICAL", "0") == "1":
            sizes = [cfg.nproc_per_node] * cfg.max_nodes
        elif cfg.node_rank == 0:
            sizes = await _gather_sizes(cfg, deadline, self._log, self._clock)
        else:
            sizes = await _ask_sizes(cfg, deadline, self._log, self._clock)
        if len(set(sizes)) > 1:
            offset, world = static_ranks(sizes, cfg.node_rank)
            self._log(
                f"static rendezvous: the nodes' --nproc-per-node are {sizes} (by node rank): "
                f"WORLD_SIZE {world}, this node's ranks {offset}..{offset + cfg.nproc_per_node - 1}"
            )
        return StaticConnection(cfg, sizes)

    async def close(self, *, linger: bool) -> None:
        return None


def _hello(cfg: AgentConfig) -> dict[str, object]:
    return {
        "run_id": cfg.rdzv_id,
        "node_rank": cfg.node_rank,
        "nnodes": cfg.max_nodes,
        "nproc_per_node": cfg.nproc_per_node,
        "role": cfg.role,
    }


def _refusal(cfg: AgentConfig, hello: object) -> str | None:
    """Why node rank 0 (``cfg``) refuses a node's hello, or None when it is consistent: its
    node rank, sizes and ids those of this job (whether its slot is free is for the caller)."""
    if not isinstance(hello, dict):
        return "not a node-agent hello"
    rank, nnodes, nproc = hello.get("node_rank"), hello.get("nnodes"), hello.get("nproc_per_node")
    run_id, role = hello.get("run_id"), hello.get("role")
    for name, value in (("node_rank", rank), ("nnodes", nnodes), ("nproc_per_node", nproc)):
        if type(value) is not int:
            return f"{name} {shown(repr(value))} is not an integer"
    assert isinstance(rank, int) and isinstance(nnodes, int) and isinstance(nproc, int)
    if not isinstance(run_id, str) or not isinstance(role, str):
        return "run_id and role must be text"
    if nnodes != cfg.max_nodes:
        return f"--nnodes {nnodes} of node rank {rank} differs from node rank 0's --nnodes {cfg.max_nodes}"
    if run_id != cfg.rdzv_id:
        return (
            f"--rdzv-id {shown(run_id)!r} of node rank {rank} differs from node rank 0's "
            f"--rdzv-id {cfg.rdzv_id!r}"
        )
    if not 1 <= rank < cfg.max_nodes:
        return f"--node-rank {rank} is not in 1..{cfg.max_nodes - 1} (node rank 0 listens on the master port)"
    if not 1 <= nproc <= MAX_NPROC:
        return f"--nproc-per-node {nproc} of node rank {rank} must be in 1..{MAX_NPROC}"
    return None


class _Holder:
    """The connection that took a node rank's slot, while the exchange runs."""

    __slots__ = ("gone", "nproc", "where")

    def __init__(self, where: str, nproc: int, gone: asyncio.Future[bytes]) -> None:
        self.where, self.nproc, self.gone = where, nproc, gone


def _seen(fut: asyncio.Future[Any]) -> None:
    """A connection's end may be an error (a reset): it only means the node left."""
    if not fut.cancelled():
        fut.exception()


async def _gather_sizes(cfg: AgentConfig, deadline: float, log: Log, clock: Callable[[], float]) -> list[int]:
    """Node rank 0: listen on the master port until every other node told its size; answer all.

    Anyone may connect to the master port, so what a connection costs is bounded: at most
    ``_MAX_WAITING`` connections that have not said who they are at once (the oldest is closed
    for a new one), ``_MAX_WAITING_PER_HOST`` of them from one address (that address's oldest
    is closed), and each has ``_HELLO_TIMEOUT`` to say it. A node whose connection was closed
    so connects again. A slot is taken by the first consistent hello for it; a second agent
    claiming a taken slot while its holder is connected ends the exchange on every node with an
    error naming both, since a static job has no secret to tell the real node from the other.
    Every connection left open is closed before this returns: worker rank 0 binds the port and
    the workers need the descriptors.
    """
    n, port = cfg.max_nodes, cfg.rdzv_port
    sizes: dict[int, int] = {0: cfg.nproc_per_node}
    holders: dict[int, _Holder] = {}
    waiting: dict[asyncio.StreamWriter, str] = {}  # not yet identified, oldest first: their host
    handlers: set[asyncio.Task[None]] = set()
    ended = asyncio.Event()  # every size is in (``result``), or the exchange failed (``failed``)
    result: list[int] = []
    failed: list[str] = []
    dropped = 0

    def drop(writer: asyncio.StreamWriter, why: str) -> None:
        nonlocal dropped
        waiting.pop(writer, None)
        writer.transport.abort()
        dropped += 1
        if dropped == 1:
            log(
                f"static rendezvous: closed a connection to port {port} that had not said who it is "
                f"({why}); is something other than this job's nodes connecting to the master port?",
                "warning",
            )

    def admit(writer: asyncio.StreamWriter, host: str) -> None:
        same = [w for w, h in waiting.items() if h == host]
        if len(same) >= _MAX_WAITING_PER_HOST:
            drop(same[0], f"{_MAX_WAITING_PER_HOST} wait from {host}")
        elif len(waiting) >= _MAX_WAITING:
            drop(next(iter(waiting)), f"{_MAX_WAITING} wait")
        waiting[writer] = host

    def release(rank: int, holder: _Holder) -> None:
        if holders.get(rank) is holder and not result:
            del holders[rank], sizes[rank]

    def fail(why: str) -> None:
        if not failed and not result:
            failed.append(why)  # raised by the waiting side, once every node is told
            ended.set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "?"
        task = asyncio.current_task()
        if ended.is_set():  # accepted as the exchange ended: nothing to tell it
            writer.transport.abort()
            return
        assert task is not None
        handlers.add(task)
        admit(writer, host)
        rank: int | None = None
        holder: _Holder | None = None

        async def answer(obj: dict[str, object]) -> None:
            writer.write(json.dumps(obj).encode() + b"\n")
            await writer.drain()

        try:
            writer.write(GREETING)
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), _HELLO_TIMEOUT)
            if writer not in waiting:  # closed for a newer connection, or the exchange ended
                return
            del waiting[writer]
            if not line:
                return
            try:
                hello = json.loads(line)
            except ValueError:
                hello = None
            why = _refusal(cfg, hello)
            if why is not None:
                log(f"static rendezvous: refused the node at {where}: {why}", "warning")
                await answer({"error": why})
                return
            assert isinstance(hello, dict)
            claim, nproc = int(hello["node_rank"]), int(hello["nproc_per_node"])
            first = holders.get(claim)
            if first is not None:  # its holder may have just gone: its close may not be seen yet
                await asyncio.wait({first.gone}, timeout=_CLAIM_GRACE)
                if first.gone.done():
                    release(claim, first)
            if ended.is_set():
                await answer({"error": failed[0] if failed else "node rank 0 has every node's size already"})
                return
            first = holders.get(claim)
            if first is not None:
                why = (
                    f"--node-rank {claim} is already taken by the agent at {first.where} "
                    f"(--nproc-per-node {first.nproc}), and the agent at {where} claims it too "
                    f"(--nproc-per-node {nproc}): two agents give one node rank, so no node starts "
                    "(is --node-rank given twice, or is something else connecting to the master port?)"
                )
                fail(why)
                await answer({"error": why})
                return
            rank = claim
            holder = _Holder(where, nproc, asyncio.ensure_future(reader.read(1)))  # b"": it left
            holder.gone.add_done_callback(_seen)
            sizes[rank], holders[rank] = nproc, holder
            if hello["role"] != cfg.role:
                log(
                    f"static rendezvous: node rank {rank} gives --role {shown(hello['role'])!r}, this "
                    f"node {cfg.role!r}: ROLE_RANK and ROLE_WORLD_SIZE count the whole job here "
                    "(torchrun counts them per role)",
                    "warning",
                )
            log(f"static rendezvous: node rank {rank} ({where}) runs {nproc} worker(s)", "debug")
            if len(sizes) == n:
                result.extend(sizes[r] for r in range(n))  # before any answer goes out
                ended.set()
            done = asyncio.ensure_future(ended.wait())
            either: set[asyncio.Future[Any]] = {holder.gone, done}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            done.cancel()
            if failed:
                holder.gone.cancel()
                await answer({"error": failed[0]})
                return
            if not result:
                if holder.gone.done():
                    log(f"static rendezvous: node rank {rank} ({where}) left before every node told its size")
                    release(rank, holder)
                return  # else node rank 0 stopped waiting (cancelled): its connection closes
            await answer({"sizes": result})
            # Let the node close first, so that no TIME_WAIT of ours sits on the master port.
            with contextlib.suppress(TimeoutError, OSError):
                await asyncio.wait_for(holder.gone, _GOODBYE_TIMEOUT)
        except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            if rank is not None and holder is not None:
                release(rank, holder)
        finally:
            waiting.pop(writer, None)
            if holder is not None:
                holder.gone.cancel()
            writer.close()
            handlers.discard(task)

    try:
        server = await asyncio.start_server(handle, host=None, port=port, limit=_MAX_LINE)
    except OSError as exc:
        raise RendezvousError(
            f"static rendezvous: node rank 0 cannot listen on the master port {port} to learn the "
            f"other nodes' --nproc-per-node: {exc}"
        ) from None
    started = clock()
    log(f"static rendezvous: node rank 0 waits on port {port} for {n - 1} other node(s) to tell their sizes")
    try:
        try:
            await asyncio.wait_for(ended.wait(), max(0.0, deadline - clock()))
        except TimeoutError:
            missing = [r for r in range(1, n) if r not in sizes]
            why = (
                f"static rendezvous: node rank 0 waited {clock() - started:.0f} s on port {port} for "
                f"node rank(s) {', '.join(map(str, missing))} of {n} to tell their --nproc-per-node "
                "(is every node started, with this --master-addr/--master-port?)"
            )
            failed.append(why)  # the nodes that told theirs are told this, not left waiting
            raise RendezvousError(why) from None
        if failed:
            raise RendezvousError(f"static rendezvous: node rank 0 on port {port}: {failed[0]}")
    finally:
        ended.set()  # whatever connects from now on is closed at once
        server.close()  # stops listening: worker rank 0 binds this port next
        for writer in list(waiting):
            waiting.pop(writer)
            writer.transport.abort()
        if handlers:  # the nodes get their answers (or the error) before this returns
            await asyncio.wait(set(handlers), timeout=_GOODBYE_TIMEOUT + 1.0)
    return result


async def _ask_sizes(cfg: AgentConfig, deadline: float, log: Log, clock: Callable[[], float]) -> list[int]:
    """Any other node: tell node rank 0 our size; get every node's once all are in."""
    host, port, rank = cfg.rdzv_host, cfg.rdzv_port, cfg.node_rank
    started = clock()
    last = "nothing answered"
    said_waiting = said_stranger = False
    hello = json.dumps(_hello(cfg)).encode() + b"\n"
    while True:
        left = deadline - clock()
        if left <= 0:
            raise RendezvousError(
                f"static rendezvous: node rank {rank} waited {clock() - started:.0f} s for node rank 0's "
                f"agent at {host}:{port} (--master-addr/--master-port) to tell every node's "
                f"--nproc-per-node ({last})"
            )
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, limit=_MAX_LINE), min(left, _GREETING_TIMEOUT)
            )
        except (OSError, TimeoutError) as exc:
            last = f"last try: {str(exc) or type(exc).__name__}"
            if not said_waiting:
                log(f"static rendezvous: waiting for node rank 0's agent at {host}:{port}")
                said_waiting = True
            await asyncio.sleep(min(_RETRY_S, max(0.0, deadline - clock())))
            continue
        try:
            try:
                greeting = await asyncio.wait_for(
                    reader.readline(), min(max(0.0, deadline - clock()), _GREETING_TIMEOUT)
                )
            except TimeoutError:
                greeting = b"(nothing)"
            if not greeting:  # closed for a newer connection (node rank 0 bounds those waiting)
                last = "node rank 0's agent closed the connection before its greeting"
                await asyncio.sleep(min(_RETRY_S, max(0.0, deadline - clock())))
                continue
            if greeting != GREETING:
                last = f"something other than node-agent answers there: {shown(repr(greeting[:60]))}"
                if not said_stranger:
                    log(f"static rendezvous: {last}; waiting for node rank 0's agent", "warning")
                    said_stranger = True
                await asyncio.sleep(min(1.0, max(0.0, deadline - clock())))
                continue
            writer.write(hello)
            await writer.drain()
            if not said_waiting:
                log(f"static rendezvous: waiting for node rank 0 at {host}:{port} to hear from every node")
                said_waiting = True
            try:
                line = await asyncio.wait_for(reader.readline(), max(0.0, deadline - clock()))
            except TimeoutError:
                last = "node rank 0 answered but not every node told its size"
                continue
            if not line:
                last = "node rank 0's agent closed the connection"
                await asyncio.sleep(min(_RETRY_S, max(0.0, deadline - clock())))
                continue
            return _sizes_from(line, cfg, host, port)
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            last = f"last try: {str(exc) or type(exc).__name__}"
            await asyncio.sleep(min(_RETRY_S, max(0.0, deadline - clock())))
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def _sizes_from(line: bytes, cfg: AgentConfig, host: str, port: int) -> list[int]:
    try:
        answer = json.loads(line)
    except ValueError:
        answer = None
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        raise RendezvousError(
            f"static rendezvous: node rank 0's agent at {host}:{port} refused node rank "
            f"{cfg.node_rank}: {shown(answer['error'])}"
        )
    sizes = answer.get("sizes") if isinstance(answer, dict) else None
    if (
        not isinstance(sizes, list)
        or len(sizes) != cfg.max_nodes
        or not all(type(s) is int and 1 <= s <= MAX_NPROC for s in sizes)
        or sizes[cfg.node_rank] != cfg.nproc_per_node
    ):
        raise RendezvousError(
            f"static rendezvous: node rank 0's agent at {host}:{port} answered with no usable sizes: "
            f"{shown(repr(line[:200]))}"
        )
    return sizes


class StaticConnection:
    """Answers the agent's messages as a server would, from the command line and the sizes."""

    challenge = ""  # nothing to prove a token to

    def __init__(self, config: AgentConfig, sizes: Sequence[int] | None = None) -> None:
        self.config = config
        self.sizes = list(sizes) if sizes is not None else [config.nproc_per_node] * config.max_nodes
        self.rank_offset, self.world_size = static_ranks(self.sizes, config.node_rank)
        self.restart_count = 0
        self.round = 0
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.local_ip = config.local_addr or socket.gethostname()

    def send(self, msg: Message) -> None:
        cfg = self.config
        if isinstance(msg, Join):
            self._inbox.put_nowait(
                Assignment(
                    job_id=cfg.rdzv_id,
                    round=self.round,
                    group_rank=cfg.node_rank,
                    group_world_size=cfg.max_nodes,
                    rank_offset=self.rank_offset,
                    world_size=self.world_size,
                    master_addr=cfg.rdzv_host,
                    master_port=cfg.rdzv_port,
                    restart_count=self.restart_count,
                    max_restarts=cfg.max_restarts,
                )
            )
        elif isinstance(msg, WorkersFailed):
            from protocol.failure_text import describe_failure

            cause = describe_failure(msg.failure, node=False)
            if self.restart_count < cfg.max_restarts:
                self.restart_count += 1
                self._inbox.put_nowait(
                    Restart(
                        round=self.round, reason=f"worker failure: {cause}", restart_count=self.restart_count
                    )
                )
                self.round += 1
            else:
                self._inbox.put_nowait(
                    JobFailed(
                        reason=f"{cause} (--max-restarts {cfg.max_restarts} used up)", failure=msg.failure
                    )
                )
        elif isinstance(msg, WorkersSucceeded):
            self._inbox.put_nowait(JobDone())
        elif isinstance(msg, Leave):
            why = f"the static rendezvous has no place for group rank {cfg.node_rank} without this node"
            self._inbox.put_nowait(Left(job_continues=False, reason=why))

    async def receive(self) -> Message:
        return await self._inbox.get()

    async def close(self) -> None:
        return None
