"""Simulated agents: many light clients in one process, speaking the real protocol on real sockets.

Run as ``python -m bench.simagents --port P --count K --first I``. Agent ``I + k`` is node
``sim-<I+k>``. The process reads one JSON command per line on stdin and answers each with one
JSON line on stdout; the driver (``bench/scale.py``) sends the same command to every client
process at once and stamps the time just before it does.

Commands:

``{"cmd": "join", "job": ..., "min": .., "max": .., "last_call": .., "timeout": ..}``
    connect every agent (MAGIC + Hello), send Join on Welcome, and answer when every agent
    holds an Assignment (time of the last one, and of the last Welcome).
``{"cmd": "window", "seconds": S}``
    count the heartbeats sent during S seconds.
``{"cmd": "drop", "every": 100, "timeout": ..}``
    close the sockets of the agents whose number is ``99 mod every``; the others get Restart,
    send Join again, and the answer comes when every survivor holds the next round.
``{"cmd": "close"}``, ``{"cmd": "exit"}``

Each agent is an ``asyncio.Protocol`` (no task, no stream per connection). Heartbeats go out
at 1 Hz from every joined agent, in 50 slots of 20 ms so the load is spread over the second
the way independent agents' timers are.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from protocol import (
    MAGIC,
    SERVER_MESSAGES,
    Assignment,
    Error,
    FrameDecoder,
    Heartbeat,
    Hello,
    Join,
    Message,
    ProtocolError,
    Restart,
    Welcome,
    encode,
)

from .procs import raise_nofile_limit

HELLO = MAGIC + encode(Hello(versions=(1,), software="bench-sim/0.1"))
HEARTBEAT = encode(Heartbeat())
SLOTS = 50
SLOT_SECONDS = 1.0 / SLOTS
CONNECT_RETRY = 0.05


class SimAgent(asyncio.Protocol):
    __slots__ = ("closed", "decoder", "index", "join_frame", "pool", "round", "transport", "world_size")

    def __init__(self, pool: Pool, index: int) -> None:
        self.pool = pool
        self.index = index
        self.transport: asyncio.Transport | None = None
        self.decoder = FrameDecoder(allowed=SERVER_MESSAGES, expect_magic=True)
        self.round = -1  # the round of the assignment held, -1 for none
        self.world_size = 0
        self.closed = False
        self.join_frame = b""  # a node's Join is the same every round: encoded once per job

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
    def __init__(self, port: int, count: int, first: int) -> None:
        self.port = port
        self.count = count
        self.first = first
        self.agents: list[SimAgent] = []
        self.slots: list[list[SimAgent]] = [[] for _ in range(SLOTS)]
        self.job: dict[str, Any] = {}
        self.hb_sent = 0
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

    # -- protocol --------------------------------------------------------------------------

    def join_msg(self, index: int) -> bytes:
        j = self.job
        return encode(
            Join(
                job_id=j["job"],
                node_id=f"sim-{index:06d}",
                addr="127.0.0.1",
                nproc=1,
                min_nodes=j["min"],
                max_nodes=j["max"],
                entrypoint="sim.py",
                master_port=20000 + index % 10000,
                max_restarts=0,
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
            agent.round = msg.round
            agent.world_size = msg.world_size
            if not had and msg.round >= self._want_round:
                self.world_sizes.add(msg.world_size)
                self.t_last_assigned = time.time()
                self._missing -= 1
                if self._missing == 0 and self._done is not None and not self._done.done():
                    self._done.set_result(None)
        elif isinstance(msg, Restart):
            self.restarts += 1
            agent.send(agent.join_frame)
        elif isinstance(msg, Error):
            self.note_error(f"{msg.code}: {msg.message}")

    def on_lost(self, agent: SimAgent) -> None:
        self._lost += 1
        if self._all_lost is not None and self._lost >= len(self.agents) and not self._all_lost.done():
            self._all_lost.set_result(None)

    def note_error(self, text: str) -> None:
        if len(self.errors) < 20:
            self.errors.append(text)

    # -- heartbeats ------------------------------------------------------------------------

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
            for a in live:
                a.send(HEARTBEAT)
            self.hb_sent += len(live)

    # -- commands --------------------------------------------------------------------------

    async def _connect(self, index: int, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                _, agent = await loop.create_connection(lambda: SimAgent(self, index), "127.0.0.1", self.port)
            except OSError as exc:
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
        n0, t0 = self.hb_sent, time.monotonic()
        await asyncio.sleep(seconds)
        return {"ok": True, "hb_sent": self.hb_sent - n0, "elapsed": time.monotonic() - t0}

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
    args = p.parse_args(argv)
    raise_nofile_limit()
    pool = Pool(args.port, args.count, args.first)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(pool))
    else:
        uvloop.run(serve(pool))
    return 0


if __name__ == "__main__":
    sys.exit(main())
