"""``runner.worker_specs``: an assignment, the config and the environment in, the workers' specs out."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from node_agent.cli.parse import parse_config
from node_agent.config import AgentConfig, Std
from node_agent.worker_env import worker_specs
from protocol import Assignment


class Paths:
    """An attempt's paths that exist nowhere: worker_specs must only name them."""

    def error_file(self, local_rank: int) -> str:
        return f"/nowhere/{local_rank}/error.json"

    def stdout_path(self, local_rank: int) -> str:
        return f"/nowhere/{local_rank}/stdout.log"

    def stderr_path(self, local_rank: int) -> str:
        return f"/nowhere/{local_rank}/stderr.log"

    def filtered_stdout_path(self) -> str:
        return "/nowhere/filtered_stdout.log"

    def place_dir(self, local_rank: int) -> str:
        return f"/nowhere/place/{local_rank}"

    def page_path(self, local_rank: int) -> str:
        return f"/nowhere/{local_rank}/progress.page"

    def flight_recorder_stem(self, kind: str) -> str:
        return f"/nowhere/fr/{kind}_rank_"

    def filtered_stderr_path(self) -> str:
        return "/nowhere/filtered_stderr.log"


ASSIGNMENT = Assignment(
    job_id="job",
    round=3,
    group_rank=1,
    group_world_size=2,
    rank_offset=2,
    world_size=4,
    master_addr="10.0.0.7",
    master_port=29511,
    restart_count=1,
    max_restarts=2,
)


def config(tmp_path: Path, *flags: str) -> AgentConfig:
    script = tmp_path / "train.py"
    script.write_text("")
    argv = ["--nnodes=2", "--nproc-per-node=2", "--rdzv-endpoint=h:1", "--rdzv-id=job", "--max-restarts=2"]
    return parse_config([*argv, *flags, str(script), "--lr", "0.1"], {})


def test_each_local_rank_gets_its_place_in_the_job_and_its_files(tmp_path: Path) -> None:
    cfg = config(tmp_path, "--tee=1", "--local-ranks-filter=1")
    specs = worker_specs(cfg, ASSIGNMENT, {"PATH": "/bin", "FOO": "bar"}, Paths())
    assert [(s.local_rank, s.rank) for s in specs] == [(0, 2), (1, 3)]
    env = specs[1].env
    assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"], env["WORLD_SIZE"]) == ("3", "1", "1", "4")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.7", "29511")
    assert (env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == ("1", "2")
    assert env["FOO"] == "bar"  # the agent's environment is the workers'
    assert env["TORCHELASTIC_ERROR_FILE"] == specs[1].error_file == "/nowhere/1/error.json"
    assert (specs[1].stdout_path, specs[1].stderr_path) == ("/nowhere/1/stdout.log", "/nowhere/1/stderr.log")
    assert list(specs[0].argv) == [sys.executable, "-u", str(tmp_path / "train.py"), "--lr", "0.1"]
    assert [s.console for s in specs] == [False, True]  # --local-ranks-filter
    assert [s.tee for s in specs] == [Std.OUT, Std.OUT]
    assert [s.prefix for s in specs] == ["[default0]:", "[default1]:"]


def test_the_environment_given_is_the_only_one_read_and_secrets_stay_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ONLY_IN_OS_ENVIRON", "1")
    cfg = config(tmp_path)
    specs = worker_specs(cfg, ASSIGNMENT, {"RDZV_TOKEN": "s3cret", "ONLY_HERE": "1"}, Paths())
    assert all("RDZV_TOKEN" not in s.env and s.env["ONLY_HERE"] == "1" for s in specs)
    assert all("ONLY_IN_OS_ENVIRON" not in s.env for s in specs)


def test_the_same_inputs_give_the_same_specs(tmp_path: Path) -> None:
    cfg = config(tmp_path, "--redirects=3")
    environ = {"PATH": "/bin"}
    assert worker_specs(cfg, ASSIGNMENT, environ, Paths()) == worker_specs(cfg, ASSIGNMENT, environ, Paths())
    assert environ == {"PATH": "/bin"}  # not written to
    assert sorted(os.listdir(tmp_path)) == ["train.py"]  # nothing created
