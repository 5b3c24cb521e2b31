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

import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence

from edge.tls import CLIENT_ENV, TLSConfigError, client_context, client_files
from edge.tokens import TokenFileError, job_token

from ..config import (
    LOG_FORMATS,
    PASS_LOCAL_RANK_STYLES,
    START_METHODS,
    AgentConfig,
    ConfigError,
    RdzvConf,
    is_count,
    is_module_name,
    parse_float,
    parse_int,
)
from ..executables import which
from ..rdzv import BACKENDS
from .flags import (
    BY_DEST,
    DEFAULT_SHUTDOWN_TIMEOUT,
    EVENT_LOG_HANDLERS,
    LOG_LEVELS,
    build_parser,
    split_script,
)
from .inputs import (
    Inputs,
    read_choice,
    read_filters,
    read_int,
    read_log_dir,
    read_outcome_dir,
    read_port,
    read_seconds,
    read_size,
    read_snapshot_dir,
    read_std,
)
from .nproc import resolve_nproc
from .rendezvous import (
    parse_endpoint,
    parse_nnodes,
    resolve_rendezvous,
    static_master,
    warn_unused_static_flags,
)

logger = logging.getLogger(__name__)


def parse_config(argv: Sequence[str], environ: Mapping[str, str]) -> AgentConfig:
    """Read a node-agent (torchrun) command line and environment into a validated AgentConfig.

    ``argv`` excludes the program name. Semantic errors raise ConfigError with a message for
    the user; malformed command lines (a missing script, an unknown flag) exit with status 2
    and argparse's usage message, as torchrun does. Warnings (flags that have no effect with
    the chosen backend, values --standalone overrides) go to this module's logger.
    """
    launcher_part, script_args = split_script(argv)
    namespace = build_parser().parse_args(launcher_part)
    inputs = Inputs(namespace, environ)

    min_nodes, max_nodes = parse_nnodes(inputs.get("nnodes"))
    nproc = inputs.get("nproc_per_node")
    nproc_per_node = resolve_nproc(
        nproc.value or "", environ=environ, origin=nproc.what(BY_DEST["nproc_per_node"])
    )

    standalone, backend, endpoint, rdzv_id = resolve_rendezvous(inputs, max_nodes)
    traits = BACKENDS[backend]  # resolve_rendezvous admits no other name
    given_endpoint = inputs.get("rdzv_endpoint")
    rdzv_host, rdzv_port = parse_endpoint(endpoint, given_endpoint, max_nodes, traits.default_port)
    conf = inputs.get("rdzv_conf")
    rdzv_conf = RdzvConf.parse(conf.value or "", origin=conf.what(BY_DEST["rdzv_conf"]))

    module = inputs.switch("module")
    no_python = inputs.switch("no_python")
    run_path = inputs.switch("run_path")
    training_script: str = namespace.training_script
    python_exec = _python_exec(environ, needed=run_path or not no_python)
    _check_entrypoint(training_script, module=module, no_python=no_python, run_path=run_path, environ=environ)

    node_rank = read_int(inputs, "node_rank", minimum=0)
    master_addr = inputs.get("master_addr").value
    master_port = read_port(inputs, "master_port")
    if traits.static_ranks:
        rdzv_host, rdzv_port = static_master(
            inputs, endpoint, rdzv_host, rdzv_port, master_addr, master_port, min_nodes, max_nodes, node_rank
        )
    else:
        warn_unused_static_flags(inputs, backend, standalone, node_rank)

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
        max_restarts=read_int(inputs, "max_restarts", minimum=0),
        monitor_interval=read_seconds(inputs, "monitor_interval", positive=True),
        start_method=read_choice(inputs, "start_method", START_METHODS),
        event_log_handler=read_choice(inputs, "event_log_handler", EVENT_LOG_HANDLERS),
        role=inputs.text("role"),
        module=module,
        no_python=no_python,
        run_path=run_path,
        python_exec=python_exec,
        log_dir=read_log_dir(inputs),
        redirects=read_std(inputs, "redirects"),
        tee=read_std(inputs, "tee"),
        local_ranks_filter=_local_ranks_filter(inputs),
        duplicate_stdout_filters=read_filters(inputs.text("duplicate_stdout_filters")),
        duplicate_stderr_filters=read_filters(inputs.text("duplicate_stderr_filters")),
        log_line_prefix_template=environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") or None,
        logs_specs=inputs.get("logs_specs").value,
        log_level=_log_level(environ),
        log_format=read_choice(inputs, "log_format", LOG_FORMATS),  # type: ignore[arg-type]
        node_rank=node_rank,
        node_rank_given=inputs.given("node_rank") and traits.joins_node_rank and not standalone,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=inputs.get("local_addr").value or None,
        numa_binding=numa_binding,
        signals_to_handle=_signals(inputs),
        shutdown_timeout=_shutdown_timeout(inputs, environ),
        virtual_local_rank=virtual_local_rank,
        pass_local_rank=read_choice(inputs, "pass_local_rank", PASS_LOCAL_RANK_STYLES, optional=True),
        **_hang_flags(inputs),
        health_check=inputs.get("health_check").value or None,
        health_check_port=_health_check_port(environ),
        gpu_release_timeout=read_seconds(inputs, "gpu_release_timeout", positive=False),
        gpu_release_mib=read_int(inputs, "gpu_release_mib", minimum=0),
        snapshot_memory=(snapshot_memory := read_size(inputs, "snapshot_memory", auto=True)),
        snapshot_dir=read_snapshot_dir(inputs, snapshot_memory),
        outcome_dir=read_outcome_dir(inputs),
        snapshot_replication_rate=read_size(inputs, "snapshot_replication_rate", auto=False) or 0,
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


