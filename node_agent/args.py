"""torchrun's command line, read into an :class:`~node_agent.config.AgentConfig`.

Every torchrun 2.13 flag is accepted in each spelling torchrun accepts (``--nproc-per-node``
and ``--nproc_per_node``), and each can also come from ``PET_<DEST>``, as torchrun's
``argparse_util`` allows: ``PET_NPROC_PER_NODE=4``; a plain flag is on when ``PET_X`` is a
non-zero integer; a flag on the command line beats the variable. torchrun reads no variable for
``--logs-specs`` and ``--numa-binding``, so neither do we.

How it works: argparse only recognises the flags and keeps each value as the string the user
typed (every default is "not given"). ``parse_config`` then takes each value from the command
line, else ``PET_<DEST>``, else torchrun's default, converts and checks it, and remembers
where it came from, so an error names what the user actually wrote ("PET_NNODES='0'").

Where we differ from torchrun on purpose:

* ``--rdzv-backend`` defaults to ``c10d``, meaning our rendezvous server. torchrun's default,
  ``static``, has every node take ``--node-rank`` (default 0), so the common two-node command
  without ``--node-rank`` gives both nodes rank 0.
* A single-node run (``--nnodes`` 1 or 1:1) without ``--rdzv-endpoint`` and ``--rdzv-backend``
  acts as ``--standalone``. torchrun 2.13 does the same, but only while ``--master-port`` is
  unset; here ``--master-port`` never selects a backend (it only means something to ``static``).
* ``etcd`` and ``etcd-v2`` both speak etcd's v3 API (torch's speak v2, which etcd 3.4 turns
  off by default and later releases removed); see ``node_agent/rdzv/etcd.py``.
* torchrun flags we cannot honour (``--logs-specs`` other than ``default``: a torch plugin)
  are errors, not silently ignored.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Literal, overload

from edge.tls import CLIENT_ENV, TLSConfigError, client_context, client_files
from edge.tokens import TokenFileError, job_token
from edge.version import VersionAction
from protocol.records import record

from .config import (
    DEFAULT_RDZV_PORT,
    LOG_FORMATS,
    PASS_LOCAL_RANK_STYLES,
    START_METHODS,
    AgentConfig,
    ConfigError,
    RdzvConf,
    StdSpec,
    is_count,
    is_module_name,
    parse_float,
    parse_int,
)
from .executables import which
from .nproc import resolve_nproc

__all__ = ["build_parser", "parse_config"]

logger = logging.getLogger(__name__)

SUPPORTED_BACKENDS = ("c10d", "static", "etcd", "etcd-v2")  # both etcd names use etcd's v3 API
ETCD_BACKENDS = ("etcd", "etcd-v2")
DEFAULT_ETCD_PORT = 2379
# torch's registered event handlers: "null" and "dynamic_rendezvous" discard events, "console"
# prints them to stderr; any other name fails in torchrun at the first event.
EVENT_LOG_HANDLERS = ("null", "console", "dynamic_rendezvous")
LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET")
STANDALONE_ENDPOINT = "127.0.0.1:0"


def random_uuid4() -> str:
    """A random (version 4) UUID, as torchrun's standalone run id; without importing ``uuid``,
    which costs ~9 ms of start-up here (it imports ``platform``)."""
    b = bytearray(os.urandom(16))
    b[6] = (b[6] & 0x0F) | 0x40  # version 4
    b[8] = (b[8] & 0x3F) | 0x80  # RFC 4122 variant
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


DEFAULT_SHUTDOWN_TIMEOUT = 30.0

_SWITCH = "switch"  # store_true; PET_X=<int>, non-zero = on
_VALUE = "value"  # takes one value
_OPTIONAL = "optional"  # takes an optional value (--pass-local-rank [dash|underscore])


@record(frozen=True)
class _Flag:
    dest: str
    names: tuple[str, ...]
    kind: str
    default: str | None  # torchrun's default as text; None: not given
    help: str
    env: bool = True  # torchrun reads PET_<DEST> for this flag
    metavar: str | None = None

    @property
    def env_name(self) -> str:
        return f"PET_{self.dest.upper()}"

    @property
    def display(self) -> str:
        return next(name for name in self.names if name.startswith("--"))


def _f(
    dest: str,
    *names: str,
    kind: str = _VALUE,
    default: str | None = None,
    help: str,
    env: bool = True,
    metavar: str | None = None,
) -> _Flag:
    return _Flag(dest=dest, names=names, kind=kind, default=default, help=help, env=env, metavar=metavar)


def _both(flag: str) -> tuple[str, str]:
    return flag, flag.replace("-", "_").replace("__", "--", 1)


# The table every flag, its default and its environment variable come from. The order is
# torchrun's (run.py get_args_parser), then ours.
_FLAGS: tuple[_Flag, ...] = (
    _f("nnodes", "--nnodes", default="1:1", metavar="N|MIN:MAX", help="number of nodes, or a range MIN:MAX"),
    _f(
        "nproc_per_node",
        *_both("--nproc-per-node"),
        default="1",
        metavar="N|auto|cpu|gpu",
        help="workers per node: a number, 'cpu' (usable CPUs), 'gpu' (visible NVIDIA GPUs) "
        "or 'auto' (GPUs if any, else CPUs)",
    ),
    _f(
        "rdzv_backend",
        *_both("--rdzv-backend"),
        default=None,
        help="rendezvous backend (default c10d: node-agent's rendezvous server; torchrun: static)",
    ),
    _f(
        "rdzv_endpoint",
        *_both("--rdzv-endpoint"),
        default="",
        metavar="HOST[:PORT]",
        help=f"rendezvous server address; [v6addr]:PORT for IPv6 (default port {DEFAULT_RDZV_PORT})",
    ),
    _f("rdzv_id", *_both("--rdzv-id"), default="none", help="job id; nodes with the same id form one job"),
    _f(
        "rdzv_conf",
        *_both("--rdzv-conf"),
        default="",
        metavar="K=V,...",
        help="rendezvous settings: join_timeout, last_call_timeout, close_timeout, heartbeat_interval, "
        "heartbeat_timeout, keep_alive_interval, keep_alive_max_attempt, read_timeout, is_host, "
        "exit_barrier_timeout",
    ),
    _f(
        "standalone",
        "--standalone",
        kind=_SWITCH,
        help="run the rendezvous inside this agent on a free port (the default for a single node)",
    ),
    _f("max_restarts", *_both("--max-restarts"), default="0", help="worker group restarts before failing"),
    _f("monitor_interval", *_both("--monitor-interval"), default="0.1", help="seconds between worker checks"),
    _f(
        "start_method",
        *_both("--start-method"),
        default="spawn",
        metavar="{spawn,fork,forkserver}",
        help="accepted for compatibility; workers are always new processes",
    ),
    _f(
        "event_log_handler",
        *_both("--event-log-handler"),
        default="null",
        metavar="{null,console,dynamic_rendezvous}",
        help="where agent events go: null (nowhere) or console (stderr)",
    ),
    _f("role", "--role", default="default", help="worker role name (ROLE_NAME)"),
    _f("module", "-m", "--module", kind=_SWITCH, help="run the script as a module, like 'python -m'"),
    _f("no_python", *_both("--no-python"), kind=_SWITCH, help="run the script as a command, without python"),
    _f(
        "run_path",
        *_both("--run-path"),
        kind=_SWITCH,
        help="run the script file with runpy.run_path (takes precedence over --no-python)",
    ),
    _f(
        "log_dir",
        *_both("--log-dir"),
        default=None,
        help="base directory for log files (default: a temp dir)",
    ),
    _f(
        "redirects",
        "-r",
        "--redirects",
        default="0",
        metavar="STD|RANK:STD,...",
        help="send worker streams to files: 0 none, 1 stdout, 2 stderr, 3 both; or per rank, 0:1,1:2",
    ),
    _f(
        "tee",
        "-t",
        "--tee",
        default="0",
        metavar="STD|RANK:STD,...",
        help="like --redirects, and also console",
    ),
    _f(
        "local_ranks_filter",
        *_both("--local-ranks-filter"),
        default="",
        metavar="R,R,...",
        help="show only these local ranks on the console (files keep everything)",
    ),
    _f(
        "duplicate_stdout_filters",
        *_both("--duplicate-stdout-filters"),
        default="",
        metavar="S,S,...",
        help="copy stdout lines containing any of these strings to a file (',,' is a literal comma)",
    ),
    _f(
        "duplicate_stderr_filters",
        *_both("--duplicate-stderr-filters"),
        default="",
        metavar="S,S,...",
        help="copy stderr lines containing any of these strings to a file (',,' is a literal comma)",
    ),
    _f("node_rank", *_both("--node-rank"), default="0", help="node rank; static rendezvous only"),
    _f(
        "master_addr",
        *_both("--master-addr"),
        default=None,
        help="static rendezvous only (torchrun: 127.0.0.1)",
    ),
    _f("master_port", *_both("--master-port"), default=None, help="static rendezvous only (torchrun: 29500)"),
    _f(
        "local_addr",
        *_both("--local-addr"),
        default=None,
        help="the address other nodes reach this node at (default: the interface routing to the rendezvous)",
    ),
    _f(
        "logs_specs",
        *_both("--logs-specs"),
        default=None,
        env=False,
        help="only 'default' (torchrun's own log layout, which node-agent writes)",
    ),
    _f(
        "numa_binding",
        *_both("--numa-binding"),
        default=None,
        env=False,
        metavar="{node,socket,exclusive,core-complex}",
        help="bind each worker to the CPUs near its GPU (torch's modes; applied when every local rank "
        "has one visible GPU)",
    ),
    _f(
        "signals_to_handle",
        *_both("--signals-to-handle"),
        default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        metavar="SIG,SIG,...",
        help="signals the agent forwards to the workers before stopping",
    ),
    _f(
        "shutdown_timeout",
        *_both("--shutdown-timeout"),
        default=None,
        metavar="SECONDS",
        help="grace between SIGTERM and SIGKILL (default: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30)",
    ),
    _f(
        "virtual_local_rank",
        *_both("--virtual-local-rank"),
        kind=_SWITCH,
        help="LOCAL_RANK=0 in every worker, each seeing only its own GPU through CUDA_VISIBLE_DEVICES",
    ),
    # node-agent's own
    _f(
        "pass_local_rank",
        *_both("--pass-local-rank"),
        kind=_OPTIONAL,
        default=None,
        metavar="{dash,underscore}",
        help="append --local-rank=N (dash, the default) or --local_rank=N to the script's arguments, "
        "for torch.distributed.launch scripts; torchrun never does",
    ),
    _f("log_format", *_both("--log-format"), default="text", metavar="{text,json}", help="agent log format"),
    _f(
        "hang_timeout",
        *_both("--hang-timeout"),
        default="auto",
        metavar="auto|SECONDS|off",
        help="a rank that reports progress (node_agent.worker) and then makes none for this long is "
        "hung: its stacks and every rank's are collected, then the job restarts; auto (the default) "
        "calibrates the budget from the step times seen",
    ),
    _f(
        "hang_conf",
        *_both("--hang-conf"),
        default="",
        metavar="KEY=VALUE,...",
        help="the hang budgets: first_step, floor, factor, warmup, checkpoint (seconds, except factor "
        "and warmup) and phase.NAME=SECONDS for any phase",
    ),
    _f(
        "health_check",
        *_both("--health-check"),
        default=None,
        metavar="CMD",
        help="command that checks this node's health before each rendezvous, or 'gpu' for the built-in "
        "check of the visible NVIDIA GPUs",
    ),
    _f(
        "gpu_release_timeout",
        "--gpu-release-timeout",
        default="50",
        metavar="SECONDS",
        help="before a restart, wait up to this long for the previous workers' GPU memory to be "
        "released; 0: do not wait",
    ),
    _f(
        "gpu_release_mib",
        "--gpu-release-mib",
        default="512",
        metavar="MIB",
        help="GPU memory still in use (MiB per GPU) that counts as released",
    ),
    _f(
        "preload",
        "--preload",
        default="",
        metavar="MODULE,...",
        help="keep one Python per local rank that has imported these modules (e.g. torch) and "
        "becomes the next worker: restarts skip the imports; off when empty",
    ),
    _f(
        "token_file",
        *_both("--token-file"),
        default=None,
        env=False,
        metavar="PATH",
        help="file with the rendezvous token (TOKEN, or 'JOB_ID TOKEN' lines); also RDZV_TOKEN_FILE "
        "or RDZV_TOKEN",
    ),
    _f(
        "tls_ca",
        *_both("--tls-ca"),
        default=None,
        env=False,
        metavar="FILE",
        help="reach the rendezvous server over TLS, trusting this PEM CA; its certificate must name "
        "the --rdzv-endpoint host; also RDZV_TLS_CA",
    ),
    _f(
        "tls_cert",
        *_both("--tls-cert"),
        default=None,
        env=False,
        metavar="FILE",
        help="client certificate for a server with --tls-client-ca (needs --tls-key); also RDZV_TLS_CERT",
    ),
    _f(
        "tls_key",
        *_both("--tls-key"),
        default=None,
        env=False,
        metavar="FILE",
        help="the client certificate's unencrypted PEM key; also RDZV_TLS_KEY",
    ),
)
_BY_DEST = {flag.dest: flag for flag in _FLAGS}


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, sized without ``shutil``, which it would import (~10 ms, with zlib,
    bz2 and lzma) on every launch just to read the terminal's width."""

    def __init__(self, prog: str) -> None:
        try:
            width = int(os.environ["COLUMNS"])
        except (KeyError, ValueError):
            try:
                # sys.__stdout__ is None without a stdout: the AttributeError below.
                width = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
            except (AttributeError, ValueError, OSError):
                width = 80
        super().__init__(prog, width=max(width - 2, 20))


