"""A worker for test_faults.py that leaves a trail of marker files in $DUMP_DIR, so a test can
check the order of events across nodes without timing anything. Markers are written to a
temporary name and renamed: a reader never sees half of one.

- ``start-<pid>.json`` when it starts: rank, world size, restart count, and ``alive_before``:
  the pids of the workers of other rounds that started before it (their own ``start-*``
  markers) and are still alive now. Printed too: "faults: rank R of W started (restart N)".
- With $FAIL_FILE: the worker of rank $FAIL_RANK, on its first attempt, exits 1 once that file
  exists.
- On SIGTERM: ``term-<pid>``, then it lingers, as a rank writing a checkpoint would: until
  $LINGER_FILE exists (at most 60 s), or for $LINGER seconds; then ``exited-<pid>`` and exit 0.
- Otherwise it runs until $RELEASE_FILE exists (``exited-<pid>``, exit 0), or exits 3 after
  $HOLD_TIMEOUT seconds (default 120) without it.
"""

import json
import os
import signal
import sys
import time

out = os.environ["DUMP_DIR"]
pid = os.getpid()
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def mark(name: str, text: str = "") -> None:
    tmp = os.path.join(out, f".{name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(out, name))


def alive(p: int) -> bool:
    try:
        with open(f"/proc/{p}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"  # a zombie has exited
    except OSError:
        return False


def wait_for(path: str, limit: float) -> bool:
    """No event to wait on: the file is made by another process."""
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def leave(code: int) -> None:
    mark(f"exited-{pid}", str(code))
    sys.exit(code)


def on_term(signum, frame):  # type: ignore[no-untyped-def]
    mark(f"term-{pid}")
    linger_file = os.environ.get("LINGER_FILE")
    if linger_file:
        wait_for(linger_file, 60)
    else:
        time.sleep(float(os.environ.get("LINGER", "0")))
    leave(0)


def earlier_rounds() -> list[int]:
    """The pids of workers of other rounds that started before us."""
    pids = []
    for name in os.listdir(out):
        if name.startswith("start-") and name.endswith(".json"):
            with open(os.path.join(out, name)) as f:
                if json.load(f)["round"] != this_round:
                    pids.append(int(name[6:-5]))
    return pids


signal.signal(signal.SIGTERM, on_term)
# What the workers of one round share (its rendezvous point and size); another round differs.
this_round = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} {world} {restart}"
record = {
    "pid": pid,
    "rank": rank,
    "world": world,
    "restart": restart,
    "round": this_round,
    "alive_before": sorted(p for p in earlier_rounds() if alive(p)),
}
mark(f"start-{pid}.json", json.dumps(record))
print(f"faults: rank {rank} of {world} started (restart {restart})", flush=True)

fail_file = os.environ.get("FAIL_FILE")
if fail_file and restart == 0 and str(rank) == os.environ.get("FAIL_RANK", "0"):
    if wait_for(fail_file, 120):
        print(f"faults: rank {rank} fails on purpose", file=sys.stderr, flush=True)
        leave(1)
if wait_for(os.environ["RELEASE_FILE"], float(os.environ.get("HOLD_TIMEOUT", "120"))):
    leave(0)
print(f"faults: rank {rank} was never released", file=sys.stderr, flush=True)
leave(3)
