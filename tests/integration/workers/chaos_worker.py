"""A torch-free worker for the chaos campaign (tests/integration/chaos.py): it reports what it sees.

At start it writes ``<pid>.<starttime>.start.json`` into ``$CHAOS_REPORT_DIR`` (written to a
temporary name, then renamed: a reader never sees half a report) with its pid, the start time
the kernel gives it (``/proc/self/stat`` field 22: with the pid, an identity that survives pid
reuse), its parent (the agent), the attempt directory of its error file, the monotonic clock,
and every variable torchrun sets that the campaign checks (RANK, WORLD_SIZE, GROUP_RANK,
LOCAL_RANK, TORCHELASTIC_RESTART_COUNT, MASTER_ADDR/PORT, ...).

It then runs until ``$CHAOS_RELEASE_FILE`` exists and exits 0. Otherwise:

- SIGTERM (the agent stopping it): reports ``term``, spends ``$CHAOS_TERM_DELAY`` seconds
  "checkpointing" (so a node whose workers are still stopping is visible to the campaign),
  then exits 143. When the campaign is draining its node (``$CHAOS_CONTROL_DIR/drain-<agent
  pid>`` exists) it takes ``$CHAOS_DRAIN_DELAY`` seconds instead: a last checkpoint on the way
  out, longer than any other node's, which the next round must not start before.
- SIGUSR2 (the campaign injecting a failure): exits 7.
- its parent changing (the agent died and it was not killed with it): reports ``orphaned``
  once and keeps running, so the campaign sees the orphan.
- not released within ``$CHAOS_WORKER_TIMEOUT`` seconds: exits 3 (nothing outlives a campaign
  that lost track of it).

Each exit it makes itself is reported as ``<pid>.<starttime>.exit.json`` with the reason.
"""

import json
import os
import signal
import sys
import time

REPORTS = os.environ["CHAOS_REPORT_DIR"]
RELEASE = os.environ["CHAOS_RELEASE_FILE"]
TERM_DELAY = float(os.environ.get("CHAOS_TERM_DELAY", "0"))
CONTROL = os.environ.get("CHAOS_CONTROL_DIR", "")
DRAIN_DELAY = float(os.environ.get("CHAOS_DRAIN_DELAY", "0"))
TIMEOUT = float(os.environ.get("CHAOS_WORKER_TIMEOUT", "600"))
POLL = 0.05

PID = os.getpid()
PARENT = os.getppid()


def _starttime() -> int:
    with open("/proc/self/stat", "rb") as f:
        stat = f.read()
    return int(stat[stat.rfind(b")") + 2 :].split()[19])


START_TICKS = _starttime()


def report(kind: str, **extra: object) -> None:
    rec = {"kind": kind, "pid": PID, "start_ticks": START_TICKS, "t": time.monotonic(), **extra}
    name = f"{PID}.{START_TICKS}.{kind}.json"
    tmp = os.path.join(REPORTS, f".{name}.tmp")
    with open(tmp, "w") as f:
        json.dump(rec, f)
    os.replace(tmp, os.path.join(REPORTS, name))


def leave(code: int, why: str) -> None:
    report("exit", code=code, reason=why)
    sys.stdout.flush()
    os._exit(code)


def on_term(signum: int, frame: object) -> None:
    draining = bool(CONTROL) and os.path.exists(os.path.join(CONTROL, f"drain-{PARENT}"))
    report("term", draining=draining)
    delay = DRAIN_DELAY if draining else TERM_DELAY
    if delay > 0:
        time.sleep(delay)  # the "checkpoint": a worker that takes a while to stop
    leave(143, "sigterm")


def on_fail(signum: int, frame: object) -> None:
    leave(7, "injected failure")


ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_ERROR_FILE",
)
report("start", agent_pid=PARENT, env={k: os.environ.get(k) for k in ENV_KEYS})
# Only now: a signal that came before the start report (the default action: die at once) leaves
# no report at all rather than an exit without its start.
signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGUSR2, on_fail)

deadline = time.monotonic() + TIMEOUT
orphaned = False
# No event to wait on: the release is a file another process makes (as in hold.py).
while not os.path.exists(RELEASE):
    if not orphaned and os.getppid() != PARENT:
        orphaned = True
        report("orphaned", new_parent=os.getppid())
    if time.monotonic() > deadline:
        leave(3, "never released")
    time.sleep(POLL)
leave(0, "released")
