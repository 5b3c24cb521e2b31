"""A rank that reports progress, then scribbles over its own progress page for a while.

It attaches through ``node_agent.worker`` (a phase named with a tab, a few steps), maps its
page itself and, for $SCRIBBLE_SECONDS, writes in a loop what a buggy C++ or Rust writer
might: records with valid check words holding any values (negative steps, phase slots past 15,
check records at steps below -1), random phase-name bytes, and random bytes anywhere in the
records and names the agent reads (not the header: a page whose magic is gone reads as no page
at all for the rest of the run, which the agent's own tests cover), with ordinary
``worker.progress`` calls in between. Local rank 0 keeps to values a writer with small bugs
leaves (a step of -1 or -2 half the time); the others write anything. Then it exits with
$SCRIBBLE_EXIT (0). Seeded by $SCRIBBLE_SEED and its local rank.
"""

import mmap
import os
import random
import time

from node_agent import worker
from node_agent.worker import layout as L

SPAN = L.NAMES_OFFSET + L.NAME_SLOTS * L.NAME_SIZE  # what the agent reads of a page
I64 = (-(1 << 63), (1 << 63) - 1)
U64 = (0, (1 << 64) - 1)


def record(rng: random.Random, lo: int, hi: int, wild: bool) -> tuple[int, int, int]:
    if wild and rng.random() < 0.5:
        return rng.randint(*I64), rng.randint(*U64), rng.randint(*U64)
    first = rng.randint(lo, -1) if rng.random() < 0.5 else rng.randint(0, hi)
    return first, rng.randint(0, 10**12), rng.randint(0, 100)


def scribble(page: mmap.mmap, rng: random.Random, wild: bool) -> None:
    kind = rng.randrange(6 if wild else 4)
    if kind == 0:
        step, ns, count = record(rng, -2, 1000, wild)
        L.PROGRESS.pack_into(page, L.PROGRESS_OFFSET, step, ns, count, L.check(step, ns, count))
    elif kind == 1:
        slot, ns, compute = record(rng, -1, 17, wild)
        slot = abs(slot) % (1 << 64)
        L.PHASE.pack_into(page, L.PHASE_OFFSET, slot, ns, compute, L.check(slot, ns, compute))
    elif kind == 2:
        seen, at, stopped = (rng.randint(*I64) if wild else rng.randint(-3, 50) for _ in range(3))
        L.CHECK.pack_into(page, L.CHECK_OFFSET, seen, at, stopped, L.check(seen, at, stopped))
    elif kind == 3:
        off = L.name_offset(rng.randint(1, L.NAME_SLOTS - 1))
        page[off : off + L.NAME_SIZE] = rng.randbytes(L.NAME_SIZE)
    else:  # any bytes in the records and names: torn records, odd names
        off = rng.randrange(L.PROGRESS_OFFSET, SPAN)
        data = rng.randbytes(rng.randint(1, 48))[: SPAN - off]
        page[off : off + len(data)] = data


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    rng = random.Random(int(os.environ.get("SCRIBBLE_SEED", "0")) * 1000 + local_rank)
    with worker.phase("load\tdata"):
        for step in range(3):
            worker.progress(step)
    fd = os.open(os.environ[worker.PAGE_VAR], os.O_RDWR)
    try:
        page = mmap.mmap(fd, L.PAGE_SIZE)
    finally:
        os.close(fd)
    deadline = time.monotonic() + float(os.environ.get("SCRIBBLE_SECONDS", "4"))
    step = 3
    while time.monotonic() < deadline:
        if rng.random() < 0.25:
            worker.progress(step)
            step += 1
        for _ in range(rng.randint(1, 4)):
            scribble(page, rng, wild=local_rank != 0)
        time.sleep(0.002)  # pacing: the agent reads every second; this leaves it a core
    print(f"rank {local_rank} scribbled up to step {step}", flush=True)
    raise SystemExit(int(os.environ.get("SCRIBBLE_EXIT", "0")))


if __name__ == "__main__":
    main()