USAGE = """node-agent [OPTIONS] [--] TRAINING_SCRIPT [SCRIPT ARGS ...]
  one machine:    node-agent --standalone --nproc-per-node 4 train.py --epochs 3
  several nodes:  node-agent --nnodes 2:8 --nproc-per-node 8 --rdzv-endpoint head:29500 train.py"""


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser for torchrun's flags (plus ours); values are kept as strings.

    Defaults are not argparse's business here: an option absent from the command line is
    absent from the namespace, and ``parse_config`` fills it from ``PET_*`` or the default.
    """
    parser = argparse.ArgumentParser(
        prog="node-agent",
        usage=USAGE,
        description="A drop-in for torchrun: starts this node's workers and keeps them in a job. "
        "Everything after the training script is the script's own arguments, never read by "
        "node-agent; '--' before the script also ends node-agent's options "
        "(node-agent --nproc-per-node 2 -- train.py --nnodes 3).",
        epilog="Every option can also be set as PET_<NAME>, e.g. PET_NPROC_PER_NODE=4; "
        "a command-line flag wins.",
        formatter_class=_HelpFormatter,
    )
    for flag in _FLAGS:
        shown_default = "" if flag.default in (None, "") else f" (default: {flag.default})"
        common: dict[str, Any] = {
            "dest": flag.dest,
            "default": argparse.SUPPRESS,
            "help": flag.help + shown_default,
        }
        if flag.kind == _SWITCH:
            parser.add_argument(*flag.names, action="store_true", **common)
        elif flag.kind == _OPTIONAL:
            parser.add_argument(*flag.names, nargs="?", const="dash", metavar=flag.metavar, **common)
        else:
            parser.add_argument(*flag.names, metavar=flag.metavar, **common)
    parser.add_argument("--version", action=VersionAction)
    parser.add_argument("training_script", help="the training script (or module, or command) to run")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="the script's arguments")
    return parser


def _split_script(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split the command line into the launcher's part (up to and including the script) and
    the script's own arguments, which argparse never sees.

    argparse would otherwise match words after the script against our flags: ``train.py
    --token hf_x`` fails as an ambiguous prefix of ``--token-file``. We walk the launcher's part
    with the flag table (a flag that takes a value skips it; ``--`` ends the flags); the first
    word that is not a flag is the script. A bare ``--pass-local-rank`` becomes
    ``--pass-local-rank=dash``, since argparse would give that optional-value flag the next word
    whatever it is. An unknown flag stops the walk and argparse reports it.
    """
    out = list(argv)
    long_names = {name: flag for flag in _FLAGS for name in flag.names if name.startswith("--")}
    short_names = {name: flag for flag in _FLAGS for name in flag.names if not name.startswith("--")}
    i = 0
    while i < len(out):
        token = out[i]
        if token == "--":
            return out[: i + 2], out[i + 2 :]  # the script follows
        if token == "-" or not token.startswith("-"):
            return out[: i + 1], out[i + 1 :]
        if token.startswith("--"):
            name, has_value, _ = token.partition("=")
            flag = long_names.get(name)
            if flag is None:  # argparse also accepts unambiguous prefixes
                candidates = {f.dest: f for n, f in long_names.items() if n.startswith(name)}
                flag = next(iter(candidates.values())) if len(candidates) == 1 else None
        else:
            flag = short_names.get(token[:2])
            has_value = "=" if len(token) > 2 else ""  # "-r3"
            if flag is not None and flag.kind == _SWITCH and has_value:
                break  # a cluster such as "-mr3": leave it to argparse
        if flag is None:
            break  # unknown: argparse will report it
        if flag.kind == _VALUE and not has_value:
            i += 1  # skip its value
        elif flag.kind == _OPTIONAL and not has_value:
            following = out[i + 1] if i + 1 < len(out) else None
            if following in PASS_LOCAL_RANK_STYLES:
                i += 1
            else:
                out[i] = f"{flag.names[0]}=dash"
        i += 1
    return out, []


