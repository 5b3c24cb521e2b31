"""What the agent's machine is told of the config: its settings and its view of the training.

Pure, as the rest of ``machine/``: what they need of the environment (a Slurm task's variables)
and of the clocks (the wall clock minus the monotonic one) the runner reads and passes in."""

from __future__ import annotations

import signal
from collections.abc import Mapping

from ..config import AgentConfig
from .events import AgentSettings
from .training import Training
from .watch import HangPolicy


def machine_settings(
    cfg: AgentConfig,
    *,
    node_id: str,
    addr: str,
    reconnects: bool,
    environ: Mapping[str, str],
    wall_offset: float,
) -> AgentSettings:
    """The agent machine's settings for this run; ``reconnects``: the backend can ride out a
    lost link (a static backend has none to lose, so the machine gets no reconnect window)."""
    return AgentSettings(
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
        signals_end_job="SLURM_JOB_ID" in environ,
        nproc=cfg.nproc_per_node,
        job_id=cfg.rdzv_id,
        max_restarts=cfg.max_restarts,
        min_nodes=cfg.min_nodes,
        max_nodes=cfg.max_nodes,
        wall_offset=wall_offset,
    )


def training(cfg: AgentConfig, *, node_id: str, addr: str, wall_offset: float) -> Training:
    """The machine's view of the ranks' training (progress summaries, hang verdicts)."""
    return Training(
        policy=HangPolicy.parse(cfg.hang_timeout, cfg.hang_conf),
        nproc=cfg.nproc_per_node,
        node_id=node_id,
        addr=addr,
        interval=cfg.rdzv_conf.heartbeat_interval,
        wall_offset=wall_offset,
    )
