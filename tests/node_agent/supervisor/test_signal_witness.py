"""The watchdog's reports matched one to one with the agent's signals (signal_witness.py)."""

from __future__ import annotations

import asyncio
import signal

from node_agent.supervisor.signal_witness import FRESH_S, SignalWitness


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_report_already_in_says_delivered_once() -> None:
    async def main() -> None:
        w = SignalWitness()
        w.feed(b"10\n")
        assert await w.delivered(signal.SIGUSR1, wait=0.01)
        assert not await w.delivered(signal.SIGUSR1, wait=0.01)  # one report, one signal

    asyncio.run(main())


def test_a_report_that_arrives_while_the_agent_waits_counts() -> None:
    async def main() -> None:
        w = SignalWitness()
        asyncio.get_running_loop().call_later(0.02, w.feed, b"1")
        asyncio.get_running_loop().call_later(0.03, w.feed, b"5\n")  # split across reads
        assert await w.delivered(signal.SIGTERM, wait=2.0)

    asyncio.run(main())


def test_another_signals_report_does_not_count() -> None:
    async def main() -> None:
        w = SignalWitness()
        w.feed(b"12\n")
        assert not await w.delivered(signal.SIGUSR1, wait=0.01)
        assert await w.delivered(signal.SIGUSR2, wait=0.01)

    asyncio.run(main())


def test_a_stale_report_does_not_make_a_later_signal_look_delivered() -> None:
    async def main() -> None:
        clock = Clock()
        w = SignalWitness(clock)
        w.feed(b"10\n")  # someone signalled the watchdog alone
        clock.now += FRESH_S + 1
        assert not await w.delivered(signal.SIGUSR1, wait=0.01)

    asyncio.run(main())


def test_garbage_on_the_pipe_is_bounded_and_ignored() -> None:
    async def main() -> None:
        w = SignalWitness()
        w.feed(b"x" * 100_000)
        w.feed(b"\n" + b"10\n" * 1000)
        assert len(w._seen) <= 64 and len(w._partial) <= 32
        assert await w.delivered(signal.SIGUSR1, wait=0.01)

    asyncio.run(main())