@record(frozen=True)
class _Given:
    value: str | None
    origin: str | None  # "--flag" or "PET_X"; None when the default applies

    def what(self, flag: _Flag) -> str:
        return self.origin or flag.display


class _Inputs:
    """The raw value of every flag and where it came from: command line, PET_*, or default."""

    def __init__(self, namespace: argparse.Namespace, environ: Mapping[str, str]) -> None:
        self._ns = vars(namespace)
        self._env = environ

    def get(self, dest: str) -> _Given:
        flag = _BY_DEST[dest]
        if dest in self._ns:
            value = self._ns[dest]
            return _Given("1" if flag.kind == _SWITCH else value, flag.display)
        if flag.env and flag.env_name in self._env:
            return _Given(self._env[flag.env_name], flag.env_name)
        return _Given(flag.default, None)

    def switch(self, dest: str) -> bool:
        given = self.get(dest)
        if given.origin is None:
            return False
        if given.origin.startswith("PET_"):
            # torchrun: bool(int(PET_X)); anything but an integer fails there too
            try:
                return int(given.value or "") != 0
            except ValueError:
                raise ConfigError(
                    f"{given.origin}={given.value!r}: expected an integer (0 = off, non-zero = on)"
                ) from None
        return True

    def text(self, dest: str) -> str:
        value = self.get(dest).value
        return "" if value is None else value

    def given(self, dest: str) -> bool:
        return self.get(dest).origin is not None