def _local_ranks_filter(inputs: Inputs) -> frozenset[int] | None:
    given = inputs.get("local_ranks_filter")
    text = given.value or ""
    if not text.strip():
        return None
    items = [item.strip() for item in text.split(",")]
    if not all(is_count(item) for item in items):
        raise ConfigError(
            f"{given.what(BY_DEST['local_ranks_filter'])}={given.value!r}: expected a comma-separated "
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
    inputs: Inputs, environ: Mapping[str, str], *, backend: str, hosts: bool, is_host: bool | None
) -> tuple[str | None, str | None, str | None]:
    """--tls-ca/--tls-cert/--tls-key, else RDZV_TLS_*: checked now by loading them once."""
    flags = {name: (inputs.get(f"tls_{name}").value, BY_DEST[f"tls_{name}"].display) for name in CLIENT_ENV}
    try:
        files = client_files(flags, environ)
    except TLSConfigError as exc:
        raise ConfigError(str(exc)) from None
    if files is None:
        return None, None, None
    tls = BACKENDS[backend].tls
    if not tls or hosts:
        why = f"--rdzv-backend={backend}" if not tls else "this agent hosts its own rendezvous"
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


def _preload(inputs: Inputs) -> tuple[str, ...]:
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
                f"{given.what(BY_DEST['preload'])}={given.value!r}: {name!r} is not a module name "
                "(expected dotted names separated by commas, e.g. torch,transformers)"
            )
        if name not in names:
            names.append(name)
    return tuple(names)


def _signals(inputs: Inputs) -> tuple[str, ...]:
    given = inputs.get("signals_to_handle")
    what = given.what(BY_DEST["signals_to_handle"])
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


def _shutdown_timeout(inputs: Inputs, environ: Mapping[str, str]) -> float:
    given = inputs.get("shutdown_timeout")
    if given.value is not None:
        return read_seconds(inputs, "shutdown_timeout", positive=False)
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


def _hang_flags(inputs: Inputs) -> dict[str, str]:
    """--hang-timeout and --hang-conf as given, once HangPolicy.parse accepts them."""
    from ..machine.watch import HangPolicy

    timeout, conf = inputs.get("hang_timeout"), inputs.get("hang_conf")
    flags = {"hang_timeout": timeout.value or "auto", "hang_conf": conf.value or ""}
    try:
        HangPolicy.parse(flags["hang_timeout"], flags["hang_conf"])
    except ValueError as why:
        where = f"{timeout.what(BY_DEST['hang_timeout'])}={flags['hang_timeout']!r}"
        if flags["hang_conf"]:
            where += f", {conf.what(BY_DEST['hang_conf'])}={flags['hang_conf']!r}"
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


def _refuse_unsupported(inputs: Inputs, dest: str) -> None:
    given = inputs.get(dest)
    if given.value is None or (dest == "logs_specs" and given.value == "default"):
        return  # "default" names torchrun's own DefaultLogsSpecs: the layout we write
    flag = BY_DEST[dest]
    reasons = {
        "logs_specs": "it loads a torch LogsSpecs plugin; node-agent writes torchrun's default log "
        "layout (--logs-specs default)",
    }
    raise ConfigError(f"{flag.display} is not supported yet: {reasons[dest]}")


def _numa_binding(inputs: Inputs) -> str | None:
    """``--numa-binding MODE``: torch's modes (torch.numa.binding.AffinityMode), as its choices."""
    given = inputs.get("numa_binding")
    if given.value is None:
        return None
    from ..gpu.numa import MODES  # torch.numa.binding.AffinityMode's values

    if given.value not in MODES:
        raise ConfigError(
            f"{given.what(BY_DEST['numa_binding'])}={given.value!r} is not valid: use one of "
            f"{', '.join(MODES)}"
        )
    return given.value


def _warn_about_environment(environ: Mapping[str, str]) -> None:
    # torchrun's agent reads these; we do not implement them, and saying so beats silence.
    if environ.get("TORCHELASTIC_ENABLE_FILE_TIMER") == "1":
        logger.warning(
            "TORCHELASTIC_ENABLE_FILE_TIMER=1 is not supported by node-agent: worker timers are not enforced"
        )
