"""Restart in place: ``worker.run(train)`` runs ``train()`` again in the same process when the
job restarts, instead of the agent killing the process and starting a new one.

    from node_agent import worker

    def train():
        dist.init_process_group("gloo")       # the place of this attempt is in os.environ
        r = worker.restore()                  # the step the server chose for every rank
        ...
        dist.destroy_process_group()

    if __name__ == "__main__":
        worker.run(train)

Under node-agent (``NODE_AGENT_PLACE_DIR`` set) a survivor of a failure keeps its process, its
imports and whatever it cached: when the job restarts, its attempt is interrupted
(:class:`Interrupted`, raised in the training thread; a collective it is blocked in is aborted),
its process group is destroyed, it waits for the next round's place and calls ``train()``
again with ``os.environ`` updated (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_RESTART_COUNT``, ``NODE_AGENT_RESTORE_STEP``...). Only the ranks whose process
died are started again (from the warm pool with ``--preload``). Outside node-agent, under
torchrun, or when the agent cannot park it, ``run(train)`` is ``train()``.

What ends an attempt and what follows:

* ``train()`` returns: the worker is done; ``run`` returns its value (the process exits 0).
  Unless it returned at a commit point (``worker.should_stop()`` said True): the job goes on
  in a next round (nodes join, or one leaves), so the process waits for its place in it and
  calls ``train()`` again, which resumes from the checkpoint it saved at the commit step.
* The job restarts (another rank or node failed, a hang, a spare took a node's place): the
  agent asks this process to park; :class:`Interrupted` (a ``BaseException``, so a plain
  ``except Exception`` in the script does not swallow it) ends the attempt.
* ``train()`` raises an error of ``torch.distributed`` (a collective or the store failing
  because a peer died, a process group aborted): the agent's park usually comes within
  moments, and ``run`` waits up to :data:`COLLATERAL_S` for it. Any other exception, or no park
  in that time: the exception is this rank's own and propagates (the process exits 1 with the
  traceback, as without ``run``; this rank alone starts again, in a fresh process, since its
  own state may be what broke).
* ``SystemExit`` and ``KeyboardInterrupt`` propagate at once.

``Interrupted`` can arrive at any bytecode of ``train()``, like ``KeyboardInterrupt``: state
that must stay whole belongs in a snapshot, which is what the next attempt restores.
"""

from __future__ import annotations

import _thread
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from . import _rebind, _stopped_at_commit
from . import place as _place

__all__ = ["COLLATERAL_S", "Interrupted", "run"]

T = TypeVar("T")

COLLATERAL_S = 5.0  # a failed attempt's wait for the park that makes its exception collateral
ABORT_AFTER_S = 0.3  # a park the training thread has not acted on by then: it is blocked in C
_WATCH_S = 0.02  # the watcher thread's look at the order, during an attempt
_WAIT_S = 0.002  # a parked process's look at the order


class Interrupted(BaseException):
    """The job restarts: this attempt of ``train()`` ends here (raised by ``worker.run``)."""


