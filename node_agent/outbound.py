"""What this node tells the rendezvous, built from the config and what happened: its ``Join``
(with a master port free right now) and its workers' exits as the ``Failure`` reports the server
and the other nodes read."""

from __future__ import annotations

from protocol import MAX_PATH_LEN, MAX_TEXT_LEN, Failure, Join

from .config import AgentConfig
from .supervisor.spec import GroupResult, WorkerExit
from .worker_env import free_port


def join_message(
    cfg: AgentConfig,
    *,
    node_id: str,
    addr: str,
    proof: str,
    node_secret: str,
    store_port: int = 0,
    replica_port: int = 0,
    replica_key: str = "",
    replica_cert: str = "",
    durable_world: int = -1,
    durable_steps: tuple[int, ...] = (),
    standby_port: int = 0,
) -> Join:
    """This node's Join for the next round, with a master port free right now, or
    ``store_port``: the port this node's agent hosts the workers' store on (store/host.py);
    ``replica_port``/``replica_key``/``replica_cert``: where it takes snapshot replicas, the
    key a peer proves and the certificate it pins (snapshots/node.py);
    ``durable_world``/``durable_steps``: what its --snapshot-dir offers (snapshots/durable.py);
    ``standby_port``: where it would host the rendezvous were its host lost (rdzv/takeover.py)."""
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
        replica_port=replica_port,
        replica_key=replica_key,
        replica_cert=replica_cert,
        durable_world=durable_world,
        durable_steps=durable_steps,
        standby_port=standby_port,
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
