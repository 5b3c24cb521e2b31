"""A worker's TORCHELASTIC_USE_AGENT_STORE follows the round: "True" (torchrun's value) when the
group-rank-0 node's agent hosts the store, "False" (worker rank 0 hosts it) otherwise; and the
Join offers the store only when this node's agent can host it."""

from __future__ import annotations

from node_agent.cli.parse import parse_config
from node_agent.config import AgentConfig
from node_agent.outbound import join_message
from node_agent.worker_env import NodeAssignment, worker_env


def _config() -> AgentConfig:
    return parse_config(["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29500", __file__], {})


def _env(agent_store: bool, group_rank: int = 1) -> dict[str, str]:
    config = _config()
    node = NodeAssignment(
        run_id="job", group_rank=group_rank, group_world_size=2, rank_offset=group_rank, world_size=2,
        master_addr="10.0.0.1", master_port=29600, restart_count=0, max_restarts=0,
        agent_store=agent_store,
    )  # fmt: skip
    return worker_env(config=config, node=node, local_rank=0, error_file="/e", base_env={})


def test_every_rank_connects_as_a_client_when_the_agent_hosts_the_store() -> None:
    assert _env(True)["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert _env(True, group_rank=0)["TORCHELASTIC_USE_AGENT_STORE"] == "True"


def test_rank_0_hosts_the_store_when_no_agent_does() -> None:
    assert _env(False)["TORCHELASTIC_USE_AGENT_STORE"] == "False"


def test_the_join_offers_the_store_only_on_its_port() -> None:
    config = _config()
    offered = join_message(config, node_id="n", addr="10.0.0.2", proof="", node_secret="", store_port=29777)
    assert (offered.master_port, offered.hosts_store) == (29777, True)
    plain = join_message(config, node_id="n", addr="10.0.0.2", proof="", node_secret="")
    assert plain.hosts_store is False and plain.master_port != 29777
