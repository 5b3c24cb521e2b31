"""The agent's side of restarts in place (the worker's: :mod:`node_agent.worker.inplace`).

When the job restarts, a worker that runs under ``worker.run`` is asked to park instead of
being killed: a park order in its place folder (:mod:`node_agent.worker.place`), then
:data:`PARK_SIGNAL` to its process (never to its group: a DataLoader worker would die of it).
It leaves its attempt, destroys its process group and says ``parked``; once the next round is
formed it gets its place (a run order with its whole environment) and trains again in the
same process. A worker that has not said it runs under ``worker.run``, or does not park
within :data:`PARK_TIMEOUT`, is stopped as before.

At a commit point (a scale-up, a drain elsewhere) nothing is asked: ``train()`` returns at the
commit step and the worker says ``committed`` by itself, alive. The group counts it as a
worker that exited 0 (:meth:`Parking.committed`, looked at every :data:`COMMIT_POLL_S` while
workers run under ``worker.run``: one ``stat`` each), and the next start gives it its place.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence

from node_agent.worker import place

from .process import Worker

__all__ = ["COMMIT_POLL_S", "PARK_TIMEOUT", "RELEASE_S", "Parking", "folder_of"]

# How long a survivor may take to leave its attempt: its thread aborts a blocked collective
# after inplace.ABORT_AFTER_S, so seconds are spent only by a process that is truly stuck
# (in the kernel, in a C loop that never checks): that one is killed and replaced.
PARK_TIMEOUT = 3.0
_POLL_S = 0.003
COMMIT_POLL_S = 0.05  # a commit is seen this much later than an exit would be
RELEASE_S = 2.0  # a worker released after a commit exits by itself within this, or is stopped


def folder_of(worker: Worker) -> str:
    return worker.spec.env.get(place.PLACE_VAR, "")


def _state(worker: Worker) -> dict[str, object] | None:
    folder = folder_of(worker)
    state = place.read(folder, place.STATE) if folder else None
    if state is None or state.get("pid") != worker.pid:
        return None  # not this process's (yet): it never called worker.run, or another did
    return state


class Parking:
    """The serials of one agent's orders (its place folders are its own, fresh per run)."""

    def __init__(self) -> None:
        self._serial = 0

    def _next(self) -> int:
        self._serial += 1
        return self._serial

    def can_park(self, worker: Worker) -> bool:
        state = _state(worker)
        return state is not None and state.get("state") in (place.RUNNING, place.FAILED)

    def committed(self, worker: Worker) -> bool:
        """Whether the worker's attempt ended at a commit point and it waits for a place; the
        file is read only when it changed (a stat otherwise)."""
        folder = folder_of(worker)
        if not folder:
            return False
        try:
            st = os.stat(os.path.join(folder, place.STATE))
        except OSError:
            return False
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        seen = worker.state_seen
        if seen is not None and seen[0] == key:
            return seen[1]
        state = _state(worker)
        said = (
            state is not None
            and state.get("state") == place.COMMITTED
            and place.serial_of(state) >= worker.place_serial
        )
        worker.state_seen = (key, said)
        return said

    async def park(self, workers: Sequence[Worker], timeout: float = PARK_TIMEOUT) -> list[Worker]:
        """Ask every live worker that can park to do so; return those that did in time."""
        asked: dict[Worker, int] = {}
        for w in workers:
            if w.exited.done() or not self.can_park(w):
                continue
            serial = self._next()
            try:
                place.write(folder_of(w), place.ORDER, {"serial": serial, "do": place.PARK})
                os.kill(w.pid, place.PARK_SIGNAL)
            except OSError:
                continue  # its folder is gone, or it is: stopped as before
            asked[w] = serial
        parked: list[Worker] = []
        deadline = time.monotonic() + timeout
        while asked:
            for w, serial in list(asked.items()):
                if w.exited.done():
                    del asked[w]
                    continue
                state = _state(w)
                if (
                    state is not None
                    and state.get("state") == place.PARKED
                    and place.serial_of(state) >= serial
                ):
                    parked.append(w)
                    del asked[w]
            if not asked or time.monotonic() >= deadline:
                break
            await asyncio.sleep(_POLL_S)
        return parked

    def release(self, worker: Worker) -> bool:
        """Let a worker that waits after a commit point end by itself (``worker.run`` returns:
        its output flushed, its exit handlers run); False: it cannot be told, or waits for
        another reason (a park after a failure: it is stopped as before)."""
        if worker.exited.done() or not self.committed(worker):
            return False
        try:
            place.write(folder_of(worker), place.ORDER, {"serial": self._next(), "do": place.EXIT})
        except OSError:
            return False
        return True

    def place(self, worker: Worker, env: Mapping[str, str], logs: Mapping[str, str] | None = None) -> bool:
        """Give a parked worker its next place (False: it cannot be told; stop it); ``logs``:
        the new attempt's files for the descriptors it writes itself ("1", "2")."""
        unset = [k for k in worker.spec.env if k not in env]
        serial = self._next()
        order: dict[str, object] = {"serial": serial, "do": place.RUN, "env": dict(env), "unset": unset}
        if logs:
            order["logs"] = dict(logs)
        try:
            place.write(folder_of(worker), place.ORDER, order)
        except OSError:
            return False
        worker.place_serial, worker.state_seen = serial, None
        return True