def parse_config(argv: Sequence[str], environ: Mapping[str, str]) -> AgentConfig:
    """Read a node-agent (torchrun) command line and environment into a validated AgentConfig.

    ``argv`` excludes the program name. Semantic errors raise ConfigError with a message for
    the user; malformed command lines (a missing script, an unknown flag) exit with status 2
    and argparse's usage message, as torchrun does. Warnings (flags that have no effect with
    the chosen backend, values --standalone overrides) go to this module's logger.
    """
    launcher_part, script_args = _split_script(argv)
    namespace = build_parser().parse_args(launcher_part)
    inputs = _Inputs(namespace, environ)

    min_nodes, max_nodes = _parse_nnodes(inputs.get("nnodes"))
    nproc = inputs.get("nproc_per_node")
    nproc_per_node = resolve_nproc(
        nproc.value or "", environ=environ, origin=nproc.what(_BY_DEST["nproc_per_node"])
    )

    standalone, backend, endpoint, rdzv_id = _resolve_rendezvous(inputs, max_nodes)
    rdzv_host, rdzv_port = _parse_endpoint(endpoint, inputs.get("rdzv_endpoint"), max_nodes)
    if backend in ETCD_BACKENDS and ":" not in endpoint.rsplit("]", 1)[-1]:
        rdzv_port = DEFAULT_ETCD_PORT  # etcd's client port, as torch's etcd backends default to
    conf = inputs.get("rdzv_conf")
    rdzv_conf = RdzvConf.parse(conf.value or "", origin=conf.what(_BY_DEST["rdzv_conf"]))

    module = inputs.switch("module")
    no_python = inputs.switch("no_python")
    run_path = inputs.switch("run_path")
    training_script: str = namespace.training_script
    python_exec = _python_exec(environ, needed=run_path or not no_python)
    _check_entrypoint(training_script, module=module, no_python=no_python, run_path=run_path, environ=environ)

    node_rank = _int(inputs, "node_rank", minimum=0)
    master_addr = inputs.get("master_addr").value
    master_port = _port(inputs, "master_port")
    if backend == "static":
        rdzv_host, rdzv_port = _static_master(
            inputs, endpoint, rdzv_host, rdzv_port, master_addr, master_port, min_nodes, max_nodes, node_rank
        )
    else:
        _warn_unused_static_flags(inputs, backend, standalone, node_rank)

    virtual_local_rank = inputs.switch("virtual_local_rank")
    if virtual_local_rank and "CUDA_VISIBLE_DEVICES" in environ:
        visible = environ["CUDA_VISIBLE_DEVICES"].split(",")
        if len(visible) < nproc_per_node:
            raise ConfigError(
                "--virtual-local-rank gives each worker one GPU from CUDA_VISIBLE_DEVICES="
                f"{environ['CUDA_VISIBLE_DEVICES']!r}, which lists {len(visible)} "
                f"for {nproc_per_node} workers"
            )

    _refuse_unsupported(inputs, "logs_specs")
    numa_binding = _numa_binding(inputs)

    hosts = standalone or rdzv_port == 0  # the agent's own rendezvous is plain TCP
    tls_ca, tls_cert, tls_key = _tls(inputs, environ, backend=backend, hosts=hosts, is_host=rdzv_conf.is_host)
    config = AgentConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc_per_node,
        standalone=standalone,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_host=rdzv_host,
        rdzv_port=rdzv_port,
        rdzv_id=rdzv_id,
        rdzv_conf=rdzv_conf,
        max_restarts=_int(inputs, "max_restarts", minimum=0),
        monitor_interval=_seconds(inputs, "monitor_interval", positive=True),
        start_method=_choice(inputs, "start_method", START_METHODS),
        event_log_handler=_choice(inputs, "event_log_handler", EVENT_LOG_HANDLERS),
        role=inputs.text("role"),
        module=module,
        no_python=no_python,
        run_path=run_path,
        python_exec=python_exec,
        log_dir=_log_dir(inputs),
        redirects=_std(inputs, "redirects"),
        tee=_std(inputs, "tee"),
        local_ranks_filter=_local_ranks_filter(inputs),
        duplicate_stdout_filters=_filters(inputs.text("duplicate_stdout_filters")),
        duplicate_stderr_filters=_filters(inputs.text("duplicate_stderr_filters")),
        log_line_prefix_template=environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") or None,
        logs_specs=inputs.get("logs_specs").value,
        log_level=_log_level(environ),
        log_format=_choice(inputs, "log_format", LOG_FORMATS),  # type: ignore[arg-type]
        node_rank=node_rank,
        node_rank_given=inputs.given("node_rank") and backend == "c10d" and not standalone,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=inputs.get("local_addr").value or None,
        numa_binding=numa_binding,
        signals_to_handle=_signals(inputs),
        shutdown_timeout=_shutdown_timeout(inputs, environ),
        virtual_local_rank=virtual_local_rank,
        pass_local_rank=_choice(inputs, "pass_local_rank", PASS_LOCAL_RANK_STYLES, optional=True),
        **_hang_flags(inputs),
        health_check=inputs.get("health_check").value or None,
        health_check_port=_health_check_port(environ),
        gpu_release_timeout=_seconds(inputs, "gpu_release_timeout", positive=False),
        gpu_release_mib=_int(inputs, "gpu_release_mib", minimum=0),
        token=_token(inputs.get("token_file").value, environ, rdzv_id),
        tls_ca=tls_ca,
        tls_cert=tls_cert,
        tls_key=tls_key,
        preload=_preload(inputs),
        training_script=training_script,
        training_script_args=(*namespace.training_script_args, *script_args),
    )
    _warn_about_environment(environ)
    return config


