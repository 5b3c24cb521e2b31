"""Simulated agents: many light clients in one process, speaking the real protocol on real sockets.

Run as ``python -m bench.simagents --port P --count K --first I [--source ADDR]``. Agent
``I + k`` is node ``sim-<I+k>``, an 8-rank node (``Join.nproc`` 8 unless a join says
otherwise). ``--source``: the local address its sockets connect from (127.0.0.x: the server
caps the connections of one peer address at half of what its open-file limit allows, so the
driver gives each client process an address of its own). The process reads one JSON command
per line on stdin and answers each with one JSON line on stdout; the driver
(``bench/scale.py``) sends the same command to every client process at once and stamps the
time just before it does.

Commands:

``{"cmd": "join", "job": ..., "min": .., "max": .., "last_call": .., "timeout": ..}``
    connect every agent (MAGIC + Hello), send Join on Welcome, and answer when every agent
    holds an Assignment (time of the last one, and of the last Welcome). Optional:
    ``"nproc"`` (8) and ``"max_restarts"`` (0) of the Join.
``{"cmd": "window", "seconds": S}``
    count the heartbeats and progress summaries sent during S seconds.
``{"cmd": "train", "step_s": .., "straggler": N}``
    from now on every agent also sends what a real agent of a training node sends: one
    ``Progress`` per heartbeat interval while its ranks' steps move (see below); node ``N``'s
    local rank 5 computes 1.6 times as long as every other rank (a straggler).
``{"cmd": "hang", "budget": B, "culprit": N, "timeout": ..}``
    every rank of every node stops making progress (rank 3 of node ``N`` in its data loader,
    the others in the collective that waits for it), and each agent does what a real one does
    (``node_agent/machine/training.py``): B s later plus its page poll's phase it finds its ranks hung
    and sends ``HangDetected``, collects its ranks' stacks (for ``COLLECT_S``) and sends
    ``Stacks``, then ``WorkersFailed`` (signal HUNG); a ``CollectStacks`` from the server
    starts a collection at once (a node that finds its own hang meanwhile collects again
    once that one is in, as a real agent does). Answered when every agent holds the round
    after the verdict (``Restart``: the agents join again).
``{"cmd": "drop", "every": 100, "timeout": ..}``
    close the sockets of the agents whose number is ``99 mod every``; the others get Restart,
    send Join again, and the answer comes when every survivor holds the next round.
``{"cmd": "close"}``, ``{"cmd": "exit"}``

Each agent is an ``asyncio.Protocol`` (no task, no stream per connection). Heartbeats go out
at 1 Hz from every joined agent, in 50 slots of 20 ms so the load is spread over the second
the way independent agents' timers are; summaries likewise, in a slot of their own (a real
agent sends them from its page-read loop, whose timer is not its heartbeat's). As a real
agent's heartbeat timer (``node_agent/runner.py``), a tick that finds a summary went since the
last one sends no heartbeat: while training, the summaries are the nodes' signs of life.

What a summary holds, as a real agent's does (``node_agent/machine/watch.py``): the slowest and
fastest rank's step (all ranks advance together, one step every ``step_s``), the node's step
time p50/p90 (``step_s`` with a little noise: synchronous training waits for the slowest
rank), the phase of its least recent rank and that rank's age, each local rank's median
"compute" time (70 % of a step, 1 % noise; the straggler's rank 5: 1.6 times that, a score
of 0.62 under the default threshold 0.75), and ``checks`` (the ranks call should_stop()).
Every value is rounded to the millisecond's thousandth as the agent rounds it. Stacks are
py-spy dumps of a training process (main thread, pin-memory, checkpoint and logger threads),
compacted to ``MAX_STACK_LEN`` characters per rank with ``protocol.hang_report.compact``, as
the agent sends them: about 16 KB per 8-rank node.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import time
from typing import Any

from protocol import (
    MAGIC,
    SERVER_MESSAGES,
    Assignment,
    CollectStacks,
    Error,
    Failure,
    FrameDecoder,
    HangDetected,
    Heartbeat,
    Hello,
    Join,
    Message,
    Progress,
    ProtocolError,
    Restart,
    Stacks,
    Welcome,
    WorkersFailed,
    encode,
)
from protocol.failure_text import HUNG
from protocol.hang_report import Entry, compact, merge, render
from protocol.messages import MAX_STACK_LEN

from .procs import raise_nofile_limit

HELLO = MAGIC + encode(Hello(versions=(1,), software="bench-sim/0.1"))
HEARTBEAT = encode(Heartbeat())
SLOTS = 50
SLOT_SECONDS = 1.0 / SLOTS
CONNECT_RETRY = 0.05
NPROC = 8
SUMMARY_SLOT = SLOTS // 2  # summaries go half a second after the node's heartbeat
POLL_S = 1.0  # the agent's page poll (auto hang policy: min(1 s, budget / 10))
COMPUTE_SHARE = 0.7  # of a step, in the "compute" phase
STRAGGLER_RANK = 5
STRAGGLER_FACTOR = 1.6
CULPRIT_RANK = 3
PHASES = ("data", "compute", "compute", "compute", "optimizer")
COLLECT_S = (0.3, 1.2)  # py-spy on 8 ranks in parallel: how long an agent's collection takes


# --- a training process's stacks, as py-spy dumps them ------------------------------------

_TRAIN = [
    ("train_step", "trainer/loop.py", 242),
    ("run_epoch", "trainer/loop.py", 301),
    ("fit", "trainer/loop.py", 356),
    ("main", "train.py", 142),
    ("wrapper", "torch/distributed/elastic/multiprocessing/errors/__init__.py", 355),
    ("<module>", "train.py", 171),
]
_IN_COLLECTIVE = [
    ("wait", "torch/distributed/distributed_c10d.py", 4470),
    ("all_reduce", "torch/distributed/distributed_c10d.py", 2501),
    ("wrapper", "torch/distributed/c10d_logger.py", 83),
    ("_reduce_scalar", "trainer/metrics.py", 58),
    ("log_metrics", "trainer/metrics.py", 97),
    ("_sync_loss", "trainer/loop.py", 188),
    ("backward_and_step", "trainer/loop.py", 214),
    ("_call_impl", "torch/nn/modules/module.py", 1762),
    ("_wrapped_call_impl", "torch/nn/modules/module.py", 1751),
]
_IN_DATA = [
    ("wait", "threading.py", 331),
    ("get", "queue.py", 180),
    ("_try_get_data", "torch/utils/data/dataloader.py", 1133),
    ("_get_data", "torch/utils/data/dataloader.py", 1294),
    ("_next_data", "torch/utils/data/dataloader.py", 1332),
    ("__next__", "torch/utils/data/dataloader.py", 631),
    ("next_batch", "trainer/data.py", 77),
    ("prefetch", "trainer/data.py", 112),
]
_THREADS = [
    (
        "Thread-1 (_pin_memory_loop)",
        [
            ("wait", "threading.py", 331),
            ("get", "queue.py", 180),
            ("do_one_step", "torch/utils/data/_utils/pin_memory.py", 31),
            ("_pin_memory_loop", "torch/utils/data/_utils/pin_memory.py", 54),
            ("run", "threading.py", 982),
            ("_bootstrap_inner", "threading.py", 1045),
            ("_bootstrap", "threading.py", 1002),
        ],
    ),
    (
        "ThreadPoolExecutor-0_0",
        [
            ("wait", "threading.py", 327),
            ("get", "queue.py", 171),
            ("_worker", "concurrent/futures/thread.py", 81),
            ("run", "threading.py", 982),
            ("_bootstrap_inner", "threading.py", 1045),
            ("_bootstrap", "threading.py", 1002),
        ],
    ),
    (
        "Thread-3 (_run)",
        [
            ("select", "selectors.py", 468),
            ("_run_once", "asyncio/base_events.py", 1898),
            ("run_forever", "asyncio/base_events.py", 608),
            ("_run", "trainer/logging/remote.py", 64),
            ("run", "threading.py", 982),
            ("_bootstrap_inner", "threading.py", 1045),
            ("_bootstrap", "threading.py", 1002),
        ],
    ),
    (
        "EventFileWriter",
        [
            ("wait", "threading.py", 331),
            ("get", "queue.py", 180),
            ("run", "tensorboard/summary/writer/event_file_writer.py", 244),
            ("_bootstrap_inner", "threading.py", 1045),
            ("_bootstrap", "threading.py", 1002),
        ],
    ),
]


def py_spy_dump(pid: int, main: list[tuple[str, str, int]]) -> str:
    """``py-spy dump --pid PID`` of a training rank whose main thread is in ``main``."""
    prefix = "/opt/conda/lib/python3.11/site-packages/"

    def frames(fs: list[tuple[str, str, int]]) -> list[str]:
        return [f"    {fn} ({prefix if f.startswith('torch') else ''}{f}:{line})" for fn, f, line in fs]

    lines = [
        f"Process {pid}: /opt/conda/bin/python -u train.py --config configs/pretrain_7b.yaml",
        "Python v3.11.7 (/opt/conda/bin/python3.11)",
        "",
        f'Thread {pid} (idle): "MainThread"',
        *frames(main + _TRAIN),
    ]
    for i, (name, fs) in enumerate(_THREADS):
        lines += [f'Thread {pid + 17 + i} (idle): "{name}"', *frames(fs)]
    return "\n".join(lines) + "\n"


STACK_CROWD = compact(py_spy_dump(48213, _IN_COLLECTIVE), MAX_STACK_LEN)
STACK_CULPRIT = compact(py_spy_dump(48216, _IN_DATA), MAX_STACK_LEN)


def poll_phase(a: SimAgent) -> float:
    """Where in its page poll's period a node's hang deadline falls: spread over the period
    as independent agents' timers are."""
    return (a.index * 0.6180339887) % POLL_S


