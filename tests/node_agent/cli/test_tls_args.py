"""node-agent's TLS flags: --tls-ca/--tls-cert/--tls-key, RDZV_TLS_*, checked at config time."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from node_agent.cli.parse import parse_config
from node_agent.config import AgentConfig, ConfigError
from tests.pki import Pki, make_pki

ENDPOINT = ["--nnodes", "2", "--rdzv-endpoint", "rdzv.example:1234"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("scripts") / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def parse(argv: list[str], environ: dict[str, str] | None = None) -> AgentConfig:
    return parse_config(argv, {"PATH": os.environ.get("PATH", os.defpath), **(environ or {})})


@pytest.mark.parametrize("sep", ["-", "_"])
def test_flags_in_both_spellings(pki: Pki, script: str, sep: str) -> None:
    flags = [f"--tls{sep}ca", str(pki.ca), f"--tls{sep}cert", str(pki.client_cert)]
    cfg = parse([*ENDPOINT, *flags, f"--tls{sep}key", str(pki.client_key), script])
    assert (cfg.tls_ca, cfg.tls_cert, cfg.tls_key) == (str(pki.ca), str(pki.client_cert), str(pki.client_key))
    assert parse([*ENDPOINT, script]).tls_ca is None


def test_environment_and_flag_precedence(pki: Pki, script: str) -> None:
    environ = {"RDZV_TLS_CA": str(pki.other_ca), "RDZV_TLS_CERT": str(pki.client_cert)}
    environ["RDZV_TLS_KEY"] = str(pki.client_key)
    cfg = parse([*ENDPOINT, script], environ)
    assert (cfg.tls_ca, cfg.tls_cert) == (str(pki.other_ca), str(pki.client_cert))
    assert parse([*ENDPOINT, "--tls-ca", str(pki.ca), script], environ).tls_ca == str(pki.ca)
    assert parse([*ENDPOINT, script], {"PET_TLS_CA": str(pki.ca)}).tls_ca is None  # as --token-file


def test_bad_combinations_and_files(pki: Pki, script: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs --tls-ca"):
        parse([*ENDPOINT, "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key), script])
    with pytest.raises(ConfigError, match="go together"):
        parse([*ENDPOINT, "--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert), script])
    missing = str(tmp_path / "ca.pem")
    with pytest.raises(ConfigError, match=f"cannot read the TLS CA file '{missing}': No such file"):
        parse([*ENDPOINT, "--tls-ca", missing, script])
    with pytest.raises(ConfigError, match="--tls-cert and RDZV_TLS_KEY: a client certificate needs --tls-ca"):
        parse([*ENDPOINT, "--tls-cert", str(pki.client_cert), script], {"RDZV_TLS_KEY": str(pki.client_key)})
    with pytest.raises(ConfigError, match="is_host=true: the rendezvous an agent hosts is plain TCP"):
        parse([*ENDPOINT, "--rdzv-conf", "is_host=true", "--tls-ca", str(pki.ca), script])


def test_tls_is_ignored_where_the_agent_hosts_its_rendezvous(
    pki: Pki, script: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        cfg = parse(["--standalone", "--tls-ca", str(pki.ca), script])
    assert cfg.tls_ca is None
    assert "--tls-ca: ignored (this agent hosts its own rendezvous" in caplog.text


def test_config_invariants() -> None:
    with pytest.raises(ConfigError, match="go together"):
        AgentConfig(training_script="x.py", tls_ca="ca.pem", tls_cert="c.pem")
    with pytest.raises(ConfigError, match="needs tls_ca"):
        AgentConfig(training_script="x.py", tls_cert="c.pem", tls_key="k.pem")


def test_the_cli_exits_with_usage_and_no_traceback(tmp_path: Path, script: str) -> None:
    missing = str(tmp_path / "nope.pem")
    p = subprocess.run(
        [sys.executable, "-m", "node_agent.cli", *ENDPOINT, "--tls-ca", missing, script],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2
    assert f"node-agent: error: cannot read the TLS CA file {missing!r}" in p.stderr
    assert "Traceback" not in p.stderr