# --- the rendezvous -------------------------------------------------------------------------


def _parse_nnodes(given: _Given) -> tuple[int, int]:
    text = (given.value or "").strip()
    what = given.what(_BY_DEST["nnodes"])
    bad = ConfigError(f"{what}={given.value!r}: expected N or MIN:MAX with 0 < MIN <= MAX, e.g. 2 or 1:4")
    parts = text.split(":")
    if len(parts) not in (1, 2) or not all(is_count(p.strip().removeprefix("+")) for p in parts):
        raise bad
    low, high = int(parts[0]), int(parts[-1])
    if not 0 < low <= high:
        raise bad
    return low, high


def _implied_static(inputs: _Inputs, max_nodes: int) -> bool:
    """torchrun's own backend choice when the line names no backend and no endpoint.

    torchrun defaults to ``static``, and runs a standalone rendezvous instead only on one node
    without ``--master-port``. We keep that wherever the line gives torchrun's static flags
    (``--node-rank``, ``--master-addr``, ``--master-port``, as flags or ``PET_*``): the classic
    ``--nnodes 2 --node-rank R --master-addr A --master-port P`` line, Kubeflow's ``PET_*``.
    A multi-node line without any of them is refused instead (``_resolve_rendezvous``).
    """
    if inputs.given("master_port"):
        return True
    return max_nodes > 1 and (inputs.given("node_rank") or inputs.given("master_addr"))


def _resolve_rendezvous(inputs: _Inputs, max_nodes: int) -> tuple[bool, str, str, str]:
    """Decide standalone, backend, endpoint and id (torchrun's run() rules, adjusted)."""
    backend_given = inputs.get("rdzv_backend")
    endpoint_given = inputs.get("rdzv_endpoint")
    id_given = inputs.get("rdzv_id")
    standalone = inputs.switch("standalone")
    unnamed = backend_given.origin is None and not (endpoint_given.value or "").strip()

    if not standalone and unnamed and _implied_static(inputs, max_nodes):
        return False, "static", "", id_given.value or "none"
    implicit = not standalone and max_nodes == 1 and unnamed
    if standalone or implicit:
        # As torchrun's --standalone: a private rendezvous on a free local port, and a fresh id
        # so two single-node jobs on one machine never meet.
        if max_nodes > 1:
            # torchrun accepts this and then waits for nodes that can never find the free port.
            raise ConfigError(
                f"--standalone runs a private rendezvous no other node can join, but --nnodes allows "
                f"up to {max_nodes} nodes; give --rdzv-endpoint HOST:PORT for a multi-node run"
            )
        overridden = [
            f"{g.origin}={g.value}"
            for g in (backend_given, endpoint_given, id_given)
            if g.origin is not None and (g is not endpoint_given or (g.value or "").strip())
        ]
        if overridden:
            logger.warning(
                "%s: ignoring %s (a standalone run uses its own rendezvous on a free local port "
                "and a fresh id)",
                "--standalone" if standalone else "single-node run without --rdzv-endpoint",
                ", ".join(overridden),
            )
        return True, "c10d", STANDALONE_ENDPOINT, random_uuid4()

    backend = "c10d" if backend_given.value is None else backend_given.value
    what = backend_given.what(_BY_DEST["rdzv_backend"])
    if backend not in SUPPORTED_BACKENDS:
        raise ConfigError(
            f"{what}={backend!r} is not a rendezvous backend: use one of {', '.join(SUPPORTED_BACKENDS)}"
        )
    endpoint = (endpoint_given.value or "").strip()
    if not endpoint and max_nodes > 1 and backend_given.origin is None:
        # torchrun would run static with every node rank 0 (none of its flags was given): both
        # nodes would wait for each other's rank 1 until a timeout.
        raise ConfigError(
            "a multi-node run needs --rdzv-endpoint HOST[:PORT], the address of the rendezvous "
            "server, or torchrun's static flags: --node-rank R --master-addr ADDR --master-port PORT"
        )
    if not id_given.value:
        raise ConfigError(
            f"{id_given.what(_BY_DEST['rdzv_id'])} is empty: give the job a name shared by its nodes"
        )
    return False, backend, endpoint, id_given.value


