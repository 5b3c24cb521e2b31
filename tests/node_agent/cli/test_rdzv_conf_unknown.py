"""Unknown ``--rdzv-conf`` keys are warned about once and ignored, as torchrun ignores them.

Kubeflow's training-operator copies a job's ``rdzvConf`` into ``PET_RDZV_CONF`` verbatim; torchrun
hands every key to its backend, which reads its own. A malformed value of a key we read is still
refused (exit 2).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from node_agent import config as config_module
from node_agent.cli.parse import parse_config
from node_agent.config import ConfigError, RdzvConf


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "w.py"
    path.write_text("print('worker ran')\n")
    return str(path)


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module, "_WARNED_UNKNOWN", set())


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_unknown_keys_are_ignored_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="node_agent.config"):
        conf = RdzvConf.parse("join_timeout=30,foo=bar,zeta=1,jion_timeout=5")
        RdzvConf.parse("foo=bar,zeta=1,jion_timeout=7")  # the same keys again: no second line
    assert conf.join_timeout == 30.0
    assert dict(conf.extra) == {}  # nothing of an unknown key is kept
    (line,) = _warnings(caplog)
    assert line.startswith("--rdzv-conf: ignoring unknown key(s) foo, jion_timeout, zeta")
    for read in ("join_timeout", "last_call_timeout", "is_host", "keep_alive_interval", "store_type"):
        assert read in line  # which keys we read is named


def test_known_keys_alone_do_not_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="node_agent.config"):
        RdzvConf.parse("join_timeout=30,store_type=tcp,is_host=false")
    assert _warnings(caplog) == []


def test_pet_rdzv_conf_names_its_origin(script, caplog):
    with caplog.at_level(logging.WARNING, logger="node_agent.config"):
        config = parse_config(
            ["--standalone", "--nproc-per-node", "1", script],
            {"PATH": os.defpath, "PET_RDZV_CONF": "join_timeout=30,foo=bar"},
        )
    assert config.rdzv_conf.join_timeout == 30.0
    (line,) = _warnings(caplog)
    assert line.startswith("PET_RDZV_CONF: ignoring unknown key(s) foo")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("foo=bar,join_timeout=soon", "join_timeout='soon' is not a number"),
        ("foo=bar,is_host=maybe", "is_host='maybe' is not a boolean"),
        ("foo", "'foo' has no value"),  # malformed for torch too: every key needs a value
        ("foo=", "'foo' has no value"),
        ("=bar", "expected key=value"),
    ],
)
def test_malformed_conf_is_still_refused(text, needle):
    with pytest.raises(ConfigError) as info:
        RdzvConf.parse(text)
    assert needle in str(info.value)


def _run(argv: list[str], conf: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PET_RDZV_CONF": conf}
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


LINE = ["--standalone", "--nproc-per-node", "1", "w.py"]


def test_command_line_goes_on_as_torchrun_does(script):
    cwd = Path(script).parent
    ours = _run([sys.executable, "-m", "node_agent", *LINE], "join_timeout=30,foo=bar", cwd)
    assert ours.returncode == 0, ours.stderr
    assert "worker ran" in ours.stdout
    warned = [line for line in ours.stderr.splitlines() if "ignoring unknown key(s) foo" in line]
    assert len(warned) == 1, ours.stderr
    assert warned[0].startswith("[node-agent] WARNING: PET_RDZV_CONF:")
    pytest.importorskip("torch")
    theirs = _run([sys.executable, "-m", "torch.distributed.run", *LINE], "join_timeout=30,foo=bar", cwd)
    assert theirs.returncode == 0, theirs.stderr
    assert "worker ran" in theirs.stdout


def test_command_line_refuses_a_bad_value_of_a_key_we_read(script):
    ours = _run([sys.executable, "-m", "node_agent", *LINE], "join_timeout=soon,foo=bar", Path(script).parent)
    assert ours.returncode == 2
    assert "join_timeout='soon' is not a number" in ours.stderr
