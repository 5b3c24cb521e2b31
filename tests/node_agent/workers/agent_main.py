"""A stand-in agent for the SIGKILL test: start two workers with a grandchild each through
WorkerGroup, write every pid to argv[1] as JSON, print "ready", then block until killed."""

import asyncio
import json
import os
import sys

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
)

from node_agent.supervisor import WorkerGroup, WorkerSpec

HERE = os.path.dirname(os.path.abspath(__file__))


class ReadyCounter:
    """Console stand-in: counts the workers' "ready" lines."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.seen = 0
        self.event = asyncio.Event()

    def write(self, data: bytes) -> int:
        self.seen += data.count(b"ready ")
        if self.seen >= self.n:
            self.event.set()
        return len(data)

    def flush(self) -> None:
        pass


async def main(out_path: str) -> None:
    console = ReadyCounter(2)
    group = WorkerGroup(stdout=console, stderr=sys.stderr.buffer)
    pidfiles = [f"{out_path}.w{r}" for r in range(2)]
    specs = [
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
    ]
    await group.start(specs)
    await asyncio.wait_for(console.event.wait(), 30)
    workers, grandchildren = [], []
    for path in pidfiles:
        with open(path) as f:
            pid, *kids = (int(x) for x in f.read().split())
        workers.append(pid)
        grandchildren.extend(kids)
    watchdog = group._watchdog.pid  # test-only peek at the private watchdog
    with open(out_path + ".tmp", "w") as f:
        json.dump(
            {"agent": os.getpid(), "watchdog": watchdog, "workers": workers, "grandchildren": grandchildren},
            f,
        )
    os.rename(out_path + ".tmp", out_path)
    print("ready", flush=True)
    await asyncio.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
