"""A rendezvous assignment turned into each worker's environment and command line.

Scripts written for torchrun read their place in the job from the environment, so this module
must give a worker exactly what torchrun 2.13 gives it (``LocalElasticAgent._start_workers``
plus what ``torch.distributed.run`` and ``launcher.api`` put into the agent's own environment,
which workers inherit). ``tests/node_agent/test_worker_env.py`` runs the real torchrun and
compares, key by key. Values that differ on purpose:

* ``TORCHELASTIC_USE_AGENT_STORE`` follows the round (``Assignment.agent_store``): ``"True"``,
  as torchrun's c10d agent says, when the group-rank-0 node's agent hosts the TCPStore on
  ``MASTER_PORT`` (``node_agent.store.host``: every rank connects as a client); ``"False"``
  when that agent cannot (no usable torch for the workers' interpreter, an older server, the
  static backend), so worker RANK 0 hosts it, as torch does when the variable is False.
* ``MASTER_ADDR``, ``MASTER_PORT`` and ``TORCHELASTIC_RUN_ID`` come from the rendezvous
  (torchrun's standalone run says ``localhost``; ours gives whatever the server assigned,
  ``127.0.0.1`` for a standalone run, so nothing depends on how ``localhost`` resolves).
* ``TORCHELASTIC_ERROR_FILE`` is a path in our log directory.
* ``TORCHELASTIC_SIGNALS_TO_HANDLE`` is the parsed list joined by commas; torchrun exports
  the flag's text as typed (the same for any value without spaces).

Not set, as torchrun sets them only for features we do not have: ``TORCHELASTIC_TIMER_FILE``
(the file-timer watchdog).

Added (``training_health_env``), for watching the training (README "Progress, hangs and
stragglers"): ``NODE_AGENT_PROGRESS_PAGE``, the rank's progress page (``node_agent.worker``
reports through it; unset, every call of that module is a no-op), and, unless the user set
them, torch's flight-recorder dump file and dump pipe variables
(``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``, ``TORCH_FR_DUMP_TEMP_FILE``,
``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``, ``TORCH_FR_DEBUG_INFO_PIPE_FILE``) pointing into the
attempt's log directory, so a hang's dumps land beside its report.

Not inherited, unlike everything else of the agent's environment: ``RDZV_TOKEN``, the job's
rendezvous token (``SECRETS``). A worker runs the user's code and whatever it imports; with the
token it could join the job as another node. Paths (``RDZV_TOKEN_FILE``, the TLS files) are not
secrets and pass, as torchrun passes everything.
"""

from __future__ import annotations

import os
import socket
import string
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Protocol

from protocol import Assignment
from protocol.records import record

from .config import AgentConfig, ConfigError
from .supervisor.spec import WorkerSpec

__all__ = ["NodeAssignment", "omp_threads_notice", "training_health_env", "worker_argv", "worker_env"]