def _warn_unused_static_flags(inputs: _Inputs, backend: str, standalone: bool, node_rank: int) -> None:
    """Say which of torchrun's static flags this rendezvous does not use (as torchrun warns)."""
    standalone = standalone and inputs.switch("standalone")  # else torchrun's single-node c10d
    unused = [_BY_DEST[d].display for d in ("master_addr", "master_port") if inputs.given(d)]
    if unused:
        logger.warning(
            "%s: ignored, as torchrun ignores %s with %s; workers get MASTER_ADDR/MASTER_PORT "
            "from the rendezvous",
            " and ".join(unused),
            "it" if len(unused) == 1 else "them",
            "--standalone" if standalone else f"--rdzv-backend={backend}",
        )
    if inputs.given("node_rank") and (standalone or backend in ETCD_BACKENDS):
        logger.warning(
            "--node-rank=%d: ignored with %s (torchrun too); the rendezvous assigns node ranks",
            node_rank,
            "--standalone" if standalone else f"--rdzv-backend={backend}",
        )


def _static_master(
    inputs: _Inputs,
    endpoint: str,
    endpoint_host: str,
    endpoint_port: int,
    master_addr: str | None,
    master_port: int | None,
    min_nodes: int,
    max_nodes: int,
    node_rank: int,
) -> tuple[str, int]:
    """torchrun's static rendezvous: ranks come from --node-rank; the master from the flags.

    The master is --rdzv-endpoint when given, else --master-addr:--master-port (torchrun's
    127.0.0.1:29500). Worker rank 0 hosts torch's TCPStore on that port.
    """
    if min_nodes != max_nodes:
        raise ConfigError(
            "the static rendezvous (--rdzv-backend=static, or torchrun's --node-rank/--master-addr/"
            f"--master-port without --rdzv-endpoint) needs a fixed node count (--nnodes N), not "
            f"{min_nodes}:{max_nodes}; give --rdzv-endpoint HOST:PORT for an elastic job"
        )
    if node_rank >= max_nodes:
        raise ConfigError(f"--node-rank={node_rank} must be below --nnodes={max_nodes} (ranks count from 0)")
    if endpoint:
        if not inputs.given("rdzv_endpoint") or ":" in endpoint.rsplit("]", 1)[-1]:
            return endpoint_host, endpoint_port
        return endpoint_host, master_port or DEFAULT_RDZV_PORT
    return master_addr or "127.0.0.1", master_port or DEFAULT_RDZV_PORT


def _parse_endpoint(endpoint: str, given: _Given, max_nodes: int) -> tuple[str, int]:
    """Split HOST[:PORT] / [V6]:PORT / [V6]; an empty endpoint means 127.0.0.1 (torchrun: localhost)."""
    what = given.what(_BY_DEST["rdzv_endpoint"])
    text = endpoint.strip()
    if not text:
        return "127.0.0.1", DEFAULT_RDZV_PORT
    port_text: str | None = None
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ConfigError(f"{what}={endpoint!r}: write an IPv6 endpoint as [ADDR]:PORT, e.g. [::1]:29500")
        port_text = rest[1:] if rest else None
    elif text.count(":") > 1:
        raise ConfigError(
            f"{what}={endpoint!r}: put an IPv6 address in brackets, e.g. [{text}] or [::1]:29500"
        )
    else:
        host, colon, port_text_ = text.partition(":")
        port_text = port_text_ if colon else None
    if not host or not all(c.isalnum() or c in "_.:-" for c in host):
        raise ConfigError(f"{what}={endpoint!r}: the host must be a hostname, an IPv4 or an IPv6 address")
    if port_text is None:
        return host, DEFAULT_RDZV_PORT
    if not is_count(port_text) or int(port_text) > 65535:
        raise ConfigError(f"{what}={endpoint!r}: the port must be a number in 1..65535")
    port = int(port_text)
    if port == 0 and max_nodes > 1:
        raise ConfigError(
            f"{what}={endpoint!r}: port 0 (a free port) only works for a single-node run; "
            "other nodes could not find it. Give the rendezvous server's port"
        )
    return host, port


# --- the entrypoint -------------------------------------------------------------------------


def _python_exec(environ: Mapping[str, str], *, needed: bool) -> str:
    # torchrun: os.getenv("PYTHON_EXEC", sys.executable)
    python = environ.get("PYTHON_EXEC", sys.executable)
    if needed:
        if not python:
            raise ConfigError("PYTHON_EXEC is set but empty: unset it or name a python interpreter")
        if which(python, path=environ.get("PATH", os.defpath)) is None:
            raise ConfigError(f"PYTHON_EXEC={python!r}: no such executable")
    return python