def run(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call ``fn(*args, **kwargs)``; under node-agent, call it again in this process each time
    the job restarts (module doc). Returns what the last call returned."""
    folder = os.environ.get(_place.PLACE_VAR, "")
    if not folder or not os.path.isdir(folder):
        return fn(*args, **kwargs)
    return _Attempts(folder).loop(fn, args, kwargs)


class _Attempts:
    def __init__(self, folder: str) -> None:
        self.folder = folder
        # Orders at or below this serial were for an earlier process of this local rank.
        self.acted = _place.serial_of(_place.read(folder, _place.ORDER))
        self.in_attempt = False
        self.parking = False
        self._watcher: threading.Thread | None = None
        self._sockets: dict[int, str] = {}  # the process's sockets as the attempt began
        self._main = False  # run() was called from the main thread: our handler is installed

    # -- the loop ------------------------------------------------------------------------

    def loop(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
        import signal

        handler = signal.getsignal(_place.PARK_SIGNAL)
        main = threading.current_thread() is threading.main_thread()
        self._main = main
        if main:
            signal.signal(_place.PARK_SIGNAL, self._on_park_signal)
        try:
            result: Any = None
            while True:
                self._sockets = _sockets()
                committed = False
                try:
                    try:
                        # In the attempt before the agent can know it (the state says so): a
                        # park signal from then on interrupts it, here or in fn.
                        self.in_attempt = True
                        self._state(_place.RUNNING)
                        self._start_watching()
                        result = fn(*args, **kwargs)
                    finally:
                        self.in_attempt = False
                    if not _stopped_at_commit():
                        return result
                    committed = True
                except Interrupted:
                    pass
                except (SystemExit, KeyboardInterrupt):
                    raise
                except Exception as exc:
                    self._state(_place.FAILED)
                    if not self._park_within(COLLATERAL_S if _collateral(exc) else 0.0):
                        raise
                if not self._park(committed):
                    return result  # (released after a commit: the job goes on without us)
        finally:
            self._state("done")
            if main:  # a late park signal must never kill a process on its way out (default: kills)
                keep = handler not in (None, signal.SIG_DFL)
                signal.signal(_place.PARK_SIGNAL, handler if keep else signal.SIG_IGN)

    def _park(self, committed: bool = False) -> bool:
        """Out of the attempt: the process group torn down, parked until the next place.
        ``committed``: the attempt ended cleanly at a commit point, every rank at one step:
        nothing is blocked, so nothing is aborted (a peer may still be in its last collective).
        False: released instead (an exit order; only after a commit)."""
        _tear_down_torch(self._sockets, clean=committed)
        self._state(_place.COMMITTED if committed else _place.PARKED)
        while True:
            order = _place.read(self.folder, _place.ORDER)
            serial = _place.serial_of(order)
            if order is not None and serial > self.acted:
                do = order.get("do")
                env = _place.env_of(order) if do == _place.RUN else None
                if env is not None:
                    self.acted = serial
                    _take_place(env, order.get("unset"), order.get("logs"))
                    return True
                if do == _place.EXIT and committed:
                    self.acted = serial
                    return False
            time.sleep(_WAIT_S)

    # -- orders --------------------------------------------------------------------------

    def _park_order(self) -> int:
        """The serial of a park order not acted on yet (-1: none)."""
        order = _place.read(self.folder, _place.ORDER)
        serial = _place.serial_of(order)
        if order is not None and serial > self.acted and order.get("do") == _place.PARK:
            return serial
        return -1

    def _park_within(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while True:
            serial = self._park_order()
            if serial >= 0:
                self.acted = serial
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(_WAIT_S)

    def _on_park_signal(self, signum: int, frame: object) -> None:
        if not self.in_attempt or self.parking:
            return  # between attempts, or already leaving one: the loop reads the order itself
        serial = self._park_order()
        if serial >= 0:
            self.acted = serial
            self.parking = True
            try:
                raise Interrupted(f"the job restarts (order {serial})")
            finally:
                self.parking = False

    def _state(self, state: str) -> None:
        try:
            _place.write(
                self.folder, _place.STATE, {"pid": os.getpid(), "serial": self.acted, "state": state}
            )
        except OSError:
            pass  # the agent's folder is gone: it is going too

    # -- the watcher: a training thread blocked in a collective never runs a signal handler --

    def _start_watching(self) -> None:
        if self._watcher is None or not self._watcher.is_alive():
            self._watcher = threading.Thread(target=self._watch, name="node-agent-inplace", daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        seen_at: float | None = None
        while True:
            time.sleep(_WATCH_S)
            if not self.in_attempt:
                seen_at = None
                continue
            if self._park_order() < 0:
                seen_at = None
                continue
            now = time.monotonic()
            if seen_at is None:
                seen_at = now
            elif now - seen_at >= ABORT_AFTER_S:
                # The blocked collective raises; the loop finds the park order. The signal is
                # simulated once more (a handler that ran as the attempt began found no order).
                _abort_torch()
                _shut_down_sockets(self._sockets)
                if self._main:
                    _thread.interrupt_main(_place.PARK_SIGNAL)  # type: ignore[arg-type]  # an int is taken
                seen_at = now + 10 * ABORT_AFTER_S  # once in a while after that, not in a spin


def _collateral(exc: BaseException) -> bool:
    """Whether ``exc`` may come from a peer's failure rather than this rank's own: an error of
    torch.distributed (its collectives, its store), or a RuntimeError its backends raise."""
    dist = sys.modules.get("torch.distributed")
    dist_error = getattr(dist, "DistError", None)
    if isinstance(dist_error, type) and isinstance(exc, dist_error):
        return True
    if type(exc) is RuntimeError or isinstance(exc, ConnectionError):
        text = str(exc).lower()
        return any(w in text for w in _PEER_WORDS)
    return False


_PEER_WORDS = ("gloo", "nccl", "connection", "peer", "abort", "timed out", "timeout", "socket", "store")


def _take_place(env: dict[str, str], unset: object, logs: object = None) -> None:
    """The next round's environment: what the agent sets, less what it no longer sets; and
    the new attempt's log files for the descriptors this process writes itself."""
    if isinstance(unset, list):
        for key in unset:
            if type(key) is str and key not in env:
                os.environ.pop(key, None)
    os.environ.update(env)
    _rebind()  # the new round's progress page
    if isinstance(logs, dict):
        _reopen_logs(logs)


def _reopen_logs(logs: dict[object, object]) -> None:
    """``{"1": path, "2": path}``: stdout's and stderr's file for this attempt (``--redirects``),
    opened in place of the last attempt's, what Python buffered written out first."""
    for key, path in logs.items():
        if key not in ("1", "2") or type(path) is not str or not path:
            continue
        fd = int(key)
        stream = sys.stdout if fd == 1 else sys.stderr
        try:
            if stream is not None:
                stream.flush()
            new = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        except (OSError, ValueError):
            continue  # the old file goes on: output is never lost for a log's sake
        try:
            os.dup2(new, fd)
        except OSError:
            pass
        finally:
            os.close(new)


def _tear_down_torch(before: dict[int, str], *, clean: bool = False) -> None:
    """Destroy the default process group if the attempt left one, and forget what frameworks
    keep of it. An interrupted attempt's group may be broken: its connections are shut down
    first (``before``: the sockets as the attempt began) and it is aborted. ``clean``: the
    attempt ended at a commit point, every rank at one step: nothing is blocked, so nothing is
    shut down or aborted (a peer may still be in its last collective)."""
    _forget_frameworks()
    if not clean:
        _forget_backward_context()
        _shut_down_sockets(before)
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    try:
        if not dist.is_available() or not dist.is_initialized():
            return
    except Exception:
        return
    if not clean:
        _abort_torch()
    try:
        dist.destroy_process_group()
    except Exception:
        pass  # the next init_process_group makes a fresh one all the same


def _forget_backward_context() -> None:
    """Drop the context autograd keeps in the thread's storage during a backward pass, if the
    interruption left it there. torch stashes it as the backward starts and removes it in a
    ``finally``; an attempt interrupted in a collective inside backward gets ``Interrupted`` at
    the first bytecode after the C++ call, which is that ``finally``, so the removal is skipped.
    Left there, it is captured by every collective of the next attempt, whose gloo thread must
    then take the GIL to free it, and torch's process group teardown joins that thread with the
    GIL held."""
    c = getattr(sys.modules.get("torch"), "_C", None)
    is_key, remove = getattr(c, "_is_key_in_tls", None), getattr(c, "_remove_obj_from_tls", None)
    if not (callable(is_key) and callable(remove)):
        return
    try:
        if is_key("context"):
            remove("context")
    except Exception:
        pass  # another torch: nothing of ours to fix


def _forget_frameworks() -> None:
    """Forget what a framework keeps for the life of the process about the process group this
    attempt had, so the next attempt's sets it up again. accelerate's ``PartialState`` is a
    process-wide singleton: once set up it never calls ``init_process_group`` again, so a
    second ``Accelerator()`` would find no process group. (Hugging Face's Trainer and Lightning
    set theirs up again by themselves: tested.)"""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return
    for name, args in (("AcceleratorState", (True,)), ("GradientState", ()), ("PartialState", ())):
        reset = getattr(getattr(state, name, None), "_reset_state", None)
        if callable(reset):
            try:
                reset(*args)
            except Exception:
                pass  # (another version: its own error comes at the next Accelerator)


def _sockets() -> dict[int, str]:
    """This process's sockets: descriptor -> ``socket:[inode]``."""
    found: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found[int(name)] = target
    return found


def _shut_down_sockets(before: dict[int, str]) -> None:
    """Shut down the TCP connections this attempt opened (gloo's pairs, the store's).

    Torch's abort does not reach a gloo collective blocked on a peer that is alive but gone
    from the attempt (a parked survivor, a hung rank): its pairs' sockets stay open, and the
    collective waits for the process group's timeout (30 minutes by default). Shut down (not
    closed: the descriptors stay gloo's to close), they make every read of both ends fail at
    once: this rank's collective raises, and so do its peers'. Connections the process had
    before the attempt are left alone; one that ``train()`` opened itself ends with the attempt.
    """
    import socket

    for fd, target in _sockets().items():
        if before.get(fd) == target:
            continue
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                if not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected: nothing to shut down
        finally:
            s.close()


def _abort_torch() -> None:
    """Abort every process group (gloo and NCCL: torch's own abort path), so a collective
    blocked on a peer that will never answer returns with an error."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    abort = getattr(c10d, "_abort_process_group", None)
    if abort is None:
        return
    try:
        if c10d.is_initialized():  # type: ignore[union-attr]
            abort()
    except Exception:
        pass
