"""torch.distributed.run's Python surface, on node-agent: for wrappers that launch in-process.

``accelerate launch`` and torchtune's ``tune run`` do not start ``torchrun``: they call
``torch.distributed.run.get_args_parser()`` and ``run(args)`` inside their own process. This
module offers the same functions, with torch's names, flags, defaults and return values:

* :func:`get_args_parser` - torch's parser (every flag in each of torch's spellings, torch's
  defaults and types, ``PET_*`` read as torch does), plus node-agent's own flags;
* :func:`parse_args`, :func:`config_from_args` (``(LaunchConfig, cmd, cmd_args)``, our
  :class:`~node_agent.api.LaunchConfig`), :func:`run` (launches; raises what torch's raises
  for the same ending, in torch's classes where torch is importable: ``ChildFailedError``
  with its failures, ``SignalException`` with ``sigval``, ``RendezvousError``);
* :func:`main`, which raises on failure as torch's does and, as torch's ``@record``-wrapped
  one, writes the launcher's ``TORCHELASTIC_ERROR_FILE`` (``node_agent.cli.main`` returns the
  exit code instead);
* :func:`install`: replaces ``torch.distributed.run.run`` and ``main`` in this process with
  ours, so a wrapper that calls them launches with node-agent. ``python -m node_agent.inprocess
  accelerate launch ...`` installs and then runs the wrapper's command in the same process.

A namespace made by torch's own parser works as well as one of ours: :func:`run` reads only the
attributes torch's parser defines (and ours where present). The rendezvous follows torch's
``run()``: ``--standalone``, or a single node with torch's default ``static`` backend and no
endpoint or master port, is a standalone run; otherwise the backend is the one in the namespace,
so a multi-node job on our server names ``--rdzv-backend c10d`` (torch's parser cannot tell a
default from a typed ``static``).

Importing this module does not import torch; :func:`install` does (the wrapper imports it anyway).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .api import ChildFailedError, LaunchConfig, _launch, _torch_entry
from .config import ConfigError

DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torch's

__all__ = [
    "config_from_args",
    "get_args_parser",
    "install",
    "main",
    "parse_args",
    "run",
    "run_script_path",
    "uninstall",
]

_STANDALONE_PORT_DEFAULT = 29500  # torch's run(): master_port None -> 29500 (static only)

# torch 2.13's flags: (dest, option strings, default, type); None type: a switch.
_TORCH_FLAGS: tuple[tuple[str, tuple[str, ...], Any, Callable[[str], Any] | None], ...] = (
    ("nnodes", ("--nnodes",), "1:1", str),
    ("nproc_per_node", ("--nproc-per-node", "--nproc_per_node"), "1", str),
    ("rdzv_backend", ("--rdzv-backend", "--rdzv_backend"), "static", str),
    ("rdzv_endpoint", ("--rdzv-endpoint", "--rdzv_endpoint"), "", str),
    ("rdzv_id", ("--rdzv-id", "--rdzv_id"), "none", str),
    ("rdzv_conf", ("--rdzv-conf", "--rdzv_conf"), "", str),
    ("standalone", ("--standalone",), False, None),
    ("max_restarts", ("--max-restarts", "--max_restarts"), 0, int),
    ("monitor_interval", ("--monitor-interval", "--monitor_interval"), 0.1, float),
    ("start_method", ("--start-method", "--start_method"), "spawn", str),
    ("event_log_handler", ("--event-log-handler", "--event_log_handler"), "null", str),
    ("role", ("--role",), "default", str),
    ("module", ("-m", "--module"), False, None),
    ("no_python", ("--no-python", "--no_python"), False, None),
    ("run_path", ("--run-path", "--run_path"), False, None),
    ("log_dir", ("--log-dir", "--log_dir"), None, str),
    ("redirects", ("-r", "--redirects"), "0", str),
    ("tee", ("-t", "--tee"), "0", str),
    ("local_ranks_filter", ("--local-ranks-filter", "--local_ranks_filter"), "", str),
    ("duplicate_stdout_filters", ("--duplicate-stdout-filters", "--duplicate_stdout_filters"), [], None),
    ("duplicate_stderr_filters", ("--duplicate-stderr-filters", "--duplicate_stderr_filters"), [], None),
    ("node_rank", ("--node-rank", "--node_rank"), 0, int),
    ("master_addr", ("--master-addr", "--master_addr"), "127.0.0.1", str),
    ("master_port", ("--master-port", "--master_port"), None, int),
    ("local_addr", ("--local-addr", "--local_addr"), None, str),
    ("logs_specs", ("--logs-specs", "--logs_specs"), None, str),
    ("numa_binding", ("--numa-binding", "--numa_binding"), None, str),
    (
        "signals_to_handle",
        ("--signals-to-handle", "--signals_to_handle"),
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        str,
    ),
    ("shutdown_timeout", ("--shutdown-timeout", "--shutdown_timeout"), None, int),
    ("virtual_local_rank", ("--virtual-local-rank", "--virtual_local_rank"), False, None),
)
_TORCH_DESTS = frozenset(dest for dest, *_ in _TORCH_FLAGS)
_NO_ENV = frozenset({"logs_specs", "numa_binding"})  # torch reads no PET_* for these
_FILTERS = frozenset({"duplicate_stdout_filters", "duplicate_stderr_filters"})


def comma_separated_list(value: str) -> list[str]:
    """torch's ``--duplicate-*-filters`` type: a comma list, ``,,`` for a literal comma."""
    placeholder = "\0"
    return [item.replace(placeholder, ",") for item in value.replace(",,", placeholder).split(",")]