def _check_entrypoint(
    script: str, *, module: bool, no_python: bool, run_path: bool, environ: Mapping[str, str]
) -> None:
    if run_path:
        if module:
            raise ConfigError("--run-path runs a file by its path; it cannot be combined with -m/--module")
        if no_python:
            logger.warning("--run-path takes precedence over --no-python (as in torchrun)")
        if not os.path.isfile(script):
            raise ConfigError(f"training script {script!r} not found (--run-path needs a file path)")
        return
    if module:
        if no_python:
            # torchrun's own rule: a module needs python
            raise ConfigError("don't use both --no-python and -m/--module: a module needs python to run it")
        return  # the worker's python finds (or reports) the module
    if no_python:
        if which(script, path=environ.get("PATH", os.defpath)) is None:
            if os.path.exists(script):
                raise ConfigError(f"--no-python: {script!r} exists but is not an executable file")
            raise ConfigError(f"--no-python: command {script!r} is not an existing path or on PATH")
        return
    if not os.path.exists(script):
        raise ConfigError(f"training script {script!r} not found")


# --- single values --------------------------------------------------------------------------


def _int(inputs: _Inputs, dest: str, *, minimum: int) -> int:
    given = inputs.get(dest)
    what = given.what(_BY_DEST[dest])
    value = parse_int(given.value or "", what=what)
    if value < minimum:
        raise ConfigError(f"{what}={given.value!r} must be >= {minimum}")
    return value


def _seconds(inputs: _Inputs, dest: str, *, positive: bool) -> float:
    given = inputs.get(dest)
    what = given.what(_BY_DEST[dest])
    value = parse_float(given.value or "", what=what)
    if value < 0 or (positive and value == 0):
        raise ConfigError(f"{what}={given.value!r} must be {'> 0' if positive else '>= 0'} seconds")
    return value


def _port(inputs: _Inputs, dest: str) -> int | None:
    given = inputs.get(dest)
    if given.value is None:
        return None
    what = given.what(_BY_DEST[dest])
    port = parse_int(given.value, what=what)
    if not 1 <= port <= 65535:
        raise ConfigError(f"{what}={given.value!r}: a port must be in 1..65535")
    return port


@overload
def _choice(inputs: _Inputs, dest: str, choices: Sequence[str], *, optional: Literal[False] = ...) -> str: ...
@overload
def _choice(inputs: _Inputs, dest: str, choices: Sequence[str], *, optional: bool) -> str | None: ...


def _choice(inputs: _Inputs, dest: str, choices: Sequence[str], *, optional: bool = False) -> str | None:
    given = inputs.get(dest)
    if given.value is None and optional:
        return None
    if given.value not in choices:
        what = given.what(_BY_DEST[dest])
        raise ConfigError(f"{what}={given.value!r} is not valid: use one of {', '.join(choices)}")
    return given.value


def _log_dir(inputs: _Inputs) -> str | None:
    given = inputs.get("log_dir")
    if not given.value:
        return None  # torchrun: an empty value also means a fresh temporary directory
    if os.path.exists(given.value) and not os.path.isdir(given.value):
        raise ConfigError(f"{given.what(_BY_DEST['log_dir'])}={given.value!r} is a file, not a directory")
    return given.value


def _std(inputs: _Inputs, dest: str) -> StdSpec:
    given = inputs.get(dest)
    return StdSpec.parse(given.value or "", origin=given.what(_BY_DEST[dest]))


def _local_ranks_filter(inputs: _Inputs) -> frozenset[int] | None:
    given = inputs.get("local_ranks_filter")
    text = given.value or ""
    if not text.strip():
        return None
    items = [item.strip() for item in text.split(",")]
    if not all(is_count(item) for item in items):
        raise ConfigError(
            f"{given.what(_BY_DEST['local_ranks_filter'])}={given.value!r}: expected a comma-separated "
            "list of local ranks, e.g. 0,1,2"
        )
    return frozenset(int(item) for item in items)


def _token(path: str | None, environ: Mapping[str, str], rdzv_id: str) -> str | None:
    """The job's token: --token-file, else RDZV_TOKEN_FILE, else RDZV_TOKEN; None without one."""
    try:
        return job_token(path, environ, rdzv_id)
    except TokenFileError as exc:
        raise ConfigError(str(exc)) from None


def _tls(
    inputs: _Inputs, environ: Mapping[str, str], *, backend: str, hosts: bool, is_host: bool | None
) -> tuple[str | None, str | None, str | None]:
    """--tls-ca/--tls-cert/--tls-key, else RDZV_TLS_*: checked now by loading them once."""
    flags = {name: (inputs.get(f"tls_{name}").value, _BY_DEST[f"tls_{name}"].display) for name in CLIENT_ENV}
    try:
        files = client_files(flags, environ)
    except TLSConfigError as exc:
        raise ConfigError(str(exc)) from None
    if files is None:
        return None, None, None
    if backend != "c10d" or hosts:
        why = f"--rdzv-backend={backend}" if backend != "c10d" else "this agent hosts its own rendezvous"
        logger.warning("%s: ignored (%s; TLS applies to a rdzv-server only)", files.origins, why)
        return None, None, None
    if is_host is True:
        # Its peers would need TLS to reach it; silently plain would be worse than refusing.
        raise ConfigError(
            f"{files.origins} with is_host=true: the rendezvous an agent hosts is plain TCP; run "
            "`rdzv-server --tls-cert ... --tls-key ...` and point every agent at it"
        )
    try:
        client_context(files.ca, files.cert, files.key)
    except TLSConfigError as exc:
        raise ConfigError(str(exc)) from None
    return files.ca, files.cert, files.key