PAGE_VAR = "NODE_AGENT_PROGRESS_PAGE"
PLACE_VAR = "NODE_AGENT_PLACE_DIR"  # worker/place.py's
# torch's flight recorder: where a dump is written (the rank is appended), and the stem of the
# FIFO whose write asks for a dump while training goes on (``<stem><rank>.pipe``). Old and new
# spellings: torch reads one or the other depending on the release.
FR_DUMP_VARS = ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE")
FR_PIPE_VARS = ("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "TORCH_FR_DEBUG_INFO_PIPE_FILE")
# In-memory snapshots (node_agent/snapshots/node.py sets them, node_agent/worker/snapshots.py
# reads them): the rank's folder, one file's size limit, the step every rank restores.
SNAPSHOT_DIR_VAR = "NODE_AGENT_SNAPSHOT_DIR"
SNAPSHOT_LIMIT_VAR = "NODE_AGENT_SNAPSHOT_LIMIT"
RESTORE_STEP_VAR = "NODE_AGENT_RESTORE_STEP"
RESTORE_DIGEST_VAR = "NODE_AGENT_RESTORE_SHA256"  # set where the snapshot came from another node
SNAPSHOT_VARS = (SNAPSHOT_DIR_VAR, SNAPSHOT_LIMIT_VAR, RESTORE_STEP_VAR, RESTORE_DIGEST_VAR)
# A worker's mark in its folder: its snapshots hold state every rank holds alike
# (worker.snapshot(step, replicated=True)).
REPLICATED_MARK = ".replicated"

# What torchrun prints when it sets OMP_NUM_THREADS for the workers, word for word, so logs and
# the scripts that grep them look the same.
_OMP_NOTICE = (
    "\n*****************************************\n"
    "Setting OMP_NUM_THREADS environment variable for each process to be "
    "{threads} in default, to avoid your system being overloaded, "
    "please further tune the variable for optimal performance in "
    "your application as needed. \n"
    "*****************************************"
)
_DEFAULT_OMP_THREADS = 1
# Whether the agent sets OMP_NUM_THREADS (and says so) as the torchrun command does: the
# node-agent command and node_agent.run.run do; node_agent.launch()/elastic_launch() set it
# False for their own run (a context variable: one launch's, not another thread's), as torch's
# elastic_launch leaves the variable to the command line.
SETS_OMP_THREADS: ContextVar[bool] = ContextVar("SETS_OMP_THREADS", default=True)
# What the agent reads from its environment that a worker must never see.
SECRETS: tuple[str, ...] = ("RDZV_TOKEN",)

# --run-path: torchrun calls runpy.run_path in a function worker wrapped by @record. We run a
# fresh interpreter instead and do the same: sys.argv = [script, *args], run_name="__main__",
# faulthandler on, and an uncaught exception written to TORCHELASTIC_ERROR_FILE in @record's
# format before it propagates (SystemExit is not an Exception, so exit codes pass through).
RUN_PATH_BOOTSTRAP = """\
import faulthandler, json, os, runpy, sys, time, traceback
faulthandler.enable(all_threads=True)
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except Exception as e:
    _path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if _path:
        with open(_path, "w") as _f:
            json.dump({"message": {"message": f"{type(e).__name__}: {e}", "extraInfo": {
                "py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))}}}, _f)
    raise
"""


@record(frozen=True, kw_only=True)
class NodeAssignment:
    """What one rendezvous round gives this node."""

    run_id: str
    group_rank: int  # this node's rank among the nodes
    group_world_size: int  # the number of nodes
    rank_offset: int  # RANK of this node's local rank 0
    world_size: int  # workers in the whole job
    master_addr: str  # where worker RANK 0 hosts the TCPStore
    master_port: int
    restart_count: int
    max_restarts: int
    agent_store: bool = False  # the group-rank-0 node's agent hosts the TCPStore

    def __post_init__(self) -> None:
        if not 0 <= self.group_rank < self.group_world_size:
            raise ValueError(f"group_rank {self.group_rank} not in 0..{self.group_world_size - 1}")
        if not 0 <= self.rank_offset < self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} not in 0..{self.world_size - 1}")
        if not 1 <= self.master_port <= 65535:
            raise ValueError(f"master_port {self.master_port} not in 1..65535")
        if not self.master_addr:
            raise ValueError("master_addr is empty")
        if self.restart_count < 0 or self.max_restarts < 0:
            raise ValueError(f"restart_count {self.restart_count} / max_restarts {self.max_restarts} < 0")


