"""Workers get exactly torchrun's environment and command line.

The core test runs the real torchrun once (standalone, two workers, loopback only), has each
worker dump its environment and command line, and compares our worker_env/worker_argv for the
same command key by key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from node_agent.cli.parse import parse_config
from node_agent.config import AgentConfig, ConfigError
from node_agent.worker_env import (
    NodeAssignment,
    omp_threads_notice,
    worker_argv,
    worker_env,
)

DUMP_SCRIPT = """\
import json, os, sys
with open(os.path.join(os.environ["DUMP_DIR"], "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump({"env": dict(os.environ), "orig_argv": sys.orig_argv, "argv": sys.argv}, f)
"""
SCRIPT_ARGS = ["alpha", "--beta=1"]

# Keys torchrun's agent gives a worker that we knowingly do not: none.
NOT_SET_BY_US: frozenset[str] = frozenset()
# Keys whose values must differ, and why (see node_agent/worker_env.py):
DIFFERENT = {
    "MASTER_ADDR": "torchrun standalone says localhost; ours is the rendezvous's address (127.0.0.1)",
    "MASTER_PORT": "a free port, chosen per run",
    "TORCHELASTIC_RUN_ID": "a fresh uuid per standalone run",
    "TORCHELASTIC_ERROR_FILE": "a path inside each run's own log directory",
    "TORCHELASTIC_USE_AGENT_STORE": "False here (a round whose group-rank-0 agent hosts no store)",
}


def node(**overrides) -> NodeAssignment:
    fields = {
        "run_id": "job",
        "group_rank": 0,
        "group_world_size": 1,
        "rank_offset": 0,
        "world_size": 2,
        "master_addr": "10.0.0.1",
        "master_port": 29600,
        "restart_count": 0,
        "max_restarts": 0,
    }
    fields.update(overrides)
    return NodeAssignment(**fields)


def env_for(config: AgentConfig, assignment: NodeAssignment, local_rank: int, base=None) -> dict[str, str]:
    return worker_env(
        config=config,
        node=assignment,
        local_rank=local_rank,
        error_file="/logs/err.json",
        base_env=base or {},
    )


# --- against the real torchrun ----------------------------------------------------------------


@pytest.fixture(scope="module")
def torchrun(tmp_path_factory: pytest.TempPathFactory):
    """One real torchrun: its workers' environments, its stderr, and the agent's own environment."""
    work = tmp_path_factory.mktemp("torchrun")
    script = work / "dump_env.py"
    script.write_text(DUMP_SCRIPT)
    # A small, known environment: a marker to prove inheritance, LANG so that python does not
    # coerce the C locale (it would add LC_CTYPE to its own environment).
    environ = {
        "PATH": os.environ.get("PATH", os.defpath),
        "HOME": str(work),
        "LANG": "C.UTF-8",
        "DUMP_DIR": str(work),
        "NODE_AGENT_TEST_MARKER": "inherited",
    }
    argv = ["--standalone", "--nproc-per-node", "2", str(script), *SCRIPT_ARGS]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *argv],
        env=environ,
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    dumps = {rank: json.loads((work / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    # What a python agent started with `environ` sees as its os.environ (the runner passes that).
    agent_env = subprocess.run(
        [sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"],
        env=environ,
        capture_output=True,
        text=True,
        check=True,
    )
    return {"argv": argv, "dumps": dumps, "stderr": proc.stderr, "base_env": json.loads(agent_env.stdout)}


@pytest.fixture(scope="module")
def ours(torchrun):
    config = parse_config(torchrun["argv"], torchrun["base_env"])
    assignment = NodeAssignment(
        run_id=config.rdzv_id,
        group_rank=0,
        group_world_size=1,
        rank_offset=0,
        world_size=2,
        master_addr="127.0.0.1",
        master_port=29555,
        restart_count=0,
        max_restarts=config.max_restarts,
    )
    return config, {
        rank: worker_env(
            config=config,
            node=assignment,
            local_rank=rank,
            error_file=f"/tmp/node-agent-logs/attempt_0/{rank}/error.json",
            base_env=torchrun["base_env"],
        )
        for rank in (0, 1)
    }


@pytest.mark.parametrize("rank", [0, 1])
def test_same_keys_as_torchrun(torchrun, ours, rank):
    theirs = torchrun["dumps"][rank]["env"]
    mine = ours[1][rank]
    assert set(theirs) - set(mine) == NOT_SET_BY_US
    assert set(mine) - set(theirs) == set()


@pytest.mark.parametrize("rank", [0, 1])
def test_same_values_as_torchrun(torchrun, ours, rank):
    theirs = torchrun["dumps"][rank]["env"]
    mine = ours[1][rank]
    differing = {key for key in theirs if key in mine and theirs[key] != mine[key]}
    assert differing <= set(DIFFERENT), {k: (theirs[k], mine[k]) for k in differing - set(DIFFERENT)}
    # the expected keys really are there and hold what we say
    assert theirs["NODE_AGENT_TEST_MARKER"] == mine["NODE_AGENT_TEST_MARKER"] == "inherited"
    assert theirs["OMP_NUM_THREADS"] == mine["OMP_NUM_THREADS"] == "1"
    assert theirs["RANK"] == mine["RANK"] == theirs["LOCAL_RANK"] == str(rank)


@pytest.mark.parametrize("rank", [0, 1])
def test_the_values_that_differ_differ_as_documented(torchrun, ours, rank):
    theirs = torchrun["dumps"][rank]["env"]
    config, mine = ours[0], ours[1][rank]
    assert theirs["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert mine["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert theirs["MASTER_ADDR"] == "localhost" and mine["MASTER_ADDR"] == "127.0.0.1"
    assert theirs["TORCHELASTIC_ERROR_FILE"].endswith(f"/attempt_0/{rank}/error.json")
    uuid.UUID(theirs["TORCHELASTIC_RUN_ID"])
    assert mine["TORCHELASTIC_RUN_ID"] == config.rdzv_id
    assert int(theirs["MASTER_PORT"]) > 0 and mine["MASTER_PORT"] == "29555"


@pytest.mark.parametrize("rank", [0, 1])
def test_same_command_line_as_torchrun(torchrun, ours, rank):
    config, _ = ours
    dumped = torchrun["dumps"][rank]
    assert worker_argv(config, rank) == dumped["orig_argv"]
    assert dumped["argv"][1:] == SCRIPT_ARGS


def test_same_omp_notice_as_torchrun(torchrun, ours):
    config, _ = ours
    notice = omp_threads_notice(config, torchrun["base_env"])
    assert notice is not None
    assert notice in torchrun["stderr"]


# --- ranks ------------------------------------------------------------------------------------


def test_ranks_on_a_later_node():
    config = AgentConfig(training_script="t.py", nproc_per_node=4, min_nodes=3, max_nodes=3)
    assignment = node(group_rank=2, group_world_size=3, rank_offset=8, world_size=12)
    envs = [env_for(config, assignment, r) for r in range(4)]
    assert [e["RANK"] for e in envs] == ["8", "9", "10", "11"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["ROLE_RANK"] for e in envs] == ["8", "9", "10", "11"]
    for e in envs:
        assert (e["GROUP_RANK"], e["GROUP_WORLD_SIZE"]) == ("2", "3")
        assert (e["WORLD_SIZE"], e["ROLE_WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == ("12", "12", "4")
        assert (e["MASTER_ADDR"], e["MASTER_PORT"]) == ("10.0.0.1", "29600")


def test_rank_offset_comes_from_the_assignment():
    # The server may give offsets that are not group_rank * nproc (nodes of different sizes).
    config = AgentConfig(training_script="t.py", nproc_per_node=2, min_nodes=2, max_nodes=2)
    e = env_for(config, node(group_rank=1, group_world_size=2, rank_offset=3, world_size=5), 1)
    assert e["RANK"] == "4"


def test_restart_counters_role_and_run_id():
    config = AgentConfig(training_script="t.py", role="trainer")
    e = env_for(config, node(run_id="job-9", restart_count=2, max_restarts=5, world_size=1), 0)
    assert (e["TORCHELASTIC_RESTART_COUNT"], e["TORCHELASTIC_MAX_RESTARTS"]) == ("2", "5")
    assert (e["TORCHELASTIC_RUN_ID"], e["ROLE_NAME"]) == ("job-9", "trainer")
    assert e["TORCHELASTIC_ERROR_FILE"] == "/logs/err.json"
    assert e["TORCHELASTIC_USE_AGENT_STORE"] == "False"


def test_bad_local_rank_or_world_is_refused():
    config = AgentConfig(training_script="t.py", nproc_per_node=2)
    with pytest.raises(ValueError, match=r"local_rank 2 not in 0\.\.1"):
        env_for(config, node(), 2)
    with pytest.raises(ValueError, match=">= world_size 1"):
        env_for(config, node(world_size=1), 1)


@pytest.mark.parametrize(
    "overrides",
    [
        {"group_rank": 1, "group_world_size": 1},
        {"rank_offset": 2, "world_size": 2},
        {"master_port": 0},
        {"master_addr": ""},
        {"restart_count": -1},
    ],
)
def test_assignment_validates(overrides):
    with pytest.raises(ValueError):
        node(**overrides)


# --- inherited and defaulted variables -------------------------------------------------------


def test_base_env_is_inherited_and_not_changed():
    base = {"PATH": "/bin", "PET_NNODES": "1", "CUDA_VISIBLE_DEVICES": "2,3"}
    e = env_for(AgentConfig(training_script="t.py"), node(world_size=1), 0, base)
    assert e["PATH"] == "/bin" and e["PET_NNODES"] == "1"  # torchrun leaks PET_* too
    assert e["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert base == {"PATH": "/bin", "PET_NNODES": "1", "CUDA_VISIBLE_DEVICES": "2,3"}


def test_workers_never_inherit_the_rendezvous_token():
    # torchrun's workers would inherit it; ours must not: the user's code could join the job
    # as another node with it. A path to the token file is no secret and passes.
    base = {"PATH": "/bin", "RDZV_TOKEN": "s3cret", "RDZV_TOKEN_FILE": "/etc/rdzv/token"}
    e = env_for(AgentConfig(training_script="t.py"), node(world_size=1), 0, base)
    assert "RDZV_TOKEN" not in e and "s3cret" not in e.values()
    assert e["RDZV_TOKEN_FILE"] == "/etc/rdzv/token" and e["PATH"] == "/bin"
    assert base["RDZV_TOKEN"] == "s3cret"  # the agent's own environment is untouched


def test_worker_variables_beat_inherited_ones():
    base = {"RANK": "99", "LOCAL_RANK": "99", "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGUSR1"}
    e = env_for(AgentConfig(training_script="t.py"), node(world_size=1), 0, base)
    assert (e["RANK"], e["LOCAL_RANK"]) == ("0", "0")
    assert e["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def test_signals_to_handle_are_exported():
    config = AgentConfig(training_script="t.py", signals_to_handle=("SIGTERM", "SIGUSR1"))
    assert env_for(config, node(world_size=1), 0)["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGUSR1"


def test_nccl_async_error_handling():
    config = AgentConfig(training_script="t.py")
    assert env_for(config, node(world_size=1), 0)["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    inherited = env_for(config, node(world_size=1), 0, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})
    assert inherited["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


@pytest.mark.parametrize(
    ("nproc", "base", "expected", "notice"),
    [
        (2, {}, "1", True),  # several workers, unset: torchrun sets 1 and says so
        (1, {}, None, False),  # one worker: left alone
        (4, {"OMP_NUM_THREADS": "8"}, "8", False),  # the user's value is kept
        (
            4,
            {"OMP_NUM_THREADS": ""},
            "",
            False,
        ),  # set, even if empty, counts as set (torchrun: "in os.environ")
    ],
)
def test_omp_num_threads_rule(nproc, base, expected, notice):
    config = AgentConfig(training_script="t.py", nproc_per_node=nproc)
    e = env_for(config, node(world_size=nproc), 0, base)
    assert e.get("OMP_NUM_THREADS") == expected
    text = omp_threads_notice(config, base)
    assert (text is not None) is notice
    if notice:
        assert "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default" in text


# --- virtual local rank ---------------------------------------------------------------------


def test_virtual_local_rank_without_cuda_visible_devices():
    config = AgentConfig(training_script="t.py", nproc_per_node=3, virtual_local_rank=True)
    envs = [env_for(config, node(world_size=3), r) for r in range(3)]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0", "0"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "2"]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]


def test_virtual_local_rank_maps_through_cuda_visible_devices():
    config = AgentConfig(training_script="t.py", nproc_per_node=2, virtual_local_rank=True)
    base = {"CUDA_VISIBLE_DEVICES": "4, 6"}
    assert [env_for(config, node(), r, base)["CUDA_VISIBLE_DEVICES"] for r in (0, 1)] == ["4", "6"]
    with pytest.raises(ConfigError, match="local rank 1 has no GPU"):
        env_for(config, node(), 1, {"CUDA_VISIBLE_DEVICES": "4"})


# --- command lines ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "argv"),
    [
        ({}, ["/py", "-u", "train.py", "--lr", "1"]),
        ({"module": True}, ["/py", "-u", "-m", "train.py", "--lr", "1"]),
        ({"no_python": True}, ["train.py", "--lr", "1"]),
        ({"pass_local_rank": "dash"}, ["/py", "-u", "train.py", "--local-rank=1", "--lr", "1"]),
        ({"pass_local_rank": "underscore"}, ["/py", "-u", "train.py", "--local_rank=1", "--lr", "1"]),
        ({"no_python": True, "pass_local_rank": "dash"}, ["train.py", "--local-rank=1", "--lr", "1"]),
    ],
)
def test_worker_argv_forms(fields, argv):
    config = AgentConfig(
        training_script="train.py",
        training_script_args=("--lr", "1"),
        nproc_per_node=2,
        python_exec="/py",
        **fields,
    )
    assert worker_argv(config, 1) == argv


def test_python_exec_from_the_environment(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    python = tmp_path / "python-alias"
    python.symlink_to(sys.executable)
    config = parse_config([str(script)], {"PATH": os.defpath, "PYTHON_EXEC": str(python)})
    assert worker_argv(config, 0)[0] == str(python)


RUN_PATH_PROBE = """\
import json, os, sys
print(json.dumps({"argv": sys.argv, "name": __name__}))
if "--fail" in sys.argv:
    raise RuntimeError("boom")
if "--exit" in sys.argv:
    sys.exit(3)
"""


def _run_path(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    script = tmp_path / "probe.py"
    script.write_text(RUN_PATH_PROBE)
    error_file = tmp_path / "error.json"
    config = AgentConfig(
        training_script=str(script), training_script_args=args, run_path=True, pass_local_rank="dash"
    )
    argv = worker_argv(config, 0)
    assert argv[:3] == [sys.executable, "-u", "-c"]
    env = {"PATH": os.defpath, "TORCHELASTIC_ERROR_FILE": str(error_file)}
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60), error_file


def test_run_path_runs_the_file_as_main(tmp_path):
    proc, error_file = _run_path(tmp_path, "a", "b")
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    # as torchrun's run_script_path: sys.argv = [script, *args]; run as __main__
    assert seen == {"argv": [str(tmp_path / "probe.py"), "--local-rank=0", "a", "b"], "name": "__main__"}
    assert not error_file.exists()


def test_run_path_records_an_exception_like_torchrun(tmp_path):
    proc, error_file = _run_path(tmp_path, "--fail")
    assert proc.returncode == 1
    assert "RuntimeError: boom" in proc.stderr
    record = json.loads(error_file.read_text())["message"]
    assert record["message"] == "RuntimeError: boom"
    assert "RuntimeError: boom" in record["extraInfo"]["py_callstack"]
    assert int(record["extraInfo"]["timestamp"]) > 0


def test_run_path_keeps_exit_codes(tmp_path):
    proc, error_file = _run_path(tmp_path, "--exit")
    assert proc.returncode == 3
    assert not error_file.exists()
