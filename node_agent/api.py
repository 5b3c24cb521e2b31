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
ranks of the attempt that succeeded (``None`` for a script or command). A failed job raises
:class:`LaunchError`, whose message names the job's root cause: the rank, its exit code and its
error, as torch's ``ChildFailedError`` does.

Pickle is used only here, between this process and its own workers through a private temporary
directory, for the user's Python objects (as torch and multiprocessing do); the wire protocol
never pickles.

This module stays cheap to import: every worker of a callable imports it first.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, field
from types import MappingProxyType, ModuleType
from typing import TYPE_CHECKING, Any

from protocol.records import record

from .config import DEFAULT_SIGNALS, ConfigError

if TYPE_CHECKING:
    from protocol import Failure

    from .config import AgentConfig
    from .runner import AgentOutcome

__all__ = ["LaunchConfig", "LaunchError", "launch", "launch_async"]

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

    Differences from torch's ``LaunchConfig``, on purpose:

    * ``rdzv_backend`` defaults to ``"c10d"`` (node-agent's rendezvous server), and
      ``rdzv_endpoint=""`` means a standalone single-node run (a private rendezvous on a free
      port); a multi-node job needs the server's ``HOST:PORT``.
    * ``max_restarts`` defaults to 0, as for the ``node-agent`` and ``torchrun`` commands
      (torch's ``LaunchConfig`` says 3).
    * ``run_id`` is ignored by a standalone run, which takes a fresh id (as ``--standalone``).
    * ``nproc_per_node`` may also be ``"auto"``, ``"cpu"`` or ``"gpu"``, as on the command line.
    * Output goes where ``log_dir``, ``redirects`` and ``tee`` say, as for the command; torch's
      ``logs_specs`` and ``metrics_cfg`` are not supported.

    Values are checked when :func:`launch` builds the agent's configuration, with the messages
    of the command line (``ConfigError: --nproc-per-node='0': ...``).
    """

    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int | str = 1
    _: KW_ONLY
    run_id: str = ""
    role: str = "default"
    rdzv_endpoint: str = ""
    rdzv_backend: str = "c10d"
    rdzv_configs: Mapping[str, Any] = field(default_factory=dict)  # --rdzv-conf keys
    rdzv_timeout: float = -1  # torch's spelling of rdzv_configs["join_timeout"]; -1: not given
    max_restarts: int = 0
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
    # For a str entrypoint: run it as a module (python -m) or as a command (no python).
    module: bool = False
    no_python: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "rdzv_configs", MappingProxyType(dict(self.rdzv_configs)))
        if self.local_ranks_filter is not None:
            object.__setattr__(self, "local_ranks_filter", frozenset(self.local_ranks_filter))
        if not isinstance(self.signals_to_handle, str):
            object.__setattr__(self, "signals_to_handle", tuple(self.signals_to_handle))

    @property
    def standalone(self) -> bool:
        return not self.rdzv_endpoint.strip()


class LaunchError(Exception):
    """The job failed. ``str()`` names the root cause first, then torch's failure summary.

    ``root_cause`` is the job's first failure (which may be on another node), ``failures``
    this node's failed workers; both are ``protocol.Failure`` records. Without a worker
    failure (the rendezvous could not be reached, the agent was stopped) both are empty and
    ``reason`` says what happened.
    """

    def __init__(
        self,
        message: str,
        *,
        exit_code: int,
        reason: str,
        root_cause: Failure | None = None,
        failures: tuple[Failure, ...] = (),
    ) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.reason = reason
        self.root_cause = root_cause
        self.failures = failures

    @property
    def rank(self) -> int | None:
        """The global rank of the root cause, when a worker failed."""
        return None if self.root_cause is None else self.root_cause.rank


def launch(config: LaunchConfig, entrypoint: Entrypoint, *args: Any) -> dict[int, Any]:
    """Run ``entrypoint`` under a node agent on this node and wait for the whole job to end.

    Returns ``{global_rank: return value}`` for this node's workers (``None`` for a script or
    command). Raises :class:`LaunchError` when the job fails, and
    :class:`~node_agent.config.ConfigError` for a bad configuration, before anything starts.

    ``launch`` runs its own event loop, so it cannot be called from a running one: there, use
    ``await launch_async(...)``. It must be called from the main thread, since the agent
    handles signals (SIGTERM, SIGINT, ... are forwarded to the workers while the job runs);
    the signal handlers in place before the call are put back afterwards.
    """
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
    _require_main_thread("launch")
    from edge.loop import run_loop  # uvloop where installed, as the node-agent command

    saved = _signal_handlers(config)
    try:
        return run_loop(launch_async(config, entrypoint, *args))
    finally:
        for signum, handler in saved.items():
            with contextlib.suppress(OSError, ValueError, TypeError):
                signal.signal(signum, handler)


async def launch_async(config: LaunchConfig, entrypoint: Entrypoint, *args: Any) -> dict[int, Any]:
    """:func:`launch` for code that already runs an event loop (in the main thread).

    The agent adds its signal handlers to the running loop while the job runs and removes them
    afterwards; a handler the caller had added for the same signal with
    ``loop.add_signal_handler`` must be added again.
    """
    _require_main_thread("launch_async")
    from .runner import Agent

    with tempfile.TemporaryDirectory(prefix="node-agent-launch-") as tmp:
        results_dir = os.path.join(tmp, "results")
        os.mkdir(results_dir)
        name, entry_argv, is_callable = _entry(config, entrypoint, args, tmp, results_dir)
        agent_config = agent_config_for(config, entry_argv)
        outcome = await Agent(agent_config).run()
        if outcome.code != 0:
            raise _launch_error(name, outcome)
        ranks = sorted(outcome.ranks.values())
        if not is_callable:
            return dict.fromkeys(ranks)
        return {rank: _load_result(results_dir, rank) for rank in ranks}


# --- LaunchConfig -> node-agent's command line ----------------------------------------------


def agent_argv(config: LaunchConfig, entry_argv: Sequence[str]) -> list[str]:
    """The node-agent command line (without the program name) that ``config`` stands for.

    ``entry_argv`` is the entrypoint part: the script or module or command and its arguments,
    preceded by ``--module`` or ``--no-python`` when one applies.
    """
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
    return [*argv, *entry_argv]


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
    from .args import parse_config

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
    _write_payload(payload, entrypoint, args, name)
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


def _write_payload(path: str, fn: Callable[..., Any], args: tuple[Any, ...], name: str) -> None:
    try:
        body = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise TypeError(
            f"cannot send {name} and its arguments to the workers: {exc}. The callable must be "
            "importable (defined at the top level of a module, not a lambda or a nested function) "
            "and its arguments picklable"
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


def _launch_error(name: str, outcome: AgentOutcome) -> LaunchError:
    from protocol.failure_text import describe_failure

    from .agent_log import shown
    from .report import failure_summary

    code = outcome.code
    reason = outcome.reason or f"the agent exited with {code}"
    local = outcome.local_failures
    root = outcome.failure or (min(local, key=lambda f: f.timestamp) if local else None)
    if root is None:
        return LaunchError(f"{name} failed: {reason} (exit code {code})", exit_code=code, reason=reason)
    # Worded as everywhere else a failure is shown; its texts may come from another node.
    error = next((line for line in root.message.splitlines() if line.strip()), "no error message")
    headline = f"{name} failed: {shown(describe_failure(root))}: {shown(error)}"
    summary = failure_summary(name, root, local)
    return LaunchError(
        f"{headline}\n{summary}", exit_code=code, reason=reason, root_cause=root, failures=local
    )


def _require_main_thread(what: str) -> None:
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(f"node_agent.{what}() must run in the main thread: the agent handles signals")


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
    with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as f:
        json.dump(record, f)


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
    partial = f"{result}.partial"
    with open(partial, "wb") as f:
        f.write(data)
    os.replace(partial, result)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
