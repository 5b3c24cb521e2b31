"""A stand-in agent for the SIGKILL test: start two workers with a grandchild each through
WorkerGroup, write every pid to argv[1] as JSON, print "ready", then block until killed.

With argv[2] == "restarted" it first stops that attempt as the agent does before a restart
(keeping the watchdog) and starts a second one, whose pids it writes (and the first one's
watchdog pid, as "first_watchdog")."""

import asyncio
import json
import os
import sys

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
)

from node_agent.supervisor.group import WorkerGroup
from node_agent.supervisor.spec import WorkerSpec

HERE = os.path.dirname(os.path.abspath(__file__))


class ReadyCounter:
    """Console stand-in: counts the workers' "ready" lines."""

    def __init__(self) -> None:
        self.n = 0
        self.seen = 0
        self.event = asyncio.Event()

    async def until(self, n: int) -> None:
        self.n = n
        if self.seen < n:
            self.event.clear()
            await asyncio.wait_for(self.event.wait(), 30)

    def write(self, data: bytes) -> int:
        self.seen += data.count(b"ready ")
        if self.seen >= self.n:
            self.event.set()
        return len(data)

    def flush(self) -> None:
        pass


def specs(out_path: str, attempt: int) -> tuple[list[WorkerSpec], list[str]]:
    pidfiles = [f"{out_path}.a{attempt}w{r}" for r in range(2)]
    return [
        WorkerSpec(
            local_rank=r,
            rank=r,
            argv=[
                sys.executable,
                "-u",
                os.path.join(HERE, "block.py"),
                "--child",
                "plain",
                "--child",
                "ignore-term",
                "--pidfile",
                pidfiles[r],
            ],
            env={**os.environ, "LOCAL_RANK": str(r)},
        )
        for r in range(2)
    ], pidfiles


async def main(out_path: str, restarted: bool) -> None:
    console = ReadyCounter()
    group = WorkerGroup(stdout=console, stderr=sys.stderr.buffer)
    first_watchdog = 0
    if restarted:
        first, _ = specs(out_path, 0)
        await group.start(first)
        await console.until(2)
        first_watchdog = group._watchdog.pid  # test-only peek at the private watchdog
        await group.stop(grace=1.0, keep_watchdog=True)
    attempt, pidfiles = specs(out_path, 1)
    await group.start(attempt)
    await console.until(4 if restarted else 2)
    workers, grandchildren = [], []
    for path in pidfiles:
        with open(path) as f:
            pid, *kids = (int(x) for x in f.read().split())
        workers.append(pid)
        grandchildren.extend(kids)
    watchdog = group._watchdog.pid  # test-only peek at the private watchdog
    with open(out_path + ".tmp", "w") as f:
        json.dump(
            {
                "agent": os.getpid(),
                "watchdog": watchdog,
                "first_watchdog": first_watchdog,
                "workers": workers,
                "grandchildren": grandchildren,
            },
            f,
        )
    os.rename(out_path + ".tmp", out_path)
    print("ready", flush=True)
    await asyncio.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2:] == ["restarted"]))