def _env_default(dest: str, default: Any, switch: bool) -> Any:
    name = f"PET_{dest.upper()}"
    if dest in _NO_ENV or name not in os.environ:
        return default
    value = os.environ[name]
    if switch:
        return bool(int(value))  # torch's check_env
    return value  # argparse applies the flag's type to a str default, as for torch's


def get_args_parser() -> argparse.ArgumentParser:
    """torch.distributed.run's parser: the same flags, spellings, defaults and types (``PET_*``
    as defaults, as torch's), then node-agent's own flags (absent from the namespace unless
    given)."""
    from .cli.flags import build_parser

    parser = argparse.ArgumentParser(description="node-agent: torch distributed elastic launcher")
    for dest, names, default, kind in _TORCH_FLAGS:
        switch = kind is None and dest not in _FILTERS
        value = _env_default(dest, default, switch)
        if switch:
            parser.add_argument(*names, dest=dest, action="store_true", default=value)
        elif dest in _FILTERS:
            parser.add_argument(*names, dest=dest, type=comma_separated_list, default=value)
        elif kind is not None:
            parser.add_argument(*names, dest=dest, type=kind, default=value)
    for action in build_parser()._actions:
        if action.dest in _TORCH_DESTS or not action.option_strings or action.dest in ("help", "version"):
            continue
        if action.nargs == 0:
            parser.add_argument(
                *action.option_strings, dest=action.dest, action="store_true", default=argparse.SUPPRESS
            )
        else:
            parser.add_argument(
                *action.option_strings,
                dest=action.dest,
                nargs=action.nargs,
                const=action.const,
                metavar=action.metavar,
                default=argparse.SUPPRESS,
                help=action.help,
            )
    parser.add_argument("training_script", type=str)
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser


def parse_args(args: Sequence[str] | None) -> argparse.Namespace:
    """torch's ``parse_args``: ``get_args_parser().parse_args(args)``."""
    return get_args_parser().parse_args(args)


def _nnodes(value: Any) -> tuple[int, int]:
    text = str(value).strip()
    low, _, high = text.partition(":")
    try:
        return int(low), int(high or low)
    except ValueError:
        raise ConfigError(f"--nnodes={value!r}: expected N or MIN:MAX, e.g. 2 or 1:4") from None