class SimAgent(asyncio.Protocol):
    __slots__ = (
        "again",
        "closed",
        "collecting",
        "decoder",
        "failed",
        "hung",
        "index",
        "join_frame",
        "pool",
        "rank_offset",
        "round",
        "said",
        "transport",
        "world_size",
    )

    def __init__(self, pool: Pool, index: int) -> None:
        self.pool = pool
        self.index = index
        self.transport: asyncio.Transport | None = None
        self.decoder = FrameDecoder(allowed=SERVER_MESSAGES, expect_magic=True)
        self.round = -1  # the round of the assignment held, -1 for none
        self.said = False  # sent a summary since its last heartbeat tick (no heartbeat due then)
        self.world_size = 0
        self.rank_offset = 0
        self.closed = False
        self.join_frame = b""  # a node's Join is the same every round: encoded once per job
        # A hang, as node_agent.machine.training.Training keeps it (for the round held).
        self.hung = False  # found its own ranks hung
        self.collecting = False  # collecting its ranks' stacks
        self.again = False  # found its hang while collecting for the server: collect again
        self.failed = False  # reported its hang as its failure (or the round moved on)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(HELLO)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        try:
            msgs = self.decoder.feed(data)
        except ProtocolError as exc:
            self.pool.note_error(f"decode: {exc}")
            self.close()
            return
        for msg in msgs:
            self.pool.on_message(self, msg)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        self.pool.on_lost(self)

    def send(self, frame: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(frame)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class Pool:
    def __init__(self, port: int, count: int, first: int, source: str = "") -> None:
        self.port = port
        self.count = count
        self.first = first
        self.source = source
        self.agents: list[SimAgent] = []
        self.slots: list[list[SimAgent]] = [[] for _ in range(SLOTS)]
        self.job: dict[str, Any] = {}
        self.hb_sent = 0
        self.progress_sent = 0
        self.progress_bytes = 0
        self.errors: list[str] = []
        self.connect_retries = 0
        self.t_last_welcome = 0.0
        self.t_last_assigned = 0.0
        self.restarts = 0
        self.world_sizes: set[int] = set()
        self._want_round = 0
        self._missing = 0
        self._done: asyncio.Future[None] | None = None
        self._lost = 0
        self._all_lost: asyncio.Future[None] | None = None
        self.rng = random.Random(first)
        # Training (the "train" command): None until it starts.
        self.train: dict[str, Any] | None = None
        self.frozen_step = -1  # the step every rank stopped at in a hang (-1: no hang)
        self.hang: dict[str, Any] = {}
        self.hang_counts: dict[str, float] = {}

    # -- protocol --------------------------------------------------------------------------

    def join_msg(self, index: int) -> bytes:
        j = self.job
        return encode(
            Join(
                job_id=j["job"],
                node_id=f"sim-{index:06d}",
                addr="127.0.0.1",
                nproc=int(j.get("nproc", NPROC)),
                min_nodes=j["min"],
                max_nodes=j["max"],
                entrypoint="sim.py",
                master_port=20000 + index % 10000,
                max_restarts=int(j.get("max_restarts", 0)),
                last_call_timeout=float(j["last_call"]),
                heartbeat_interval=1.0,
                heartbeat_timeout=5.0,
            )
        )

    def on_message(self, agent: SimAgent, msg: Message) -> None:
        if isinstance(msg, Welcome):
            self.t_last_welcome = time.time()
            agent.join_frame = self.join_msg(agent.index)
            agent.send(agent.join_frame)
            self.slots[agent.index % SLOTS].append(agent)
        elif isinstance(msg, Assignment):
            had = agent.round >= self._want_round
            if msg.round != agent.round:
                agent.hung = agent.again = agent.failed = False  # a new round's training
            agent.round = msg.round
            agent.world_size = msg.world_size
            agent.rank_offset = msg.rank_offset
            if not had and msg.round >= self._want_round:
                self.world_sizes.add(msg.group_world_size)
                self.t_last_assigned = time.time()
                self._missing -= 1
                if self._missing == 0 and self._done is not None and not self._done.done():
                    self._done.set_result(None)
        elif isinstance(msg, Restart):
            self.restarts += 1
            if self.hang:
                if msg.report and "report_chars" not in self.hang:  # once, for --keep's logs
                    print(f"the first Restart's hang report:\n{msg.report}", file=sys.stderr, flush=True)
                self.hang["t_last_restart"] = time.time()
                self.hang["report_chars"] = max(self.hang.get("report_chars", 0), len(msg.report))
                self.hang["culprit_named"] = self.hang.get("culprit_named", False) or (
                    f"rank {self.hang['culprit_rank']} " in msg.report
                )
            agent.failed = True  # the round is over: no failure of it to report any more
            agent.send(agent.join_frame)
        elif isinstance(msg, CollectStacks):
            self.hang_counts["collect_stacks"] = self.hang_counts.get("collect_stacks", 0) + 1
            if msg.round == agent.round and not agent.collecting and not agent.failed:
                self._collect(agent)
        elif isinstance(msg, Error):
            self.note_error(f"{msg.code}: {msg.message}")

    def on_lost(self, agent: SimAgent) -> None:
        self._lost += 1
        if self._all_lost is not None and self._lost >= len(self.agents) and not self._all_lost.done():
            self._all_lost.set_result(None)

    def note_error(self, text: str) -> None:
        if len(self.errors) < 20:
            self.errors.append(text)

    # -- heartbeats and summaries ------------------------------------------------------------

    async def heartbeats(self) -> None:
        start = time.monotonic()
        tick = 0
        while True:
            tick += 1
            await asyncio.sleep(max(0.0, start + tick * SLOT_SECONDS - time.monotonic()))
            slot = self.slots[tick % SLOTS]
            live = [a for a in slot if not a.closed]
            if len(live) != len(slot):
                slot[:] = live
            # As a real agent (node_agent/runner.py): a tick after a summary sends no heartbeat.
            beating = [a for a in live if not a.said]
            for a in live:
                a.said = False
            for a in beating:
                a.send(HEARTBEAT)
            self.hb_sent += len(beating)
            if self.train is not None and self.frozen_step < 0:
                now = time.monotonic()
                for a in self.slots[(tick + SUMMARY_SLOT) % SLOTS]:
                    if not a.closed and a.round >= 0:
                        frame = encode(self.progress(a, now))
                        a.send(frame)
                        a.said = True
                        self.progress_sent += 1
                        self.progress_bytes += len(frame)

    def progress(self, a: SimAgent, now: float) -> Progress:
        """What ``node_agent.machine.watch.NodeWatch.summary`` says of this node's 8 ranks now."""
        t = self.train
        assert t is not None
        rnd = self.rng.random
        step_ms = t["step_s"] * 1000.0
        step = int((now - t["t0"]) / t["step_s"])
        p50 = step_ms * (1.0 + 0.01 * (rnd() - 0.5))
        compute = [COMPUTE_SHARE * step_ms * (1.0 + 0.01 * (rnd() - 0.5)) for _ in range(NPROC)]
        if a.index == t["straggler"]:
            compute[STRAGGLER_RANK] *= STRAGGLER_FACTOR
        return Progress(
            round=a.round,
            min_step=max(0, step - (rnd() < 0.3)),
            max_step=step,
            step_p50_ms=round(p50, 3),
            step_p90_ms=round(p50 * 1.03, 3),
            phase=PHASES[int(rnd() * len(PHASES))],
            age_ms=round(rnd() * step_ms, 3),
            compute_ms=tuple(round(c, 3) for c in compute),
            checks=True,
        )

    # -- a hang ------------------------------------------------------------------------------

    def _count(self, key: str, n: float = 1) -> None:
        self.hang_counts[key] = self.hang_counts.get(key, 0) + n

    def _detect(self, a: SimAgent, rnd: int) -> None:
        """The agent's page poll finds its ranks hung (``Training.on_read``)."""
        if a.closed or a.round != rnd or a.hung or a.failed:
            return
        a.hung = True
        h = self.hang
        h.setdefault("t_first_detected", time.time())
        culprit = a.index == h["culprit"]
        a.send(
            encode(
                HangDetected(
                    round=rnd,
                    ranks=tuple(range(a.rank_offset, a.rank_offset + NPROC)),
                    step=self.frozen_step,
                    phase="data" if culprit else "compute",
                    silent_s=round(h["budget"] + poll_phase(a), 3),
                )
            )
        )
        self._count("hang_detected")
        if a.collecting:
            a.again = True  # the stacks under way were for another's hang: collect again after
        else:
            self._collect(a)

    def _collect(self, a: SimAgent) -> None:
        a.collecting = True
        lo, hi = COLLECT_S
        rnd = a.round
        asyncio.get_running_loop().call_later(lo + (hi - lo) * self.rng.random(), self._dumped, a, rnd)

    def _dumped(self, a: SimAgent, rnd: int) -> None:
        """The stacks are in (``StacksDumped``): send them, then, for our own hang, collect once
        more or report the failure (``Training.on_dumped``)."""
        a.collecting = False
        if a.closed:
            return
        culprit = a.index == self.hang["culprit"]
        silent = round(self.hang["budget"] + 0.5, 3)
        texts = [STACK_CULPRIT if culprit and lr == CULPRIT_RANK else STACK_CROWD for lr in range(NPROC)]
        frame = encode(
            Stacks(
                round=rnd,
                ranks=tuple(range(a.rank_offset, a.rank_offset + NPROC)),
                steps=(self.frozen_step,) * NPROC,
                phases=tuple("data" if culprit and lr == CULPRIT_RANK else "compute" for lr in range(NPROC)),
                silent_s=(silent,) * NPROC,
                stacks=tuple(texts),
            )
        )
        a.send(frame)
        self._count("stacks")
        self._count("stacks_bytes", len(frame))
        if not a.hung or a.failed or a.round != rnd:
            return
        if a.again:
            a.again = False
            self._collect(a)
            return
        a.failed = True
        report = self.hang["node_report"].replace("sim-NODE", f"sim-{a.index:06d}")
        failure = Failure(
            node_id=f"sim-{a.index:06d}",
            addr="127.0.0.1",
            rank=a.rank_offset,
            local_rank=0,
            exitcode=-15,
            signal=HUNG,
            timestamp=time.time(),
            message=f"{self.hang['headline'](a)}\nhang report: /dev/shm/node-agent-1000/attempt_0/"
            f"hang_report.txt\n{report}",
        )
        frame = encode(WorkersFailed(round=rnd, failure=failure, step=self.frozen_step))
        a.send(frame)
        self._count("failures")
        self._count("failure_bytes", len(frame))

    def _headline(self, a: SimAgent) -> str:
        budget = self.hang["budget"]
        parts = [
            f"rank {a.rank_offset + lr} (local {lr}): no progress for {budget:.0f} s "
            f"(last step {self.frozen_step}, phase compute; budget {budget:g} s)"
            for lr in range(NPROC)
        ]
        return "hang: " + "; ".join(parts)

    async def start_hang(self, cmd: dict[str, Any]) -> dict[str, Any]:
        t = self.train
        if t is None:
            return {"ok": False, "errors": ["hang: no training (send train first)"]}
        now = time.monotonic()
        self.frozen_step = int((now - t["t0"]) / t["step_s"])
        budget = float(cmd["budget"])
        entries = [
            Entry(
                rank=lr,
                step=self.frozen_step,
                phase="compute",
                silent_s=budget,
                text=STACK_CROWD,
                hung=True,
                source="py-spy",
                node="sim-NODE",
            )
            for lr in range(NPROC)
        ]
        node_report = (
            "node sim-NODE's hang report (its own ranks only; the job-wide one merges every node's)\n"
            + render(merge(entries, hung=range(NPROC)))
        )
        culprit = int(cmd["culprit"])
        self.hang = {
            "culprit": culprit,
            "culprit_rank": culprit * NPROC + CULPRIT_RANK,
            "budget": budget,
            "headline": self._headline,
            "node_report": node_report,
        }
        self.hang_counts = {}
        loop = asyncio.get_running_loop()
        live = [a for a in self.agents if not a.closed]
        current = max((a.round for a in live), default=0)
        self._want_round = current + 1
        self._missing = len(live)
        self.world_sizes = set()
        self.restarts = 0
        self._done = loop.create_future()
        if not live:
            self._done.set_result(None)
        for a in live:
            loop.call_later(budget + poll_phase(a), self._detect, a, a.round)
        ok = await self._wait(self._done, time.monotonic() + float(cmd.get("timeout", 60)))
        self.train, self.frozen_step = None, -1  # the next round trains no more
        h = self.hang
        return {
            "ok": ok,
            "t_first_detected": h.get("t_first_detected", 0.0),
            "t_last_restart": h.get("t_last_restart", 0.0),
            "t_last_assigned": self.t_last_assigned,
            "report_chars": h.get("report_chars", 0),
            "culprit_named": h.get("culprit_named", False),
            "restarts": self.restarts,
            "rejoined": len(live) - self._missing,
            "world_sizes": sorted(self.world_sizes),
            "stack_chars": [len(STACK_CROWD), len(STACK_CULPRIT)],
            **self.hang_counts,
            "errors": self.errors,
        }

    # -- commands --------------------------------------------------------------------------

    def _bound_socket(self) -> socket.socket:
        """A socket bound to ``--source`` whose port the kernel picks at connect(), per
        destination, as for an unbound one (IP_BIND_ADDRESS_NO_PORT): a plain bind to port 0
        takes one of the address's 28,000 ephemeral ports for any destination, TIME_WAIT ones
        included, and trial after trial connect() slows down until agents miss their hello."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.IPPROTO_IP, getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24), 1)
            sock.bind((self.source, 0))
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        return sock

    async def _connect(self, index: int, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock = None
            try:
                if self.source:
                    sock = self._bound_socket()
                    await loop.sock_connect(sock, ("127.0.0.1", self.port))
                    _, agent = await loop.create_connection(lambda: SimAgent(self, index), sock=sock)
                else:
                    _, agent = await loop.create_connection(
                        lambda: SimAgent(self, index), "127.0.0.1", self.port
                    )
            except OSError as exc:
                if sock is not None:
                    sock.close()
                if time.monotonic() > deadline:
                    self.note_error(f"connect: {exc}")
                    return
                self.connect_retries += 1
                await asyncio.sleep(CONNECT_RETRY)
                continue
            self.agents.append(agent)
            return

    async def join(self, cmd: dict[str, Any]) -> dict[str, Any]:
        t_go = time.time()
        self.job = cmd
        self.agents = []
        self.slots = [[] for _ in range(SLOTS)]
        self.train, self.frozen_step = None, -1
        self._lost = 0
        self._want_round = 0
        self._missing = self.count
        self.world_sizes = set()
        self._done = asyncio.get_running_loop().create_future()
        timeout = float(cmd.get("timeout", 60))
        deadline = time.monotonic() + timeout
        await asyncio.gather(*(self._connect(self.first + k, deadline) for k in range(self.count)))
        t_connected = time.time()
        ok = await self._wait(self._done, deadline)
        return {
            "ok": ok,
            "t_go": t_go,
            "t_connected": t_connected,
            "t_last_welcome": self.t_last_welcome,
            "t_last_assigned": self.t_last_assigned,
            "assigned": self.count - self._missing,
            "connect_retries": self.connect_retries,
            "world_sizes": sorted(self.world_sizes),
            "errors": self.errors,
        }

    async def window(self, seconds: float) -> dict[str, Any]:
        n0, p0, b0, t0 = self.hb_sent, self.progress_sent, self.progress_bytes, time.monotonic()
        await asyncio.sleep(seconds)
        return {
            "ok": True,
            "hb_sent": self.hb_sent - n0,
            "progress_sent": self.progress_sent - p0,
            "progress_bytes": self.progress_bytes - b0,
            "elapsed": time.monotonic() - t0,
        }

    def start_training(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.train = {
            "t0": time.monotonic(),
            "step_s": float(cmd.get("step_s", 0.5)),
            "straggler": int(cmd.get("straggler", -1)),
        }
        self.frozen_step = -1
        return {"ok": True}

    async def drop(self, every: int, timeout: float) -> dict[str, Any]:
        current = max((a.round for a in self.agents if not a.closed), default=0)
        victims = [a for a in self.agents if a.index % every == every - 1]
        survivors = [a for a in self.agents if a.index % every != every - 1 and not a.closed]
        self._want_round = current + 1
        self._missing = len(survivors)
        self.world_sizes = set()
        self.restarts = 0
        self._done = asyncio.get_running_loop().create_future()
        if not survivors:
            self._done.set_result(None)
        t_drop = time.time()
        for a in victims:
            a.close()
        ok = await self._wait(self._done, time.monotonic() + timeout)
        return {
            "ok": ok,
            "t_drop": t_drop,
            "t_last_assigned": self.t_last_assigned,
            "dropped": len(victims),
            "survivors": len(survivors),
            "reassigned": len(survivors) - self._missing,
            "restarts": self.restarts,
            "world_sizes": sorted(self.world_sizes),
            "errors": self.errors,
        }

    async def close(self, timeout: float = 30.0) -> dict[str, Any]:
        self._all_lost = asyncio.get_running_loop().create_future()
        if self._lost >= len(self.agents):
            self._all_lost.set_result(None)
        for a in self.agents:
            a.close()
        ok = await self._wait(self._all_lost, time.monotonic() + timeout)
        return {"ok": ok, "lost": self._lost}

    @staticmethod
    async def _wait(fut: asyncio.Future[None], deadline: float) -> bool:
        try:
            await asyncio.wait_for(asyncio.shield(fut), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return False
        return True


async def serve(pool: Pool) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    hb = asyncio.ensure_future(pool.heartbeats())
    reply(ready=True, count=pool.count)
    try:
        while True:
            line = await reader.readline()
            if not line:
                break
            cmd = json.loads(line)
            name = cmd["cmd"]
            if name == "join":
                reply(**await pool.join(cmd))
            elif name == "window":
                reply(**await pool.window(float(cmd["seconds"])))
            elif name == "train":
                reply(**pool.start_training(cmd))
            elif name == "hang":
                reply(**await pool.start_hang(cmd))
            elif name == "drop":
                reply(**await pool.drop(int(cmd["every"]), float(cmd.get("timeout", 60))))
            elif name == "close":
                reply(**await pool.close())
            elif name == "exit":
                break
            else:
                reply(ok=False, errors=[f"unknown command {name!r}"])
    finally:
        hb.cancel()
        for a in pool.agents:
            a.close()


def reply(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.simagents")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--source", default="", help="the local address to connect from (default: any)")
    args = p.parse_args(argv)
    raise_nofile_limit()
    pool = Pool(args.port, args.count, args.first, args.source)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(pool))
    else:
        uvloop.run(serve(pool))
    return 0


if __name__ == "__main__":
    sys.exit(main())