def worker_env(
    *,
    config: AgentConfig,
    node: NodeAssignment,
    local_rank: int,
    error_file: str,
    base_env: Mapping[str, str],
) -> dict[str, str]:
    """The complete environment of worker ``local_rank`` (inherited variables included).

    ``base_env`` is the agent's environment: torchrun's workers inherit the agent's, so ours
    inherit it too (``PET_*`` included, as in torchrun).
    """
    if not 0 <= local_rank < config.nproc_per_node:
        raise ValueError(f"local_rank {local_rank} not in 0..{config.nproc_per_node - 1}")
    rank = node.rank_offset + local_rank
    if rank >= node.world_size:
        raise ValueError(
            f"rank {rank} (offset {node.rank_offset} + local rank {local_rank}) "
            f">= world_size {node.world_size}"
        )

    env = {k: v for k, v in base_env.items() if k not in SECRETS}
    # torchrun writes these two into its own os.environ before starting workers, so every
    # worker inherits them; the worker-specific variables below then take precedence.
    env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(config.signals_to_handle)
    if _sets_omp_threads(config, base_env):
        env["OMP_NUM_THREADS"] = str(_DEFAULT_OMP_THREADS)

    env.update(
        {
            "RANK": str(rank),
            "GROUP_RANK": str(node.group_rank),
            # One role per job, so the role's ranks are the job's ranks.
            "ROLE_RANK": str(rank),
            "ROLE_NAME": config.role,
            "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
            "WORLD_SIZE": str(node.world_size),
            "GROUP_WORLD_SIZE": str(node.group_world_size),
            "ROLE_WORLD_SIZE": str(node.world_size),
            "MASTER_ADDR": node.master_addr,
            "MASTER_PORT": str(node.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(node.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(node.max_restarts),
            "TORCHELASTIC_RUN_ID": node.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": str(node.agent_store),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": base_env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "TORCHELASTIC_ERROR_FILE": error_file,
        }
    )
    if config.virtual_local_rank:
        # Each worker sees only its own GPU, as device 0.
        env["LOCAL_RANK"] = "0"
        env["CUDA_VISIBLE_DEVICES"] = _own_device(base_env.get("CUDA_VISIBLE_DEVICES"), local_rank)
    else:
        env["LOCAL_RANK"] = str(local_rank)
    return env


def _own_device(parent_visible: str | None, local_rank: int) -> str:
    if parent_visible is None:
        return str(local_rank)
    devices = parent_visible.split(",")
    if local_rank >= len(devices):
        raise ConfigError(
            f"--virtual-local-rank: local rank {local_rank} has no GPU in "
            f"CUDA_VISIBLE_DEVICES={parent_visible!r} ({len(devices)} listed)"
        )
    return devices[local_rank].strip()


def _sets_omp_threads(config: AgentConfig, base_env: Mapping[str, str]) -> bool:
    # torchrun's rule: only when the user left it unset and several workers share the node.
    return SETS_OMP_THREADS.get() and "OMP_NUM_THREADS" not in base_env and config.nproc_per_node > 1


def omp_threads_notice(config: AgentConfig, base_env: Mapping[str, str]) -> str | None:
    """torchrun's warning banner when it sets OMP_NUM_THREADS=1 for the workers, else None."""
    if not _sets_omp_threads(config, base_env):
        return None
    return _OMP_NOTICE.format(threads=_DEFAULT_OMP_THREADS)


def worker_argv(config: AgentConfig, local_rank: int) -> list[str]:
    """The worker's command line, as torchrun builds it.

    ``[python, "-u", ("-m"), script, *args]``; with --no-python ``[script, *args]``; with
    --run-path a python that runs the file through runpy (see RUN_PATH_BOOTSTRAP).
    --pass-local-rank puts ``--local-rank=N`` right after the script, where
    torch.distributed.launch puts it.
    """
    extra: list[str] = []
    if config.pass_local_rank == "dash":
        extra.append(f"--local-rank={local_rank}")
    elif config.pass_local_rank == "underscore":
        extra.append(f"--local_rank={local_rank}")
    args = [config.training_script, *extra, *config.training_script_args]

    if config.run_path:  # takes precedence over --no-python, as in torchrun
        return [config.python_exec, "-u", "-c", RUN_PATH_BOOTSTRAP, *args]
    if config.no_python:
        return args
    return [config.python_exec, "-u", *(["-m"] if config.module else []), *args]


def training_health_env(
    base_env: Mapping[str, str], *, page: str, fr_dump: str, fr_pipe: str, place: str = ""
) -> dict[str, str]:
    """The variables a worker gets for watching its training (added to ``worker_env``'s).

    ``page``: this rank's progress page; ``fr_dump``/``fr_pipe``: the stems of torch's
    flight-recorder dump files and dump pipes in the attempt's log directory, set only where
    the user set neither spelling (theirs wins); ``place``: the rank's place folder, where
    ``worker.run`` learns its next place (restarts in place).
    """
    env = {PAGE_VAR: page}
    if place:
        env[PLACE_VAR] = place
    for names, value in ((FR_DUMP_VARS, fr_dump), (FR_PIPE_VARS, fr_pipe)):
        if not any(name in base_env for name in names):
            env.update(dict.fromkeys(names, value))
    return env


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(attempts: int = 50) -> int:
    """A port free right now, for worker rank 0's TCPStore, which binds it seconds later.

    Ports the kernel hands out for outgoing connections (the ephemeral range) can be taken in
    those seconds by any connect() on this machine, gloo's included; a port below that range
    is only taken by an explicit bind. So we look there first, and fall back to port 0.
    """
    lo, _ = _ephemeral_range()
    low_end = max(1024, lo - 1)
    for _ in range(attempts if low_end > 10000 else 0):
        port = 10000 + int.from_bytes(os.urandom(4), "big") % (low_end - 9999)  # not `random`: 2 ms to import
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def line_prefix(cfg: AgentConfig, local_rank: int, rank: int) -> str:
    """torchrun's tee prefix, ``[default0]:``, or its TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE."""
    if cfg.log_line_prefix_template is None:
        return f"[{cfg.role}{local_rank}]:"
    return string.Template(cfg.log_line_prefix_template).safe_substitute(
        role_name=cfg.role, local_rank=local_rank, rank=rank
    )


class AttemptPaths(Protocol):
    """Where one attempt's files go (:class:`node_agent.logs.Attempt`)."""

    def error_file(self, local_rank: int) -> str: ...
    def stdout_path(self, local_rank: int) -> str: ...
    def stderr_path(self, local_rank: int) -> str: ...
    def filtered_stdout_path(self) -> str: ...
    def filtered_stderr_path(self) -> str: ...
    def page_path(self, local_rank: int) -> str: ...
    def place_dir(self, local_rank: int) -> str: ...
    def flight_recorder_stem(self, kind: str) -> str: ...


def worker_specs(
    cfg: AgentConfig,
    a: Assignment,
    environ: Mapping[str, str],
    paths: AttemptPaths,
    cpus: Mapping[int, frozenset[int]] | None = None,
) -> list[WorkerSpec]:
    """What to start for one assignment: a spec per local rank, its argv, environment and files;
    ``cpus``: each local rank's ``--numa-binding`` (gpu/binding.py)."""
    node = NodeAssignment(
        run_id=cfg.rdzv_id,
        group_rank=a.group_rank,
        group_world_size=a.group_world_size,
        rank_offset=a.rank_offset,
        world_size=a.world_size,
        master_addr=a.master_addr,
        master_port=a.master_port,
        restart_count=a.restart_count,
        max_restarts=a.max_restarts,
        agent_store=a.agent_store,
    )
    specs = []
    fr_dump, fr_pipe = paths.flight_recorder_stem("trace"), paths.flight_recorder_stem("pipe")
    for local_rank in range(cfg.nproc_per_node):
        error_file = paths.error_file(local_rank)
        rank = a.rank_offset + local_rank
        env = worker_env(
            config=cfg, node=node, local_rank=local_rank, error_file=error_file, base_env=environ
        )
        env.update(
            training_health_env(
                environ,
                page=paths.page_path(local_rank),
                fr_dump=fr_dump,
                fr_pipe=fr_pipe,
                place=paths.place_dir(local_rank),
            )
        )
        specs.append(
            WorkerSpec(
                local_rank=local_rank,
                rank=rank,
                argv=worker_argv(cfg, local_rank),
                env=env,
                redirect=cfg.redirect_for(local_rank),
                tee=cfg.tee_for(local_rank),
                stdout_path=paths.stdout_path(local_rank),
                stderr_path=paths.stderr_path(local_rank),
                console=cfg.local_ranks_filter is None or local_rank in cfg.local_ranks_filter,
                prefix=line_prefix(cfg, local_rank, rank),
                error_file=error_file,
                duplicate_stdout_filters=cfg.duplicate_stdout_filters,
                duplicate_stderr_filters=cfg.duplicate_stderr_filters,
                filtered_stdout_path=paths.filtered_stdout_path(),
                filtered_stderr_path=paths.filtered_stderr_path(),
                cpus=cpus.get(local_rank) if cpus else None,
            )
        )
    return specs
