"""Launch a job from Python: node-agent's counterpart of torch's ``elastic_launch``.

    from node_agent import LaunchConfig, launch

    def train(lr: float) -> float:  # at the top level of an importable module
        ...
        return final_loss

    if __name__ == "__main__":
        losses = launch(LaunchConfig(nproc_per_node=4), train, 0.1)  # {0: ..., 1: ..., 2: ..., 3: ...}

How it works: :class:`LaunchConfig` is turned into the node-agent command line that means the
same thing and read by :func:`node_agent.args.parse_config`, so a launch from Python gets every
check, default and message the ``node-agent`` command gets. The agent then runs in this process
(:class:`node_agent.runner.Agent`), on this node only; on a multi-node job each node calls
``launch`` with the same config, as each would run ``node-agent``.

The entrypoint is a script path (run with this interpreter), an argv list (run as a command,
``--no-python``), or a callable. A callable runs in fresh interpreters, never forked from this
one: each worker runs ``python -m node_agent.api PAYLOAD RESULTS``, which restores this process's
``sys.path``, unpickles the callable and its arguments (so the callable must be importable at the
top level of a module, as for ``multiprocessing``'s spawn), calls it, and pickles its return
value into ``RESULTS/<RANK>.pkl``. ``launch`` returns ``{global_rank: value}`` for this node's
ranks of the attempt that succeeded (``None`` for a script or command). A failed job raises a
:class:`LaunchError` in the shape of what torch's ``elastic_launch`` raises for the same ending
(and, where torch is importable, of torch's class too): :class:`ChildFailedError` when a worker
failed, whose message names the job's root cause (the rank, its exit code and its error),
:class:`SignalException` when a signal stopped the launch, :class:`RendezvousError` when the
rendezvous could not be completed.

Pickle is used only here, between this process and its own workers through a private temporary
directory, for the user's Python objects (as torch and multiprocessing do); the wire protocol
never pickles.

This module stays cheap to import: every worker of a callable imports it first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import json
import os
import pickle
import pickletools
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import KW_ONLY, field
from types import MappingProxyType, ModuleType
from typing import TYPE_CHECKING, Any

from edge.atomic_write import replace_file
from protocol.records import record

from .config import DEFAULT_SIGNALS, ConfigError

if TYPE_CHECKING:
    from protocol import Failure

    from .config import AgentConfig
    from .runner import AgentOutcome

__all__ = [
    "ChildFailedError",
    "LaunchConfig",
    "LaunchError",
    "ProcessFailure",
    "RendezvousError",
    "RendezvousTimeoutError",
    "SignalException",
    "elastic_launch",
    "from_torch",
    "launch",
    "launch_async",
]

# The module every worker of a callable runs (``python -u -m node_agent.api PAYLOAD RESULTS``).
# A module name rather than a path, so the entrypoint every node reports to the rendezvous is
# the same on every node whatever its temporary directory or interpreter path.
WORKER_MODULE = "node_agent.api"
_MP_MAIN = "__mp_main__"  # what multiprocessing calls the parent's __main__ in a child

Entrypoint = str | os.PathLike[str] | Sequence[str] | Callable[..., Any]
StdSetting = int | str | Mapping[int, int]


@record(frozen=True)
class LaunchConfig:
    """What to launch, in torch's ``LaunchConfig`` terms; each field is a node-agent flag.

    Every field of torch's ``LaunchConfig`` is here, with torch's default where a worker can
    see it (``role="default_role"`` is the workers' ``ROLE_NAME``; ``max_restarts=3``), and a
    torch ``LaunchConfig`` object is accepted wherever this one is (converted field by field,
    :func:`from_torch`). Differences, on purpose:

    * ``rdzv_backend`` defaults to ``"c10d"`` (node-agent's rendezvous server; torch: etcd), and
      ``rdzv_endpoint=""`` means a standalone single-node run (a private rendezvous on a free
      port); a multi-node job needs the server's ``HOST:PORT``.
    * ``run_id`` is ignored by a standalone run, which takes a fresh id (as ``--standalone``).
    * ``nproc_per_node`` may also be ``"auto"``, ``"cpu"`` or ``"gpu"``, as on the command line.
    * Output goes where ``log_dir``, ``redirects``, ``tee`` and ``local_ranks_filter`` say (our
      own fields, torchrun's flags). ``logs_specs`` may be torch's ``DefaultLogsSpecs``, whose
      settings are used where those fields are not given; another ``LogsSpecs`` class (a plugin
      that decides file paths inside torch's agent) is refused.
    * ``metrics_cfg`` is accepted and unused: open-source torch's ``initialize_metrics`` does
      nothing with it either; node-agent's metrics are the rendezvous server's ``/metrics``.
    * ``start_method`` is accepted; workers are always fresh interpreters, so a callable
      entrypoint must be importable even with ``"fork"`` (a closure is refused with a message).
    * ``agent_args`` (ours): further node-agent flags (``["--hang-timeout=off"]``), after the
      fields' own.

    Values are checked when :func:`launch` builds the agent's configuration, with the messages
    of the command line (``ConfigError: --nproc-per-node='0': ...``).
    """

    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int | str = 1
    _: KW_ONLY
    run_id: str = ""
    role: str = "default_role"
    rdzv_endpoint: str = ""
    rdzv_backend: str = "c10d"
    rdzv_configs: Mapping[str, Any] = field(default_factory=dict)  # --rdzv-conf keys
    rdzv_timeout: float = -1  # torch's spelling of rdzv_configs["join_timeout"]; -1: not given
    max_restarts: int = 3
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_dir: str | os.PathLike[str] | None = None
    redirects: StdSetting = 0  # 0..3 for every local rank, or {local_rank: 0..3}
    tee: StdSetting = 0
    local_ranks_filter: Iterable[int] | None = None  # None: every rank on the console
    local_addr: str | None = None
    event_log_handler: str = "null"
    signals_to_handle: str | Sequence[str] = DEFAULT_SIGNALS
    shutdown_timeout: float | None = None  # None: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 s
    log_line_prefix_template: str | None = None
    # --numa-binding: a mode ("node", "socket", "exclusive", "core-complex"), torch's
    # AffinityMode, or torch's NumaOptions (its should_fall_back_if_binding_fails is not
    # honoured: a binding that cannot be made is an error, as by default in torch).
    numa_options: Any = None
    logs_specs: Any = None  # None, or torch's DefaultLogsSpecs
    metrics_cfg: Mapping[str, str] = field(default_factory=dict)  # accepted, unused (as torch's)
    duplicate_stdout_filters: Sequence[str] | None = None
    duplicate_stderr_filters: Sequence[str] | None = None
    virtual_local_rank: bool = False
    # For a str entrypoint: run it as a module (python -m) or as a command (no python).
    module: bool = False
    no_python: bool = False
    agent_args: Sequence[str] = ()  # more node-agent flags, after those of the fields

    def __post_init__(self) -> None:
        object.__setattr__(self, "rdzv_configs", MappingProxyType(dict(self.rdzv_configs)))
        if self.local_ranks_filter is not None:
            object.__setattr__(self, "local_ranks_filter", frozenset(self.local_ranks_filter))
        if not isinstance(self.signals_to_handle, str):
            object.__setattr__(self, "signals_to_handle", tuple(self.signals_to_handle))
        object.__setattr__(self, "metrics_cfg", MappingProxyType(dict(self.metrics_cfg or {})))
        for name in ("duplicate_stdout_filters", "duplicate_stderr_filters"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise ConfigError(f"{name}={value!r}: give a list of strings, e.g. [{value!r}]")
            if value is not None:
                object.__setattr__(self, name, tuple(value))
        if isinstance(self.agent_args, str):
            raise ConfigError(f"agent_args={self.agent_args!r}: give a list of flags")
        object.__setattr__(self, "agent_args", tuple(self.agent_args))

    @property
    def standalone(self) -> bool:
        return not self.rdzv_endpoint.strip()


_NOT_AVAILABLE = "<N/A>"  # torch's spelling of "no error file" / "no signal"


def _signal_name(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return _NOT_AVAILABLE
    return _NOT_AVAILABLE


@record(frozen=True)
class ProcessFailure:
    """One failed worker, in the shape of torch's ``ProcessFailure`` (``LaunchError.failures``).

    ``message`` is the error file's ``message`` entry (a dict with the traceback, or a str) as
    torch reads it, else node-agent's description of the failure (the last lines of stderr),
    else torch's own text (``To enable traceback see: ...``, or ``Signal N (SIGX) received by
    PID P``); ``error_file`` is ``"<N/A>"`` when the worker wrote none, as in torch.
    """

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    message: Any
    timestamp: int
    error_file_data: Mapping[str, Any]
    rank: int = -1
    node_id: str = ""

    def signal_name(self) -> str:
        return _signal_name(self.exitcode)

    def timestamp_isoformat(self) -> str:
        from datetime import datetime

        return datetime.fromtimestamp(self.timestamp).isoformat(sep="_")

    @classmethod
    def from_failure(cls, failure: Failure) -> ProcessFailure:
        data: Mapping[str, Any] = {}
        message: Any = failure.message
        error_file = failure.error_file or _NOT_AVAILABLE
        timestamp = int(failure.timestamp)
        if failure.error_file:  # read when the worker failed; not read again while unchanged
            from .error_file import worker_record

            loaded = worker_record(failure.error_file)
            if loaded is not None and "message" in loaded:
                message = loaded["message"]
                data = loaded
        if not message:  # torch's ProcessFailure makes one up, as here
            if failure.exitcode < 0:
                name = failure.signal or _signal_name(failure.exitcode)
                message = f"Signal {-failure.exitcode} ({name}) received by PID {failure.pid}"
            else:
                from .error_file import TRACEBACK_HINT

                message = TRACEBACK_HINT
        return cls(
            local_rank=failure.local_rank,
            pid=failure.pid,
            exitcode=failure.exitcode,
            error_file=error_file,
            message=message,
            timestamp=timestamp,
            error_file_data=data,
            rank=failure.rank,
            node_id=failure.node_id,
        )


class LaunchError(Exception):
    """The launch failed. ``str()`` names the root cause first, then torch's failure summary.

    The base of every error a failed launch raises; what is raised is one of its subclasses,
    in the shape of what torch's ``elastic_launch`` raises for the same ending:

    * :class:`ChildFailedError`: a worker failed (here or, as the job's root cause, on another
      node): ``name`` (the entrypoint), ``failures`` (``{global rank: ProcessFailure}`` of this
      node's failed workers, or of the root cause when it failed elsewhere; never empty) and
      ``get_first_failure()``;
    * :class:`SignalException`: the launcher got one of ``signals_to_handle`` (a scheduler's
      SIGTERM, Ctrl-C) and stopped the workers; ``sigval`` is the signal;
    * :class:`RendezvousError` (:class:`RendezvousTimeoutError` for a join timeout): no worker
      failed and the rendezvous could not be completed, reached or kept;
    * :class:`LaunchError` itself: no worker failed for another reason of the agent's (a
      failed health check, a NUMA binding that cannot be made); ``reason`` says it.

    Where torch is importable each of these is also torch's class of the same name (a subclass
    made on first use: ``ChildFailedError``, ``SignalException``, ``RendezvousError``,
    ``RendezvousTimeoutError``), so ``except`` clauses written for torch catch them, and
    torch's ``@record`` handles them as its own (only a ``ChildFailedError`` has failures to
    copy, and only it is one).

    ``exit_code`` is the ``node-agent`` command's exit code for the same ending, ``reason`` the
    agent's last line, ``root_cause`` the job's first failure (a ``protocol.Failure``, maybe
    on another node; None when no worker failed) and ``local_failures`` this node's.
    """

    def __init__(
        self,
        message: str,
        *,
        exit_code: int,
        reason: str,
        root_cause: Failure | None = None,
        failures: Mapping[int, ProcessFailure] | None = None,
        name: str = "",
        local_failures: Sequence[Failure] = (),
    ) -> None:
        Exception.__init__(self, message)  # not super(): torch's class may follow in the MRO
        self.exit_code = exit_code
        self.reason = reason
        self.root_cause = root_cause
        self.failures: dict[int, ProcessFailure] = dict(failures or {})
        self.name = name
        self.local_failures: tuple[Failure, ...] = tuple(local_failures)

    @property
    def rank(self) -> int | None:
        """The global rank of the root cause, when a worker failed."""
        return None if self.root_cause is None else self.root_cause.rank

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        """(global rank, failure) of the earliest failure, as torch's ChildFailedError."""
        if self.root_cause is not None and self.root_cause.rank in self.failures:
            return self.root_cause.rank, self.failures[self.root_cause.rank]
        if not self.failures:
            raise ValueError(f"no worker failed: {self.reason}")
        rank = min(self.failures, key=lambda r: self.failures[r].timestamp)
        return rank, self.failures[rank]

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        return str(self)

    def __reduce__(self) -> Any:
        return (_rebuild_error, (_OURS[_ours_of(type(self))], str(self), dict(self.__dict__)))


class ChildFailedError(LaunchError):
    """A worker failed: torch's ``ChildFailedError`` (``failures``, ``get_first_failure()``)."""


class SignalException(LaunchError):
    """The launcher got a signal it handles and stopped the workers: torch's ``SignalException``
    (``sigval``, a ``signal.Signals``; torch's message, ``Process PID got signal: N``)."""

    sigval: signal.Signals


class RendezvousError(LaunchError):
    """No worker failed; the rendezvous could not be completed, reached or kept: torch's
    ``RendezvousError`` (``torch.distributed.elastic.rendezvous.api``)."""


class RendezvousTimeoutError(RendezvousError):
    """The rendezvous did not complete within its join timeout: torch's ``RendezvousTimeoutError``."""


# Our classes by name (for unpickling), and where torch's of the same name lives.
_OURS: dict[type[LaunchError], str] = {
    LaunchError: "LaunchError",
    ChildFailedError: "ChildFailedError",
    SignalException: "SignalException",
    RendezvousError: "RendezvousError",
    RendezvousTimeoutError: "RendezvousTimeoutError",
}
_TORCH_HOME = {
    "ChildFailedError": "torch.distributed.elastic.multiprocessing.errors",
    "SignalException": "torch.distributed.elastic.multiprocessing.api",
    "RendezvousError": "torch.distributed.elastic.rendezvous.api",
    "RendezvousTimeoutError": "torch.distributed.elastic.rendezvous.api",
}
_RAISED: dict[str, type[LaunchError]] = {}  # what is raised for each of ours, made on first use


def _ours_of(cls: type[LaunchError]) -> type[LaunchError]:
    """Our class that ``cls`` is (itself, or the torch flavour made of it)."""
    return next(c for c in cls.__mro__ if c in _OURS)


def _rebuild_error(kind: str, message: str, state: dict[str, Any]) -> LaunchError:
    cls = _raised_class(next(c for c, name in _OURS.items() if name == kind))
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


def _raised_class(ours: type[LaunchError]) -> type[LaunchError]:
    """``ours``, or where torch is importable a subclass of it and of torch's class of the same
    name. Made on first use, not at import: the agent and its workers never import torch."""
    name = _OURS[ours]
    if name not in _RAISED:
        cls = ours
        home = _TORCH_HOME.get(name)
        if home is not None:
            import importlib
            import importlib.util

            try:
                if importlib.util.find_spec("torch") is not None:
                    theirs = getattr(importlib.import_module(home), name)
                    cls = type(name, (ours, theirs), {"__module__": __name__, "__doc__": ours.__doc__})
            except Exception:  # a broken torch install: our own error still says it all
                cls = ours
        _RAISED[name] = cls
    return _RAISED[name]


def launch(config: LaunchConfig, entrypoint: Entrypoint, *args: Any) -> dict[int, Any]:
    """Run ``entrypoint`` under a node agent on this node and wait for the whole job to end.

    Returns ``{global_rank: return value}`` for this node's workers (``None`` for a script or
    command). Raises a :class:`LaunchError` when the job fails (:class:`ChildFailedError`,
    :class:`SignalException`, :class:`RendezvousError`: see there), and
    :class:`~node_agent.config.ConfigError` for a bad configuration, before anything starts.

    As torch's ``elastic_launch``, it neither sets ``OMP_NUM_THREADS`` for the workers nor
    prints torchrun's banner about it (the ``node-agent`` command and
    :func:`node_agent.run.run` do, as the ``torchrun`` command does): workers inherit this
    process's environment.

    ``launch`` runs its own event loop, so it cannot be called from a running one: there, use
    ``await launch_async(...)``. It runs in any thread. In the main thread the agent handles
    ``signals_to_handle`` (and SIGUSR1/SIGUSR2, passed on to the workers) while the job runs,
    and puts the handlers in place before the call back afterwards; one of those signals ends
    the launch with :class:`SignalException`, as torch's agent. In another thread, as torch's
    agent there, it handles no signal (a signal is the main thread's to handle, and Python
    delivers it there): it says so in a warning, and a launcher killed then leaves it to the
    orphan watchdog and the workers' PDEATHSIG (tied to the launching thread) to stop them.
    """
    return _launch(config, entrypoint, args, torchrun=False)


def _launch(config: Any, entrypoint: Entrypoint, args: tuple[Any, ...], *, torchrun: bool) -> dict[int, Any]:
    """:func:`launch`; ``torchrun``: as the torchrun command (OMP_NUM_THREADS and its banner)."""
    import asyncio  # here, not at the top: a callable's worker imports this module first

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError(
            "node_agent.launch() cannot be called from a running event loop (it runs its own); "
            "use `await node_agent.launch_async(...)` there"
        )
    config = from_torch(config)
    from edge.loop import run_loop  # uvloop where installed, as the node-agent command

    main = threading.current_thread() is threading.main_thread()
    saved = _signal_handlers(config) if main else {}
    try:
        return run_loop(_launch_async(config, entrypoint, args, torchrun=torchrun))
    finally:
        for signum, handler in saved.items():
            with contextlib.suppress(OSError, ValueError, TypeError):
                signal.signal(signum, handler)


async def launch_async(config: LaunchConfig, entrypoint: Entrypoint, *args: Any) -> dict[int, Any]:
    """:func:`launch` for code that already runs an event loop (in any thread, as :func:`launch`).

    In the main thread the agent adds its signal handlers to the running loop while the job
    runs and removes them afterwards; a handler the caller had added for the same signal with
    ``loop.add_signal_handler`` must be added again.
    """
    return await _launch_async(config, entrypoint, args, torchrun=False)


async def _launch_async(
    config: Any, entrypoint: Entrypoint, args: tuple[Any, ...], *, torchrun: bool
) -> dict[int, Any]:
    import asyncio

    from .runner import Agent
    from .worker_env import SETS_OMP_THREADS

    config = from_torch(config)
    seen: list[int] = []  # the signals the agent got while it ran, in order
    with (
        tempfile.TemporaryDirectory(prefix="node-agent-launch-") as tmp,
        _signals_seen(asyncio.get_running_loop(), seen),
    ):
        results_dir = os.path.join(tmp, "results")
        os.mkdir(results_dir)
        name, entry_argv, is_callable = _entry(config, entrypoint, args, tmp, results_dir)
        agent_config = agent_config_for(config, entry_argv)
        omp = SETS_OMP_THREADS.set(torchrun)  # this task's and its children's, not another launch's
        try:
            outcome = await Agent(agent_config).run()
        finally:
            SETS_OMP_THREADS.reset(omp)
        if outcome.code != 0:
            handled = {int(signal.Signals[s]) for s in agent_config.signals_to_handle}
            signum = next((s for s in seen if s in handled), None)
            raise _launch_error(name, outcome, signum)
        ranks = sorted(outcome.ranks.values())
        if not is_callable:
            return dict.fromkeys(ranks)
        return {rank: _load_result(results_dir, rank) for rank in ranks}


@contextlib.contextmanager
def _signals_seen(loop: Any, seen: list[int]) -> Iterator[None]:
    """While the agent runs on ``loop``: each signal its handlers get is noted in ``seen``
    (what :class:`SignalException` says); off the main thread it adds none, as torch's agent
    (``loop.add_signal_handler`` works only in the main thread)."""
    main = threading.current_thread() is threading.main_thread()
    real_add, real_remove = loop.add_signal_handler, loop.remove_signal_handler
    names = ("add_signal_handler", "remove_signal_handler")
    own = {name: vars(loop)[name] for name in names if name in vars(loop)}  # the caller's own, if any
    warned: list[int] = []

    def add(sig: int, callback: Callable[..., Any], *args: Any) -> None:
        if not main:
            if not warned:
                warned.append(sig)
                import logging

                logging.getLogger(__name__).warning(
                    "node-agent runs in a thread other than the main one, where it handles no "
                    "signal (as torch's agent); should this process be killed, the workers are "
                    "stopped by its orphan watchdog"
                )
            return

        def noted(*given: Any) -> None:
            seen.append(int(sig))
            callback(*given)

        real_add(sig, noted, *args)

    def remove(sig: int) -> bool:
        return bool(real_remove(sig)) if main else False

    loop.add_signal_handler, loop.remove_signal_handler = add, remove
    try:
        yield
    finally:
        for name in names:
            if name in own:
                setattr(loop, name, own[name])
            else:
                delattr(loop, name)


class elastic_launch:  # torch's name (a class), so that a wrapper can switch by import
    """torch's ``elastic_launch(config, entrypoint)(*args)``: ``{global rank: return value}``.

    ``config`` is our :class:`LaunchConfig` or torch's. ``entrypoint`` is as torch's: a
    callable, or a command (a str) that ``args`` are given to; the python interpreter as the
    command (torchrun's ``sys.executable, "-u", [-m], script, ...``) runs the script or module
    as node-agent runs a Python script. Our argv lists and script paths work as for
    :func:`launch` (a str that is an existing ``.py`` file is a script, run with this Python).

    As torch's: ``OMP_NUM_THREADS`` and its banner are left to the command line (the workers
    inherit this process's environment); it runs in any thread (in one other than the main
    thread it handles no signal, as torch's); a failed launch raises torch's exception for
    that ending (:class:`LaunchError`'s subclasses: ``ChildFailedError`` with ``failures``,
    ``SignalException`` with ``sigval``, ``RendezvousError``).
    """

    def __init__(self, config: Any, entrypoint: Entrypoint | None, health_check_server: Any = None) -> None:
        if health_check_server is not None:
            raise ConfigError(
                "health_check_server: torch's health-check server object runs inside torch's agent; "
                "node-agent serves TORCHELASTIC_HEALTH_CHECK_PORT itself, so set that variable instead"
            )
        if entrypoint is None:
            raise ConfigError("elastic_launch: the entrypoint is None; give a callable or a command")
        self._config = from_torch(config)
        self._entrypoint = entrypoint

    def __call__(self, *args: Any) -> dict[int, Any]:
        config, entrypoint, rest = _torch_entry(self._config, self._entrypoint, args)
        return _launch(config, entrypoint, rest, torchrun=False)


def _is_python(command: str) -> bool:
    if command in (sys.executable, os.environ.get("PYTHON_EXEC")):
        return True
    base = os.path.basename(command)
    return base == "python" or (base.startswith("python") and base[6:].replace(".", "").isdigit())


def _torch_entry(
    config: LaunchConfig, entrypoint: Entrypoint, args: tuple[Any, ...]
) -> tuple[LaunchConfig, Entrypoint, tuple[Any, ...]]:
    """torch's (entrypoint, args) as :func:`launch` takes them."""
    if not isinstance(entrypoint, (str, os.PathLike)) or config.module or config.no_python:
        return config, entrypoint, args
    command = os.fspath(entrypoint)
    if command.endswith(".py") and os.path.isfile(command):
        return config, command, args  # a script path, as launch() takes it
    rest = [os.fspath(a) if isinstance(a, os.PathLike) else a for a in args]
    if _is_python(command) and rest and all(isinstance(a, str) for a in rest):
        i = 0
        while i < len(rest) and rest[i] == "-u":  # unbuffered: node-agent's workers always are
            i += 1
        if i < len(rest) - 1 and rest[i] == "-m":
            return dataclasses.replace(config, module=True), rest[i + 1], tuple(rest[i + 2 :])
        if i < len(rest) and not rest[i].startswith("-"):
            return config, rest[i], tuple(rest[i + 1 :])
    return config, [command, *_command_args(tuple(rest))], ()


def from_torch(config: Any) -> LaunchConfig:
    """Our LaunchConfig for torch's ``torch.distributed.launcher.api.LaunchConfig`` (field by
    field; duck-typed, so torch is never imported here); ours is returned as it is."""
    if isinstance(config, LaunchConfig):
        return config
    kind = type(config)
    if kind.__name__ != "LaunchConfig" or not hasattr(config, "rdzv_configs"):
        raise TypeError(
            f"config: expected node_agent.LaunchConfig or torch's LaunchConfig, not {kind.__name__}"
        )
    ours = {f for f in LaunchConfig.__dataclass_fields__ if not f.startswith("_")}
    theirs = {name: getattr(config, name) for name in ours if hasattr(config, name)}
    unknown = sorted(name for name in vars(config) if name not in ours and not name.startswith("_"))
    if unknown:
        raise ConfigError(
            f"torch's LaunchConfig field(s) {', '.join(unknown)} are new to node-agent, which "
            "cannot honour them; leave them at their defaults or use node_agent.LaunchConfig"
        )
    return LaunchConfig(**theirs)


def _logs_specs(config: LaunchConfig) -> dict[str, Any]:
    """log_dir, redirects, tee and local_ranks_filter from torch's DefaultLogsSpecs, where our
    own fields leave them unset."""
    specs = config.logs_specs
    if specs is None:
        return {}
    if type(specs).__name__ != "DefaultLogsSpecs":
        raise ConfigError(
            f"logs_specs={type(specs).__name__}: a LogsSpecs class decides log file paths inside "
            "torch's agent, which node-agent does not run; node-agent writes torchrun's default "
            "layout: give torch's DefaultLogsSpecs, or log_dir/redirects/tee/local_ranks_filter"
        )
    out: dict[str, Any] = {}
    root = getattr(specs, "_root_log_dir", None)
    if config.log_dir is None and root and root != os.devnull:
        out["log_dir"] = root
    if not _std_setting(config.redirects, "redirects").strip("0"):
        out["redirects"] = getattr(specs, "_redirects", 0)
    if not _std_setting(config.tee, "tee").strip("0"):
        out["tee"] = getattr(specs, "_tee", 0)
    if config.local_ranks_filter is None and getattr(specs, "_local_ranks_filter", None):
        out["local_ranks_filter"] = specs._local_ranks_filter
    return out


# --- LaunchConfig -> node-agent's command line ----------------------------------------------


def agent_argv(config: LaunchConfig, entry_argv: Sequence[str]) -> list[str]:
    """The node-agent command line (without the program name) that ``config`` stands for.

    ``entry_argv`` is the entrypoint part: the script or module or command and its arguments,
    preceded by ``--module`` or ``--no-python`` when one applies.
    """
    from_specs = _logs_specs(config)
    if from_specs:
        config = dataclasses.replace(config, **from_specs)
    nodes = f"{config.min_nodes}:{config.max_nodes}"
    argv = [
        f"--nnodes={nodes}",
        f"--nproc-per-node={config.nproc_per_node}",
        f"--max-restarts={config.max_restarts}",
        f"--monitor-interval={config.monitor_interval}",
        f"--start-method={config.start_method}",
        f"--role={config.role}",
        f"--event-log-handler={config.event_log_handler}",
        f"--redirects={_std_setting(config.redirects, 'redirects')}",
        f"--tee={_std_setting(config.tee, 'tee')}",
    ]
    if config.standalone:
        argv.append("--standalone")
    else:
        argv += [
            f"--rdzv-backend={config.rdzv_backend}",
            f"--rdzv-endpoint={config.rdzv_endpoint}",
            f"--rdzv-id={config.run_id}",
        ]
    conf = _rdzv_conf(config)
    if conf:
        argv.append(f"--rdzv-conf={conf}")
    if config.log_dir is not None:
        argv.append(f"--log-dir={os.fspath(config.log_dir)}")
    if config.local_ranks_filter is not None:
        argv.append(f"--local-ranks-filter={','.join(str(r) for r in sorted(config.local_ranks_filter))}")
    if config.local_addr:
        argv.append(f"--local-addr={config.local_addr}")
    signals = config.signals_to_handle
    argv.append(f"--signals-to-handle={signals if isinstance(signals, str) else ','.join(signals)}")
    if config.shutdown_timeout is not None:
        argv.append(f"--shutdown-timeout={config.shutdown_timeout}")
    mode = _numa_mode(config.numa_options)
    if mode is not None:
        argv.append(f"--numa-binding={mode}")
    for name in ("duplicate_stdout_filters", "duplicate_stderr_filters"):
        filters = getattr(config, name)
        if filters:
            escaped = ",".join(str(item).replace(",", ",,") for item in filters)
            argv.append(f"--{name.replace('_', '-')}={escaped}")
    if config.virtual_local_rank:
        argv.append("--virtual-local-rank")
    return [*argv, *config.agent_args, *entry_argv]


def _numa_mode(options: Any) -> str | None:
    """The --numa-binding mode a LaunchConfig's ``numa_options`` names (torch's NumaOptions
    or AffinityMode, duck-typed: importing torch here would cost the launch seconds)."""
    if options is None:
        return None
    mode = getattr(options, "affinity_mode", options)
    return str(getattr(mode, "value", mode))


def agent_config_for(config: LaunchConfig, entry_argv: Sequence[str]) -> AgentConfig:
    """The validated AgentConfig: ``parse_config`` of :func:`agent_argv`.

    The environment is this process's without ``PET_*``: here the LaunchConfig, not a stray
    variable, decides every flag.
    """
    from .cli.parse import parse_config

    environ = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    if config.log_line_prefix_template is not None:
        environ["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = config.log_line_prefix_template
    argv = agent_argv(config, entry_argv)
    try:
        return parse_config(argv, environ)
    except SystemExit as exc:  # argparse refused the command line (and printed its usage)
        raise ConfigError(f"node-agent's command line {argv!r} was refused (exit {exc.code})") from None


def _std_setting(value: StdSetting, what: str) -> str:
    if isinstance(value, Mapping):
        return ",".join(f"{int(rank)}:{int(std)}" for rank, std in sorted(value.items()))
    if isinstance(value, str):
        return value
    if isinstance(value, int):  # int, or torch's / our Std flags
        return str(int(value))
    raise ConfigError(f"{what}={value!r}: use 0..3, a str such as '0:1,1:2', or {{local_rank: 0..3}}")


def _rdzv_conf(config: LaunchConfig) -> str:
    pairs = dict(config.rdzv_configs)
    if config.rdzv_timeout is not None and config.rdzv_timeout >= 0:
        pairs.setdefault("join_timeout", config.rdzv_timeout)
    items = []
    for key, value in pairs.items():
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        if "," in text or "," in str(key):
            raise ConfigError(f"rdzv_configs[{key!r}]={value!r}: --rdzv-conf cannot carry a ','")
        items.append(f"{key}={text}")
    return ",".join(items)


# --- the entrypoint -------------------------------------------------------------------------


def _entry(
    config: LaunchConfig, entrypoint: Entrypoint, args: tuple[Any, ...], tmp: str, results_dir: str
) -> tuple[str, list[str], bool]:
    """(name for messages, the entrypoint part of the agent's argv, whether it is a callable)."""
    if isinstance(entrypoint, (str, os.PathLike)):
        script = os.fspath(entrypoint)
        flags = ["--module"] if config.module else ["--no-python"] if config.no_python else []
        return script, [*flags, script, *_command_args(args)], False
    if isinstance(entrypoint, Sequence):
        argv = [os.fspath(a) for a in entrypoint]
        if not argv:
            raise ConfigError("the entrypoint command is an empty list")
        if config.module:
            raise ConfigError("module=True needs a module name as entrypoint, not an argv list")
        return argv[0], ["--no-python", *argv, *_command_args(args)], False
    if not callable(entrypoint):
        raise TypeError(f"entrypoint {entrypoint!r}: expected a script path, an argv list or a callable")
    if config.module or config.no_python:
        raise ConfigError("module/no_python apply to a script or command entrypoint, not to a callable")
    name = f"{getattr(entrypoint, '__module__', '?')}.{getattr(entrypoint, '__qualname__', entrypoint)}"
    payload = os.path.join(tmp, "payload.pkl")
    _write_payload(payload, entrypoint, args, name, config.start_method)
    return name, ["--module", WORKER_MODULE, payload, results_dir], True


def _command_args(args: tuple[Any, ...]) -> list[str]:
    out = []
    for arg in args:
        if isinstance(arg, bool) or not isinstance(arg, (str, os.PathLike, int, float)):
            raise TypeError(
                f"argument {arg!r}: a script or command takes str (or path, int, float) arguments"
            )
        out.append(os.fspath(arg) if isinstance(arg, os.PathLike) else str(arg))
    return out


def _write_payload(
    path: str, fn: Callable[..., Any], args: tuple[Any, ...], name: str, start_method: str = "spawn"
) -> None:
    try:
        body = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        fork = (
            f" start_method={start_method!r} does not change this: node-agent never forks the "
            "launching process (torch does, which lets a closure run there); every worker is a "
            "fresh interpreter."
            if start_method != "spawn"
            else ""
        )
        raise TypeError(
            f"cannot send {name} and its arguments to the workers: {exc}. The callable must be "
            "importable (defined at the top level of a module, not a lambda or a nested function) "
            f"and its arguments picklable.{fork}"
        ) from exc
    header = {"sys_path": list(sys.path), "main": _main_reference() if _mentions_main(body) else None}
    with open(path, "wb") as f:
        pickle.dump(header, f, protocol=pickle.HIGHEST_PROTOCOL)
        f.write(body)


def _mentions_main(body: bytes) -> bool:
    """Whether the pickle refers to something in ``__main__`` (its module name appears)."""
    return any(arg == "__main__" for _, arg, _ in pickletools.genops(body))


def _main_reference() -> dict[str, str]:
    """How a worker can load this process's ``__main__``: by module name (python -m) or path."""
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name not in ("__main__", None):
        return {"module": spec.name}
    path = getattr(main, "__file__", None)
    if path is None:
        raise TypeError(
            "the entrypoint or its arguments are defined in an interactive __main__, which the "
            "workers cannot import; move them to a module"
        )
    return {"path": os.path.abspath(path)}


# --- after the run --------------------------------------------------------------------------


class _MainAlias(pickle.Unpickler):
    """Unpickle a worker's ``__mp_main__`` objects as this process's ``__main__`` ones."""

    def find_class(self, module: str, name: str) -> Any:
        return super().find_class("__main__" if module == _MP_MAIN else module, name)


def _load_result(results_dir: str, rank: int) -> Any:
    path = os.path.join(results_dir, f"{rank}.pkl")
    try:
        with open(path, "rb") as f:
            return _MainAlias(f).load()
    except FileNotFoundError:
        return None  # the worker ended with sys.exit(0) before returning


def _launch_error(name: str, outcome: AgentOutcome, signum: int | None = None) -> LaunchError:
    """The error for a launch that ended with ``outcome``; ``signum``: a handled signal the
    agent got (the launch ended because of it, as torch's agent ends on one)."""
    from protocol.failure_text import describe_failure

    from .agent_log import shown
    from .report import failure_summary

    code = outcome.code
    reason = outcome.reason or f"the agent exited with {code}"
    local = outcome.local_failures
    root = outcome.failure or (min(local, key=lambda f: f.timestamp) if local else None)
    failures = {} if root is None else {f.rank: ProcessFailure.from_failure(f) for f in (local or (root,))}
    common: dict[str, Any] = {
        "exit_code": code,
        "reason": reason,
        "root_cause": root,
        "failures": failures,
        "name": name,
        "local_failures": local,
    }
    if signum is not None:
        sigval = signal.Signals(signum)
        error = _raised_class(SignalException)(f"Process {os.getpid()} got signal: {sigval}", **common)
        error.sigval = sigval  # type: ignore[attr-defined]
        return error
    if root is None:
        kind: type[LaunchError] = LaunchError
        if "(join_timeout)" in reason:
            kind = RendezvousTimeoutError
        elif "rendezvous" in reason.lower():
            kind = RendezvousError
        return _raised_class(kind)(f"{name} failed: {reason} (exit code {code})", **common)
    # Worded as everywhere else a failure is shown; its texts may come from another node.
    first = next((line for line in root.message.splitlines() if line.strip()), "no error message")
    headline = f"{name} failed: {shown(describe_failure(root))}: {shown(first)}"
    summary = failure_summary(name, root, local)
    return _raised_class(ChildFailedError)(f"{headline}\n{summary}", **common)


def _signal_handlers(config: LaunchConfig) -> dict[int, Any]:
    names = config.signals_to_handle
    names = names.split(",") if isinstance(names, str) else list(names)
    wanted = {signal.SIGUSR1, signal.SIGUSR2}
    for name in names:
        with contextlib.suppress(KeyError):
            wanted.add(signal.Signals[name.strip()])
    return {int(s): signal.getsignal(s) for s in wanted}


# --- the worker side: python -m node_agent.api PAYLOAD RESULTS -------------------------------


def _load_main(reference: Mapping[str, str] | None) -> None:
    """Load the parent's ``__main__`` as ``__mp_main__`` (multiprocessing's spawn does the same)."""
    if reference is None:
        return
    import runpy

    if "module" in reference:
        namespace = runpy.run_module(reference["module"], run_name=_MP_MAIN, alter_sys=True)
    else:
        namespace = runpy.run_path(reference["path"], run_name=_MP_MAIN)
    main = ModuleType(_MP_MAIN)
    main.__dict__.update(namespace)
    sys.modules["__main__"] = sys.modules[_MP_MAIN] = main


def _write_error_file(exc: BaseException) -> None:
    """torch's @record format, which the agent reads into the failure it reports."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))},
        }
    }
    body = json.dumps(record)
    try:  # whole or not at all: the agent never reads half of it
        replace_file(path, body, mode=0o644)
    except OSError:  # a folder we may not create files in, but the file itself is writable
        with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as f:
            f.write(body)


def worker_main(argv: Sequence[str]) -> int:
    """Run the pickled callable once, as this worker's RANK, and store its return value."""
    faulthandler.enable(all_threads=True)
    payload, results_dir = argv
    result = os.path.join(results_dir, f"{os.environ['RANK']}.pkl")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(result)  # left by an earlier attempt of this node with the same rank
    try:
        with open(payload, "rb") as f:
            header = pickle.load(f)
            sys.path[:] = header["sys_path"]
            _load_main(header["main"])
            fn, args = pickle.load(f)
        data = pickle.dumps(fn(*args), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # on purpose: whatever the user's function raised, as torchrun's @record
        _write_error_file(exc)
        raise
    replace_file(result, data)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