def _filters(text: str) -> tuple[str, ...]:
    """torchrun's comma list with ',,' for a literal comma.

    Empty items are dropped: torchrun would keep "" (from "" or a trailing comma), which
    matches every line and so duplicates the whole stream; nobody means that.
    """
    placeholder = "\0"
    items = text.replace(",,", placeholder).split(",")
    return tuple(item.replace(placeholder, ",") for item in items if item)


def _preload(inputs: _Inputs) -> tuple[str, ...]:
    """``--preload torch,transformers``: dotted module names, each once, in the given order."""
    given = inputs.get("preload")
    text = (given.value or "").strip()
    if not text:
        return ()
    names: list[str] = []
    for item in text.split(","):
        name = item.strip()
        if not is_module_name(name):
            raise ConfigError(
                f"{given.what(_BY_DEST['preload'])}={given.value!r}: {name!r} is not a module name "
                "(expected dotted names separated by commas, e.g. torch,transformers)"
            )
        if name not in names:
            names.append(name)
    return tuple(names)


def _signals(inputs: _Inputs) -> tuple[str, ...]:
    given = inputs.get("signals_to_handle")
    what = given.what(_BY_DEST["signals_to_handle"])
    text = (given.value or "").strip()
    if not text:
        return ()  # explicitly none: the agent forwards nothing
    names: list[str] = []
    for item in text.split(","):
        name = item.strip()
        if name in ("SIGKILL", "SIGSTOP"):
            raise ConfigError(f"{what}: {name} cannot be caught, so it cannot be forwarded")
        if not name.startswith("SIG") or name.startswith("SIG_") or not hasattr(signal.Signals, name):
            raise ConfigError(
                f"{what}={given.value!r}: {name!r} is not a signal name on this system "
                "(use names like SIGTERM,SIGUSR1)"
            )
        if name not in names:
            names.append(name)
    return tuple(names)


def _shutdown_timeout(inputs: _Inputs, environ: Mapping[str, str]) -> float:
    given = inputs.get("shutdown_timeout")
    if given.value is not None:
        return _seconds(inputs, "shutdown_timeout", positive=False)
    # torchrun's LaunchConfig: the variable, else 30 s
    text = environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    if text is None:
        return DEFAULT_SHUTDOWN_TIMEOUT
    value = parse_float(text, what="TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    if value < 0:
        raise ConfigError(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={text!r} must be >= 0 seconds")
    return value


def _log_level(environ: Mapping[str, str]) -> str | None:
    """LOGLEVEL, as torchrun applies it to its own lines; None when unset (the agent's INFO)."""
    text = environ.get("LOGLEVEL")
    if text is None:
        return None
    level = text.strip().upper()
    if level == "WARN":
        level = "WARNING"
    if level not in LOG_LEVELS:
        raise ConfigError(f"LOGLEVEL={text!r} is not a log level: use one of {', '.join(LOG_LEVELS)}")
    return level


def _hang_flags(inputs: _Inputs) -> dict[str, str]:
    """--hang-timeout and --hang-conf as given, once HangPolicy.parse accepts them."""
    from .machine.watch import HangPolicy

    timeout, conf = inputs.get("hang_timeout"), inputs.get("hang_conf")
    flags = {"hang_timeout": timeout.value or "auto", "hang_conf": conf.value or ""}
    try:
        HangPolicy.parse(flags["hang_timeout"], flags["hang_conf"])
    except ValueError as why:
        where = f"{timeout.what(_BY_DEST['hang_timeout'])}={flags['hang_timeout']!r}"
        if flags["hang_conf"]:
            where += f", {conf.what(_BY_DEST['hang_conf'])}={flags['hang_conf']!r}"
        raise ConfigError(f"{where}: {why}") from None
    return flags


def _health_check_port(environ: Mapping[str, str]) -> int | None:
    text = environ.get("TORCHELASTIC_HEALTH_CHECK_PORT")
    if text is None or not text.strip():
        return None
    port = parse_int(text, what="TORCHELASTIC_HEALTH_CHECK_PORT")
    if not 1 <= port <= 65535:
        raise ConfigError(f"TORCHELASTIC_HEALTH_CHECK_PORT={text!r}: a port must be in 1..65535")
    return port


def _refuse_unsupported(inputs: _Inputs, dest: str) -> None:
    given = inputs.get(dest)
    if given.value is None or (dest == "logs_specs" and given.value == "default"):
        return  # "default" names torchrun's own DefaultLogsSpecs: the layout we write
    flag = _BY_DEST[dest]
    reasons = {
        "logs_specs": "it loads a torch LogsSpecs plugin; node-agent writes torchrun's default log "
        "layout (--logs-specs default)",
    }
    raise ConfigError(f"{flag.display} is not supported yet: {reasons[dest]}")


def _numa_binding(inputs: _Inputs) -> str | None:
    """``--numa-binding MODE``: torch's modes (torch.numa.binding.AffinityMode), as its choices."""
    given = inputs.get("numa_binding")
    if given.value is None:
        return None
    from .gpu.numa import MODES  # torch.numa.binding.AffinityMode's values

    if given.value not in MODES:
        raise ConfigError(
            f"{given.what(_BY_DEST['numa_binding'])}={given.value!r} is not valid: use one of "
            f"{', '.join(MODES)}"
        )
    return given.value


def _warn_about_environment(environ: Mapping[str, str]) -> None:
    # torchrun's agent reads these; we do not implement them, and saying so beats silence.
    if environ.get("TORCHELASTIC_ENABLE_FILE_TIMER") == "1":
        logger.warning(
            "TORCHELASTIC_ENABLE_FILE_TIMER=1 is not supported by node-agent: worker timers are not enforced"
        )
