"""node-agent's command line: every torchrun flag, its PET_* variable, defaults and errors."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from node_agent.cli import nproc
from node_agent.cli.flags import FLAGS, build_parser
from node_agent.cli.nproc import physical_gpu_uuids, resolve_nproc, visible_gpu_count
from node_agent.cli.parse import parse_config
from node_agent.config import (
    DEFAULT_RDZV_PORT,
    AgentConfig,
    ConfigError,
    RdzvConf,
    Std,
    StdSpec,
)

REPO = Path(__file__).resolve().parents[3]
ENDPOINT = ["--rdzv-endpoint", "rdzv.example:1234"]  # avoids the single-node standalone default


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("scripts") / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


@pytest.fixture
def env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", os.defpath)}


def parse(argv: list[str], environ: dict[str, str] | None = None) -> AgentConfig:
    return parse_config(argv, {"PATH": os.environ.get("PATH", os.defpath), **(environ or {})})


# --- every flag, each spelling, and PET_* ---------------------------------------------------

# (dest, spellings, value, getter, expected, extra argv that the flag needs, script override)
VALUE_FLAGS = [
    ("nnodes", ["--nnodes"], "2:4", lambda c: (c.min_nodes, c.max_nodes), (2, 4), ENDPOINT),
    ("nproc_per_node", ["--nproc-per-node", "--nproc_per_node"], "3", lambda c: c.nproc_per_node, 3, []),
    (
        "rdzv_backend",
        ["--rdzv-backend", "--rdzv_backend"],
        "c10d",
        lambda c: (c.rdzv_backend, c.standalone, c.rdzv_host, c.rdzv_port),
        ("c10d", False, "127.0.0.1", DEFAULT_RDZV_PORT),
        [],
    ),
    (
        "rdzv_endpoint",
        ["--rdzv-endpoint", "--rdzv_endpoint"],
        "10.0.0.7:2345",
        lambda c: (c.rdzv_endpoint, c.rdzv_host, c.rdzv_port, c.standalone),
        ("10.0.0.7:2345", "10.0.0.7", 2345, False),
        [],
    ),
    ("rdzv_id", ["--rdzv-id", "--rdzv_id"], "job7", lambda c: c.rdzv_id, "job7", ENDPOINT),
    (
        "rdzv_conf",
        ["--rdzv-conf", "--rdzv_conf"],
        "join_timeout=5,is_host=true",
        lambda c: (c.rdzv_conf.join_timeout, c.rdzv_conf.is_host),
        (5.0, True),
        [],
    ),
    ("max_restarts", ["--max-restarts", "--max_restarts"], "3", lambda c: c.max_restarts, 3, []),
    (
        "monitor_interval",
        ["--monitor-interval", "--monitor_interval"],
        "0.5",
        lambda c: c.monitor_interval,
        0.5,
        [],
    ),
    ("start_method", ["--start-method", "--start_method"], "fork", lambda c: c.start_method, "fork", []),
    (
        "event_log_handler",
        ["--event-log-handler", "--event_log_handler"],
        "console",
        lambda c: c.event_log_handler,
        "console",
        [],
    ),
    ("role", ["--role"], "trainer", lambda c: c.role, "trainer", []),
    (
        "log_dir",
        ["--log-dir", "--log_dir"],
        "/nonexistent/logs",
        lambda c: c.log_dir,
        "/nonexistent/logs",
        [],
    ),
    (
        "redirects",
        ["-r", "--redirects"],
        "3",
        lambda c: (c.redirect_for(0), c.redirect_for(5)),
        (Std.ALL,) * 2,
        [],
    ),
    ("tee", ["-t", "--tee"], "0:1,1:2", lambda c: (c.tee_for(0), c.tee_for(1), c.tee_for(2)), (1, 2, 0), []),
    (
        "local_ranks_filter",
        ["--local-ranks-filter", "--local_ranks_filter"],
        "0,2",
        lambda c: c.local_ranks_filter,
        frozenset({0, 2}),
        [],
    ),
    (
        "duplicate_stdout_filters",
        ["--duplicate-stdout-filters", "--duplicate_stdout_filters"],
        "loss,,acc,step",
        lambda c: c.duplicate_stdout_filters,
        ("loss,acc", "step"),
        [],
    ),
    (
        "duplicate_stderr_filters",
        ["--duplicate-stderr-filters", "--duplicate_stderr_filters"],
        "Error",
        lambda c: c.duplicate_stderr_filters,
        ("Error",),
        [],
    ),
    ("node_rank", ["--node-rank", "--node_rank"], "2", lambda c: c.node_rank, 2, []),
    ("master_addr", ["--master-addr", "--master_addr"], "10.1.1.1", lambda c: c.master_addr, "10.1.1.1", []),
    ("master_port", ["--master-port", "--master_port"], "29501", lambda c: c.master_port, 29501, []),
    ("local_addr", ["--local-addr", "--local_addr"], "node3", lambda c: c.local_addr, "node3", []),
    (
        "signals_to_handle",
        ["--signals-to-handle", "--signals_to_handle"],
        "SIGTERM,SIGUSR1",
        lambda c: c.signals_to_handle,
        ("SIGTERM", "SIGUSR1"),
        [],
    ),
    (
        "shutdown_timeout",
        ["--shutdown-timeout", "--shutdown_timeout"],
        "5",
        lambda c: c.shutdown_timeout,
        5.0,
        [],
    ),
    (
        "pass_local_rank",
        ["--pass-local-rank", "--pass_local_rank"],
        "underscore",
        lambda c: c.pass_local_rank,
        "underscore",
        [],
    ),
    ("log_format", ["--log-format", "--log_format"], "json", lambda c: c.log_format, "json", []),
    (
        "health_check",
        ["--health-check", "--health_check"],
        "nvidia-smi",
        lambda c: c.health_check,
        "nvidia-smi",
        [],
    ),
    ("hang_timeout", ["--hang-timeout", "--hang_timeout"], "300", lambda c: c.hang_timeout, "300", []),
    ("hang_conf", ["--hang-conf", "--hang_conf"], "floor=60", lambda c: c.hang_conf, "floor=60", []),
    ("preload", ["--preload"], "torch, torch.nn,torch", lambda c: c.preload, ("torch", "torch.nn"), []),
    ("gpu_release_timeout", ["--gpu-release-timeout"], "7.5", lambda c: c.gpu_release_timeout, 7.5, []),
    ("gpu_release_mib", ["--gpu-release-mib"], "1024", lambda c: c.gpu_release_mib, 1024, []),
    ("snapshot_memory", ["--snapshot-memory"], "16G", lambda c: c.snapshot_memory, 16 << 30, []),
    (
        "snapshot_replication_rate",
        ["--snapshot-replication-rate"],
        "64M",
        lambda c: c.snapshot_replication_rate,
        64 << 20,
        [],
    ),
    ("snapshot_dir", ["--snapshot-dir"], "/var/snaps", lambda c: c.snapshot_dir, "/var/snaps", []),
    ("outcome_dir", ["--outcome-dir"], "/var/outcome", lambda c: c.outcome_dir, "/var/outcome", []),
]

SWITCH_FLAGS = [
    ("standalone", ["--standalone"], lambda c: c.standalone, ["--rdzv-backend", "c10d"]),
    ("module", ["-m", "--module"], lambda c: c.module, []),
    ("no_python", ["--no-python", "--no_python"], lambda c: c.no_python, []),
    ("run_path", ["--run-path", "--run_path"], lambda c: c.run_path, []),
    (
        "virtual_local_rank",
        ["--virtual-local-rank", "--virtual_local_rank"],
        lambda c: c.virtual_local_rank,
        [],
    ),
]


def _value_cases():
    for dest, spellings, value, getter, expected, extra in VALUE_FLAGS:
        for spelling in spellings:
            yield pytest.param(dest, [*extra, spelling, value], {}, getter, expected, id=f"{spelling}")
        yield pytest.param(
            dest, list(extra), {f"PET_{dest.upper()}": value}, getter, expected, id=f"PET_{dest.upper()}"
        )


@pytest.mark.parametrize(("dest", "argv", "environ", "getter", "expected"), list(_value_cases()))
def test_value_flag(dest, argv, environ, getter, expected, script):
    config = parse([*argv, script], environ)
    assert getter(config) == expected


def _switch_script(dest: str, script: str) -> str:
    # --no-python runs a command, so give it one that exists
    return sys.executable if dest == "no_python" else script


def _switch_cases():
    for dest, spellings, getter, extra in SWITCH_FLAGS:
        for spelling in spellings:
            yield pytest.param(dest, [*extra, spelling], {}, getter, True, id=spelling)
        yield pytest.param(
            dest, list(extra), {f"PET_{dest.upper()}": "1"}, getter, True, id=f"PET_{dest.upper()}=1"
        )
        yield pytest.param(
            dest, list(extra), {f"PET_{dest.upper()}": "0"}, getter, False, id=f"PET_{dest.upper()}=0"
        )


@pytest.mark.parametrize(("dest", "argv", "environ", "getter", "expected"), list(_switch_cases()))
def test_switch_flag(dest, argv, environ, getter, expected, script):
    config = parse([*argv, _switch_script(dest, script)], environ)
    assert getter(config) is expected


def test_the_tables_cover_every_flag():
    covered = (
        {row[0] for row in VALUE_FLAGS}
        | {row[0] for row in SWITCH_FLAGS}
        | {"logs_specs", "numa_binding", "token_file"}  # token_file: test_token_sources
        | {"tls_ca", "tls_cert", "tls_key"}  # test_tls_args.py
    )
    assert covered == {flag.dest for flag in FLAGS}
    spellings = {s for row in VALUE_FLAGS for s in row[1]} | {s for row in SWITCH_FLAGS for s in row[1]}
    assert spellings == {name for flag in FLAGS for name in flag.names} - {
        "--logs-specs",
        "--logs_specs",
        "--numa-binding",
        "--numa_binding",
        "--token-file",
        "--token_file",
        *(f"--tls{sep}{name}" for sep in "-_" for name in ("ca", "cert", "key")),
    }


def test_flag_beats_environment(script):
    config = parse(
        ["--nproc-per-node", "2", "--role", "a", script], {"PET_NPROC_PER_NODE": "4", "PET_ROLE": "b"}
    )
    assert (config.nproc_per_node, config.role) == (2, "a")
    # a switch cannot be turned off from the environment once on the command line (torchrun)
    assert parse(["--virtual-local-rank", script], {"PET_VIRTUAL_LOCAL_RANK": "0"}).virtual_local_rank


def test_pet_switch_takes_any_nonzero_integer(script):
    assert parse([script], {"PET_RUN_PATH": "2"}).run_path


def test_parse_config_reads_only_the_given_environment(script, monkeypatch):
    monkeypatch.setenv("PET_NPROC_PER_NODE", "7")
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "9")
    config = parse([script])
    assert (config.nproc_per_node, config.shutdown_timeout) == (1, 30.0)


def test_spellings_can_use_equals(script):
    config = parse(["--nproc_per_node=2", "-r3", "--rdzv-conf=join_timeout=7", script])
    assert (config.nproc_per_node, config.redirect_for(1), config.rdzv_conf.join_timeout) == (2, Std.ALL, 7.0)


def test_script_arguments_are_not_ours(script):
    config = parse(["--nproc-per-node", "2", script, "--nproc-per-node", "8", "-m", "--pass-local-rank"])
    assert config.nproc_per_node == 2
    assert not config.module and config.pass_local_rank is None
    assert config.training_script_args == ("--nproc-per-node", "8", "-m", "--pass-local-rank")


# --- torchrun's own parser as the reference -----------------------------------------------

_TORCHRUN_PARSER_DUMP = """
import json
from torch.distributed.run import get_args_parser
actions = [
    {"dest": a.dest, "options": a.option_strings, "default": a.default, "kind": type(a).__name__}
    for a in get_args_parser()._actions
]
print(json.dumps(actions))
"""


@pytest.fixture(scope="module")
def torchrun_actions() -> dict[str, dict]:
    # In a subprocess, with no PET_* set, so torch's import stays out of this process and
    # its env-reading defaults are the plain ones.
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    out = subprocess.run(
        [sys.executable, "-c", _TORCHRUN_PARSER_DUMP],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return {a["dest"]: a for a in json.loads(out.stdout) if a["dest"] != "help"}


def test_every_torchrun_flag_is_accepted_in_every_spelling(torchrun_actions):
    ours = {action.dest: action.option_strings for action in build_parser()._actions if action.dest != "help"}
    for dest, theirs in torchrun_actions.items():
        assert dest in ours, dest
        assert set(theirs["options"]) <= set(ours[dest]), dest


def test_pet_variables_exist_exactly_where_torchrun_reads_them(torchrun_actions):
    reads_env = {dest for dest, a in torchrun_actions.items() if a["kind"] in ("env", "check_env")}
    ours = {flag.dest for flag in FLAGS if flag.env}
    assert reads_env <= ours
    assert {dest for dest in torchrun_actions if dest not in reads_env and dest in ours} == set()
    assert reads_env >= {"nproc_per_node", "standalone", "module"}
    assert "logs_specs" not in reads_env and "numa_binding" not in reads_env


# How each torchrun default appears in our config; entries say why a value differs.
def _expected_from_torchrun(defaults: dict) -> dict:
    return {
        "min_nodes": int(defaults["nnodes"].split(":")[0]),
        "max_nodes": int(defaults["nnodes"].split(":")[1]),
        "nproc_per_node": int(defaults["nproc_per_node"]),
        # torchrun 2.13 also turns its single-node default into c10d on a free port with a uuid
        # (run.py run()); we do the same, on 127.0.0.1 rather than localhost.
        "rdzv_backend": "c10d",
        "rdzv_endpoint": "127.0.0.1:0",
        "max_restarts": defaults["max_restarts"],
        "monitor_interval": defaults["monitor_interval"],
        "start_method": defaults["start_method"],
        "event_log_handler": defaults["event_log_handler"],
        "role": defaults["role"],
        "module": defaults["module"],
        "no_python": defaults["no_python"],
        "run_path": defaults["run_path"],
        "log_dir": defaults["log_dir"],
        "redirects": StdSpec(default=Std(int(defaults["redirects"]))),
        "tee": StdSpec(default=Std(int(defaults["tee"]))),
        "local_ranks_filter": None
        if defaults["local_ranks_filter"] == ""
        else defaults["local_ranks_filter"],
        "duplicate_stdout_filters": tuple(defaults["duplicate_stdout_filters"]),
        "duplicate_stderr_filters": tuple(defaults["duplicate_stderr_filters"]),
        "node_rank": defaults["node_rank"],
        # torchrun's 127.0.0.1 only feeds its static backend; None here means "not given"
        "master_addr": None,
        "master_port": defaults["master_port"],
        "local_addr": defaults["local_addr"],
        "logs_specs": defaults["logs_specs"],
        "numa_binding": defaults["numa_binding"],
        "signals_to_handle": tuple(defaults["signals_to_handle"].split(",")),
        "shutdown_timeout": 30.0,  # torchrun: None -> TORCH_ELASTIC_SHUTDOWN_TIMEOUT else 30
        "virtual_local_rank": defaults["virtual_local_rank"],
    }


def test_defaults_match_torchrun(torchrun_actions, script):
    defaults = {dest: a["default"] for dest, a in torchrun_actions.items()}
    assert defaults["rdzv_backend"] == "static"  # the one default we change, on purpose
    assert defaults["master_addr"] == "127.0.0.1"
    config = parse([script])
    for attr, expected in _expected_from_torchrun(defaults).items():
        assert getattr(config, attr) == expected, attr
    assert config.standalone and config.hosts_rendezvous
    uuid.UUID(config.rdzv_id)


def test_multi_node_defaults_keep_torchruns_rdzv_id(torchrun_actions, script):
    config = parse(["--nnodes", "2", *ENDPOINT, script])
    assert config.rdzv_id == torchrun_actions["rdzv_id"]["default"] == "none"
    assert config.rdzv_conf == RdzvConf()
    assert not config.standalone and not config.hosts_rendezvous


def test_our_own_defaults(script):
    config = parse([script])
    assert config.pass_local_rank is None
    assert config.log_format == "text"
    assert config.health_check is None
    assert config.python_exec == sys.executable
    assert config.log_level is None  # unset: the agent shows its INFO lines
    assert config.entrypoint_name == script
    assert not config.elastic


# --- standalone and the rendezvous endpoint ------------------------------------------------


@pytest.mark.parametrize("nnodes", [[], ["--nnodes", "1"], ["--nnodes", "1:1"]])
def test_single_node_without_endpoint_is_standalone(nnodes, script):
    config = parse([*nnodes, script])
    assert config.standalone
    assert (config.rdzv_backend, config.rdzv_endpoint, config.rdzv_host, config.rdzv_port) == (
        "c10d",
        "127.0.0.1:0",
        "127.0.0.1",
        0,
    )
    assert str(uuid.UUID(config.rdzv_id)) == config.rdzv_id


def test_each_standalone_run_gets_its_own_id(script):
    assert parse([script]).rdzv_id != parse([script]).rdzv_id


def test_standalone_overrides_rdzv_flags_and_warns(script, caplog):
    with caplog.at_level(logging.WARNING, logger="node_agent.cli"):
        config = parse(
            ["--standalone", "--rdzv-backend", "static", "--rdzv-endpoint", "h:1", script],
            {"PET_RDZV_ID": "mine"},
        )
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("c10d", "127.0.0.1:0")
    assert config.rdzv_id != "mine"
    message = caplog.text
    assert (
        "--rdzv-backend=static" in message
        and "--rdzv-endpoint=h:1" in message
        and "PET_RDZV_ID=mine" in message
    )


def test_standalone_without_rdzv_flags_does_not_warn(script, caplog):
    with caplog.at_level(logging.WARNING, logger="node_agent.cli"):
        parse(["--standalone", script])
        parse([script])
    assert caplog.text == ""


def test_implicit_standalone_warns_about_a_given_id(script, caplog):
    with caplog.at_level(logging.WARNING, logger="node_agent.cli"):
        config = parse(["--rdzv-id", "job1", script])
    assert config.standalone and config.rdzv_id != "job1"
    assert "--rdzv-id=job1" in caplog.text


def test_explicit_backend_is_not_standalone(script):
    config = parse(["--rdzv-backend", "c10d", script])
    assert not config.standalone
    assert (config.rdzv_host, config.rdzv_port) == ("127.0.0.1", DEFAULT_RDZV_PORT)


def test_master_port_on_one_node_is_static_as_in_torchrun(script, caplog):
    with caplog.at_level(logging.WARNING, logger="node_agent.cli"):
        config = parse(["--master-port", "29501", script])
    assert not config.standalone and config.rdzv_backend == "static"
    assert (config.rdzv_host, config.rdzv_port) == ("127.0.0.1", 29501)
    assert caplog.text == ""


def test_master_addr_alone_on_one_node_is_ignored_as_in_torchrun(script, caplog):
    with caplog.at_level(logging.WARNING, logger="node_agent.cli"):
        config = parse(["--master-addr", "10.0.0.9", script])
    assert config.standalone
    assert "--master-addr: ignored, as torchrun ignores it with --rdzv-backend=c10d" in caplog.text


@pytest.mark.parametrize(
    ("argv", "environ"),
    [
        (["--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1", "--master_port", "1234"], {}),
        (
            [],
            {
                "PET_NNODES": "2",
                "PET_NODE_RANK": "1",
                "PET_MASTER_ADDR": "10.0.0.1",
                "PET_MASTER_PORT": "1234",
            },
        ),
    ],
    ids=["flags", "PET"],
)
def test_node_rank_without_a_backend_is_torchruns_static(argv, environ, script):
    config = parse([*argv, script], environ)
    assert config.rdzv_backend == "static" and config.node_rank == 1
    assert (config.rdzv_host, config.rdzv_port) == ("10.0.0.1", 1234)


def test_node_rank_with_our_server_orders_nodes(script, caplog):
    with caplog.at_level(logging.WARNING, logger="node_agent.cli"):
        config = parse(["--node-rank", "1", *ENDPOINT, script])
    assert config.rdzv_backend == "c10d" and config.node_rank_given and config.node_rank == 1
    assert caplog.text == ""


def test_node_rank_with_etcd_warns(script, caplog):
    with caplog.at_level(logging.WARNING, logger="node_agent.cli"):
        config = parse(["--node-rank", "1", "--rdzv-backend", "etcd", *ENDPOINT, script])
    assert "--node-rank=1: ignored with --rdzv-backend=etcd" in caplog.text
    assert not config.node_rank_given


@pytest.mark.parametrize(
    ("endpoint", "host", "port"),
    [
        ("rdzv.example", "rdzv.example", DEFAULT_RDZV_PORT),
        ("rdzv.example:29400", "rdzv.example", 29400),
        ("10.0.0.1:1", "10.0.0.1", 1),
        ("[::1]:29501", "::1", 29501),
        ("[fe80::1]", "fe80::1", DEFAULT_RDZV_PORT),
        ("  host-a:65535 ", "host-a", 65535),
    ],
)
def test_endpoint_forms(endpoint, host, port, script):
    config = parse(["--nnodes", "2", "--rdzv-endpoint", endpoint, script])
    assert (config.rdzv_host, config.rdzv_port) == (host, port)
    assert config.rdzv_endpoint == endpoint.strip()


def test_port_zero_endpoint_is_for_a_single_node_that_hosts(script):
    config = parse(["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", script])
    assert not config.standalone and config.rdzv_port == 0 and config.hosts_rendezvous


def test_is_host_makes_this_agent_host(script):
    assert parse(["--rdzv-conf", "is_host=1", *ENDPOINT, script]).hosts_rendezvous


# --- --pass-local-rank's optional value -------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "style", "args"),
    [
        (["--pass-local-rank", "{s}", "a"], "dash", ("a",)),
        (["--pass_local_rank", "{s}"], "dash", ()),
        (["--pass-local-rank", "underscore", "{s}", "x"], "underscore", ("x",)),
        (["--pass-local-rank=dash", "{s}"], "dash", ()),
        (["--nproc-per-node", "2", "--pass-local-rank", "{s}"], "dash", ()),
        (["-r", "3", "--pass-local-rank", "-m", "{s}"], "dash", ()),
        (["--pass", "{s}"], "dash", ()),  # argparse abbreviations still work
    ],
)
def test_bare_pass_local_rank_means_dash(argv, style, args, script):
    config = parse([a.replace("{s}", script) for a in argv])
    assert config.pass_local_rank == style
    assert config.training_script == script
    assert config.training_script_args == args


# --- rdzv-conf --------------------------------------------------------------------------------


def test_rdzv_conf_values():
    conf = RdzvConf.parse(
        "join_timeout=10, last_call_timeout=1.5,close_timeout=0,heartbeat_interval=0.5,"
        "heartbeat_timeout=4,read_timeout=3,is_host=no,exit_barrier_timeout=20"
    )
    assert conf == RdzvConf(
        join_timeout=10,
        last_call_timeout=1.5,
        close_timeout=0,
        heartbeat_interval=0.5,
        heartbeat_timeout=4,
        read_timeout=3,
        is_host=False,
        exit_barrier_timeout=20,
    )


def test_rdzv_conf_empty_is_defaults():
    assert RdzvConf.parse("") == RdzvConf.parse("  ") == RdzvConf()


@pytest.mark.parametrize(
    ("text", "interval", "timeout"),
    [
        ("keep_alive_interval=5,keep_alive_max_attempt=3", 5.0, 15.0),  # torchrun's defaults: 15 s
        ("keep_alive_interval=2", 2.0, 6.0),  # torch's 3 attempts
        ("keep_alive_max_attempt=4", 1.0, 4.0),  # our 1 s interval
        ("heartbeat_interval=0.5,keep_alive_max_attempt=10", 0.5, 5.0),
    ],
)
def test_rdzv_conf_keep_alive_sets_liveness(text, interval, timeout):
    conf = RdzvConf.parse(text)
    assert (conf.heartbeat_interval, conf.heartbeat_timeout) == (interval, timeout)


def test_rdzv_conf_keep_alive_beats_heartbeat_timeout(caplog):
    with caplog.at_level(logging.WARNING):
        conf = RdzvConf.parse("heartbeat_timeout=99,keep_alive_interval=1,keep_alive_max_attempt=2")
    assert conf.heartbeat_timeout == 2.0
    assert "heartbeat_timeout=99" in caplog.text


@pytest.mark.parametrize(
    "text", ["store_type=tcp,use_libuv=1,timeout=900", "rank=0,local_addr=x,protocol=https"]
)
def test_rdzv_conf_accepts_torch_keys_it_does_not_use(text):
    conf = RdzvConf.parse(text)
    assert dict(conf.extra) == dict(kv.split("=") for kv in text.split(","))
    assert conf.join_timeout == 600.0


def test_rdzv_conf_later_key_wins():
    assert RdzvConf.parse("join_timeout=1,join_timeout=2").join_timeout == 2.0


@pytest.mark.parametrize("value", ["1", "true", "True", "yes", "y", "t"])
def test_rdzv_conf_booleans(value):
    assert RdzvConf.parse(f"is_host={value}").is_host is True


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("join_timeout", "'join_timeout' has no value"),
        ("join_timeout=", "'join_timeout' has no value"),
        ("=5", "expected key=value"),
        ("join_timeout=soon", "join_timeout='soon' is not a number"),
        ("join_timeout=inf", "join_timeout='inf' must be a finite"),
        ("join_timeout=0", "join_timeout=0.0 must be > 0"),
        ("last_call_timeout=-1", "last_call_timeout=-1.0 must be >= 0"),
        ("is_host=maybe", "is_host='maybe' is not a boolean"),
        ("keep_alive_max_attempt=0", "keep_alive_max_attempt=0 must be >= 1"),
        ("keep_alive_max_attempt=1.5", "keep_alive_max_attempt='1.5' is not an integer"),
        (
            "heartbeat_interval=2,heartbeat_timeout=1",
            "heartbeat_timeout=1.0 is shorter than heartbeat_interval",
        ),
        ("keep_alive_interval=1,heartbeat_interval=1", "same setting"),
        ("store_type=redis", "store_type='redis'"),
        ("timeout=long", "timeout='long' is not an integer"),
    ],
)
def test_rdzv_conf_errors(text, needle, script):
    with pytest.raises(ConfigError) as info:
        parse(["--rdzv-conf", text, script])
    assert needle in str(info.value)


# --- redirects / tee ------------------------------------------------------------------------------


def test_std_spec_forms():
    assert StdSpec.parse("2", origin="-r").for_rank(7) == Std.ERR
    spec = StdSpec.parse("0:3,1:0,12:1", origin="-r")
    assert [spec.for_rank(r) for r in (0, 1, 2, 12)] == [Std.ALL, Std.NONE, Std.NONE, Std.OUT]
    with pytest.raises(TypeError):
        spec.per_rank[3] = Std.ALL  # type: ignore[index]


# --- errors ---------------------------------------------------------------------------------------

ERRORS = [
    # nnodes
    (["--nnodes", "0"], {}, "--nnodes='0': expected N or MIN:MAX"),
    (["--nnodes", "3:2"], {}, "--nnodes='3:2'"),
    (["--nnodes", "two"], {}, "--nnodes='two'"),
    (["--nnodes", "1:2:3"], {}, "--nnodes='1:2:3'"),
    (["--nnodes=-1:2"], {}, "--nnodes='-1:2'"),
    ([], {"PET_NNODES": "0:0"}, "PET_NNODES='0:0'"),
    # nproc
    (["--nproc-per-node", "0"], {}, "--nproc-per-node='0': the number of workers must be >= 1"),
    (["--nproc-per-node", "-2"], {}, "--nproc-per-node='-2'"),
    (
        ["--nproc-per-node", "lots"],
        {},
        "--nproc-per-node='lots' is not valid: use a positive integer, 'auto'",
    ),
    (["--nproc-per-node", "xpu"], {}, "xpu is not supported"),
    ([], {"PET_NPROC_PER_NODE": ""}, "PET_NPROC_PER_NODE=''"),
    # backends
    (["--rdzv-backend", "static", "--nnodes", "1:2"], {}, "needs a fixed node count (--nnodes N)"),
    (["--rdzv-backend", "static", "--nnodes", "2", "--node-rank", "2"], {}, "--node-rank=2 must be below"),
    (
        ["--rdzv-backend", "zookeeper"],
        {},
        "'zookeeper' is not a rendezvous backend: use one of c10d, static, etcd",
    ),
    ([], {"PET_RDZV_BACKEND": "etc"}, "PET_RDZV_BACKEND='etc' is not a rendezvous backend"),
    (["--nnodes", "2"], {}, "a multi-node run needs --rdzv-endpoint"),
    (["--nnodes", "2"], {}, "or torchrun's static flags: --node-rank R"),
    (["--rdzv-id", "", *ENDPOINT], {}, "--rdzv-id is empty"),
    (
        ["--standalone", "--nnodes", "1:2"],
        {},
        "--standalone runs a private rendezvous no other node can join",
    ),
    # endpoints and ports
    (["--nnodes", "2", "--rdzv-endpoint", "h:0"], {}, "port 0 (a free port) only works for a single-node"),
    (["--rdzv-endpoint", "h:70000"], {}, "--rdzv-endpoint='h:70000': the port must be a number in 1..65535"),
    (["--rdzv-endpoint", "h:http"], {}, "--rdzv-endpoint='h:http'"),
    (["--rdzv-endpoint", "::1:29500"], {}, "put an IPv6 address in brackets"),
    (["--rdzv-endpoint", "[::1"], {}, "write an IPv6 endpoint as [ADDR]:PORT"),
    (["--rdzv-endpoint", "[::1]29500"], {}, "write an IPv6 endpoint as [ADDR]:PORT"),
    (["--rdzv-endpoint", ":29500"], {}, "the host must be"),
    (["--rdzv-endpoint", "bad host:1"], {}, "the host must be"),
    (["--master-port", "0"], {}, "--master-port='0': a port must be in 1..65535"),
    (["--master-port", "65536"], {}, "--master-port='65536'"),
    (["--master-port", "x"], {}, "--master-port='x' is not an integer"),
    ([], {"PET_MASTER_PORT": ""}, "PET_MASTER_PORT='' is not an integer"),
    # numbers
    (["--max-restarts", "-1"], {}, "--max-restarts='-1' must be >= 0"),
    (["--max-restarts", "1.5"], {}, "--max-restarts='1.5' is not an integer"),
    (["--monitor-interval", "0"], {}, "--monitor-interval='0' must be > 0"),
    (["--monitor-interval", "fast"], {}, "--monitor-interval='fast' is not a number"),
    (["--shutdown-timeout", "-1"], {}, "--shutdown-timeout='-1' must be >= 0"),
    (["--shutdown-timeout", "nan"], {}, "must be a finite number"),
    ([], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"}, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT='soon' is not a number"),
    (["--node-rank", "-1"], {}, "--node-rank='-1' must be >= 0"),
    # choices
    (
        ["--start-method", "thread"],
        {},
        "--start-method='thread' is not valid: use one of spawn, fork, forkserver",
    ),
    ([], {"PET_START_METHOD": "thread"}, "PET_START_METHOD='thread'"),
    (
        ["--event-log-handler", "file"],
        {},
        "--event-log-handler='file' is not valid: use one of null, console",
    ),
    (["--log-format", "xml"], {}, "--log-format='xml' is not valid: use one of text, json"),
    (["--pass-local-rank=camel"], {}, "--pass-local-rank='camel' is not valid: use one of dash, underscore"),
    ([], {"LOGLEVEL": "chatty"}, "LOGLEVEL='chatty' is not a log level"),
    # redirects, filters, signals
    (["-r", "4"], {}, "--redirects='4' is not valid: expected 0 (none)"),
    (["--tee", "0:5"], {}, "--tee='0:5' is not valid"),
    (["--tee", "a:1"], {}, "--tee='a:1' is not valid"),
    (["--redirects", "0:1,0:2"], {}, "names local rank 0 twice"),
    (["--local-ranks-filter", "0,one"], {}, "--local-ranks-filter='0,one': expected a comma-separated list"),
    (["--local-ranks-filter", "0,-1"], {}, "--local-ranks-filter='0,-1'"),
    (["--local-ranks-filter", "\u00b2"], {}, "expected a comma-separated list"),
    (["--tee", "\u00b2:1"], {}, "is not valid"),
    (["--signals-to-handle", "SIGTERM,SIGFOO"], {}, "'SIGFOO' is not a signal name"),
    (["--signals-to-handle", "TERM"], {}, "'TERM' is not a signal name"),
    (["--signals-to-handle", "SIGTERM,"], {}, "'' is not a signal name"),
    (["--signals-to-handle", "SIG_IGN"], {}, "'SIG_IGN' is not a signal name"),
    (["--signals-to-handle", "SIGKILL"], {}, "SIGKILL cannot be caught"),
    # switches from the environment
    ([], {"PET_STANDALONE": "yes"}, "PET_STANDALONE='yes': expected an integer (0 = off, non-zero = on)"),
    # torchrun flags we do not implement
    (["--logs-specs", "mine"], {}, "--logs-specs is not supported yet"),
    (["--logs_specs", "mine"], {}, "--logs-specs is not supported yet"),
    (
        ["--numa-binding", "everywhere"],
        {},
        "--numa-binding='everywhere' is not valid: use one of node, socket, exclusive, core-complex",
    ),
    (["--gpu-release-timeout", "-1"], {}, "--gpu-release-timeout='-1' must be >= 0 seconds"),
    (["--gpu-release-mib", "-5"], {}, "--gpu-release-mib='-5' must be >= 0"),
    # the entrypoint
    (["-m", "--no-python"], {}, "don't use both --no-python and -m/--module"),
    (["-m", "--run-path"], {}, "--run-path runs a file by its path"),
    (
        ["--virtual-local-rank", "--nproc-per-node", "2"],
        {"CUDA_VISIBLE_DEVICES": "3"},
        "which lists 1 for 2 workers",
    ),
    ([], {"PYTHON_EXEC": "/no/such/python"}, "PYTHON_EXEC='/no/such/python': no such executable"),
    ([], {"PYTHON_EXEC": ""}, "PYTHON_EXEC is set but empty"),
]


@pytest.mark.parametrize(("argv", "environ", "needle"), ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_errors(argv, environ, needle, script):
    with pytest.raises(ConfigError) as info:
        parse([*argv, script], environ)
    assert needle in str(info.value)


def test_missing_script_is_named(tmp_path):
    missing = str(tmp_path / "trian.py")
    with pytest.raises(ConfigError, match=re.escape(f"training script '{missing}' not found")):
        parse([missing])
    with pytest.raises(ConfigError, match="--run-path needs a file path"):
        parse(["--run-path", str(tmp_path)])


def test_no_python_command_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="command 'no-such-command-xyz' is not an existing path or on PATH"):
        parse(["--no-python", "no-such-command-xyz"])
    plain = tmp_path / "plain.sh"
    plain.write_text("echo hi\n")
    with pytest.raises(ConfigError, match="exists but is not an executable file"):
        parse(["--no-python", str(plain)])
    plain.chmod(0o755)
    assert parse(["--no-python", str(plain)]).no_python
    assert parse(["--no-python", "sh", "-c", "true"]).training_script == "sh"


def test_module_is_not_checked_here(script):
    # the worker's python finds the module (or says it can't); the agent's sys.path is not its
    assert parse(["-m", "some.module"]).training_script == "some.module"


def test_log_dir_must_not_be_a_file(script):
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        parse(["--log-dir", script, script])


def test_empty_log_dir_means_a_temporary_one(script):
    assert parse(["--log-dir", "", script]).log_dir is None


def test_run_path_beats_no_python(script, caplog):
    with caplog.at_level(logging.WARNING, logger="node_agent.cli"):
        config = parse(["--run-path", "--no-python", script])
    assert config.run_path and config.no_python
    assert "--run-path takes precedence over --no-python" in caplog.text


def test_shutdown_timeout_from_environment(script):
    assert parse([script], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "12"}).shutdown_timeout == 12.0
    assert (
        parse(["--shutdown-timeout", "3", script], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "12"}).shutdown_timeout
        == 3
    )


def test_environment_only_settings(script):
    config = parse(
        [script],
        {
            "PYTHON_EXEC": sys.executable,
            "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[${rank}]",
            "LOGLEVEL": "info",
        },
    )
    assert (config.python_exec, config.log_line_prefix_template, config.log_level) == (
        sys.executable,
        "[${rank}]",
        "INFO",
    )


@pytest.mark.parametrize("mode", ["node", "socket", "exclusive", "core-complex"])
def test_numa_binding_takes_torchs_modes_in_both_spellings(mode, script):
    assert parse(["--numa-binding", mode, script]).numa_binding == mode
    assert parse([f"--numa_binding={mode}", script]).numa_binding == mode


def test_pet_logs_specs_and_numa_binding_are_ignored_like_torchrun(script):
    config = parse([script], {"PET_LOGS_SPECS": "x", "PET_NUMA_BINDING": "node"})
    assert config.logs_specs is None and config.numa_binding is None


def test_signals_are_deduplicated_and_may_be_empty(script):
    assert parse(["--signals-to-handle", " SIGTERM , SIGUSR2,SIGTERM", script]).signals_to_handle == (
        "SIGTERM",
        "SIGUSR2",
    )
    assert parse(["--signals-to-handle", "", script]).signals_to_handle == ()


@pytest.mark.parametrize("argv", [[], ["--nproc-per-node", "2"], ["--bogus", "x.py"], ["--nnodes"]])
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    assert "usage: node-agent" in capsys.readouterr().err


def test_config_rejects_bad_values_built_in_code():
    with pytest.raises(ConfigError):
        AgentConfig(training_script="x", min_nodes=2, max_nodes=1)
    with pytest.raises(ConfigError):
        AgentConfig(training_script="x", nproc_per_node=0)
    with pytest.raises(ConfigError):
        AgentConfig(training_script="x", module=True, no_python=True)
    config = AgentConfig(training_script="x", training_script_args=["a"], min_nodes=1, max_nodes=3)  # type: ignore[arg-type]
    assert config.training_script_args == ("a",) and config.elastic


# --- nproc --------------------------------------------------------------------------------


def test_nproc_numbers_and_cpu():
    assert resolve_nproc("4") == 4
    assert resolve_nproc(" 2 ") == 2
    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert resolve_nproc("cpu") == expected


def test_nproc_gpu_and_auto(monkeypatch):
    monkeypatch.setattr(nproc, "physical_gpu_uuids", lambda: ["GPU-aaa", "GPU-bbb", "GPU-ccc", "GPU-ddd"])
    assert resolve_nproc("gpu", environ={}) == 4
    assert resolve_nproc("auto", environ={}) == 4
    assert resolve_nproc("gpu", environ={"CUDA_VISIBLE_DEVICES": "2,3"}) == 2
    # CUDA_VISIBLE_DEVICES="" hides every GPU: gpu fails as torchrun's does, auto falls back to CPUs
    with pytest.raises(ConfigError, match="no NVIDIA GPU is visible"):
        resolve_nproc("gpu", environ={"CUDA_VISIBLE_DEVICES": ""})
    assert resolve_nproc("auto", environ={"CUDA_VISIBLE_DEVICES": ""}) == nproc.cpu_count()


def test_nproc_without_gpus(monkeypatch):
    monkeypatch.setattr(nproc, "physical_gpu_uuids", lambda: [])
    with pytest.raises(
        ConfigError, match=r"--nproc-per-node=gpu: no NVIDIA GPU is visible \(torchrun: 'Cuda is not"
    ):
        resolve_nproc("gpu", environ={})
    assert resolve_nproc("auto", environ={}) == nproc.cpu_count()


@pytest.mark.parametrize(
    ("visible", "count"),
    [
        (None, 4),
        ("0,1", 2),
        ("3", 1),
        ("1,7,2", 1),  # cut at the first ordinal past the last device
        ("0,1,-1,2", 2),  # a negative entry ends the list
        ("0,0", 0),  # a repeat empties the set
        ("", 0),
        ("1gpu,2x", 2),  # parsed like strtoul
        ("GPU-bbb,GPU-a", 2),  # UUID prefixes
        ("GPU-bbb,GPU-zzz,GPU-aaa", 1),  # an unknown UUID ends the list
        ("GPU-aaa,GPU-aaa", 0),
        ("MIG-1,MIG-2", 2),
    ],
)
def test_visible_gpu_count(visible, count):
    assert visible_gpu_count(visible, ["GPU-aaa", "GPU-bbb", "GPU-ccc", "GPU-ddd"]) == count


def test_physical_gpus_from_proc(tmp_path):
    for bus, uuid_ in (("0000:3b:00.0", "GPU-1234"), ("0000:1a:00.0", "GPU-5678")):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "information").write_text(f"Model: \t\t NVIDIA A100\nGPU UUID: \t {uuid_}\n")
    (tmp_path / "0000:5e:00.0").mkdir()  # unreadable details still count as a GPU
    assert physical_gpu_uuids(tmp_path) == ["GPU-5678", "GPU-1234", ""]


# --- start-up cost ----------------------------------------------------------------------------


def loaded_in_a_fresh_interpreter(setup: str, packages: tuple[str, ...]) -> list[str]:
    """Which modules of ``packages`` a new Python process holds after running ``setup``."""
    code = (
        "import json, sys\n"
        f"{setup}\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {packages!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_importing_the_front_end_loads_neither_torch_nor_aiohttp():
    setup = "import node_agent.cli.parse, node_agent.worker_env, node_agent.cli.nproc, node_agent.config"
    assert loaded_in_a_fresh_interpreter(setup, ("torch", "aiohttp", "numpy")) == []


def test_static_backend_takes_ranks_and_master_from_flags(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    cfg = parse_config(
        [
            "--rdzv-backend",
            "static",
            "--nnodes",
            "3",
            "--node-rank",
            "2",
            "--master-addr",
            "10.1.2.3",
            "--master-port",
            "23456",
            str(script),
        ],
        {},
    )
    assert (cfg.rdzv_backend, cfg.node_rank, cfg.rdzv_host, cfg.rdzv_port) == ("static", 2, "10.1.2.3", 23456)
    cfg = parse_config(
        ["--rdzv-backend", "static", "--nnodes", "2", "--rdzv-endpoint", "h:5", str(script)], {}
    )
    assert (cfg.rdzv_host, cfg.rdzv_port) == ("h", 5)
    cfg = parse_config(["--rdzv-backend", "static", "--nnodes", "2", str(script)], {})
    assert (cfg.rdzv_host, cfg.rdzv_port) == ("127.0.0.1", 29500)


@pytest.mark.parametrize("spelling", ["--token-file", "--token_file"])
def test_token_sources(tmp_path, spelling) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    tokens = tmp_path / "tokens"
    tokens.write_text("# shared\ndefault-secret\njobA job-a-secret\n")
    ep = ["--nnodes", "2", "--rdzv-endpoint", "h:1"]
    cfg = parse_config([*ep, "--rdzv-id", "jobA", spelling, str(tokens), str(script)], {})
    assert cfg.token == "job-a-secret"
    cfg = parse_config([*ep, "--rdzv-id", "other", spelling, str(tokens), str(script)], {})
    assert cfg.token == "default-secret"
    assert "secret" not in repr(cfg)
    cfg = parse_config([*ep, str(script)], {"RDZV_TOKEN_FILE": str(tokens)})
    assert cfg.token == "default-secret"
    assert parse_config([*ep, str(script)], {"RDZV_TOKEN": "t0"}).token == "t0"
    assert parse_config([*ep, str(script)], {}).token is None
    with pytest.raises(ConfigError, match="cannot read the token file"):
        parse_config([*ep, spelling, str(tmp_path / "missing"), str(script)], {})
    only_b = tmp_path / "only_b"
    only_b.write_text("jobB b-secret\n")
    with pytest.raises(ConfigError, match="no token for job 'jobA'"):
        parse_config([*ep, "--rdzv-id", "jobA", spelling, str(only_b), str(script)], {})


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_etcd_backends_default_to_etcds_client_port_and_never_host(tmp_path, backend: str) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    base = ["--rdzv-backend", backend, "--nnodes", "1:4", "--rdzv-conf", "is_host=1"]
    cfg = parse_config([*base, "--rdzv-endpoint", "etcd.example", str(script)], {})
    assert (cfg.rdzv_backend, cfg.rdzv_host, cfg.rdzv_port) == (backend, "etcd.example", 2379)
    assert not cfg.hosts_rendezvous  # etcd keeps the rendezvous; no agent serves it
    cfg = parse_config([*base, "--rdzv-endpoint", "[::1]:23790", str(script)], {})
    assert (cfg.rdzv_host, cfg.rdzv_port) == ("::1", 23790)


def test_a_launch_imports_nothing_it_does_not_need():
    # Each of these costs milliseconds of every launch (shutil brings zlib, bz2 and lzma;
    # uuid brings platform; hashlib initialises OpenSSL); the agent has its own small versions.
    setup = (
        "import os, node_agent.cli.flags, node_agent.cli.parse\n"
        "import node_agent.runner, node_agent.logs, node_agent.runtime_dir\n"
        "import rdzv_server.service\n"
        "node_agent.cli.flags.build_parser().format_help()\n"
        "rt = node_agent.runtime_dir.RuntimeDir()\n"
        "run = node_agent.logs.RunLogs(None, 'x', rt)\n"
        "run.new_attempt().page_path(0)\n"
        "node_agent.runtime_dir.remove_tree(os.path.dirname(run.root)); rt.close()  # nothing left behind"
    )
    slow = ("shutil", "tempfile", "uuid", "platform", "hashlib", "secrets")
    assert loaded_in_a_fresh_interpreter(setup, slow) == []


# What a standalone launch has no use for; each was imported by one once. The GPU modules
# (no GPU counted, no --numa-binding), the warm interpreters' (no --preload) and their json,
# pathlib (and its urllib.parse and ipaddress: the store's boot file is read by os.path), the
# hang report's (no hang), the error file's (no TORCHELASTIC_ERROR_FILE), the API, the health
# port, an HTTP stack.
NOT_FOR_A_STANDALONE_LAUNCH = (
    "json",
    "pathlib",
    "urllib.parse",
    "ipaddress",
    "node_agent.gpu.devices",
    "node_agent.gpu.numa",
    "node_agent.gpu.amd_intel",
    "node_agent.gpu.binding",
    "node_agent.gpu.health",
    "node_agent.supervisor.warm_boot",
    "node_agent.gpu.node",
    "node_agent.store.boot",
    "protocol.hang_report",
    "node_agent.progress.stacks",
    "node_agent.error_file",
    "node_agent.api",
    "node_agent.liveness",
    "rdzv_server.http_app",
    "aiohttp",
    "torch",
)


def test_a_standalone_launch_imports_nothing_it_does_not_use(tmp_path: Path) -> None:
    # The whole launch, run to its end in a fresh interpreter (what it imports on the way
    # counts: the embedded rendezvous server, the first worker start), then its modules.
    script = tmp_path / "noop.py"
    script.write_text("")
    code = (
        "import sys\n"
        "from node_agent.cli import main\n"
        f"code = main(['--standalone', '--nproc-per-node', '2', {str(script)!r}])\n"
        "print(repr(sorted(sys.modules)))\n"
        "sys.exit(code)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_ERROR_FILE", "LOGLEVEL")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    loaded = set(eval(out.stdout.strip().splitlines()[-1]))  # a list of module names, printed by repr
    assert {"node_agent.runner", "rdzv_server.service"} <= loaded  # it did launch
    assert sorted(loaded & set(NOT_FOR_A_STANDALONE_LAUNCH)) == []


def test_the_command_leaves_the_collector_as_it_found_it(tmp_path: Path) -> None:
    # main() turns the cyclic collector off while it imports, and freezes what it imported.
    script = tmp_path / "noop.py"
    script.write_text("")
    code = (
        "import gc\n"
        "from node_agent.cli import main\n"
        "for enabled in (True, False):\n"
        "    (gc.enable if enabled else gc.disable)()\n"
        "    assert main(['--nproc-per-node', '0', 'x.py']) == 2  # a usage error\n"
        "    assert gc.isenabled() is enabled, enabled\n"
        f"    assert main(['--standalone', '--nproc-per-node', '1', {str(script)!r}]) == 0\n"
        "    assert gc.isenabled() is enabled, enabled\n"
        "    assert gc.get_freeze_count() > 10_000\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_own_uuid4_which_and_temp_dir_behave_like_the_stdlib_ones(tmp_path) -> None:
    from node_agent.cli.flags import random_uuid4
    from node_agent.executables import which
    from node_agent.logs import make_temp_dir

    ids = {random_uuid4() for _ in range(100)}
    assert len(ids) == 100
    assert all(uuid.UUID(i).version == 4 and str(uuid.UUID(i)) == i for i in ids)
    assert which("sh") == shutil.which("sh") and which("sh") is not None
    assert which("no-such-program-here") is None
    tool = tmp_path / "bin" / "tool"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\n")
    assert which("tool", path=str(tool.parent)) is None  # not executable
    tool.chmod(0o755)
    assert which("tool", path=f"/nonexistent:{tool.parent}") == str(tool)
    assert which(str(tool)) == str(tool)
    made = make_temp_dir("run_", str(tmp_path))
    assert os.path.basename(made).startswith("run_") and os.stat(made).st_mode & 0o777 == 0o700
    assert make_temp_dir("run_", str(tmp_path)) != made


# --- what follows the script is the script's -------------------------------------------------


@pytest.mark.parametrize(
    "script_args",
    [
        ["--token", "hf_x"],  # a prefix of our --token-file: argparse called it ambiguous
        ["--health", "--pass", "p", "--tls", "--to", "x"],
        ["--nnodes", "3", "-m", "--standalone", "--nproc-per-node=9"],  # our own flags, verbatim
        ["--", "--help"],
        ["-"],
    ],
)
def test_nothing_after_the_script_is_parsed(script_args, script):
    config = parse(["--nproc-per-node", "2", script, *script_args])
    assert config.training_script == script
    assert config.training_script_args == tuple(script_args)
    assert config.nproc_per_node == 2 and not config.module


def test_double_dash_ends_our_options(script):
    config = parse(["--nproc-per-node", "2", "--", script, "--nproc-per-node", "3"])
    assert config.training_script == script
    assert config.training_script_args == ("--nproc-per-node", "3")
    assert config.nproc_per_node == 2


def test_help_starts_with_two_examples_and_explains_the_separator(capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--help"])
    assert info.value.code == 0
    head = capsys.readouterr().out.splitlines()[:4]
    assert head[0].startswith("usage: node-agent [OPTIONS] [--] TRAINING_SCRIPT")
    assert "--standalone" in head[1] and "--rdzv-endpoint" in head[2]


def test_help_text_says_what_double_dash_does():
    text = build_parser().format_help()
    assert "'--' before the script also ends node-agent's options" in " ".join(text.split())


def test_logs_specs_default_is_accepted_and_others_refused(script):
    assert parse(["--logs-specs", "default", script]).logs_specs == "default"
    with pytest.raises(ConfigError, match="--logs-specs is not supported yet"):
        parse(["--logs-specs", "mine", script])


@pytest.mark.parametrize(("value", "expected"), [("8123", 8123), ("", None)])
def test_health_check_port_is_read(value, expected, script):
    assert parse([script], {"TORCHELASTIC_HEALTH_CHECK_PORT": value}).health_check_port == expected


def test_a_bad_health_check_port_is_refused(script):
    with pytest.raises(ConfigError, match="TORCHELASTIC_HEALTH_CHECK_PORT"):
        parse([script], {"TORCHELASTIC_HEALTH_CHECK_PORT": "70000"})


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("auto", None),
        ("AUTO", None),
        ("0", 0),
        ("512", 512),
        ("1.5K", 1536),
        ("8GiB", 8 << 30),
        ("2MB", 2 << 20),
    ],
)
def test_snapshot_memory_is_a_size_or_auto(value, expected, script):
    assert parse(["--snapshot-memory", value, script]).snapshot_memory == expected


@pytest.mark.parametrize("value", ["lots", "-1G", "1e30", "nan", "", "auto"])
def test_a_bad_snapshot_size_is_refused_naming_the_flag(value, script):
    flag = "--snapshot-memory" if value != "auto" else "--snapshot-replication-rate"
    with pytest.raises(ConfigError, match=flag):
        parse([f"{flag}={value}", script])


def test_snapshot_dir_is_made_absolute_and_refused_where_it_cannot_work(script, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse(["--snapshot-dir", "snaps", script]).snapshot_dir == str(tmp_path / "snaps")
    assert parse([script]).snapshot_dir is None
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="--snapshot-dir='file' is a file, not a directory"):
        parse(["--snapshot-dir", "file", script])
    with pytest.raises(ConfigError, match="--snapshot-memory 0 turns off"):
        parse(["--snapshot-memory", "0", "--snapshot-dir", "snaps", script])
