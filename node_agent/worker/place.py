"""The channel between an agent and a worker that restarts in place (:mod:`.inplace`).

One folder per local rank, ``NODE_AGENT_PLACE_DIR``, in the agent's private directory (0700),
the same across rounds: a survivor keeps the folder it was started with. Two small JSON files,
each replaced whole (written beside, then renamed), so a reader sees an old one or a new one,
never half of one:

* ``order`` (the agent's): ``{"serial": n, "do": "park"}`` asks the process to leave its
  attempt (the job restarts), ``{"serial": n, "do": "run", "env": {...}}`` gives it the next
  round's place (its whole environment: rank, world size, master address and port, the step
  to restore; and ``"logs": {"1": path, "2": path}``, the new attempt's files for the streams
  the process writes itself, which it reopens); ``{"serial": n, "do": "exit"}`` lets a
  process that waits after a commit point end (the job goes on without this node):
  ``worker.run`` returns. Serials only grow; a
  worker acts on an order whose serial is above the last one it acted on.
* ``state`` (the worker's): ``{"pid": p, "serial": n, "state": s}`` with ``s`` one of
  ``running`` (in an attempt, since order ``n``), ``parked`` (out of it, waiting for a place),
  ``failed`` (its attempt raised; waiting a moment for a park that would make it collateral),
  ``committed`` (``train()`` returned at a commit point, ``worker.should_stop()``: the job goes
  on in a next round, a scale-up or a drain elsewhere; waiting, alive, for a place in it).

The agent sends :data:`PARK_SIGNAL` after writing a park order: it interrupts the attempt at
the next bytecode; a thread of the worker notices the order by itself when the main thread is
blocked in a collective and aborts its process group.

Both sides are one user and one folder nobody else can enter; what is read is still bounded
and type-checked (a torn or foreign file reads as none), as everything a process reads is.
"""

from __future__ import annotations

import os

try:
    from _signal import SIGRTMIN  # type: ignore[import-not-found, unused-ignore]
except ImportError:  # not CPython
    from signal import SIGRTMIN

PLACE_VAR = "NODE_AGENT_PLACE_DIR"
PARK_SIGNAL = int(SIGRTMIN) + 5  # the stack signal is +4 (worker.STACK_SIGNAL)
ORDER = "order"
STATE = "state"
MAX_FILE = 1 << 20  # an environment is tens of kB; anything past this is not ours
PARK, RUN, EXIT = "park", "run", "exit"
RUNNING, PARKED, FAILED, COMMITTED = "running", "parked", "failed", "committed"


def write(folder: str, name: str, obj: dict[str, object]) -> None:
    """Replace ``folder/name`` with ``obj`` as JSON, whole."""
    import json  # here: the agent imports this module, and a launch has no other use for json

    tmp = os.path.join(folder, f".{name}.{os.getpid()}")
    data = json.dumps(obj, separators=(",", ":")).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, os.path.join(folder, name))


def read(folder: str, name: str) -> dict[str, object] | None:
    """``folder/name`` as a JSON object, or None (missing, too big, not an object)."""
    try:
        with open(os.path.join(folder, name), "rb") as f:
            data = f.read(MAX_FILE + 1)
    except OSError:
        return None
    if len(data) > MAX_FILE:
        return None
    import json

    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def serial_of(obj: dict[str, object] | None) -> int:
    """The serial of an order or state (-1: none, or not a valid one)."""
    if obj is None:
        return -1
    s = obj.get("serial")
    return s if type(s) is int and s >= 0 else -1


def env_of(order: dict[str, object]) -> dict[str, str] | None:
    """A run order's environment, when it is one (every key and value a string)."""
    env = order.get("env")
    if not isinstance(env, dict) or not all(type(k) is str and type(v) is str for k, v in env.items()):
        return None
    return env