def _rdzv_configs(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in str(text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--rdzv-conf={text!r}: expected key=value pairs separated by commas")
        out[key.strip()] = value.strip()
    return out


def _filters(value: Any) -> tuple[str, ...] | None:
    if not value:
        return None
    items = comma_separated_list(value) if isinstance(value, str) else list(value)
    return tuple(str(item) for item in items)


def _own_flags(args: argparse.Namespace) -> list[str]:
    """node-agent's own flags present in the namespace, as command-line words."""
    from .cli.flags import build_parser

    out: list[str] = []
    for action in build_parser()._actions:
        if action.dest in _TORCH_DESTS or not action.option_strings or action.dest in ("help", "version"):
            continue
        if not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        flag = next(name for name in action.option_strings if name.startswith("--"))
        if action.nargs == 0:
            if value:
                out.append(flag)
        elif value is not None:
            out.append(f"{flag}={value}")
    return out


def config_from_args(args: argparse.Namespace) -> tuple[LaunchConfig, Callable[..., Any] | str, list[str]]:
    """torch's ``config_from_args``: (our LaunchConfig, the command or callable, its arguments).

    Unlike torch's, it neither sets ``OMP_NUM_THREADS`` in this process (the agent sets it in
    the workers' environment, as torchrun's) nor resolves ``auto``/``gpu`` counts (the agent
    does, without importing torch).
    """
    min_nodes, max_nodes = _nnodes(args.nnodes)
    agent_args: list[str] = []
    backend = str(args.rdzv_backend or "static")
    endpoint = str(args.rdzv_endpoint or "")
    master_port = getattr(args, "master_port", None)
    standalone = bool(args.standalone) or (
        backend == "static" and not endpoint and master_port is None and max_nodes == 1
    )
    if standalone:
        backend, endpoint = "c10d", ""
    elif backend == "static":
        if not endpoint:
            port = master_port if master_port is not None else _STANDALONE_PORT_DEFAULT
            endpoint = f"{getattr(args, 'master_addr', None) or '127.0.0.1'}:{port}"
        agent_args.append(f"--node-rank={int(getattr(args, 'node_rank', 0) or 0)}")
    nproc = str(args.nproc_per_node).strip()
    local_ranks = str(getattr(args, "local_ranks_filter", "") or "")
    try:
        ranks = {int(r) for r in local_ranks.split(",")} if local_ranks else None
    except ValueError:
        raise ConfigError(
            f"--local-ranks-filter={local_ranks!r}: expected a comma-separated list of integers, e.g. 0,1,2"
        ) from None
    logs_specs = getattr(args, "logs_specs", None)
    if logs_specs not in (None, "default"):
        agent_args.append(f"--logs-specs={logs_specs}")  # refused by the agent's own check, with why
    if getattr(args, "use_env", True) is False:  # torch.distributed.launch's namespace
        agent_args.append("--pass-local-rank")
    agent_args += _own_flags(args)
    config = LaunchConfig(
        min_nodes,
        max_nodes,
        int(nproc) if nproc.isdigit() else nproc,
        run_id=str(args.rdzv_id),
        role=str(args.role),
        rdzv_endpoint=endpoint,
        rdzv_backend=backend,
        rdzv_configs=_rdzv_configs(args.rdzv_conf),
        max_restarts=int(args.max_restarts),
        monitor_interval=float(args.monitor_interval),
        start_method=str(args.start_method),
        log_line_prefix_template=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        local_addr=getattr(args, "local_addr", None),
        log_dir=getattr(args, "log_dir", None),
        redirects=str(getattr(args, "redirects", "0")),
        tee=str(getattr(args, "tee", "0")),
        local_ranks_filter=ranks,
        event_log_handler=str(args.event_log_handler),
        numa_options=getattr(args, "numa_binding", None),
        signals_to_handle=str(getattr(args, "signals_to_handle", DEFAULT_SIGNALS)),
        duplicate_stdout_filters=_filters(getattr(args, "duplicate_stdout_filters", None)),
        duplicate_stderr_filters=_filters(getattr(args, "duplicate_stderr_filters", None)),
        virtual_local_rank=bool(getattr(args, "virtual_local_rank", False)),
        shutdown_timeout=getattr(args, "shutdown_timeout", None),
        agent_args=agent_args,
    )
    cmd: Callable[..., Any] | str
    cmd_args: list[str] = []
    if getattr(args, "run_path", False):
        cmd = run_script_path
        cmd_args.append(args.training_script)
    elif not args.no_python:
        cmd = os.getenv("PYTHON_EXEC", sys.executable)
        cmd_args.append("-u")
        if args.module:
            cmd_args.append("-m")
        cmd_args.append(args.training_script)
    else:
        if args.module:
            raise ConfigError("--no-python and --module cannot be used together")
        cmd = args.training_script
    cmd_args.extend(args.training_script_args or ())
    return config, cmd, cmd_args


def run_script_path(training_script: str, *training_script_args: str) -> None:
    """torch's ``--run-path`` entrypoint: run the script in the worker's interpreter (runpy)."""
    import runpy

    sys.argv = [training_script, *training_script_args]
    runpy.run_path(training_script, run_name="__main__")


def run(args: argparse.Namespace) -> None:
    """torch's ``run(args)``: launch this node's workers and wait for the job; raise on failure
    what torch's raises for that ending (:class:`~node_agent.api.LaunchError`'s subclasses,
    also torch's classes where torch is importable: ``ChildFailedError`` when a worker failed,
    ``SignalException`` when a signal stopped the launch, ``RendezvousError``), and
    :class:`~node_agent.config.ConfigError` for a bad command line.

    As torch's ``run`` (whose ``config_from_args`` does it), the workers get
    ``OMP_NUM_THREADS=1`` with torchrun's banner when the variable is unset and several run
    on the node; this process's own environment is left alone."""
    config, cmd, cmd_args = config_from_args(args)
    config, entrypoint, rest = _torch_entry(config, cmd, tuple(cmd_args))
    _launch(config, entrypoint, rest, torchrun=True)


def main(args: Sequence[str] | None = None) -> None:
    """torch's ``main``: parse ``args`` (default ``sys.argv[1:]``) and :func:`run`; raises on
    failure (torch's does too), never returns an exit code.

    As torch's, which is wrapped in ``@record``: when the launch fails, the launcher's
    ``TORCHELASTIC_ERROR_FILE`` (named in this process's environment at the call) receives
    what the ``node-agent`` command writes there for a worker failure (the root cause's own
    error file, copied with its ``errorCode``, else the failure as reported) and, for any
    other exception (a signal, the rendezvous, a bad command line), the exception as torch's
    ``@record`` writes it. A ``SystemExit(0)`` returns, as under ``@record``."""
    from . import error_file as ef

    path = ef.launcher_error_file(os.environ)
    try:
        run(parse_args(args))
    except SystemExit as exc:
        if exc.code == 0:
            return
        raise
    except ChildFailedError as exc:
        if path:
            record = ef.outcome_record(exc.exit_code or 1, exc.reason, exc.root_cause, exc.local_failures)
            if record is not None:
                ef.write(path, record, _warn)
        raise
    except Exception as exc:
        if path:
            ef.write(path, ef.exception_record(exc), _warn)
        raise


def _warn(text: str, level: str) -> None:
    if level != "debug":
        sys.stderr.write(f"[node-agent] {text}\n")  # one write: whole beside the workers' lines


# --- install(): torch.distributed.run's functions, replaced in this process ---------------------

_REPLACED = ("run", "main")
_ORIGINALS: dict[str, Any] = {}


def install() -> None:
    """Make ``torch.distributed.run.run`` and ``.main`` ours, in this process only.

    A wrapper that calls them (``accelerate launch``: ``distrib_run.run(args)``) then launches
    with node-agent; one that imports the names (torchtune: ``from torch.distributed.run import
    run``) must do so after this call, as ``python -m node_agent.inprocess`` arranges. Torch's
    parser and ``config_from_args`` stay torch's: our ``run`` reads torch's namespace. Calling it
    twice is harmless; :func:`uninstall` puts torch's back.
    """
    import torch.distributed.run as torch_run

    for name in _REPLACED:
        if name not in _ORIGINALS:
            _ORIGINALS[name] = getattr(torch_run, name)
    torch_run.run = run
    torch_run.main = main


def uninstall() -> None:
    """Put back the functions :func:`install` replaced."""
    if not _ORIGINALS:
        return
    import torch.distributed.run as torch_run

    for name, original in _ORIGINALS.items():
        setattr(torch_run, name, original)
    _ORIGINALS.clear()


def _cli() -> int:
    """``python -m node_agent.run ...``: torchrun's command line, exiting with the job's code."""
    from .api import LaunchError

    try:
        main()
    except ConfigError as exc:
        print(f"node-agent: error: {exc}", file=sys.stderr)
        return 2
    except LaunchError as exc:
        print(exc, file=sys.stderr)
        return exc.exit_code or 1
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
