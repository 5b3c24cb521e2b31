"""node_agent.elastic_launch against torch's elastic_launch: what a user of either sees.

Each real run uses two workers of a callable that only reads its environment; torch's runs
import torch in the workers, so there is one torch run per case that needs one.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

torch_api = pytest.importorskip("torch.distributed.launcher.api")
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, LogsSpecs, Std  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402

import node_agent  # noqa: E402
from node_agent import LaunchConfig, LaunchError, elastic_launch  # noqa: E402
from node_agent.api import agent_config_for  # noqa: E402
from node_agent.config import ConfigError  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _no_tracker_left() -> Any:
    """torch's elastic_launch runs its workers through multiprocessing in this process, which
    starts multiprocessing's resource tracker, a child that would outlive the module (and
    show as a leaked process to the tests that check for ours): stopped after the module."""
    yield
    from multiprocessing import resource_tracker

    resource_tracker._resource_tracker._stop()  # type: ignore[attr-defined]


def who(tag: str) -> tuple[str, int, str, str]:
    return tag, int(os.environ["RANK"]), os.environ["ROLE_NAME"], os.environ["WORLD_SIZE"]


def fail_on_rank_one() -> str:
    if os.environ["RANK"] == "1":
        raise ValueError("rank one fails")
    return "ok"


def _torch_config(**kw: Any) -> Any:
    return torch_api.LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=2,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        run_id=str(uuid.uuid4()),
        monitor_interval=0.05,
        **kw,
    )


def test_return_values_and_role_name_match_torchs() -> None:
    theirs = torch_api.elastic_launch(_torch_config(), who)("x")
    ours = elastic_launch(LaunchConfig(nproc_per_node=2), who)("x")
    assert ours == theirs == {0: ("x", 0, "default_role", "2"), 1: ("x", 1, "default_role", "2")}
    # torch's LaunchConfig object as it is, converted field by field
    assert elastic_launch(_torch_config(role="trainer"), who)("y") == {
        0: ("y", 0, "trainer", "2"),
        1: ("y", 1, "trainer", "2"),
    }


def _check_failures(error: ChildFailedError) -> None:
    assert set(error.failures) == {1}
    failure = error.failures[1]
    assert (failure.local_rank, failure.exitcode) == (1, 1)
    assert failure.pid > 0 and isinstance(failure.timestamp, int)
    assert os.path.isfile(failure.error_file)
    assert isinstance(failure.message, dict) and "rank one fails" in failure.message["message"]
    assert error.get_first_failure()[0] == 1


def test_a_failure_is_caught_as_torchs_child_failed_error_with_torchs_failures() -> None:
    with pytest.raises(ChildFailedError) as theirs:
        torch_api.elastic_launch(_torch_config(max_restarts=0), fail_on_rank_one)()
    _check_failures(theirs.value)
    with pytest.raises(ChildFailedError) as ours:
        elastic_launch(LaunchConfig(nproc_per_node=2, max_restarts=0), fail_on_rank_one)()
    _check_failures(ours.value)
    assert isinstance(ours.value, LaunchError) and ours.value.rank == 1
    assert "rank one fails" in str(ours.value)


def test_torchs_defaults_where_a_user_sees_them() -> None:
    ours = {f.name for f in dataclasses.fields(LaunchConfig)}
    assert {f.name for f in dataclasses.fields(torch_api.LaunchConfig)} <= ours
    config = LaunchConfig()
    assert (config.role, config.max_restarts) == ("default_role", 3)
    assert (config.start_method, config.monitor_interval, config.rdzv_timeout) == ("spawn", 0.1, -1)


def test_a_closure_with_fork_is_refused_with_the_reason() -> None:
    def closure() -> int:
        return 1

    with pytest.raises(TypeError, match=r"start_method='fork'.*never forks"):
        elastic_launch(LaunchConfig(start_method="fork"), closure)()


def test_torch_only_fields_become_flags(tmp_path: Path) -> None:
    script = tmp_path / "x.py"
    script.write_text("")
    specs = DefaultLogsSpecs(log_dir=str(tmp_path / "logs"), tee=Std.ALL, local_ranks_filter={1})
    config = _torch_config(
        logs_specs=specs,
        duplicate_stdout_filters=["loss,acc", "step"],
        virtual_local_rank=True,
        metrics_cfg={"a": "b"},
    )
    cfg = agent_config_for(node_agent.api.from_torch(config), [str(script)])
    assert cfg.log_dir == str(tmp_path / "logs") and cfg.local_ranks_filter == frozenset({1})
    assert int(cfg.tee_for(0)) == 3
    assert cfg.duplicate_stdout_filters == ("loss,acc", "step")
    assert cfg.virtual_local_rank and cfg.role == "default_role" and cfg.max_restarts == 3

    class Custom(LogsSpecs):
        def reify(self, envs):  # type: ignore[no-untyped-def]
            raise NotImplementedError

        @property
        def root_log_dir(self) -> str:
            return ""

    with pytest.raises(ConfigError, match="logs_specs=Custom"):
        agent_config_for(LaunchConfig(logs_specs=Custom()), [str(script)])


def test_a_python_command_runs_as_torchrun_passes_it(tmp_path: Path) -> None:
    import sys

    script = tmp_path / "w.py"
    script.write_text("import os, sys\nopen(sys.argv[1] + os.environ['RANK'], 'w').close()\n")
    out = elastic_launch(LaunchConfig(nproc_per_node=2), sys.executable)(
        "-u", str(script), str(tmp_path / "r")
    )
    assert out == {0: None, 1: None}
    assert sorted(p.name for p in tmp_path.glob("r*")) == ["r0", "r1"]
