"""What the agent starts and sends, as plain functions of the config and what the server said.

:func:`worker_specs` turns an assignment into one :class:`~node_agent.supervisor.group.WorkerSpec` per
local rank (argv, environment, files, console prefix); :func:`join_message` is this node's
``Join``; :func:`failure_of` and :func:`failures_of` turn a worker's exit into the ``Failure``
the agent reports; :func:`machine_settings` is what the agent's machine is told of the config.
No state and no asyncio: the runner (:mod:`node_agent.runner`) calls them and does the I/O,
and tests call them directly. The only touches of the machine are picking a free port for the
master's TCPStore and a random node id.
"""

from __future__ import annotations

import os
import signal
import socket
import string
import time
from collections.abc import Mapping
from typing import Protocol

from protocol import MAX_PATH_LEN, MAX_TEXT_LEN, Assignment, Failure, Join

from .config import AgentConfig
from .machine import events as st
from .machine.training import Training
from .machine.watch import HangPolicy
from .supervisor.spec import GroupResult, WorkerExit, WorkerSpec
from .worker_env import NodeAssignment, training_health_env, worker_argv, worker_env


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


def make_node_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(2).hex()}"


class AttemptPaths(Protocol):
    """Where one attempt's files go (:class:`node_agent.logs.Attempt`)."""

    def error_file(self, local_rank: int) -> str: ...
    def stdout_path(self, local_rank: int) -> str: ...
    def stderr_path(self, local_rank: int) -> str: ...
    def filtered_stdout_path(self) -> str: ...
    def filtered_stderr_path(self) -> str: ...
    def page_path(self, local_rank: int) -> str: ...
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
            training_health_env(environ, page=paths.page_path(local_rank), fr_dump=fr_dump, fr_pipe=fr_pipe)
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


def machine_settings(cfg: AgentConfig, *, node_id: str, addr: str, reconnects: bool) -> st.AgentSettings:
    """The agent machine's settings for this run; ``reconnects``: the backend can ride out a
    lost link (a static backend has none to lose, so the machine gets no reconnect window)."""
    return st.AgentSettings(
        node_id=node_id,
        addr=addr,
        join_timeout=cfg.rdzv_conf.join_timeout,
        exit_barrier_timeout=cfg.rdzv_conf.exit_barrier_timeout,
        shutdown_timeout=cfg.shutdown_timeout,
        elastic=cfg.elastic,
        reconnect_timeout=cfg.rdzv_conf.reconnect_timeout if reconnects else 0.0,
        health_check=bool(cfg.health_check),
        # A drain asks for a commit point first only in an elastic job (SIGTERM leaves it).
        commit_timeout=cfg.rdzv_conf.commit_timeout if cfg.elastic else 0.0,
        handled_signals=frozenset(signal.Signals[s] for s in cfg.signals_to_handle),
        # A task of a Slurm job: its signals (scancel, pre-emption, --signal) reach every node.
        signals_end_job="SLURM_JOB_ID" in os.environ,
        nproc=cfg.nproc_per_node,
        job_id=cfg.rdzv_id,
        max_restarts=cfg.max_restarts,
        min_nodes=cfg.min_nodes,
        max_nodes=cfg.max_nodes,
        wall_offset=time.time() - time.monotonic(),  # the runner's clock is monotonic
    )


def training(cfg: AgentConfig, *, node_id: str, addr: str) -> Training:
    """The machine's view of the ranks' training (progress summaries, hang verdicts)."""
    return Training(
        policy=HangPolicy.parse(cfg.hang_timeout, cfg.hang_conf),
        nproc=cfg.nproc_per_node,
        node_id=node_id,
        addr=addr,
        interval=cfg.rdzv_conf.heartbeat_interval,
        wall_offset=time.time() - time.monotonic(),
    )


def join_message(
    cfg: AgentConfig, *, node_id: str, addr: str, proof: str, node_secret: str, store_port: int = 0
) -> Join:
    """This node's Join for the next round, with a master port free right now, or
    ``store_port``: the port this node's agent hosts the workers' store on (store/host.py)."""
    return Join(
        job_id=cfg.rdzv_id,
        node_id=node_id,
        addr=addr,
        nproc=cfg.nproc_per_node,
        min_nodes=cfg.min_nodes,
        max_nodes=cfg.max_nodes,
        entrypoint=cfg.entrypoint_name,
        master_port=store_port or free_port(),
        hosts_store=bool(store_port),
        max_restarts=cfg.max_restarts,
        last_call_timeout=cfg.rdzv_conf.last_call_timeout,
        heartbeat_interval=cfg.rdzv_conf.heartbeat_interval,
        heartbeat_timeout=cfg.rdzv_conf.heartbeat_timeout,
        exclude_after=cfg.rdzv_conf.exclude_after,
        straggler_threshold=cfg.rdzv_conf.straggler_threshold,
        exclude_stragglers=cfg.rdzv_conf.exclude_stragglers,
        crash_loop_restarts=cfg.rdzv_conf.crash_loop_restarts,
        commit_timeout=cfg.rdzv_conf.commit_timeout,
        commit_steps=cfg.rdzv_conf.commit_steps,
        proof=proof,
        # Given explicitly, it orders a fixed-size job's group ranks (the server's rule).
        node_rank=cfg.node_rank if cfg.node_rank_given else -1,
        node_secret=node_secret,
    )


def failure_of(w: WorkerExit, node_id: str, addr: str) -> Failure:
    """A worker's exit as the failure we report, its texts cut to fit the message."""
    return Failure(
        node_id=node_id,
        addr=addr,
        rank=w.rank,
        local_rank=w.local_rank,
        exitcode=w.exitcode,
        signal=w.signal_name,
        timestamp=w.timestamp,
        message=w.error_message[-MAX_TEXT_LEN // 2 :],
        pid=w.pid,
        error_file=w.error_file[-MAX_PATH_LEN:],
    )


def failures_of(result: GroupResult, node_id: str, addr: str) -> tuple[Failure, ...]:
    """This node's failed workers, first first (those we stop afterwards are not causes)."""
    exits = sorted((w for w in result.exits if w.failed), key=lambda w: w.timestamp)
    return tuple(failure_of(w, node_id, addr) for w in exits)
